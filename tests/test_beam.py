"""Beam search: the step function on hand-built log-probs, exhaustive search, spear-tts, batching."""

import itertools
import math

import pytest
import torch

from tts_specdec import SpeculativeDecoder, kernels
from tts_specdec.beam import BeamState, beam_step, on_device

from conftest import forward_logits, make_model, make_source, sequence_table, upstream_generate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_beam_step_sends_top_ranked_eos_to_finished_and_fills_live_beams():
    eos = 3
    state = BeamState.initial(1, 2, 1.0, eos, torch.device("cpu"))
    # first step: only beam 0 expands (the others start at -inf)
    lp = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25] * 4]).log()
    out = beam_step(state, lp)
    assert out.tokens.tolist() == [0, 1] and out.parents.tolist() == [0, 0]
    assert state.tokens.tolist() == [[0], [1]] and state.finished == [[]]
    # second step, candidates best first: beam 1 + EOS (.291), beam 0 + 2 (.25), beam 0 + EOS (.2),
    # beam 0 + 0 (.03): rank 0 is finished, rank 2 (an EOS past the first K) is dropped
    lp = torch.tensor([[0.06, 0.04, 0.5, 0.4], [0.01, 0.01, 0.01, 0.97]]).log()
    s0, s1 = math.log(0.5), math.log(0.3)
    out = beam_step(state, lp)
    finished = sorted(state.finished[0], reverse=True)
    assert len(finished) == 1 and finished[0][2] == [1, 3]
    assert finished[0][0] == pytest.approx((s1 + math.log(0.97)) / 2)  # sum / len**1, len incl. EOS
    assert state.tokens.tolist() == [[0, 2], [0, 0]]
    assert state.scores[0].tolist() == pytest.approx([s0 + math.log(0.5), s0 + math.log(0.06)])
    assert out.parents.tolist() == [0, 0] and out.tokens.tolist() == [2, 0] and out.kept is None  # every item kept


def test_beam_step_eos_at_rank_k_minus_one_is_finished():
    """The boundary of the rule: an EOS ranked K-1 (the last of the first K) still finishes."""
    eos = 3
    state = BeamState.initial(1, 2, 1.0, eos, torch.device("cpu"))
    beam_step(state, torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25] * 4]).log())
    # candidates best first: beam 0 + 2 (.25), beam 0 + EOS (.15, rank 1 = K-1), beam 1 + 0 (.12)
    out = beam_step(state, torch.tensor([[0.1, 0.1, 0.5, 0.3], [0.4, 0.2, 0.2, 0.2]]).log())
    assert [f[2] for f in state.finished[0]] == [[0, 3]]
    assert state.finished[0][0][0] == pytest.approx(math.log(0.5 * 0.3) / 2)
    assert out.parents.tolist() == [0, 1] and out.tokens.tolist() == [2, 0]
    assert state.tokens.tolist() == [[0, 2], [1, 0]]


def test_beam_step_last_finalises_live_beams():
    state = BeamState.initial(1, 2, 0.0, None, torch.device("cpu"))
    beam_step(state, torch.tensor([[0.6, 0.4], [0.5, 0.5]]).log())
    out = beam_step(state, torch.tensor([[0.9, 0.1], [0.2, 0.8]]).log(), last=True)
    assert state.active == 0 and out.kept.numel() == 0
    tokens, score = state.best(0)
    assert tokens == [0, 0] and score == pytest.approx(math.log(0.6 * 0.9))
    assert len(state.finished[0]) == 2


