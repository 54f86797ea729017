"""Speculative beam search returns exactly what plain beam search returns.

Drafts at the extremes: equal to the target (exit at the last layer, exit head made a copy of the
final head: every drafted step is accepted), random (the untrained exit head: almost nothing is),
and partial (exit one layer below the top with the copied head: some cycles accept, some do not).
"""

import dataclasses
import math

import pytest
import torch

from tts_specdec import SpeculativeDecoder

from conftest import make_model, make_source

pytestmark = pytest.mark.usefixtures("one_thread")

DEPTH = 4
MAX_LENGTH = 14


def copy_final_head(model):
    """Exit head := final head: zero the residual feed-forward, copy final-norm gamma and logit weight."""
    head = model.to_early_exit_semantic_logits
    with torch.no_grad():
        ff_out = head[0].fn[-1]
        ff_out.weight.zero_()
        ff_out.bias.zero_()
        head[1].gamma.copy_(model.target_transformer.final_norm.gamma)
        head[2].weight.copy_(model.to_logits["speech"].weight)
    return model


def draft_model(kind: str, seed: int = 0, **kwargs):
    exit_layer = {"equal": DEPTH, "random": 2, "partial": DEPTH - 1}[kind]
    model = make_model(seed, target_depth=DEPTH, exit_layer=exit_layer, **kwargs)
    return copy_final_head(model) if kind != "random" else model


def assert_same(plain, spec, tol: float = 1e-9):
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    assert max(abs(a - b) for a, b in zip(spec.scores, plain.scores)) < tol


BATCHES = [(1, [6]), (3, [6, 4, 2])]


@pytest.mark.parametrize("kind", ["equal", "random", "partial"])
@pytest.mark.parametrize("beam_size", [1, 2, 4])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_float64_equals_plain(kind, beam_size, gamma):
    model = draft_model(kind, dtype=torch.float64)
    dec = SpeculativeDecoder(model)
    ended = 0
    for (batch, lengths), length_penalty in [(b, lp) for b in BATCHES for lp in (0.0, 1.0)]:
        source = make_source(batch, 6, seed=batch, lengths=lengths)
        kw = dict(beam_size=beam_size, length_penalty=length_penalty, max_length=MAX_LENGTH)
        plain = dec.beam_search(source, gamma=0, **kw)
        spec = dec.beam_search(source, **kw, gamma=gamma)
        assert_same(plain, spec)
        ended += sum(t.numel() < MAX_LENGTH for t in plain.tokens)
        stats = spec.stats
        assert stats.target_passes == stats.steps and sum(stats.committed_hist) >= stats.steps
        if kind == "equal" and batch == 1:
            # at draft width K every cycle commits gamma + 1 steps until the item is done (a wider level,
            # the default, ranks by draft score nodes beside the K beams' children and may push one out)
            exact = dec.beam_search(source, **kw, gamma=gamma, draft_width=beam_size)
            assert_same(plain, exact)
            assert exact.stats.steps == math.ceil(plain.stats.steps / (gamma + 1))
    assert ended, "EOS never reached: the test does not exercise finished hypotheses"


@pytest.mark.parametrize("kind", ["equal", "partial"])
def test_float64_cfg_equals_plain(kind, layout):
    model = draft_model(kind, seed=1, dtype=torch.float64, cond_drop_prob=0.2)
    dec = SpeculativeDecoder(model)
    source = make_source(3, 6, seed=3, lengths=[6, 3, 5])
    for beam_size, gamma in [(2, 3), (4, 2)]:
        kw = dict(beam_size=beam_size, max_length=MAX_LENGTH, cond_scale=3.0)
        assert_same(dec.beam_search(source, gamma=0, **kw), dec.beam_search(source, **kw, gamma=gamma))


@pytest.mark.parametrize("max_length", [1, 2, 5])
def test_max_length_shorter_than_gamma(max_length):
    dec = SpeculativeDecoder(draft_model("partial", dtype=torch.float64))
    source = make_source(3, 5, seed=2, lengths=[5, 2, 4])
    kw = dict(beam_size=3, max_length=max_length)
    spec = dec.beam_search(source, **kw, gamma=6, draft_width=5)
    assert_same(dec.beam_search(source, gamma=0, **kw), spec)
    assert all(t.numel() <= max_length for t in spec.tokens)


