"""sample_loop: plain sampling (gamma = 0) against spear-tts, speculative sampling against plain."""

import itertools
from functools import partial

import pytest
import torch

from tts_specdec import SpeculativeDecoder

from conftest import forward_logits, make_model, make_source, sequence_table, tv, tv_bound, upstream_generate

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 20


def greedy(model, source, **kwargs):
    """Greedy decoding at the given gamma, plain (gamma 0) unless told: not greedy's default "auto",
    whose gammas depend on timings (tests/test_auto.py covers it)."""
    return SpeculativeDecoder(model).sample(source, temperature=0.0, **{"gamma": 0, **kwargs})


def assert_same_tokens(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tolist() == y.tolist(), f"row {i}"


@pytest.fixture(scope="module")
def eos_model():
    """EOS reachable: with this seed and these sources some rows end early and some run to MAX_LEN."""
    return make_model(0)


@pytest.fixture(scope="module")
def sources():
    return {1: make_source(1, 7, seed=0), 4: make_source(4, 7, seed=0, lengths=[7, 5, 7, 2]),
            5: make_source(5, 7, seed=2, lengths=[7, 5, 7, 2, 6])}  # lengths 20, 6, 16, 0, 20


def check_eos_mix(tokens, max_length):
    """Guard on the test data itself: some rows stop at EOS, some reach max_length."""
    lengths = [t.numel() for t in tokens]
    assert min(lengths) < max_length and max(lengths) == max_length, lengths


# ---- plain (gamma = 0) -------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [True, False], ids=["eos", "no_eos"])
@pytest.mark.parametrize("batch", [1, 4])
def test_plain_greedy_equals_upstream_generate(eos, batch, sources, layout):
    model = make_model(0, eos=eos)
    source = sources[batch]
    out = greedy(model, source, max_length=MAX_LEN)
    ours = out.tokens
    assert_same_tokens(ours, upstream_generate(model, source, temperature=0.0, max_length=MAX_LEN))
    if eos and batch == 4:
        check_eos_mix(ours, MAX_LEN)
    if not eos:
        assert all(t.numel() == MAX_LEN for t in ours)
    # finished rows stop: a row runs one step per token it kept, plus the step that drew its EOS
    steps = [t.numel() + int(t.numel() < MAX_LEN) for t in ours]
    assert out.stats.steps == max(steps)
    assert out.stats.layer_evals == [sum(steps)] * len(model.target_transformer.layers)


def test_plain_greedy_with_guidance_equals_upstream_generate(sources):
    model = make_model(5, cond_drop_prob=0.5)
    source = sources[4]
    ours = greedy(model, source, max_length=MAX_LEN, cond_scale=3.0).tokens
    ref = upstream_generate(model, source, temperature=0.0, max_length=MAX_LEN, cond_scale=3.0)
    assert_same_tokens(ours, ref)
    assert any(a.tolist() != b.tolist() for a, b in zip(ours, greedy(model, source, max_length=MAX_LEN).tokens))


@pytest.mark.parametrize("gamma", [0, 3])
def test_batch_rows_equal_rows_decoded_alone(eos_model, sources, gamma):
    source = sources[5]
    batch = greedy(eos_model, source, max_length=MAX_LEN, gamma=gamma).tokens
    check_eos_mix(batch, MAX_LEN)
    for i in range(source.shape[0]):
        n = int((source[i] != 0).sum())
        alone = greedy(eos_model, source[i : i + 1, :n], max_length=MAX_LEN, gamma=gamma).tokens
        assert batch[i].tolist() == alone[0].tolist(), f"row {i}"


def test_plain_first_token_frequencies_follow_softmax(eos_model):
    n = 20_000
    source = make_source(1, 6, seed=3)
    probs = sequence_table(eos_model, source, 1, vocab=13)[()].exp()
    out = SpeculativeDecoder(eos_model).sample(
        source.expand(n, -1), temperature=1.0, max_length=1, generator=torch.Generator().manual_seed(0)
    )
    eos = eos_model.eos_id["speech"]
    first = torch.tensor([int(t[0]) if t.numel() else eos for t in out.tokens])  # EOS was stripped
    assert probs.max() < 0.9  # not degenerate
    assert tv(torch.bincount(first, minlength=13), probs) < tv_bound(13, n)


@pytest.mark.parametrize("cond_scale", [1.0, 3.0], ids=["unguided", "cfg3"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, None, None), (0.0, None, None),
                                                     (1.0, 3, None), (1.0, None, 0.7)],
                         ids=["t1", "t0.7", "greedy", "top3", "topp0.7"])