def exhaustive_best(table, vocab, eos, max_length, length_penalty):
    """Best over every sequence: EOS-terminated ones (len incl. EOS) and EOS-free ones of max_length."""
    best = (-math.inf, None)
    for n in range(1, max_length + 1):
        for body in itertools.product([t for t in range(vocab) if t != eos], repeat=n - 1):
            ends = [eos] + ([t for t in range(vocab) if t != eos] if n == max_length else [])
            for last in ends:
                seq = body + (last,)
                total = sum(float(table[seq[:i]][seq[i]]) for i in range(n))
                best = max(best, (total / n**length_penalty, seq))
    return best


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_covering_every_sequence_equals_exhaustive_search(length_penalty):
    """2 tokens + EOS, max_length 4: 31 sequences in all, so beam_size 32 prunes nothing."""
    vocab, max_length = 3, 4
    model = make_model(9, semantic_vocab=vocab - 1, dtype=torch.float64)
    with torch.no_grad():  # EOS as likely as the other tokens, so some winners end early and some do not
        model.to_logits["speech"].weight[vocab - 1] *= 0.5
    sources = make_source(4, 6, seed=5, lengths=[6, 3, 5, 6])
    out = SpeculativeDecoder(model).beam_search(
        sources, gamma=0, beam_size=32, length_penalty=length_penalty, max_length=max_length
    )
    winners = []
    for i in range(sources.shape[0]):
        n = int((sources[i] != 0).sum())
        table = sequence_table(model, sources[i : i + 1, :n], max_length, vocab)
        score, seq = exhaustive_best(table, vocab, vocab - 1, max_length, length_penalty)
        winners.append(seq)
        expected = [t for t in seq if t != vocab - 1]
        assert out.tokens[i].tolist() == expected, i
        assert out.scores[i] == pytest.approx(score, rel=1e-9, abs=1e-12)
    # guard on the data: winners of several lengths, with and without EOS
    assert len({len(w) for w in winners}) > 1 and any(w[-1] != vocab - 1 for w in winners)


@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_beam_without_eos_equals_upstream_beam_search(cond_scale, layout):
    model = make_model(10, eos=False, cond_drop_prob=0.5 if cond_scale > 1 else 0.0)
    source = make_source(3, 6, seed=6, lengths=[6, 2, 4])
    ours = SpeculativeDecoder(model).beam_search(source, gamma=0, beam_size=3, max_length=8, cond_scale=cond_scale)
    ref = upstream_generate(model, source, beam_search_decode=True, beam_size=3, max_length=8, cond_scale=cond_scale)
    for i in range(3):
        assert ours.tokens[i].tolist() == ref[i].tolist(), i
    greedy = SpeculativeDecoder(model).sample(source, temperature=0.0, max_length=8, cond_scale=cond_scale)
    assert any(a.tolist() != b.tolist() for a, b in zip(ours.tokens, greedy.tokens))  # beam search mattered


def test_beam_batch_rows_equal_rows_decoded_alone():
    model = make_model(0)
    source = make_source(5, 7, seed=2, lengths=[7, 5, 7, 2, 6])
    dec = SpeculativeDecoder(model)
    batch = dec.beam_search(source, gamma=0, beam_size=3, max_length=14)
    lengths = [t.numel() for t in batch.tokens]
    assert min(lengths) < 14 and max(lengths) == 14, lengths  # some rows end early
    for i in range(5):
        n = int((source[i] != 0).sum())
        alone = dec.beam_search(source[i : i + 1, :n], gamma=0, beam_size=3, max_length=14)
        assert batch.tokens[i].tolist() == alone.tokens[0].tolist(), i
        # float32 sums of 14 log-probs; the source encoder's products see padded batches of another
        # shape (seen: 1.4e-7 relative), and so do the decoder's without the kernels (torch's products
        # round by batch shape; seen: 1.3e-5 relative)
        assert batch.scores[i] == pytest.approx(alone.scores[0], rel=1e-5 if kernels.available() else 1e-4), i