def test_wide_draft_and_gqa(layout):
    model = draft_model("partial", seed=2, dtype=torch.float64, heads=4, kv_heads=2)
    dec = SpeculativeDecoder(model)
    source = make_source(3, 6, seed=4, lengths=[6, 6, 1])
    kw = dict(beam_size=2, max_length=MAX_LENGTH)
    assert_same(dec.beam_search(source, gamma=0, **kw), dec.beam_search(source, **kw, gamma=4, draft_width=6))


def test_float32_many_sources(layout):
    """50 random sources in float32: the same bits as beam search on every layout. A tree node's attention
    sums only the keys it sees, in their order, as a beam step does (the kernels' `attend` in
    csrc/attention.cpp; on torch's path `tiles.gathered_attention`), and on torch's path every product and
    attention runs in fixed tiles (`tiles`), whose rows keep their bits whatever shares the call."""
    from tts_specdec import kernels

    model = draft_model("partial", seed=3)
    dec = SpeculativeDecoder(model)
    lengths = torch.randint(1, 9, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    source = make_source(50, 8, seed=5, lengths=lengths)
    kw = dict(beam_size=4, max_length=20)
    plain, spec = dec.beam_search(source, gamma=0, **kw), dec.beam_search(source, **kw, gamma=3)
    if layout == "kernel" and kernels.available():
        assert dec.decoder.backend.name == "kernels"
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in plain.tokens]
    assert spec.scores == plain.scores  # every score to the bit
    hist = spec.stats.committed_hist
    assert sum(k * n for k, n in enumerate(hist)) >= plain.stats.steps
    assert any(hist[2:]), "the partial draft never got a step accepted"


# Every draft kind with every (beam size, gamma) once, the layouts taking turns so that each layout meets
# every kind and every (beam size, gamma): all pairs of the three, not the 36 cases of their product, which
# took a sixth of the suite's time.
_UPSTREAM_CASES = [(kind, beam_size, gamma, ("mm", "split", "kernel")[(i + j) % 3])
                   for j, (beam_size, gamma) in enumerate([(1, 2), (2, 1), (3, 3), (4, 6)])
                   for i, kind in enumerate(["equal", "random", "partial"])]


@pytest.mark.parametrize("kind, beam_size, gamma, layout", _UPSTREAM_CASES, indirect=["layout"])
def test_upstream_semantics_float64_equals_plain(kind, beam_size, gamma, layout):
    """spear-tts's search: items advance at different rates here but must stop together, each
    returning its first beam at the common stop."""
    model = draft_model(kind, seed=4, dtype=torch.float64, cond_drop_prob=0.2)
    dec = SpeculativeDecoder(model)
    for (batch, lengths), temperature, cond_scale in [((1, [6]), 1.0, 1.0), ((3, [6, 4, 2]), 0.6, 1.0),
                                                      ((3, [2, 6, 5]), 0.0, 2.0)]:
        source = make_source(batch, 6, seed=batch + 7, lengths=lengths)
        kw = dict(beam_size=beam_size, max_length=MAX_LENGTH, beam_semantics="upstream", temperature=temperature,
                  cond_scale=cond_scale)
        plain, spec = dec.beam_search(source, gamma=0, **kw), dec.beam_search(source, **kw, gamma=gamma)
        assert_same(plain, spec)
        assert spec.stats.beam_steps == plain.stats.beam_steps == plain.stats.steps


