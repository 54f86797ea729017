"""Acceptance over token trees (several drafts per position): greedy walks and the lossless multi-draft
rule, against closed forms written out here (not with the code under test) on hand-built p and q."""

import itertools

import pytest
import torch

from tts_specdec.sampling import draw, greedy_accept, greedy_tree_accept, tree_accept

from conftest import tv, tv_bound

pytestmark = pytest.mark.usefixtures("one_thread")

V = 4
P_ROOT = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
Q_ROOT = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # far from p: many rejections
P_AFTER = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]],
                       dtype=torch.float64)  # the target after each token at depth 1


def child_draws(q: torch.Tensor, k: int, replacement: bool):
    """Every ordered tuple of k children drawn from q, with its probability."""
    for xs in itertools.product(range(len(q)), repeat=k):
        if not replacement and len(set(xs)) < k:
            continue
        prob, left = 1.0, q.clone()
        for x in xs:
            prob *= float(left[x] / left.sum())
            if not replacement:
                left[x] = 0.0
        if prob > 0:
            yield xs, prob


def star_law(p: torch.Tensor, q: torch.Tensor, k: int, replacement: bool) -> torch.Tensor:
    """Exact joint law of (j, t) for k children of the root: j = 1..k the accepted child's place (its token
    is emitted first), or j = 0 when all are rejected and t ~ the last residual is emitted."""
    law = torch.zeros(k + 1, len(p), dtype=torch.float64)
    for xs, prob in child_draws(q, k, replacement):
        pc, qc, reach = p.clone(), q.clone(), prob
        for j, x in enumerate(xs, start=1):
            a = min(1.0, float(pc[x] / qc[x])) if qc[x] > 0 else 1.0
            law[j, x] += reach * a
            reach *= 1 - a
            excess = (pc - qc).clamp(min=0)
            pc = excess / excess.sum() if excess.sum() > 0 else pc
            if not replacement:
                qc = qc.clone()
                qc[x] = 0.0
                qc = qc / qc.sum() if qc.sum() > 0 else qc
        law[0] += reach * pc
    return law


@pytest.mark.parametrize("replacement", [True, False], ids=["iid", "without-replacement"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_rule_is_lossless_in_closed_form(k, replacement):
    """The first emitted token (an accepted child's or the final residual's) is distributed as p, exactly."""
    law = star_law(P_ROOT, Q_ROOT, k, replacement)
    assert abs(float(law.sum()) - 1) < 1e-12
    assert torch.allclose(law.sum(dim=0), P_ROOT, atol=1e-12, rtol=0)


def sample_star(k: int, replacement: bool, n: int, seed: int):
    """n rows, each a root with k children drawn from Q_ROOT; node i + 1 is the i-th child."""
    g = torch.Generator().manual_seed(seed)
    if replacement:
        kids = draw(Q_ROOT.expand(n, k, V), g)
    else:
        kids = torch.multinomial(Q_ROOT.expand(n, V), k, replacement=False, generator=g)
    parent = torch.tensor([-1] + [0] * k).expand(n, -1)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), kids], dim=1)
    p = torch.cat([P_ROOT.expand(n, 1, V), P_AFTER[kids]], dim=1)
    q = torch.cat([Q_ROOT.expand(n, 1, V), torch.full((n, k, V), 1.0 / V, dtype=torch.float64)], dim=1)
    return tokens, tree_accept(p, q, parent, tokens, g, replacement=replacement)