def test_fused_plain_runs_equal_step_by_step(sources, monkeypatch, temperature, top_k, top_p, cond_scale):
    """Plain sampling in runs of kernel steps (CpuKernels.plain_steps) returns what the step-by-step loop
    returns from the same generator, and leaves the generator where the loop leaves it: the same
    tokens, EOS mid-run and max_length mid-run included, the same counters."""
    from tts_specdec import kernels, speculative
    from tts_specdec.backends import CpuKernels, TorchEager

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    monkeypatch.setattr(speculative, "PLAIN_STEPS", 6)  # runs end inside the 20-token budget
    model = make_model(0) if cond_scale == 1 else make_model(5, cond_drop_prob=0.5)
    runs = []
    fused_plain_steps = CpuKernels.plain_steps

    def counted(self, *args, **kwargs):
        out = fused_plain_steps(self, *args, **kwargs)
        runs.append(True)
        return out

    results = []
    for fused in (True, False):
        monkeypatch.setattr(CpuKernels, "plain_steps", counted if fused else TorchEager.plain_steps)
        g = torch.Generator().manual_seed(11)
        out = SpeculativeDecoder(model).sample(sources[5], temperature=temperature, top_k=top_k, top_p=top_p,
                                               cond_scale=cond_scale, max_length=MAX_LEN, generator=g, gamma=0)
        results.append((out, g.get_state()))
    (fused_out, fused_state), (ref_out, ref_state) = results
    assert runs and all(runs)
    assert_same_tokens(fused_out.tokens, ref_out.tokens)
    assert torch.equal(fused_state, ref_state)
    assert (fused_out.stats.steps, fused_out.stats.layer_evals) == (ref_out.stats.steps, ref_out.stats.layer_evals)
    if cond_scale == 1:
        check_eos_mix(ref_out.tokens, MAX_LEN)
    assert len({t for row in ref_out.tokens for t in row.tolist()}) > 3  # the outputs vary


@pytest.mark.parametrize("cond_scale", [1.0, 3.0], ids=["unguided", "cfg3"])
@pytest.mark.parametrize("confidence", [None, 0.6], ids=["all", "early-stops"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, None, None), (0.0, None, None),
                                                     (1.0, 3, None), (1.0, None, 0.7)],
                         ids=["t1", "t0.7", "greedy", "top3", "topp0.7"])
