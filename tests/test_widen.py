"""The widened checkpoint computes the shipped model's function: logits within float rounding, the same
greedy, speculative and beam outputs; and it is a real, larger model (more parameters, zero-padded)."""

from __future__ import annotations

import pytest
import torch

from tts_specdec import SpeculativeDecoder
from tts_specdec.speech.checkpoint import load_checkpoint
from tts_specdec.speech.pipeline import ASSETS
from tts_specdec.widen import main, widen

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Seven ships sailed north."]


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(ASSETS)


@pytest.fixture(scope="module")
def wide(shipped):
    return widen(shipped, 256, 4, depth=18)


def _logits(model, source, target):
    # cond_drop_prob=0: upstream's forward drops the text condition with Python's random() at the trained
    # cond_drop_prob even in eval mode, so without it one of the two calls is sometimes unconditional.
    with torch.no_grad():
        return model(source, target=target, source_type="text", target_type="speech", return_loss=False,
                     cond_drop_prob=0.0)


def test_config_and_size(shipped, wide):
    c = wide.config
    assert (c.dim, c.heads, c.dim_head, c.target_depth) == (256, 4, shipped.config.dim_head, 18)
    assert c.target_early_exit_layer == shipped.config.target_early_exit_layer
    n_old = sum(p.numel() for p in shipped.model.parameters())
    n_new = sum(p.numel() for p in wide.model.parameters())
    assert n_new > 3.5 * n_old
    # the new channels of the residual stream stay zero: the embeddings are zero there
    assert wide.model.semantic_token_emb.weight[:, shipped.config.dim:].abs().max() == 0


def test_logits_equal_the_original(shipped, wide):
    source = shipped.model.tokenizer_encode(TEXTS)
    target = torch.randint(0, shipped.config.n_units, (2, 40), generator=torch.Generator().manual_seed(0))
    a, b = _logits(shipped.model, source, target), _logits(wide.model, source, target)
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)



@torch.no_grad()
def test_draft_logits_equal_the_original(shipped, wide):
    """The early-exit head (the draft) keeps its function too, so acceptance is the shipped model's."""
    source = shipped.model.tokenizer_encode(TEXTS)
    logits = []
    for model in (shipped.model, wide.model):
        dec = SpeculativeDecoder(model).decoder
        dec.begin()
        enc = dec.encode(source)
        cache = dec.new_cache(enc.rows, 8)
        h = dec.run(dec.start(enc.rows), 0, range(dec.exit_layer), enc, cache)
        logits.append(dec.draft_logits(h))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["greedy", "spec_greedy", "beam"])
def test_decoded_outputs_identical(shipped, wide, kind):
    source = shipped.model.tokenizer_encode(TEXTS)
    outs = []
    for model in (shipped.model, wide.model):
        dec = SpeculativeDecoder(model)
        if kind == "beam":
            outs.append(dec.beam_search(source, beam_size=3, max_length=120).tokens)
        else:
            outs.append(dec.sample(source, temperature=0.0, gamma=4 if kind == "spec_greedy" else 0, max_length=120).tokens)
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def test_a_wrong_widening_is_caught(shipped):
    """The check above can fail: a widened model whose gains were not rescaled computes another function."""
    bad = widen(shipped, 256, 4)
    with torch.no_grad():
        bad.model.target_transformer.final_norm.gamma.mul_(2.0)
    source = shipped.model.tokenizer_encode(TEXTS[:1])
    target = torch.zeros(1, 5, dtype=torch.long)
    assert not torch.allclose(_logits(shipped.model, source, target), _logits(bad.model, source, target), atol=1e-3)


@pytest.mark.parametrize("kw, word", [(dict(dim=64, heads=8), "dim"), (dict(dim=256, heads=1), "heads"),
                                      (dict(dim=256, heads=4, depth=3), "depth"), (dict(dim=256.0, heads=4), "dim")])
def test_bad_arguments(shipped, kw, word):
    with pytest.raises(ValueError, match=word):
        widen(shipped, **kw)


def test_command_line_writes_a_loadable_checkpoint(tmp_path, shipped):
    out = main([str(tmp_path / "wide"), "--dim", "192", "--heads", "3"])
    ckpt = load_checkpoint(out)
    assert ckpt.config.dim == 192 and ckpt.meta["widened_from"]["dim"] == shipped.config.dim
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--dim", "64", "--heads", "2"])