@pytest.mark.parametrize("replacement", [True, False], ids=["iid", "without-replacement"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_tree_accept_samples_the_closed_form(k, replacement):
    """The rule's (accepted child, emitted token) on a star of k children: counts against the closed form;
    a child accepted as a leaf emits its bonus token from the target after it."""
    n = 40_000
    tokens, acc = sample_star(k, replacement, n, seed=k + 10 * replacement)
    counts = torch.zeros(k + 1, V, dtype=torch.float64)
    first = torch.where(acc.node > 0, tokens.gather(1, acc.node[:, None])[:, 0], acc.next_token)
    counts.index_put_((acc.node, first), torch.ones(n, dtype=torch.float64), accumulate=True)
    assert tv(counts, star_law(P_ROOT, Q_ROOT, k, replacement)) < tv_bound((k + 1) * V, n)
    # bonus tokens after an accepted leaf follow the target after that leaf's token
    leaf = acc.node > 0
    pairs = torch.zeros(V, V, dtype=torch.float64)
    pairs.index_put_((first[leaf], acc.next_token[leaf]), torch.ones(int(leaf.sum()), dtype=torch.float64),
                     accumulate=True)
    for x in range(V):
        if pairs[x].sum() > 2000:
            assert tv(pairs[x], P_AFTER[x]) < tv_bound(V, int(pairs[x].sum()))


def test_a_deeper_tree_emits_its_first_two_tokens_as_the_target():
    """Depth 2, two children per node (drawn i.i.d. from q, each level's q its own): the first token is
    distributed as p after the root, and after an accepted first token x the second as p after x."""
    n, g = 40_000, torch.Generator().manual_seed(3)
    q2 = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kids = draw(Q_ROOT.expand(n, 2, V), g)  # nodes 1, 2
    grand = draw(q2.expand(n, 4, V), g)  # nodes 3, 4 under node 1; 5, 6 under node 2
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2]).expand(n, -1)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), kids, grand], dim=1)
    p_grand = torch.full((n, 4, V), 0.25, dtype=torch.float64)  # after two tokens: uniform
    p = torch.cat([P_ROOT.expand(n, 1, V), P_AFTER[kids], p_grand], dim=1)
    q = torch.cat([Q_ROOT.expand(n, 1, V), q2.expand(n, 2, V), q2.expand(n, 4, V)], dim=1)
    acc = tree_accept(p, q, parent, tokens, g)
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 2])[acc.node]
    path_first = torch.where(acc.node >= 3, tokens.gather(1, parent[0][acc.node].clamp_min(0)[:, None])[:, 0],
                             tokens.gather(1, acc.node[:, None])[:, 0])
    first = torch.where(depth > 0, path_first, acc.next_token)
    counts = torch.bincount(first, minlength=V).double()
    assert tv(counts, P_ROOT) < tv_bound(V, n)
    second = torch.where(depth == 2, tokens.gather(1, acc.node[:, None])[:, 0], acc.next_token)
    for x in range(V):
        rows = (depth > 0) & (first == x)
        if int(rows.sum()) > 2000:
            assert tv(torch.bincount(second[rows], minlength=V).double(), P_AFTER[x]) < tv_bound(V, int(rows.sum()))


def test_greedy_tree_walks_the_argmax_path():
    """Root children tokens 5, 7, 7; node 2 (token 7) has children 1, 3; node 3 (also 7) has child 3.
    The target says 7 after the root (the first child drafted with it, node 2, is taken), 3 after node 2,
    and 9 after node 5: the walk keeps nodes 2 and 5 and emits 9."""
    parent = torch.tensor([[-1, 0, 0, 0, 2, 2, 3]])
    tokens = torch.tensor([[0, 5, 7, 7, 1, 3, 3]])
    target = torch.tensor([[7, 0, 3, 3, 0, 9, 0]])
    acc = greedy_tree_accept(target, parent, tokens)
    assert acc.node.tolist() == [5] and acc.next_token.tolist() == [9]
    acc = greedy_tree_accept(torch.tensor([[4, 0, 3, 3, 0, 9, 0]]), parent, tokens)  # no child is 4
    assert acc.node.tolist() == [0] and acc.next_token.tolist() == [4]


def test_greedy_tree_on_a_chain_is_the_chain_rule():
    g = torch.Generator().manual_seed(0)
    rows, gamma = 64, 5
    drafts = torch.randint(0, 3, (rows, gamma), generator=g)
    target = torch.randint(0, 3, (rows, gamma + 1), generator=g)
    chain = greedy_accept(target, drafts)
    parent = torch.arange(-1, gamma).expand(rows, -1)
    tokens = torch.cat([torch.zeros(rows, 1, dtype=torch.long), drafts], dim=1)
    tree = greedy_tree_accept(target, parent, tokens)
    assert torch.equal(tree.node, chain.accepted) and torch.equal(tree.next_token, chain.next_token)


@pytest.mark.parametrize("replacement", [True, False])
def test_one_hot_targets_make_the_sampled_rule_the_greedy_walk(replacement):
    """With p one-hot (temperature 0) a child is kept iff its token is the argmax: the greedy walk's node."""
    g = torch.Generator().manual_seed(1)
    rows, n = 200, 7
    parent = torch.tensor([-1, 0, 0, 0, 1, 1, 2]).expand(rows, -1)
    tokens = torch.randint(0, V, (rows, n), generator=g)
    target = torch.randint(0, V, (rows, n), generator=g)
    p = torch.nn.functional.one_hot(target, V).double()
    q = torch.softmax(torch.randn(rows, n, V, generator=g, dtype=torch.float64), dim=-1)
    acc = tree_accept(p, q, parent, tokens, g, replacement=replacement)
    walk = greedy_tree_accept(target, parent, tokens)
    assert torch.equal(acc.node, walk.node) and torch.equal(acc.next_token, walk.next_token)


def test_rows_walk_their_own_trees_and_padding_is_never_visited():
    """Two rows in one call: a chain and a star padded with -1 parents; each row's result is its own."""
    parent = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, -1]])
    tokens = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 1]])
    target = torch.tensor([[1, 2, 0, 0], [1, 0, 0, 0]])
    acc = greedy_tree_accept(target, parent, tokens)
    assert acc.node.tolist() == [2, 2] and acc.next_token.tolist() == [0, 0]