def test_fused_verify_accept_equals_step_by_step(sources, monkeypatch, temperature, top_k, top_p, confidence, cond_scale):
    """A speculative cycle's verify pass, accept rule, read-back and next input in one kernel call
    (CpuKernels.verify_accept) give what the step-by-step cycle gives from the same generator: the same
    tokens (EOS and max_length mid-cycle included), the same accepted drafts, rejections and layer passes,
    and the generator left where the step-by-step cycle leaves it. Guided cycles take the steps."""
    from tts_specdec import kernels
    from tts_specdec.backends import CpuKernels
    from tts_specdec.backends.base import Backend

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    model = make_model(0) if cond_scale == 1 else make_model(5, cond_drop_prob=0.5)
    fused_calls = []
    fused_verify_accept = CpuKernels.verify_accept

    def counted(self, *args, **kwargs):
        out = fused_verify_accept(self, *args, **kwargs)
        fused_calls.append(out is not None)
        return out

    results = []
    for fused in (True, False):
        monkeypatch.setattr(CpuKernels, "verify_accept", counted if fused else Backend.verify_accept)
        g = torch.Generator().manual_seed(11)
        out = SpeculativeDecoder(model).sample(sources[5], temperature=temperature, top_k=top_k, top_p=top_p, gamma=4,
                                               draft_confidence=confidence, cond_scale=cond_scale,
                                               max_length=MAX_LEN, generator=g)
        results.append((out, g.get_state()))
    (fused_out, fused_state), (ref_out, ref_state) = results
    assert fused_calls and all(fused_calls) if cond_scale == 1 else not fused_calls
    assert_same_tokens(fused_out.tokens, ref_out.tokens)
    assert torch.equal(fused_state, ref_state)
    counters = lambda s: (s.steps, s.drafted, s.accepted, s.rejections, s.accepted_hist, s.layer_evals)  # noqa: E731
    assert counters(fused_out.stats) == counters(ref_out.stats)
    assert 0 < ref_out.stats.rejections and 0 < ref_out.stats.accepted  # cycles both kept and rejected drafts
    if cond_scale == 1:
        check_eos_mix(ref_out.tokens, MAX_LEN)


@pytest.mark.parametrize("gamma", [0, 4])
def test_decoder_follows_weight_changes_between_calls(sources, gamma):
    """A decoder reused after the model's weights changed (an optimizer step between evaluations) decodes
    the new weights from the first step on, the fused draft and plain runs included."""
    model = make_model(0)
    dec = SpeculativeDecoder(model)
    dec.sample(sources[5], temperature=0.0, max_length=MAX_LEN, gamma=gamma)
    with torch.no_grad():
        for p in model.target_transformer.layers[0].parameters():
            p.mul_(1.5)
    after = dec.sample(sources[5], temperature=0.0, max_length=MAX_LEN, gamma=gamma).tokens
    assert_same_tokens(after, upstream_generate(model, sources[5], temperature=0.0, max_length=MAX_LEN))


# ---- speculative ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_speculative_greedy_equals_plain_greedy(eos_model, sources, gamma, batch):
    source = sources[batch]
    plain = greedy(eos_model, source, max_length=MAX_LEN).tokens
    spec = greedy(eos_model, source, max_length=MAX_LEN, gamma=gamma)
    assert_same_tokens(spec.tokens, plain)
    if batch == 5:
        check_eos_mix(plain, MAX_LEN)
    assert sum(t.numel() for t in plain) == spec.stats.generated_tokens


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("confidence", [0.6, 0.95])
def test_greedy_with_early_draft_stops_equals_plain_greedy(eos_model, sources, confidence, batch):
    """draft_confidence ends each row's drafts at its own depth; the output does not move."""
    source = sources[batch]
    plain = greedy(eos_model, source, max_length=MAX_LEN).tokens
    spec = greedy(eos_model, source, max_length=MAX_LEN, gamma=8, draft_confidence=confidence)
    assert_same_tokens(spec.tokens, plain)
    s = spec.stats
    assert s.drafted < 8 * sum(s.accepted_hist)  # some rows stopped before gamma drafts
    assert s.accepted <= s.drafted


def test_full_confidence_drafts_one_token_per_row_and_cycle(eos_model, sources):
    """A draft probability below 1 ends drafting after the first token: one draft per row-cycle."""
    spec = greedy(eos_model, sources[5], max_length=MAX_LEN, gamma=6, draft_confidence=1.0)
    s = spec.stats
    row_cycles = sum(s.accepted_hist)
    assert s.drafted == row_cycles and s.draft_passes == s.steps
    assert s.accepted_hist[2:] == [0] * 5
    assert_same_tokens(spec.tokens, greedy(eos_model, sources[5], max_length=MAX_LEN).tokens)