def test_beam_size_one_without_eos_is_greedy():
    model = make_model(11, eos=False)
    source = make_source(2, 6, seed=7)
    dec = SpeculativeDecoder(model)
    beam = dec.beam_search(source, gamma=0, beam_size=1, max_length=10, length_penalty=0.0)
    greedy = dec.sample(source, temperature=0.0, max_length=10)
    for a, b in zip(beam.tokens, greedy.tokens):
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("eos, max_length", [(True, 14), (False, 260)], ids=["eos", "long"])
def test_beam_scores_are_forward_log_probs(eos, max_length):
    """Returned score == sum of the full forward's log-probs of the returned sequence (EOS included
    when it ended early) / len**length_penalty; 260 steps also cross the cache's first allocation."""
    model = make_model(0, eos=eos)
    source = make_source(5, 7, seed=2, lengths=[7, 5, 7, 2, 6])[: 5 if eos else 2]
    out = SpeculativeDecoder(model).beam_search(source, gamma=0, beam_size=3, length_penalty=1.0, max_length=max_length)
    eos_id = model.eos_id["speech"]
    for i, tokens in enumerate(out.tokens):
        ended = tokens.numel() < max_length  # a sequence that ends at EOS is shorter than max_length
        assert eos or not ended
        seq = torch.cat((tokens, torch.tensor([eos_id]))) if ended else tokens
        logp = forward_logits(model, source[i : i + 1], seq[None]).log_softmax(dim=-1)[0]
        total = float(logp[torch.arange(seq.numel()), seq].sum())
        assert out.scores[i] == pytest.approx(total / seq.numel(), rel=1e-4)
    if eos:
        assert any(t.numel() < max_length for t in out.tokens)


def reference_beam_search(model, source, beam_size, length_penalty, max_length, cond_scale=1.0):
    """DESIGN.md's beam semantics written out directly over full forward passes, one item at a time."""
    k, eos = beam_size, model.eos_id["speech"]
    live, finished = [((), 0.0)], []  # (tokens, summed log-prob); finished: (normalised score, tokens)
    for t in range(max_length):
        prefixes = torch.tensor([seq for seq, _ in live], dtype=torch.long).reshape(len(live), t)
        sources = source.expand(len(live), -1)
        logits = forward_logits(model, sources, prefixes)[:, -1]
        if cond_scale > 1:
            null = forward_logits(model, sources, prefixes, null=True)[:, -1]
            logits = null + (logits - null) * cond_scale
        logp = logits.double().log_softmax(-1)
        cands = [(score + float(logp[b, tok]), seq + (tok,)) for b, (seq, score) in enumerate(live)
                 for tok in range(logp.shape[1])]
        cands.sort(key=lambda c: -c[0])
        live = []
        for rank, (score, seq) in enumerate(cands[: 2 * k]):
            if seq[-1] == eos:
                if rank < k:
                    finished.append((score / (t + 1) ** length_penalty, seq))
                continue
            live.append((seq, score))
            if len(live) == k:
                break
        if t + 1 == max_length:
            finished += [(score / (t + 1) ** length_penalty, seq) for seq, score in live]
            break
        finished = sorted(finished, key=lambda f: -f[0])[:k]
        best_live = max(score for _, score in live)
        if len(finished) == k and best_live / (t + 1) ** length_penalty <= finished[-1][0]:
            break  # stopped by the rule, with live beams left
    score, seq = max(finished, key=lambda f: f[0])
    return [tok for tok in seq if tok != eos], score, t + 1


@pytest.mark.parametrize(
    "beam_size, length_penalty, cond_scale", [(2, 1.0, 1.0), (3, 0.0, 1.0), (3, 2.0, 1.0), (3, 0.5, 3.0)]
)
def test_beam_equals_reference_semantics_with_pruning(beam_size, length_penalty, cond_scale):
    """Beams much narrower than the sequence space: pruning, the finished set and the stopping rule
    all matter, and the batched search must make the same decisions as the written-out semantics."""
    model = make_model(12, dtype=torch.float64, cond_drop_prob=0.5 if cond_scale > 1 else 0.0)
    source = make_source(4, 7, seed=8, lengths=[7, 5, 3, 6])
    out = SpeculativeDecoder(model).beam_search(
        source, gamma=0, beam_size=beam_size, length_penalty=length_penalty, max_length=12, cond_scale=cond_scale
    )
    steps = []
    for i in range(source.shape[0]):
        tokens, score, n = reference_beam_search(
            model, source[i : i + 1], beam_size, length_penalty, 12, cond_scale
        )
        assert out.tokens[i].tolist() == tokens, i
        assert out.scores[i] == pytest.approx(score, rel=1e-9)
        steps.append(n)
    assert min(steps) < 12  # the stopping rule ended some items before max_length
    assert out.stats.steps == max(steps)  # the batch runs until its last item is done


