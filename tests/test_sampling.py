"""Pure sampling functions on hand-built distributions, against closed forms."""

import math

import pytest
import torch

from tts_specdec import kernels
from tts_specdec._upstream import _spear
from tts_specdec.sampling import (
    SamplingConfig,
    cfg_mix,
    draw,
    filter_logits,
    greedy_accept,
    probabilities,
    residual,
    speculative_accept,
)

from conftest import tv, tv_bound

pytestmark = pytest.mark.usefixtures("one_thread")

P = torch.tensor(
    [
        [0.50, 0.20, 0.20, 0.10, 0.00],
        [0.05, 0.05, 0.30, 0.30, 0.30],
        [0.25, 0.25, 0.25, 0.25, 0.00],
    ],
    dtype=torch.float64,
)
Q = torch.tensor(
    [
        [0.20, 0.20, 0.40, 0.10, 0.10],
        [0.60, 0.10, 0.10, 0.10, 0.10],
    ],
    dtype=torch.float64,
)
V = P.shape[1]
GAMMA = Q.shape[0]


@pytest.fixture(params=["torch", "kernel"])
def dtype(request, monkeypatch):
    """The accept rule's two paths: torch ops (float64 here), and the one-call kernel (float32 CPU)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "ENABLED", False)
        return torch.float64
    monkeypatch.setattr(kernels, "ENABLED", True)
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    return torch.float32


def test_cfg_mix_is_null_plus_scaled_difference():
    logits = torch.randn(6, 3, 7, generator=torch.Generator().manual_seed(0))
    mixed = cfg_mix(logits, 3.0)
    cond, null = logits[0::2], logits[1::2]
    assert mixed.shape == (3, 3, 7)
    torch.testing.assert_close(mixed, null + (cond - null) * 3.0, rtol=0, atol=0)
    torch.testing.assert_close(cfg_mix(logits, 1.0), cond, rtol=0, atol=1e-6)


def test_top_k_keeps_exactly_the_k_largest_and_matches_upstream():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = filter_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    kept = out > float("-inf")
    assert kept.sum(dim=-1).tolist() == [3] * 4
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, logits.topk(3).indices, True))
    assert torch.equal(out[kept], logits[kept])
    assert torch.equal(out, _spear.top_k(logits, k=3))
    assert torch.equal(filter_logits(logits, SamplingConfig(top_k=11)), logits)  # k = V keeps all


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.25, 0.15, 0.1 (sorted order scrambled)
    probs = torch.tensor([[0.15, 0.5, 0.1, 0.25]], dtype=torch.float64)
    logits = probs.log()
    cases = {0.4: [1], 0.6: [1, 3], 0.7: [1, 3], 0.8: [1, 3, 0], 0.95: [1, 3, 0, 2], 1.0: [0, 1, 2, 3]}
    for p, keep in cases.items():
        out = filter_logits(logits, SamplingConfig(top_p=p))
        assert sorted((out[0] > float("-inf")).nonzero()[:, 0].tolist()) == sorted(keep), p
        if p < 1:
            assert torch.equal(out, _spear.top_p(logits, thres=p)), p
    renorm = probabilities(logits, SamplingConfig(top_p=0.6))
    torch.testing.assert_close(renorm, torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]], dtype=torch.float64))


def test_temperature_scales_then_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    out = probabilities(logits, SamplingConfig(temperature=0.5, top_k=2))
    e = torch.tensor([math.exp(4.0), math.exp(2.0)])
    torch.testing.assert_close(out[0, :2], (e / e.sum()).double())
    assert out[0, 2:].tolist() == [0.0, 0.0]


def test_greedy_probabilities_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.9]])
    out = probabilities(logits, SamplingConfig(temperature=0.0, top_k=1))
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_draw_follows_probs():
    n = 200_000
    g = torch.Generator().manual_seed(2)
    tokens = draw(P[0].expand(n, -1), g)
    assert tv(torch.bincount(tokens, minlength=V), P[0]) < tv_bound(V, n)
    assert (tokens != 4).all()  # zero-probability token never drawn


def test_residual_is_normalised_positive_part():
    r = residual(P[:2], Q)
    expected0 = torch.tensor([0.30, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64) / 0.30
    expected1 = torch.tensor([0.0, 0.0, 0.20, 0.20, 0.20], dtype=torch.float64) / 0.60
    torch.testing.assert_close(r, torch.stack((expected0, expected1)))
    # p <= q everywhere (p == q): falls back to p itself
    torch.testing.assert_close(residual(P, P), P, rtol=0, atol=0)


def closed_form(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact joint law of (accepted count a, next token t) under Leviathan et al.'s rule.

    Draft d is accepted with probability beta_d = sum_x min(p_d(x), q_d(x)); after a rejection at d
    the next token is drawn from norm(max(p_d - q_d, 0)), after gamma acceptances from p_{gamma+1}.
    """
    gamma = q.shape[0]
    beta = torch.minimum(p[:gamma], q).sum(dim=-1)
    law = torch.zeros(gamma + 1, p.shape[1], dtype=torch.float64)
    reach = 1.0
    for a in range(gamma):
        if beta[a] < 1:  # written out, not via residual(), so the law does not lean on the code under test
            excess = (p[a] - q[a]).clamp(min=0)
            law[a] = reach * (1 - beta[a]) * excess / excess.sum()
        reach = reach * beta[a]
    law[gamma] = reach * p[gamma]
    return law