def copy_target_head(model):
    """Early exit at the last layer with the target head copied: draft logits == target logits."""
    head = model.to_early_exit_semantic_logits  # Sequential(Residual(FeedForward), RMSNorm, Linear)
    with torch.no_grad():
        last = head[0].fn[-1]
        last.weight.zero_()
        last.bias.zero_()  # Residual(FeedForward) is now the identity
        head[1].gamma.copy_(model.target_transformer.final_norm.gamma)
        head[2].weight.copy_(model.to_logits["speech"].weight)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draft_equal_to_target_accepts_every_draft(sources, dtype):
    model = copy_target_head(make_model(6, exit_layer=4, dtype=dtype))
    source = sources[4]
    gamma = 4
    plain = greedy(model, source, max_length=MAX_LEN).tokens
    spec = greedy(model, source, max_length=MAX_LEN, gamma=gamma)
    assert_same_tokens(spec.tokens, plain)
    stats = spec.stats
    assert stats.alpha == 1.0 and stats.rejections == 0
    assert stats.accepted_hist[:gamma] == [0] * gamma and stats.accepted_hist[gamma] > 0
    assert stats.tokens_per_target_pass == gamma + 1
    # sampling too: p == q, so min(1, p/q) = 1 for every draft
    sampled = SpeculativeDecoder(model).sample(
        source, temperature=1.0, max_length=MAX_LEN, gamma=gamma, generator=torch.Generator().manual_seed(1)
    )
    assert sampled.stats.alpha == 1.0 and sampled.stats.accepted_hist[:gamma] == [0] * gamma


def test_random_draft_head_accepts_almost_nothing(sources):
    model = make_model(7, eos=False, exit_layer=1)
    torch.manual_seed(123)
    with torch.no_grad():  # a head unrelated to the target: re-drawn on its own seed
        for p in model.to_early_exit_semantic_logits.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 3.0)
    source = sources[4]
    plain = greedy(model, source, max_length=MAX_LEN).tokens
    spec = greedy(model, source, max_length=MAX_LEN, gamma=4)
    assert_same_tokens(spec.tokens, plain)
    # greedy acceptance of an unrelated argmax over 12 tokens: about 1/12 per draft
    assert spec.stats.alpha < 0.25
    assert spec.stats.accepted_hist[0] > 0.6 * sum(spec.stats.accepted_hist)


def test_speculative_greedy_with_guidance_equals_plain(sources, layout):
    model = make_model(5, cond_drop_prob=0.5)
    source = sources[5]
    plain = greedy(model, source, max_length=MAX_LEN, cond_scale=3.0).tokens
    check_eos_mix(plain, MAX_LEN)
    for gamma in (1, 3):
        assert_same_tokens(greedy(model, source, max_length=MAX_LEN, cond_scale=3.0, gamma=gamma).tokens, plain)
    # a draft guided at another scale drafts other tokens, and the output still does not move
    hists = {}
    for draft_scale in (None, 3.0, 1.0, 2.0):
        spec = greedy(model, source, max_length=MAX_LEN, cond_scale=3.0, gamma=3, draft_cond_scale=draft_scale)
        assert_same_tokens(spec.tokens, plain)
        hists[draft_scale] = spec.stats.accepted_hist
    assert hists[None] == hists[3.0]
    assert hists[1.0] != hists[3.0]  # the scale reaches the draft


@pytest.mark.parametrize("gamma", [0, 3])
@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_sampling_with_a_single_candidate_is_greedy(eos_model, sources, gamma, filt):
    """top_k = 1 or a tiny top_p leave one token: sampling at any temperature is then greedy decoding."""
    plain = greedy(eos_model, sources[5], max_length=MAX_LEN).tokens
    out = SpeculativeDecoder(eos_model).sample(
        sources[5], temperature=1.5, max_length=MAX_LEN, gamma=gamma, generator=torch.Generator().manual_seed(0),
        **filt,
    )
    assert_same_tokens(out.tokens, plain)