def upstream_state(batch, k, eos, stop_together=True):
    return BeamState.initial(batch, k, 1.0, eos, torch.device("cpu"), "upstream", stop_together)


def test_upstream_step_ranks_each_beams_top_k_and_keeps_expanding_after_eos():
    """spear-tts's step: each beam offers its K best tokens; no length normalisation; a beam holding
    an EOS keeps expanding (its later tokens add to its score) until every beam holds one."""
    eos = 3
    steps = [torch.tensor([[0.1, 0.2, 0.1, 0.6], [0.25] * 4]).log(),  # only beam 0 expands
             # beam 0 (EOS, .6) offers 0 (.5), 1 (.4); beam 1 (.2) offers 2 (.9), 0 (.1): .30, .24, .18, .02
             torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.1, 0.0, 0.9, 0.0]]).log()]
    watched = upstream_state(1, 2, eos, stop_together=False)  # beams stay visible
    out = beam_step(watched, steps[0])
    assert out.tokens.tolist() == [3, 1] and out.parents.tolist() == [0, 0] and watched.ended.tolist() == [True, False]
    out = beam_step(watched, steps[1])
    assert watched.tokens.tolist() == [[3, 0], [3, 1]] and out.parents.tolist() == [0, 0]
    assert watched.scores[0].tolist() == pytest.approx([math.log(0.6 * 0.5), math.log(0.6 * 0.4)])
    assert watched.all_ended()
    state = upstream_state(1, 2, eos)
    beam_step(state, steps[0])
    beam_step(state, steps[1])
    assert state.active == 0  # every beam holds an EOS: the search stopped
    tokens, score = state.best(0)
    assert tokens == [3] and score == pytest.approx(math.log(0.6 * 0.5))  # cut after the EOS


