"""Logits that are not finite end a decode with NonFiniteLogits naming the row and the step, in every
decoding mode and on both CPU paths (the C++ kernels and torch's ops) and the compiled one; a draft head
that is NaN is reported where speculative sampling reads it and changes nothing where nothing reads it.

Three ways to put NaN where it is known: a source token's embedding that one row's text holds (that row,
every step from 0); rotary frequencies that overflow from position P on (every row, from step P: exact
where attention reads no position it masks, see `test_nan_from_a_position`); and NaN written into the last
layer's output at one (row, position) (that logit only: nothing else reads it, so every mode must name
exactly that row and step)."""

import pickle

import pytest
import torch

from tts_specdec import NonFiniteLogits, SpeculativeDecoder, kernels
from tts_specdec.backends import CpuKernels, TorchEager
from tts_specdec.backends.base import Backend
from tts_specdec.beam import BeamState, beam_step
from tts_specdec.finite import NONFINITE, NONFINITE_DRAFT, first_marked

from conftest import make_model, make_source

pytestmark = pytest.mark.usefixtures("one_thread")

NAN = float("nan")
FLT_MAX = torch.finfo(torch.float32).max
GAMMA = 3
MODES = {
    "greedy": ("sample", dict(temperature=0.0, gamma=0)),
    "sample": ("sample", dict(temperature=1.0, gamma=0, top_p=0.9)),
    "spec-greedy": ("sample", dict(temperature=0.0, gamma=GAMMA)),
    "spec-sample": ("sample", dict(temperature=1.0, gamma=GAMMA)),
    "spec-stops": ("sample", dict(temperature=1.0, gamma=GAMMA, top_k=8, top_p=0.9, draft_confidence=0.4)),
    "beam": ("beam_search", dict(beam_size=3, gamma=0)),
    "spec-beam": ("beam_search", dict(beam_size=3, gamma=2)),
}
SPECULATIVE_SAMPLING = ("spec-greedy", "spec-sample", "spec-stops")


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    if request.param == "kernels" and not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    monkeypatch.setattr(kernels, "ENABLED", request.param == "kernels")
    return request.param


def decode(model, source, mode, path=None, *, max_length=16, cond_scale=1.0, compile=False):
    fn, kwargs = MODES[mode]
    dec = SpeculativeDecoder(model, compile=compile)
    if path is not None:  # the backend the test means
        assert dec.decoder.backend.name == path
    seed = {"generator": torch.Generator().manual_seed(0)} if fn == "sample" else {}
    return getattr(dec, fn)(source, max_length=max_length, cond_scale=cond_scale, **kwargs, **seed)


def raised(*args, **kwargs) -> NonFiniteLogits:
    with pytest.raises(NonFiniteLogits) as info:
        decode(*args, **kwargs)
    return info.value


def with_nan_source(row: int, seed: int = 0):
    """A model and a batch of 3 sources in which only `row`'s text holds a token whose embedding is NaN."""
    model = make_model(seed, cond_drop_prob=0.5)  # trained for guidance, as far as decoding can tell
    source = make_source(3, 6, seed=1)
    source[source == 19] = 1
    source[row, 2] = 19
    with torch.no_grad():
        model.token_emb["text"].weight[19, 0] = NAN
    return model, source


@pytest.mark.parametrize("cond_scale", [1.0, 2.0], ids=["unguided", "guided"])
@pytest.mark.parametrize("mode", MODES)
def test_nan_in_one_source_names_its_row_at_step_0(mode, path, cond_scale):
    model, source = with_nan_source(row=1)
    e = raised(model, source, mode, path, cond_scale=cond_scale)
    assert (e.row, e.step, e.head) == (1, 0, "target")
    assert "row 1 at step 0" in str(e) and isinstance(e, ValueError)