@pytest.mark.parametrize("kind, semantics", [("partial", "standard"), ("partial", "upstream"), ("equal", "standard")])
def test_kernels_one_call_draft_builds_the_same_trees(monkeypatch, kind, semantics):
    """On the kernels (float32, unguided) a cycle's draft, verify pass and target head are one call
    (`Backend.beam_draft`); without it `spec_beam.draft` builds the tree level by level and `verify` passes
    over it. Every cycle runs both ways from the same cache: the same tree (nodes, tables, exit states),
    the same target log-probs and the same K/V written in every layer, for items at different lengths
    (rows at different slots), EOS blocked or not, a temperature, and an exit at the last layer. Where a
    root is ready (its token verified by the last cycle, `_Live.ready`), the one call skips it: passed level
    by level it is recomputed, and its K/V and log-probs must equal what the last cycle left (the same
    bits), as they do for a plain beam step. Both rank a ready root's children by those log-probs."""
    from tts_specdec import kernels, spec_beam
    from tts_specdec.backends.kernels_cpu import CpuKernels

    if not kernels.available():
        pytest.skip("the CPU kernels do not run here")
    inner, compared, made, readied, ranked = CpuKernels.beam_draft, [], [], [], []

    def one_call(*args, **kwargs):
        out = inner(*args, **kwargs)
        made.append(out is not None)
        return out

    def both(dec, live, cache, levels, width, cond_scale, temperature=1.0):
        before = cache.k.clone(), cache.v.clone()
        tree = spec_beam_draft(dec, live, cache, levels, width, cond_scale, temperature)
        logprobs = spec_beam.verify(dec, live, tree, cache, cond_scale, temperature)
        after = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        monkeypatch.setattr(CpuKernels, "beam_draft", lambda *a, **k: None)
        by_level = spec_beam_draft(dec, live, cache, levels, width, cond_scale, temperature)
        monkeypatch.setattr(CpuKernels, "beam_draft", one_call)
        for name in ("row", "index", "path", "anc", "depth", "count"):
            assert torch.equal(getattr(tree, name), getattr(by_level, name)), name
        # a ready root skips the one call's trunk pass: its exit state is zero there, the others the same
        ready = torch.zeros(live.t.numel(), dtype=torch.bool) if live.ready is None else live.ready
        assert torch.equal(tree.h[~ready], by_level.h[~ready]) and torch.equal(tree.h[ready, 1:], by_level.h[ready, 1:])
        assert torch.equal(tree.h[ready, 0], torch.zeros_like(tree.h[ready, 0]) if levels else by_level.h[ready, 0])
        # a ready root's first-level children are its best tokens by the target's log-probs the last
        # cycle carried (the draft's would pick others on this untrained model)
        for r in ready.nonzero().flatten().tolist():
            mine = {tk for (p, tk) in tree.children if p == r}
            lp = live.carried[r].clone()
            if semantics == "standard" and dec.eos_id is not None:
                lp[dec.eos_id] = -math.inf
            assert mine == set(lp.topk(len(mine)).indices.tolist())
            ranked.append(len(mine))
        assert (tree.count_host, tree.row_host, tree.children) == (by_level.count_host, by_level.row_host, by_level.children)
        assert (tree.verified is not None) == (levels > 0) and by_level.verified is None
        assert (tree.logprobs is not None) == (levels > 0) and by_level.logprobs is None  # the head in that call
        assert torch.equal(spec_beam.verify(dec, live, by_level, cache, cond_scale, temperature), logprobs)
        # recomputed, not carried: the ready roots' log-probs as a pass over them gives them
        fresh = dataclasses.replace(live, ready=None, carried=None)
        assert torch.equal(spec_beam.verify(dec, fresh, by_level, cache, cond_scale, temperature), logprobs)
        assert torch.equal(cache.k, after[0]) and torch.equal(cache.v, after[1])  # every layer's K/V
        compared.append(levels)
        readied.append(0 if live.ready is None else int(live.ready.sum()))
        return tree

    spec_beam_draft = spec_beam.draft
    monkeypatch.setattr(spec_beam, "draft", both)
    monkeypatch.setattr(CpuKernels, "beam_draft", one_call)
    dec = SpeculativeDecoder(draft_model(kind, seed=3))  # "equal": no layer above the exit
    source = make_source(3, 8, seed=5, lengths=[8, 3, 5])
    for temperature in (1.0, 0.7):
        dec.beam_search(source, beam_size=3, max_length=16, gamma=2, draft_width=5, beam_semantics=semantics,
                        temperature=temperature)
    assert dec.decoder.backend.name == "kernels" and len(compared) > 10 and max(compared) == 2
    assert sum(made) == sum(n > 0 for n in compared)  # every cycle with a level to draft, in one call
    assert sum(readied) > 0 and sum(ranked) > 0  # some cycles started with roots already verified