def prefix_law(model, source, length, vocab, top_k=None, cond_scale=1.0):
    """Exact law of the first `length` tokens (no EOS) at temperature 1, with top-k and CFG.

    CFG mixes log-probs instead of logits: they differ by a per-row constant, which softmax ignores.
    """
    table = sequence_table(model, source, length, vocab)
    null = sequence_table(model, source, length, vocab, null=True) if cond_scale > 1 else table
    law = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=length):
        prob = 1.0
        for n in range(length):
            cond_lp, null_lp = table[seq[:n]].double(), null[seq[:n]].double()
            logp = (null_lp + (cond_lp - null_lp) * cond_scale).log_softmax(dim=-1)
            if top_k is not None:
                keep = torch.zeros_like(logp, dtype=torch.bool).scatter(0, logp.topk(top_k).indices, True)
                logp = logp.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)
            prob *= float(logp[seq[n]].exp())
        law[seq] = prob
    return law


@pytest.mark.parametrize(
    "gamma, top_k, cond_scale, confidence, draft_scale",
    [(0, None, 1.0, None, None), (2, None, 1.0, None, None), (0, 2, 1.0, None, None), (2, 2, 1.0, None, None),
     (2, None, 3.0, None, None), (2, None, 3.0, None, 1.0), (3, None, 1.0, 0.5, None), (3, 2, 1.0, 0.7, None)],
    ids=["plain", "spec", "plain-topk", "spec-topk", "spec-cfg", "spec-cfg-draft-1", "spec-early-stop",
         "spec-topk-early-stop"],
)
def test_first_tokens_follow_target_law(gamma, top_k, cond_scale, confidence, draft_scale):
    """Empirical law of the first 3 tokens == the exact target law (plain and speculative)."""
    vocab, length, n = 4, 3, 30_000
    model = make_model(8, semantic_vocab=vocab, eos=False, cond_drop_prob=0.5 if cond_scale > 1 else 0.0)
    source = make_source(1, 5, seed=4)
    law = prefix_law(model, source, length, vocab, top_k, cond_scale)
    if cond_scale > 1:  # guidance moves the law visibly
        assert 0.5 * float((law - prefix_law(model, source, length, vocab)).abs().sum()) > 0.1
    out = SpeculativeDecoder(model).sample(
        source.expand(n, -1), temperature=1.0, top_k=top_k, max_length=length, gamma=gamma,
        cond_scale=cond_scale, generator=torch.Generator().manual_seed(10 + gamma), draft_confidence=confidence,
        draft_cond_scale=draft_scale,
    )
    seqs = torch.stack(out.tokens)
    codes = (seqs * torch.tensor([vocab**2, vocab, 1])).sum(dim=1)
    counts = torch.bincount(codes, minlength=vocab**length)
    assert tv(counts, law) < tv_bound(vocab**length, n)
    if gamma and confidence is None:  # the draft is neither always right nor always wrong
        hist = out.stats.accepted_hist
        assert hist[0] > 0 and hist[gamma] > 0
    if confidence is not None:  # rows stopped drafting at different depths
        assert out.stats.drafted < gamma * sum(out.stats.accepted_hist)


def test_long_greedy_outputs_are_forward_argmax(sources):
    """Past the cache's first allocation (256 positions): every greedy token is the argmax of the
    full forward's logits after its prefix, for plain and speculative decoding."""
    model, source, length = make_model(0, eos=False), sources[4][:2], 300
    plain = greedy(model, source, max_length=length).tokens
    logits = forward_logits(model, source, torch.stack(plain))
    assert torch.equal(torch.stack(plain), logits[:, :-1].argmax(dim=-1))
    assert_same_tokens(greedy(model, source, max_length=length, gamma=4).tokens, plain)


