"""Exit-head distillation: only the head moves, acceptance rises (measured by speculative sampling
itself), the best head on the set-aside sequences is the one kept, and bad arguments are named."""

from __future__ import annotations

import pytest
import torch

from conftest import TEXT_VOCAB, make_model, make_source
from tts_specdec import SpeculativeDecoder
from tts_specdec.distill import distill_exit_head


def _head_state(model):
    return {k: v.clone() for k, v in model.to_early_exit_semantic_logits.state_dict().items()}


def _spec_alpha(model, source_seed: int = 5, seed: int = 5, **guidance) -> float:
    """Acceptance rate that speculative sampling measures on new sources (not the distillation's)."""
    out = SpeculativeDecoder(model).sample(make_source(16, 6, seed=source_seed), gamma=4, max_length=30,
                                           generator=torch.Generator().manual_seed(seed), **guidance)
    return out.stats.alpha


def test_only_the_exit_head_changes_and_acceptance_rises():
    model = make_model(3, std=0.3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [p.requires_grad for p in model.parameters()]
    alpha_before = _spec_alpha(model)
    result = distill_exit_head(model, make_source(48, 6, seed=1), seq_len=30, steps=300, seed=0)
    after = model.state_dict()
    head_keys = {f"to_early_exit_semantic_logits.{k}" for k in _head_state(model)}
    for key, value in before.items():
        if key in head_keys:
            continue
        assert torch.equal(after[key], value), key  # trunk, other heads, embeddings: untouched
    assert any(not torch.equal(after[k], before[k]) for k in head_keys)
    assert result.best_step > 0 and result.train_positions > 0 and result.heldout_positions > 0
    assert result.acceptance_after > result.acceptance_before + 0.2, result
    # the decoder's own rejection sampling agrees that the draft got better
    alpha_after = _spec_alpha(model)
    assert alpha_after > alpha_before + 0.2, (alpha_before, alpha_after)
    assert abs(alpha_after - result.acceptance_after) < 0.15, (alpha_after, result.acceptance_after)
    assert [p.requires_grad for p in model.parameters()] == trainable
    assert all(p.grad is None for p in model.parameters())


def test_kl_without_holdout_keeps_the_last_head():
    model = make_model(4, std=0.3)
    result = distill_exit_head(model, make_source(16, 6, seed=2), seq_len=20, steps=120, loss="kl",
                               holdout=0.0, seed=1)
    assert result.best_step == 120 and result.heldout_positions == 0
    assert result.acceptance_after > result.acceptance_before + 0.2, result
    assert len(result.losses) == 120 and result.losses[-1] < result.losses[0]


def test_a_head_that_only_gets_worse_is_not_kept():
    model = make_model(5, std=0.3)
    distill_exit_head(model, make_source(32, 6, seed=3), seq_len=30, steps=200, seed=0)  # a good head
    good = _head_state(model)
    # a huge learning rate throws the head away from it; the set-aside sequences see that
    result = distill_exit_head(model, make_source(32, 6, seed=4), seq_len=30, steps=40, lr=30.0,
                               eval_every=10, seed=1)
    assert result.losses[-1] > result.losses[0]  # it did get worse
    assert result.best_step == 0
    for k, v in _head_state(model).items():
        assert torch.equal(v, good[k]), k
    assert result.acceptance_after == pytest.approx(result.acceptance_before, abs=1e-6)


def test_texts_as_sources():
    def encode(texts):
        ids = [[1 + (ord(c) % (TEXT_VOCAB - 1)) for c in t] for t in texts]
        out = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, : len(row)] = torch.tensor(row)
        return out

    model = make_model(6, std=0.3, tokenizer_encode=encode)
    texts = [f"sentence number {i} about a cat" for i in range(12)]
    result = distill_exit_head(model, texts, seq_len=20, steps=60, seed=0)
    assert result.acceptance_after >= result.acceptance_before
    assert result.train_positions + result.heldout_positions > 12


def test_guided_fit_raises_guided_acceptance():
    model = make_model(7, std=0.3, cond_drop_prob=0.2)
    guidance = {"cond_scale": 3.0, "draft_cond_scale": 2.0}
    before = _spec_alpha(model, source_seed=9, seed=3, **guidance)
    result = distill_exit_head(model, make_source(48, 6, seed=1), seq_len=30, steps=300, seed=0, **guidance)
    after = _spec_alpha(model, source_seed=9, seed=3, **guidance)
    assert result.acceptance_after > result.acceptance_before + 0.1, result
    assert after > before + 0.1, (before, after)  # as guided speculative sampling measures it
    assert abs(after - result.acceptance_after) < 0.15, (after, result.acceptance_after)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"cond_scale": 0.5}, ValueError, "cond_scale"),
    ({"cond_scale": 3.0}, ValueError, "cond_drop_prob"),
    ({"draft_cond_scale": 2.0}, ValueError, "draft_cond_scale"),
    ({"loss": "mse"}, ValueError, "loss"),
    ({"holdout": 1.0}, ValueError, "holdout"),
    ({"holdout": -0.1}, ValueError, "holdout"),
    ({"steps": -1}, ValueError, "steps"),
    ({"batch": 0}, ValueError, "batch"),
    ({"batch": 2.5}, TypeError, "batch"),
    ({"lr": 0.0}, ValueError, "lr"),
    ({"chunk": 0}, ValueError, "chunk"),
])
def test_bad_arguments_are_named(kwargs, error, name):
    with pytest.raises(error, match=name):
        distill_exit_head(make_model(0), make_source(2, 4), **kwargs)


def test_model_without_exit_head_is_refused():
    with pytest.raises(ValueError, match="early-exit"):
        distill_exit_head(make_model(0, exit_layer=None), make_source(2, 4))
    with pytest.raises(TypeError, match="model"):
        distill_exit_head(torch.nn.Linear(2, 2), make_source(2, 4))