@pytest.mark.parametrize("by_reference, semantics", [(True, "standard"), (True, "upstream"), (False, "standard")])
def test_kernels_one_call_commit_leaves_what_the_cache_verbs_leave(monkeypatch, by_reference, semantics):
    """On the kernels (float32, unguided) a cycle's commit is one call (`Backend.commit_beams`): the cache's
    rows reordered (slot tables, or K/V by value), the accepted paths moved, the lengths cropped, and the
    next cycle's inputs, scores by row and carried log-probs made. Every cycle runs it and the cache verbs'
    way from the same state: the same K/V in every layer, the same tables and lengths, the same next
    cycle, for items that finish at different cycles (the verbs then run alone) and rows made ready."""
    from tts_specdec import kernels, spec_beam
    from tts_specdec.backends.kernels_cpu import CpuKernels

    if not kernels.available():
        pytest.skip("the CPU kernels do not run here")
    inner, made, readied = CpuKernels.commit_beams, [], []
    commit = spec_beam.commit

    def state(cache):
        return (cache.k.clone(), cache.v.clone(), None if cache.table is None else cache.table.clone(),
                cache.lengths.clone(), cache.high)

    def restore(cache, saved):  # a cache by value that dropped rows holds fewer: its buffers replaced
        cache.k, cache.v = saved[0].clone(), saved[1].clone()
        cache._per_layer()
        cache.table = None if saved[2] is None else saved[2].clone()
        cache.lengths, cache.high = saved[3].clone(), saved[4]

    def both(dec, live, tree, advances, cache, guided, logprobs):
        before = state(cache)
        calls = []
        monkeypatch.setattr(CpuKernels, "commit_beams", lambda *a, **k: calls.append(inner(*a, **k)) or calls[-1])
        fast = commit(dec, live, tree, advances, cache, guided, logprobs)
        after = state(cache)
        restore(cache, before)
        monkeypatch.setattr(CpuKernels, "commit_beams", lambda *a, **k: None)
        slow = commit(dec, live, tree, advances, cache, guided, logprobs)
        for got, want in zip(after[:4], state(cache)[:4]):
            assert (got is None and want is None) or torch.equal(got, want)
        assert (fast.items, fast.lengths, fast.rows, fast.ready_count) == (slow.items, slow.lengths, slow.rows, slow.ready_count)
        assert torch.equal(fast.t, slow.t) and torch.equal(fast.x, slow.x)
        assert torch.equal(fast.score, slow.score.to(fast.score.dtype))
        assert (fast.ready is None) == (slow.ready is None)
        if fast.ready is not None:
            assert torch.equal(fast.ready, slow.ready)
            assert torch.equal(fast.carried[fast.ready], slow.carried[slow.ready])  # rows not ready are never read
        made.append(bool(calls) and calls[0] is not None)
        readied.append(fast.ready_count)
        restore(cache, after)
        return fast

    monkeypatch.setattr(spec_beam, "commit", both)
    monkeypatch.setattr(CpuKernels, "by_reference", by_reference)
    dec = SpeculativeDecoder(draft_model("partial", seed=3))
    source = make_source(3, 8, seed=5, lengths=[8, 3, 5])
    for temperature in (1.0, 0.7):
        dec.beam_search(source, beam_size=3, max_length=16, gamma=2, draft_width=5, beam_semantics=semantics,
                        temperature=temperature)
    assert dec.decoder.backend.name == "kernels" and len(made) > 10
    assert any(made) and not all(made)  # the one call, and the verbs alone where an item finished
    assert sum(readied) > 0  # some cycles made rows ready