def test_trunk_runs_once_per_token_beyond_rejected_drafts(sources):
    """Layers 1..E: every committed position once + every rejected draft once; nothing else.

    Per row and cycle the draft pushes the pending token and gamma drafts through the trunk; a
    cycle that keeps a drafts commits a + 1 positions and wastes gamma - a. Layers E+1..L run on
    gamma + 1 positions per row and cycle. Committed positions equal the tokens the rows emitted.
    """
    model = make_model(0, eos=False)
    gamma, source = 3, sources[4]
    plain = greedy(model, source, max_length=MAX_LEN)
    spec = greedy(model, source, max_length=MAX_LEN, gamma=gamma)
    s, e = spec.stats, model.early_exit_layer
    hist = s.accepted_hist
    row_cycles = sum(hist)
    committed = sum((a + 1) * h for a, h in enumerate(hist))
    rejected = sum((gamma - a) * h for a, h in enumerate(hist))
    assert 0 < rejected and committed >= 4 * MAX_LEN
    assert committed - 4 * MAX_LEN < 4 * (gamma + 1)  # only the last cycle may overshoot max_length
    assert s.layer_evals[:e] == [committed + rejected] * e
    assert s.layer_evals[e:] == [row_cycles * (gamma + 1)] * (4 - e)
    assert s.trunk_evals == e * (committed + rejected) and s.upper_evals == (4 - e) * row_cycles * (gamma + 1)
    assert s.accepted == committed - row_cycles and s.drafted == gamma * row_cycles
    assert s.steps == s.target_passes and row_cycles >= s.steps
    # plain decoding pushes each of its positions through every layer exactly once
    assert plain.stats.layer_evals == [4 * MAX_LEN] * 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stopped_rows_run_no_layers_past_their_drafts(sources, temperature):
    """On the kernels, a row that stopped drafting early (draft stops) runs the trunk only up to its last
    draft's pass and is verified on its own drafts only: each layer runs each row's proposed drafts and
    pending token once a cycle (a padded position would count too)."""
    from tts_specdec import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    model, gamma = make_model(0, eos=False), 8
    out = SpeculativeDecoder(model).sample(sources[4], temperature=temperature, gamma=gamma, draft_confidence=0.9,
                                           max_length=MAX_LEN, generator=torch.Generator().manual_seed(3))
    s = out.stats
    row_cycles = sum(s.accepted_hist)
    assert s.drafted < gamma * row_cycles  # rows stopped early
    assert s.layer_evals == [s.drafted + row_cycles] * 4


