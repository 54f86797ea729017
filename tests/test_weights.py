"""weights: prepared layouts and rotary tables equal the spear-tts modules they stand for."""

import pytest
import torch
from rotary_embedding_torch import RotaryEmbedding

from tts_specdec._upstream import _spear
from tts_specdec.weights import _FeedForward, _t, _unit, rope_tables, rotate

pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotate_equals_the_rotary_module(dtype):
    rot = RotaryEmbedding(16)
    t = torch.randn(2, 3, 10, 16, dtype=dtype, generator=torch.Generator().manual_seed(0))  # (b, heads, n, d)
    cos, sin = rope_tables(rot, 32, dtype, t.device)
    ours = rotate(t, cos[:10], sin[:10])
    assert rel_err(ours, rot.rotate_queries_or_keys(t)) < (1e-6 if dtype == torch.float32 else 1e-12)


def test_rope_tables_of_a_half_precision_module_skip_its_cache():
    """A float32 model that decoded (its rotary module caching float32 positions) and was then converted
    with `.to(torch.bfloat16)` (the cache rounded with it) gets the tables of a model converted before any
    decode, at every size: otherwise tables shorter than the cache came from rounded values and longer
    ones did not, and speculative beam search (a longer table) differed from beam search. The module's
    cache is not touched. (A float32 module's cache is read, as the model's own forward reads it.)"""
    used, fresh = RotaryEmbedding(16), RotaryEmbedding(16)
    used(torch.arange(64.0), seq_len=64)  # the model's own forward filled its cache
    used.to(torch.bfloat16), fresh.to(torch.bfloat16)
    cached = used.cached_freqs.clone()
    for capacity in (16, 64, 128):
        for a, b in zip(rope_tables(used, capacity, torch.float32, torch.device("cpu")),
                        rope_tables(fresh, capacity, torch.float32, torch.device("cpu"))):
            assert torch.equal(a, b)
    assert torch.equal(used.cached_freqs, cached) and used.cached_freqs_seq_len == 64
    assert fresh.cached_freqs_seq_len == 0  # nothing written


def test_folded_norm_equals_norm_then_linear():
    g = torch.Generator().manual_seed(1)
    norm, lin = _spear.RMSNorm(8).double(), torch.nn.Linear(8, 5, bias=False).double()
    with torch.no_grad():
        norm.gamma.copy_(torch.rand(8, generator=g, dtype=torch.float64) + 0.5)
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        assert rel_err(_unit(x) @ _t(lin.weight, norm), lin(norm(x))) < 1e-12


@pytest.mark.parametrize("layout", ["kernel", "plain", "split"])
def test_feed_forward_residual_equals_module(layout, monkeypatch):
    """x + FeedForward(x) on every prepared layout: the kernel (packed, GEGLU fused), plain products,
    and column blocks for one bmm (forced here on a small matrix)."""
    import tts_specdec.kernels as kernels
    import tts_specdec.weights as weights

    monkeypatch.setattr(kernels, "ENABLED", layout == "kernel")
    if layout == "split":
        monkeypatch.setattr(weights, "_SPLIT_MIN_ELEMENTS", 0)
        torch.set_num_threads(2)
    if layout == "kernel" and not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    torch.manual_seed(0)
    ff = _spear.FeedForward(dim=32, mult=2).eval()  # inner 42: padded to whole panels / blocks
    x = torch.randn(5, 32)
    with torch.no_grad():
        prepared = _FeedForward.of(ff)
        assert prepared.blocks == {"kernel": 0, "plain": 1, "split": weights._FF_BLOCKS}[layout]
        assert rel_err(prepared.residual(x), x + ff(x)) < 1e-5