def nan_from_position(p: int):
    """A model without EOS whose rotary angle of one frequency overflows to inf from position p on, so
    queries and keys there are NaN (positions below p stay finite)."""
    model = make_model(0, eos=False)
    with torch.no_grad():
        model.target_transformer.layers[0][0].rotary_emb.freqs[0] = FLT_MAX / (p - 0.5)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_nan_from_a_position(mode, monkeypatch):
    """On the kernels every row reaches step P with NaN logits and no earlier step sees them: the first
    row to get there is named at step P (plain steps and beam search: all rows at once, so row 0). Speculative
    beam search's tree pass reads the nodes a mask hides too (as torch's attention does), so a NaN node
    reaches its siblings: the error may come up to gamma steps early, never later. (torch's own CPU
    attention returns zeros for a query whose every score is NaN, so this construction is for the kernels.)"""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    p = 9
    e = raised(nan_from_position(p), make_source(2, 6), mode, "kernels")
    if mode == "spec-beam":
        assert p - MODES[mode][1]["gamma"] <= e.step <= p and e.row in (0, 1)
    elif mode in SPECULATIVE_SAMPLING:
        assert e.step == p and e.row in (0, 1)
    else:
        assert (e.row, e.step) == (0, p)
    # the same model stops short of P without a word
    out = decode(nan_from_position(p), make_source(2, 6), mode, "kernels", max_length=p)
    assert [len(t) for t in out.tokens] == [p, p]


def inject_nan_output(monkeypatch, row: int, position: int):
    """NaN in the last layer's output of `row` (batch index, as the rows' source entries say) at rotary
    position `position`, on both paths' `run_layers` (not the fused plain steps of the kernels). Beam
    search steps through `run_layers` here: its steps in one kernel call do not pass through it (they hand
    a step with non-finite candidates to `beam_step`: tests/test_beam.py)."""
    def hooked(original):
        def run_layers(self, x, start, layers, enc, cache, attn_mask=None, positions=None, real=None):
            h = original(self, x, start, layers, enc, cache, attn_mask, positions, real)
            if layers.stop == self.dec.depth:
                rows, n = h.shape[:2]
                pos = positions.expand(rows, n) if positions is not None else (
                    torch.as_tensor(start).reshape(-1, 1) + torch.arange(n)).expand(rows, n)
                item = torch.arange(rows) if enc.source is None else enc.source
                h = h.clone()
                h[(item[:, None] == row) & (pos == position)] = NAN
            return h
        return run_layers

    monkeypatch.setattr(TorchEager, "run_layers", hooked(TorchEager.run_layers))
    monkeypatch.setattr(CpuKernels, "run_layers", hooked(CpuKernels.run_layers))
    monkeypatch.setattr(CpuKernels, "beam_steps", Backend.beam_steps)


@pytest.mark.parametrize("cond_scale", [1.0, 2.0], ids=["unguided", "guided"])
@pytest.mark.parametrize("mode", MODES)
def test_nan_logits_of_one_row_at_one_step(mode, path, cond_scale, monkeypatch):
    """Exactly that row and step, whatever the other rows do and however far speculation runs ahead."""
    if path == "kernels" and mode in ("greedy", "sample"):
        pytest.skip("the kernels' plain steps run their layers in C++ (test_nan_from_a_position)")
    if path == "kernels" and mode == "spec-beam" and cond_scale == 1.0:
        pytest.skip("the kernels draft and verify an unguided tree in one C++ call (test_nan_from_a_position)")
    inject_nan_output(monkeypatch, row=2, position=5)
    e = raised(make_model(0, eos=False, cond_drop_prob=0.5), make_source(3, 6), mode, path, cond_scale=cond_scale)
    assert (e.row, e.step, e.head) == (2, 5, "target")


def nan_draft_head(seed: int = 0):
    model = make_model(seed)
    with torch.no_grad():
        model.to_early_exit_semantic_logits[2].weight[3, 0] = NAN
    return model


