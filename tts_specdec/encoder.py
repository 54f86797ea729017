"""The source transformer's forward on prepared weights.

spear-tts's `Transformer` (non-causal, key-padding mask, rotary, RMSNorm, GEGLU) run through its
modules spends most of a short source's encode on module calls, einops rearranges and the rotary
module per layer, a visible share of decoding a sentence on a small model. The same arithmetic as a
dozen tensor ops per layer, on the decoder's prepared-weight layouts, takes a fraction of that.
Equal to `model.source_transformer(x, mask=mask)` up to float rounding (tests/test_encoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import tiles
from .kernels import Packed
from .weights import _c, _FeedForward, _normed_mm, _packed_or, _residual, _store, _t, _unit, rope_tables, rotate


@dataclass
class _SourceLayer:
    qkv: Tensor | Packed  # to_q and to_kv stacked (dim, (h + 2 kvh) d), the attention's RMSNorm folded in
    out: Tensor | Packed  # (h d, dim)
    ff: _FeedForward


class SourceEncoder:
    """`transformer(x, mask=mask)` for a spear-tts source `Transformer`, weights read once."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        layers = []
        for attn, cross, ff in transformer.layers:
            if cross is not None:
                raise ValueError("the source transformer has cross-attention layers (spear-tts builds it without)")
            qkv = _t(torch.cat((attn.to_q[0].weight, attn.to_kv[0].weight)), attn.norm)
            store = _store(attn.to_out.weight)
            layers.append(_SourceLayer(_packed_or(qkv, store), _packed_or(_t(attn.to_out.weight), store), _FeedForward.of(ff)))
        self.layers = layers
        first = transformer.layers[0][0]
        self.heads, self.kv_heads = first.heads, first.kv_heads
        self.rotary = first.rotary_emb  # one module shared by all layers
        norm = transformer.final_norm
        self.final_gain = _c(norm.gamma) * norm.scale
        self._rope: tuple[Tensor, Tensor] | None = None

    def __call__(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (batch, n, dim) embeddings, mask (batch, n) True at real tokens -> (batch, n, dim)."""
        b, n, dim = x.shape
        h, kvh = self.heads, self.kv_heads
        rope = self._rope
        if rope is None or rope[0].shape[0] < n or (rope[0].dtype, rope[0].device) != (x.dtype, x.device):
            rope = self._rope = rope_tables(self.rotary, max(n, 64), x.dtype, x.device)
        cos, sin = rope[0][:n], rope[1][:n]
        # upstream fills masked scores with -finfo.max (a row with no real key would average every value
        # instead of giving NaN); adding finfo.min does the same
        bias = None
        if not bool(mask.all()):
            bias = torch.zeros((b, 1, 1, n), dtype=x.dtype, device=x.device)
            bias.masked_fill_(~mask[:, None, None, :], torch.finfo(x.dtype).min)
        x = x.reshape(b * n, dim)
        for layer in self.layers:
            heads = _normed_mm(x, layer.qkv)
            heads = heads.view(b, n, h + 2 * kvh, -1).transpose(1, 2)  # (b, heads, n, d)
            q, k = rotate(heads[:, :h], cos, sin), rotate(heads[:, h : h + kvh], cos, sin)
            v = heads[:, h + kvh :]
            if kvh < h:  # query head i reads kv head i % kvh, as upstream's repeat
                k, v = k.repeat(1, h // kvh, 1, 1), v.repeat(1, h // kvh, 1, 1)
            a = tiles.attention(q, k, v, bias).transpose(1, 2).reshape(b * n, -1)
            x = _residual(x, a, layer.out)
            x = layer.ff.residual(x)
        return (_unit(x) * self.final_gain).view(b, n, dim)