def run_accept(p, q, n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    p, q = p.to(dtype), q.to(dtype)
    drafts = draw(q.expand(n, -1, -1), g)
    acc = speculative_accept(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, g)
    return drafts, acc


def test_accept_rule_joint_law_of_count_and_next_token(dtype):
    n = 200_000
    drafts, acc = run_accept(P, Q, n, seed=3, dtype=dtype)
    counts = torch.zeros(GAMMA + 1, V, dtype=torch.long)
    counts.index_put_((acc.accepted, acc.next_token), torch.ones(n, dtype=torch.long), accumulate=True)
    law = closed_form(P, Q)
    assert abs(float(law.sum()) - 1) < 1e-12
    assert tv(counts, law) < tv_bound((GAMMA + 1) * V, n)


def test_accept_rule_emits_tokens_distributed_as_p(dtype):
    """The emitted tokens (accepted drafts, then the correction/bonus) follow p position by position:
    the first token ~ p_1, and given that a second token exists (draft 1 accepted) it is ~ p_2."""
    n = 200_000
    drafts, acc = run_accept(P, Q, n, seed=4, dtype=dtype)
    emitted = torch.cat((drafts, acc.next_token[:, None]), dim=1)
    emitted.scatter_(1, acc.accepted[:, None], acc.next_token[:, None])
    first = emitted[:, 0]
    assert tv(torch.bincount(first, minlength=V), P[0]) < tv_bound(V, n)
    has_second = acc.accepted >= 1
    second = emitted[has_second, 1]
    assert tv(torch.bincount(second, minlength=V), P[1]) < tv_bound(V, second.numel())
    # accepted drafts are emitted unchanged
    for d in range(GAMMA):
        kept = acc.accepted > d
        assert torch.equal(emitted[kept, d], drafts[kept, d])


def test_accept_rule_accepts_every_draft_when_q_equals_p(dtype):
    n = 5_000
    drafts, acc = run_accept(P, P[:GAMMA], n, seed=5, dtype=dtype)
    assert (acc.accepted == GAMMA).all()
    assert tv(torch.bincount(acc.next_token, minlength=V), P[GAMMA]) < tv_bound(V, n)


def test_accept_rule_accepts_nothing_with_disjoint_supports(dtype):
    p = torch.tensor([[0.0, 0.0, 0.7, 0.3], [0.0, 0.0, 0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.4, 0.6, 0.0, 0.0]], dtype=torch.float64)
    n = 50_000
    drafts, acc = run_accept(p, q, n, seed=6, dtype=dtype)
    assert (acc.accepted == 0).all()
    assert tv(torch.bincount(acc.next_token, minlength=4), p[0]) < tv_bound(4, n)


def test_accept_rule_checks_shapes(dtype):
    with pytest.raises(ValueError, match="shapes"):
        speculative_accept(P.to(dtype).expand(2, -1, -1), Q.to(dtype).expand(2, -1, -1), torch.zeros(2, 3, dtype=torch.long))


def test_greedy_accept_keeps_matching_prefix_then_target_token():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [0, 2, 3], [5, 6, 7]])
    acc = greedy_accept(target, drafts)
    assert acc.accepted.tolist() == [3, 1, 0, 3]
    assert acc.next_token.tolist() == [4, 2, 1, 8]
    empty = greedy_accept(target[:, :1], drafts[:, :0])  # gamma = 0: plain greedy
    assert empty.accepted.tolist() == [0] * 4 and empty.next_token.tolist() == [1, 1, 1, 5]


def test_greedy_accept_agrees_with_accept_rule_on_one_hot_distributions(dtype):
    g = torch.Generator().manual_seed(7)
    target = torch.randint(0, 3, (500, 4), generator=g)
    drafts = torch.randint(0, 3, (500, 3), generator=g)
    p = torch.nn.functional.one_hot(target, 3).to(dtype)
    q = torch.nn.functional.one_hot(drafts, 3).to(dtype)
    rule, greedy = speculative_accept(p, q, drafts, g), greedy_accept(target, drafts)
    assert torch.equal(rule.accepted, greedy.accepted) and torch.equal(rule.next_token, greedy.next_token)


def test_accept_rule_with_per_row_limits_is_the_rule_with_each_rows_gamma(dtype):
    """Rows proposing only their first L drafts follow the joint law of Algorithm 1 with gamma = L:
    drafts past the limit are never kept and the bonus token comes from p at the limit."""
    n = 120_000
    g = torch.Generator().manual_seed(7)
    drafts = draw(Q.to(dtype).expand(n, -1, -1), g)
    limit = torch.arange(n) % (GAMMA + 1)  # each limit 0..GAMMA on an equal share of the rows
    acc = speculative_accept(P.to(dtype).expand(n, -1, -1), Q.to(dtype).expand(n, -1, -1), drafts, g, limit=limit)
    assert (acc.accepted <= limit).all()
    for lim in range(GAMMA + 1):
        rows = limit == lim
        m = int(rows.sum())
        counts = torch.zeros(lim + 1, V, dtype=torch.long)
        counts.index_put_((acc.accepted[rows], acc.next_token[rows]), torch.ones(m, dtype=torch.long), accumulate=True)
        assert tv(counts, closed_form(P[: lim + 1], Q[:lim])) < tv_bound((lim + 1) * V, m), lim


