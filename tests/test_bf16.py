"""Half-precision models on the CPU: decoding computes in float32 on their weights (`weights.compute_dtype`),
so a bf16 or fp16 model decodes exactly as its float32 copy holding the same (widened) values (on the
kernels a bf16 model's packed products hold its prepared weights in bfloat16: the copy's rounded alike),
and every speculative mode keeps returning its plain mode's result, on every layout (the kernels and
torch's path)."""

import pytest
import torch

from tts_specdec import SpeculativeDecoder

from conftest import make_model, make_source

MAX_LEN = 20


def tokens(out):
    return [t.tolist() for t in out.tokens]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half(request):
    """(a half-precision model, its float32 copy with the same values); one trained with guidance."""
    model = make_model(0, dtype=torch.float32).to(request.param)
    cfg = make_model(5, heads=4, kv_heads=1, cond_drop_prob=0.5).to(request.param)
    return {"plain": (model, make_model(0).to(request.param).float()),
            "cfg": (cfg, make_model(5, heads=4, kv_heads=1, cond_drop_prob=0.5).to(request.param).float())}


@pytest.fixture
def source():
    return make_source(3, 6, seed=1, lengths=[6, 4, 5])


@pytest.fixture
def rounded_panels(half, layout, monkeypatch):
    """On the kernels a bfloat16 model's products read bfloat16 panels: its weights as prepared (norms
    folded in) rounded to bfloat16. Its float32 copy is then compared with every packed weight rounded
    the same way (a no-op for the bfloat16 panels themselves)."""
    from tts_specdec.kernels import Packed

    if layout == "kernel" and half["plain"][0].start_token["speech"].dtype == torch.bfloat16:
        init = Packed.__init__
        monkeypatch.setattr(Packed, "__init__", lambda self, w_t, width=None, store=torch.float32: init(
            self, w_t.to(torch.bfloat16).to(w_t.dtype), width, store))


@pytest.mark.parametrize("gamma", [0, 3])
def test_half_model_decodes_as_its_float32_copy(half, source, layout, gamma, rounded_panels):
    """Greedy, seeded sampling and beam search: the tokens (and on the kernels the scores, bit for bit) of
    the float32 model holding the half-precision values (on the kernels a bfloat16 model's products read
    its prepared weights rounded to bfloat16: the copy's are rounded alike, `rounded_panels`)."""
    model, wide = half["plain"]
    dec, ref = SpeculativeDecoder(model), SpeculativeDecoder(wide)
    assert dec.decoder.dtype == torch.float32 and model.start_token["speech"].dtype != torch.float32
    assert tokens(dec.sample(source, temperature=0.0, gamma=gamma, max_length=MAX_LEN)) == tokens(
        ref.sample(source, temperature=0.0, gamma=gamma, max_length=MAX_LEN))
    runs = [d.sample(source, temperature=1.0, gamma=gamma, max_length=MAX_LEN,
                     generator=torch.Generator().manual_seed(7)) for d in (dec, ref)]
    assert tokens(runs[0]) == tokens(runs[1])
    beams = [d.beam_search(source, beam_size=3, gamma=gamma, max_length=MAX_LEN) for d in (dec, ref)]
    assert tokens(beams[0]) == tokens(beams[1])
    if layout == "kernel":
        assert beams[0].scores == beams[1].scores


# All pairs of (layout, dtype, model) in 6 cases, not the 12 of their product: each layout runs both dtypes,
# and each layout and each dtype both models (the kernels run the bf16 guided model, bf16 panels).
@pytest.mark.parametrize("layout, half, name, cond_scale", [
    ("mm", torch.bfloat16, "cfg", 3.0), ("mm", torch.float16, "plain", 1.0),
    ("split", torch.bfloat16, "plain", 1.0), ("split", torch.float16, "cfg", 3.0),
    ("kernel", torch.bfloat16, "cfg", 3.0), ("kernel", torch.float16, "plain", 1.0)], indirect=["layout", "half"],
    ids=["mm-bf16-cfg", "mm-fp16-plain", "split-bf16-plain", "split-fp16-cfg", "kernel-bf16-cfg", "kernel-fp16-plain"])
def test_speculative_modes_equal_plain_modes_in_half_precision(half, source, layout, name, cond_scale):
    """Speculative greedy (fixed gamma and draft stops) == greedy, a batch == each row alone, speculative
    beam search == beam search."""
    model = half[name][0]
    dec = SpeculativeDecoder(model)
    kw = dict(temperature=0.0, max_length=MAX_LEN, cond_scale=cond_scale)
    plain = tokens(dec.sample(source, gamma=0, **kw))
    for gamma, confidence in ((1, None), (4, None), (6, 0.5)):
        assert tokens(dec.sample(source, gamma=gamma, draft_confidence=confidence, **kw)) == plain
    alone = [tokens(dec.sample(source[i : i + 1], gamma=4, **kw))[0] for i in range(source.shape[0])]
    assert [t[: len(a)] for t, a in zip(plain, alone)] == alone
    # plain beam search, not the default auto: auto may run speculative beam search (its choice follows the
    # clock), whose scores differ from another speculative search's by twice the rounding below
    beam = dec.beam_search(source, beam_size=3, gamma=0, max_length=MAX_LEN)
    for gamma, width in ((1, 6), (2, 3)):
        spec = dec.beam_search(source, beam_size=3, gamma=gamma, draft_width=width, max_length=MAX_LEN)
        assert tokens(spec) == tokens(beam)
        # scores to float32 rounding: on torch's path a tree pass's attention sums hidden keys as zeros
        # (docs/design.md), which can move a step's log-prob by a few float32 ulps, scaled by cond_scale
        # through guidance, in each of up to MAX_LEN steps (as for the float32 copy, which
        # test_half_model_decodes_as_its_float32_copy shows decodes the same); on an AMD EPYC (Zen 4) the
        # guided float16 model's differed by 2.6e-6 relative, above the 1e-6 this test asked before
        tol = 4 * MAX_LEN * cond_scale * torch.finfo(torch.float32).eps
        if layout == "kernel":  # the kernels sum only the keys a node sees: the bits of a beam step
            tol = 0.0
        assert spec.scores == pytest.approx(beam.scores, rel=tol, abs=tol)