@pytest.mark.parametrize("mode", MODES)
def test_nan_draft_head(mode, path):
    """Speculative sampling reads the draft's distribution in its accept rule: a NaN there is reported
    at the first step that read it. Elsewhere the draft only proposes and the target decides (speculative
    beam search replays exact steps on the target's log-probs): the output is the clean model's."""
    source = make_source(3, 6)
    if mode in SPECULATIVE_SAMPLING:
        e = raised(nan_draft_head(), source, mode, path)
        assert (e.row, e.step, e.head) == (0, 0, "draft") and "draft's (early-exit head's) logits" in str(e)
    else:
        out, clean = decode(nan_draft_head(), source, mode, path), decode(make_model(0), source, mode, path)
        assert [t.tolist() for t in out.tokens] == [t.tolist() for t in clean.tokens]
        # (speculative beam search's trees differ with the drafts, so float32 sums differ in the last bits)
        assert out.scores == (None if clean.scores is None else pytest.approx(clean.scores, rel=1e-5))


@pytest.mark.parametrize("mode", ["greedy", "spec-greedy", "beam"])
def test_compiled_path(mode):
    """The static compiled steps mark non-finite picks inside the graph; the loop reads them where it
    already reads the tokens."""
    model, source = with_nan_source(row=2)
    e = raised(model, source, mode, compile="aot_eager")
    assert (e.row, e.step) == (2, 0)


def test_compiled_draft_phase_reports_a_nan_draft():
    e = raised(nan_draft_head(), make_source(2, 6), "spec-sample", compile="aot_eager")
    assert (e.row, e.step, e.head) == (0, 0, "draft")


def test_first_marked_keeps_only_steps_the_loop_would_keep():
    eos, m, d = 9, NONFINITE, NONFINITE_DRAFT
    first_marked([0, 1], [[1, 2], [3, 4]], [0, 0], eos, 10)  # nothing marked: nothing raised
    first_marked([0], [[1, eos, m]], [0], eos, 10)  # after the row's EOS
    first_marked([0], [[1, 2, m]], [8], eos, 10)  # at step 10, past max_length
    with pytest.raises(NonFiniteLogits) as info:
        first_marked([5, 7, 4], [[2, d], [m], [1, m]], [6, 8, 6], eos, 10)
    # rows 5 and 4 at step 7 (row 7 at step 8): the earlier step, then the lower row
    assert (info.value.row, info.value.step, info.value.head) == (4, 7, "target")
    with pytest.raises(NonFiniteLogits) as info:
        first_marked([3], [[2, d]], [0], None, 10)
    assert info.value.head == "draft"


def test_error_pickles_and_names_row_and_step():
    e = pickle.loads(pickle.dumps(NonFiniteLogits(3, 17, "draft")))
    assert (e.row, e.step, e.head) == (3, 17, "draft")
    assert str(e).startswith("the draft's (early-exit head's) logits are not finite (NaN or inf) for row 3 at step 17")


@pytest.mark.parametrize("semantics", ["standard", "upstream"])
def test_beam_step_names_the_item_of_a_live_beam(semantics):
    k, vocab = 2, 5
    state = BeamState.initial(3, k, 1.0, None, torch.device("cpu"), semantics)
    logprobs = torch.randn(3 * k, vocab).log_softmax(-1)
    beam_step(state, logprobs)
    logprobs[2 * k + 1, 4] = NAN  # item 2, its second beam, at step 1
    with pytest.raises(NonFiniteLogits) as info:
        beam_step(state, logprobs)
    assert (info.value.row, info.value.step) == (2, 1)


def test_beam_step_ignores_a_padding_beam():
    """A -inf beam is padding: its log-probs are never read, and a NaN there must not outrank real candidates."""
    state = BeamState.initial(1, 2, 1.0, None, torch.device("cpu"))
    logprobs = torch.tensor([[0.6, 0.3, 0.1], [NAN, NAN, NAN]]).log()  # beam 1 is -inf at step 0
    out = beam_step(state, logprobs)
    assert out.tokens.tolist() == [0, 1] and out.parents.tolist() == [0, 0]
    assert state.scores.isfinite().all()