def test_greedy_accept_stops_at_the_limit():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 0, 3]])
    acc = greedy_accept(target, drafts, limit=torch.tensor([1, 3, 3]))
    assert acc.accepted.tolist() == [1, 3, 1]
    assert acc.next_token.tolist() == [2, 4, 2]


def test_accept_kernel_equals_torch_rule_on_the_same_random_numbers(monkeypatch):
    """The one-call kernel and the torch ops take the same uniforms and race from the generator and
    decide the same: counts always, next tokens too (random p, q; per-row limits; rows where p <= q)."""
    monkeypatch.setattr(kernels, "ENABLED", True)
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    rows, gamma, vocab = 4000, 4, 37
    g = torch.Generator().manual_seed(11)
    p = torch.randn(rows, gamma + 1, vocab, generator=g).mul(2).softmax(-1)
    q = (p[:, :gamma] + 0.3 * torch.randn(rows, gamma, vocab, generator=g)).mul(3).softmax(-1)
    q[:500] = p[:500, :gamma]  # drafts from p itself: accepted, or p <= q at the rejection (fall back to p)
    p[500:1000, :, 5:] = 0  # targets on few tokens: many rejections
    p[500:1000] /= p[500:1000].sum(-1, keepdim=True)
    drafts = draw(q, g)
    limit = torch.arange(rows) % (gamma + 1)
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        for lim in (None, limit):
            acc = speculative_accept(p, q, drafts, torch.Generator().manual_seed(12), limit=lim)
            results[enabled, lim is None] = acc
    for full in (True, False):
        kern, ref = results[True, full], results[False, full]
        assert torch.equal(kern.accepted, ref.accepted)
        assert torch.equal(kern.next_token, ref.next_token)
    assert 0 < float(results[True, True].accepted.float().mean()) < gamma  # both extremes are exercised


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, 3), SamplingConfig(1.0, None, 0.8), SamplingConfig(0.7, 20, 0.9),
                                 SamplingConfig(1.3, 1), SamplingConfig(1.0, 50, 0.5)], ids=str)
def test_kernel_filtered_probabilities_equal_torch(cfg, monkeypatch):
    """The one-call filter + softmax (float32 CPU kernels) keeps the same tokens as filter_logits and
    gives the same probabilities up to float rounding (on random logits, no token at a top-p edge)."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    logits = 3 * torch.randn(2, 7, 40, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(kernels, "ENABLED", True)
    ours = probabilities(logits, cfg)
    monkeypatch.setattr(kernels, "ENABLED", False)
    ref = probabilities(logits, cfg)
    assert torch.equal(ours > 0, ref > 0)
    assert bool(((ref > 0).sum(-1) < 40).all())  # the filter cut every row
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_kernel_top_p_closed_form(dtype):
    """The kept prefix and renormalised mass of test_top_p_keeps_the_smallest_prefix_reaching_p, on
    both paths (float32 through the kernel)."""
    probs = torch.tensor([[0.15, 0.5, 0.1, 0.25]], dtype=torch.float64)
    logits = probs.log().to(dtype)
    for p, keep in {0.4: [1], 0.6: [1, 3], 0.8: [0, 1, 3], 0.95: [0, 1, 2, 3]}.items():
        out = probabilities(logits, SamplingConfig(top_p=p))
        assert (out[0] > 0).nonzero()[:, 0].tolist() == keep, p
    torch.testing.assert_close(probabilities(logits, SamplingConfig(top_p=0.6)).double(),
                               torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]], dtype=torch.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-11])
def test_temperature_below_the_floor_is_greedy(temperature):
    # logits / 1e-38 overflow float32 to inf: without the floor the probabilities are NaN
    assert SamplingConfig(temperature=temperature).greedy and SamplingConfig(temperature=1e-10).temperature == 1e-10
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5]])
    assert probabilities(logits, SamplingConfig(temperature=temperature, top_k=2)).tolist() == [[0, 1, 0, 0]]


def test_tiny_temperature_decodes_as_greedy():
    from tts_specdec import SpeculativeDecoder
    from conftest import make_model, make_source

    model, source = make_model(0), make_source(3, 7, seed=0, lengths=[7, 5, 3])
    greedy = SpeculativeDecoder(model).sample(source, temperature=0.0, gamma=0, max_length=12).tokens
    for gamma in (0, 2):
        tiny = SpeculativeDecoder(model).sample(source, temperature=1e-38, gamma=gamma, max_length=12,
                                                generator=torch.Generator().manual_seed(0)).tokens
        assert [t.tolist() for t in tiny] == [t.tolist() for t in greedy]