@pytest.mark.parametrize("cond_scale", [1.0, 3.0], ids=["unguided", "cfg-3"])
@pytest.mark.parametrize("top_k, top_p", [(None, None), (3, None), (None, 0.7)], ids=["all-tokens", "top-3", "top-p-0.7"])
@pytest.mark.parametrize("confidence", [None, 0.5], ids=["all", "early-stops"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_fused_draft_phase_equals_step_by_step(sources, temperature, confidence, top_k, top_p, cond_scale):
    """The draft phase in one kernel call (CpuKernels.draft_phase) drafts what the step-by-step loop drafts from
    the same generator: the same tokens, the same exit states, q equal up to float rounding, rows at
    different positions included, the same early stops, the same top-k and top-p filters, the same guidance
    (cond and null rows); and it writes the same trunk K/V."""
    from tts_specdec import kernels
    from tts_specdec.backends import TorchEager
    from tts_specdec.decoder import Decoder
    from tts_specdec.sampling import SamplingConfig

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    model = make_model(3, std=0.3)
    dec = Decoder(model)
    dec.begin()
    src, gamma, guided = sources[4], 4, cond_scale > 1
    if guided and confidence is not None:
        confidence = 0.99  # guidance at 3 sharpens the draft: 0.5 stops no row here
    pos = torch.tensor([3, 0, 5, 2])
    results = []
    with torch.inference_mode():
        for fused in (True, False):
            enc = dec.encode(src, guided)
            cache = dec.new_cache(enc.rows, 16)
            g = torch.Generator().manual_seed(0)
            prefix = dec.embed(torch.randint(0, 12, (4, 5), generator=g), guided)
            dec.run(prefix, 0, range(dec.depth), enc, cache)  # every row's first slots filled
            x = dec.embed(torch.tensor([[1], [2], [3], [4]]), guided)
            gen = torch.Generator().manual_seed(7)
            assert dec.backend.name == "kernels"
            draft_phase = dec.backend.draft_phase if fused else partial(TorchEager.draft_phase, dec.backend)
            out = draft_phase(x, pos, gamma, SamplingConfig(temperature, top_k, top_p), gen, enc, cache,
                              confidence=confidence, cond_scale=cond_scale)
            trunk_k = cache.k[: dec.exit_layer, :, :, : 5 + 5 + gamma + 1].clone()
            results.append((out, trunk_k))
    (exits_f, q_f, drafts_f, limit_f), k_f = results[0]
    (exits_s, q_s, drafts_s, limit_s), k_s = results[1]
    if confidence is None:
        assert limit_f is None and limit_s is None
    else:
        assert torch.equal(limit_f, limit_s)
        assert drafts_f.shape[1] < gamma or int(limit_f.min()) < gamma  # some row stopped early
        # past a row's proposed drafts nothing is defined (the kernel skips a stopped row's passes there and
        # leaves zeros; the accept rules never read them): compare what each row proposed, its exit states
        # up to its last draft's and its trunk K/V up to that slot
        assert drafts_f.shape == drafts_s.shape and exits_f.shape == exits_s.shape
        steps = drafts_f.shape[1]
        # the kernel ran no pass for a row past its last draft's: zero exit states and zero trunk K/V there
        per = 2 if guided else 1  # a sequence's rows: (cond, null) with guidance
        for r, (p, l) in enumerate(zip(pos.tolist(), limit_f.tolist())):
            for row in range(per * r, per * r + per) if l < steps else ():
                assert not exits_f[row, l + 1 :].any() and exits_s[row, l + 1 :].any()
                assert not k_f[:, row, :, p + l + 1 : p + steps + 1].any()
        proposed = torch.arange(steps) < limit_f[:, None]  # (seqs, steps)
        drafts_f, drafts_s = drafts_f * proposed, drafts_s * proposed
        exits_f = exits_f * dec.per_row(torch.arange(steps + 1) <= limit_f[:, None], guided)[..., None]
        exits_s = exits_s * dec.per_row(torch.arange(steps + 1) <= limit_s[:, None], guided)[..., None]
        if q_f is not None:
            assert torch.equal(q_f * ~proposed[..., None], torch.zeros_like(q_f))  # zero, so finite, past them
            q_s = q_s * proposed[..., None]
        written = dec.per_row(torch.arange(k_f.shape[3]) <= (pos + limit_f)[:, None], guided)  # (rows, slots)
        k_f, k_s = k_f * written[None, :, None, :, None], k_s * written[None, :, None, :, None]
    assert torch.equal(drafts_f, drafts_s)
    assert torch.equal(exits_f, exits_s)
    assert torch.equal(k_f, k_s)
    if temperature == 0:
        assert q_f is None and q_s is None
    else:
        torch.testing.assert_close(q_f, q_s, rtol=1e-5, atol=1e-7)
        assert len(set(drafts_f.flatten().tolist())) > 2  # the drafts vary: the test sees the draws
        if top_k is not None:  # the filter ran: at most top_k tokens keep mass (no ties in these logits)
            assert int((q_f > 0).sum(-1).max()) == top_k
        if top_p is not None:  # the filter ran: some distributions lost tokens, none all but one
            kept = (q_f > 0).sum(-1)
            assert int(kept.min()) < q_f.shape[-1] and int(kept.max()) > 1
