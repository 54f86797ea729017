"""tools/tree_ceiling.py's count of tokens per cycle for chains and token trees on hand-built ranks, and
its count of a tree's nodes (the ranks a model gives are not tested)."""

import pytest

from conftest import load_script

tree_ceiling = load_script("tools/tree_ceiling.py")
per_cycle, cycle, nodes = tree_ceiling.tokens_per_cycle, tree_ceiling.cycle_tokens, tree_ceiling.sub_chain_nodes


def test_a_draft_always_right_yields_gamma_plus_one_at_every_shape():
    ranks = [[1] * 100]
    assert per_cycle(ranks, 4, 1, 0, True) == 5.0
    assert per_cycle(ranks, 4, 2, 4, True) == 5.0
    assert per_cycle(ranks, 4, 2, 1, False) == 5.0


def test_a_second_choice_is_rejected_by_the_chain_and_accepted_by_a_sibling():
    ranks = [[1, 2] * 50]
    # chain, gamma 2: every cycle accepts the first draft and corrects the second
    assert per_cycle(ranks, 2, 1, 0, True) == 2.0
    # sub-chains: the second draft is taken as a sibling and its chain goes on: 3 tokens a cycle, 33 such
    # cycles and one of the last token
    assert per_cycle(ranks, 2, 2, 1, False) == pytest.approx(100 / 34)
    # a third choice is not a sibling where k = 2
    assert per_cycle([[1, 3] * 50], 2, 2, 1, False) == 2.0
    assert per_cycle([[1, 3] * 50], 2, 3, 1, False) == pytest.approx(100 / 34)


def test_a_sibling_leaf_ends_the_cycle_with_its_bonus_token():
    row = [1, 2, 1, 1, 1, 1]
    assert cycle(row, 0, 4, 1, 0, True) == 2  # the chain: the first draft and the correction
    assert cycle(row, 0, 4, 2, 4, True) == 3  # the first draft, the sibling, the bonus
    assert cycle(row, 0, 4, 2, 1, False) == 5  # the first draft, the sibling's chain to depth 4, the bonus
    assert cycle([1, 2, 1, 2, 1], 0, 4, 2, 1, False) == 4  # one branching: the second rank-2 draft ends it
    assert cycle([1, 2, 1, 2, 1], 0, 4, 2, 2, False) == 5
    assert cycle(row, 4, 4, 1, 0, True) == 2  # the row ends: nothing past it


def test_tree_nodes():
    assert nodes(4, 2, 0) == 4  # a chain
    assert nodes(2, 2, 1) == 5  # chain a-b, sibling of a with its child, sibling of b
    assert nodes(4, 2, 1) == 14
    assert nodes(2, 3, 1) == 2 + 2 * 2 + 2 * 1


def test_sampling_acceptance_of_a_first_and_a_second_draft():
    import torch

    first, second = tree_ceiling.acceptance(torch.tensor([[0.3, 0.7], [1.0, 0.0]]), torch.tensor([[0.3, 0.7], [0.5, 0.5]]))
    # the same distribution: always accepted, no second draft needed; p = (1, 0) against q = (1/2, 1/2):
    # half the first drafts, and the residual (1, 0) accepts a second draft from q half the time
    assert first.tolist() == pytest.approx([1.0, 0.5]) and second.tolist() == pytest.approx([0.0, 0.5])


def test_expected_tokens_of_a_sampled_chain_and_its_sibling_leaves():
    expected = tree_ceiling.expected_cycle_tokens
    assert expected([1.0] * 8, [0.0] * 8, 4, False) == 5.0
    # one draft accepted half the time, and a sibling half the time the draft is not: 1.5 and 1.75 tokens
    assert expected([0.5], [0.5], 1, False) == 1.5 and expected([0.5], [0.5], 1, True) == 1.75
    # two depths: 1 + 0.5 + 0.25, and the siblings 0.5 * 0.5 + 0.5 * 0.5 * 0.5 more
    assert expected([0.5, 0.5], [0.5, 0.5], 2, True) == pytest.approx(1.75 + 0.25 + 0.125)


def test_a_second_drafts_chance_weighs_each_position_by_its_first_drafts_rejections():
    # a position never rejected counts nowhere; 0.5 rejected half the time, 0.0 always: (0.25 + 1) / 1.5
    assert tree_ceiling.second_accepted([(1.0, 0.0), (0.5, 0.5), (0.0, 1.0)]) == pytest.approx(1.25 / 1.5)
    assert tree_ceiling.second_accepted([(1.0, 0.0)]) == 0.0