def test_upstream_step_ties_follow_torch_sort_of_beam_major_candidates():
    """Equal candidates are ordered as torch.sort orders spear-tts's stacked (beam, rank) list."""
    state = upstream_state(1, 3, None)
    beam_step(state, torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 3).log())
    lp = torch.full((3, 4), 0.25).log()  # every candidate of a beam ties
    cand = (state.scores.float()[:, :, None] + lp.topk(3, dim=-1).values.view(1, 3, 3)).flatten(1)
    order = cand.sort(dim=1, descending=True).indices[0, :3]
    out = beam_step(state, lp)
    assert out.parents.tolist() == (order // 3).tolist()
    assert out.tokens.tolist() == lp.topk(3, dim=-1).indices.view(-1)[order].tolist()


def test_upstream_items_stop_together():
    """An item whose beams all hold an EOS keeps going until every item's do (its ranking can change)."""
    eos = 2
    state = upstream_state(2, 1, eos)
    beam_step(state, torch.tensor([[0.1, 0.1, 0.8], [0.8, 0.1, 0.1]]).log())
    assert state.active == 2 and state.ended.tolist() == [True, False]
    beam_step(state, torch.tensor([[0.1, 0.1, 0.8], [0.1, 0.1, 0.8]]).log())
    assert state.active == 0
    assert state.best(0)[0] == [2] and state.best(1)[0] == [0, 2]
    alone = upstream_state(2, 1, eos, stop_together=False)  # the caller decides (speculative beam search)
    beam_step(alone, torch.tensor([[0.1, 0.1, 0.8], [0.1, 0.1, 0.8]]).log())
    beam_step(alone, torch.tensor([[0.1, 0.1, 0.8], [0.1, 0.1, 0.8]]).log())
    assert alone.active == 2 and alone.all_ended()


@pytest.mark.parametrize("cond_scale, temperature", [(1.0, 1.0), (2.0, 0.5), (1.0, 0.0)])
def test_upstream_semantics_equals_spear_tts(cond_scale, temperature, layout):
    """Our batched loop (every layout, kernels included) == spear-tts's generate(beam_search_decode=True)."""
    from tts_specdec._upstream import TextToSemantic, quiet_progress

    model = make_model(11, cond_drop_prob=0.2)
    source = make_source(4, 6, seed=3, lengths=[6, 4, 2, 5])
    kw = dict(beam_size=3, max_length=12, cond_scale=cond_scale, temperature=temperature)
    with quiet_progress():
        ref = TextToSemantic.generate(model, source, source_type="text", target_type="speech",
                                      beam_search_decode=True, **kw)
    out = SpeculativeDecoder(model).beam_search(source, gamma=0, beam_semantics="upstream", **kw)
    eos, steps = model.eos_id["speech"], out.stats.beam_steps
    assert ref.shape[1] == steps
    for row, tokens in zip(ref, out.tokens):
        ended = (row == eos).nonzero()
        expected = row[: int(ended[0])] if ended.numel() else row
        assert tokens.tolist() == expected.tolist()


def test_on_device_sends_every_item_in_one_tensor():
    """Results of items of different lengths (one empty) come back split, in order, with their scores."""
    tokens, scores = on_device([([1, 2], -1.0), ([], -2.0), ([3], -0.5)], torch.device("cpu"))
    assert [t.tolist() for t in tokens] == [[1, 2], [], [3]] and scores == [-1.0, -2.0, -0.5]
    assert all(t.dtype == torch.long for t in tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_ranking_equals_torch_topk(dtype):
    """`kernels.beam_top` (the CPU's step) ranks as torch.topk over scores cast to the log-probs' dtype plus
    log-probs, rows picked by `rows`; its new beams are the K best. NaN candidates rank first, as
    torch.topk's (their order among themselves is not torch's: `beam_step` then ranks with torch)."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(3)
    a, k, vocab, n = 3, 4, 37, 8
    scores = torch.randn(a, k, generator=g, dtype=torch.float64) * 3
    scores[1, 2:] = -math.inf  # padding beams
    logprobs = torch.randn(20, vocab, generator=g, dtype=dtype).log_softmax(-1)
    logprobs[:, 7] = -math.inf
    logprobs[9] = math.nan
    rows = [int(r) for r in torch.randperm(20, generator=g) if r != 9][: a * k]
    rows[8] = 9  # item 2's first beam: NaN (and with rows None, its second)
    for r in (rows, None):
        lp = logprobs[: a * k] if r is None else logprobs
        picked = lp if r is None else lp[r]
        cand = (scores.to(dtype)[:, :, None] + picked.view(a, k, vocab)).view(a, k * vocab)
        want_v, want_i = cand.topk(n, dim=1)
        values, index, parents, tokens, best = kernels.beam_top(scores, lp, r, n)
        clean = 2  # items without NaN
        assert index[:clean] == want_i[:clean].tolist() and values[:clean] == want_v[:clean].double().tolist()
        assert all(v != v for v in values[2]) and want_v[2].isnan().all()
        assert parents[: clean * k].tolist() == (torch.arange(clean)[:, None] * k + want_i[:clean, :k] // vocab).flatten().tolist()
        assert tokens[: clean * k].tolist() == (want_i[:clean, :k] % vocab).flatten().tolist()
        assert torch.equal(best[:clean], want_v[:clean, :k].double())


def test_kernel_ranking_breaks_ties_to_the_lower_index():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    scores = torch.zeros(1, 2, dtype=torch.float64)
    logprobs = torch.tensor([[0.5, 0.1, 0.5], [0.5, 0.1, 0.1]]).log()
    values, index, *_ = kernels.beam_top(scores, logprobs, None, 4)
    assert index == [[0, 2, 3, 1]]  # three at log 0.5 by flat index, then the first log 0.1


@pytest.mark.parametrize("semantics, seed, vocab, eos, batch, beam_size, length_penalty, temperature, max_length", [
    ("standard", 2, 24, True, 3, 4, 1.0, 1.0, 40),  # items that finish at different steps, then rows dropped
    ("standard", 3, 60, True, 3, 4, 0.0, 1.0, 40),  # an item done in a step without EOS among its best (`_worst`)
    ("standard", 2, 24, True, 4, 3, 0.0, 0.7, 12),  # cut by max_length, a temperature
    ("standard", 2, 24, False, 1, 2, 1.0, 1.0, 300),  # past the cache's first capacity (257 slots): it grows
    ("upstream", 2, 24, True, 3, 4, 1.0, 1.0, 40),  # every beam ended: the items stop together
    ("upstream", 3, 60, True, 2, 3, 1.0, 0.7, 12),  # cut by max_length, a temperature
    ("upstream", 2, 24, False, 1, 2, 1.0, 1.0, 300),
])
def test_kernels_fused_beam_steps_equal_the_step_by_step_loop(monkeypatch, semantics, seed, vocab, eos, batch,
                                                             beam_size, length_penalty, temperature, max_length):
    """On the kernels (unguided) plain beam search takes the steps that need no decision in one call
    (`Backend.beam_steps`: standard semantics, no EOS or non-finite value among an item's K best and no
    item possibly done; spear-tts's, no NaN and not every beam ended), and the others through `verify`
    and `beam_step`: the same hypotheses, scores and steps as every step through `verify` and `beam_step`."""
    from tts_specdec.backends.base import Backend
    from tts_specdec.backends.kernels_cpu import CpuKernels

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    taken, at_capacity = [], []
    inner = kernels.beam_steps

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        taken.append(out[0].shape[0])
        at_capacity.append(out[3] is None)
        return out

    monkeypatch.setattr(kernels, "beam_steps", counted)
    dec = SpeculativeDecoder(make_model(seed, dim=64, heads=4, dim_head=16, semantic_vocab=vocab, eos=eos))
    source = make_source(batch, 8, seed=4, lengths=[8, 3, 5, 6][:batch] if batch > 1 else None)
    kw = dict(gamma=0, beam_size=beam_size, length_penalty=length_penalty, temperature=temperature, max_length=max_length,
              beam_semantics=semantics)
    fused = dec.beam_search(source, **kw)
    assert dec.decoder.backend.name == "kernels" and sum(taken) > 0
    assert any(at_capacity) == (max_length > 257)
    monkeypatch.setattr(CpuKernels, "beam_steps", Backend.beam_steps)
    stepped = dec.beam_search(source, **kw)
    assert [t.tolist() for t in fused.tokens] == [t.tolist() for t in stepped.tokens]
    assert fused.scores == stepped.scores
    assert (fused.stats.steps, fused.stats.beam_steps) == (stepped.stats.steps, stepped.stats.beam_steps)
    if not eos:
        assert all(len(t) == max_length for t in fused.tokens)


@pytest.mark.parametrize("semantics", ["standard", "upstream"])
def test_kernels_fused_beam_steps_hand_a_nonfinite_step_to_beam_step(monkeypatch, semantics):
    """Every token's input NaN in the kernel call's embedding table: the call takes the first step (its
    input is the start token), stops at the second, whose log-probs are NaN, and `beam_step` reports it."""
    from tts_specdec import NonFiniteLogits

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    taken = []
    inner = kernels.beam_steps

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        taken.append(out[0].shape[0])
        return out

    monkeypatch.setattr(kernels, "beam_steps", counted)
    dec = SpeculativeDecoder(make_model(2, dim=64, heads=4, dim_head=16, semantic_vocab=24, eos=False))
    source = make_source(2, 8, seed=4, lengths=[8, 5])
    dec.beam_search(source, gamma=0, beam_size=2, max_length=6, beam_semantics=semantics)  # the backend, built
    backend = dec.decoder.backend
    monkeypatch.setattr(backend, "_embedding", torch.full_like(backend._embedding, math.nan))
    taken.clear()
    with pytest.raises(NonFiniteLogits) as err:
        dec.beam_search(source, gamma=0, beam_size=2, max_length=6, beam_semantics=semantics)
    assert taken[0] == 1 and err.value.step == 1
