"""Incremental execution of a `TextToSemantic`'s own submodules. No sampling, no search.

`encode` runs the source once and precomputes every decoder layer's cross-attention K/V.
`run` pushes new tokens (or exit hidden states) through any contiguous range of decoder layers,
writing self-attention K/V into a `KVCache` at explicit positions. `target_logits` and `draft_logits`
are the model's two heads. Together they equal `TextToSemantic.forward` position for position.

Classifier-free guidance doubles the rows: row 2i is sequence i with its source, row 2i+1 the same
sequence with the source masked out (spear-tts's null pass). Search loops see N sequences; they
map sequence indices to rows with `Decoder.rows` and mix the two logits with `sampling.cfg_mix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._upstream import TextToSemantic, _spear
from .cache import KVCache
from .encoder import SourceEncoder
from . import kernels
from .kernels import Packed
from .weights import _FeedForward, _normed_mm, _packed_or, _residual, _split, _t, _unit, rope_tables, rotate


@dataclass
class Encoded:
    """Source side of a decode: cross-attention K/V of every decoder layer, one entry per source, and
    the entry each row reads (the beams of an item share one: a beam step reads it, never a copy)."""

    keys: Tensor  # (layers, sources, heads, 1 + source_len, dim_head), null key first
    values: Tensor
    mask: Tensor | None  # (rows, 1, 1, 1 + source_len) additive (0 or -inf); None: nothing masked
    guided: bool  # rows come in (cond, null) pairs
    source: Tensor | None = None  # (rows,) int64: the entry of each row; None: row i reads entry i
    _dense: tuple[Tensor, Tensor] | None = None  # keys and values per row, made once (torch's path)

    @property
    def rows(self) -> int:
        return self.keys.shape[1] if self.source is None else self.source.numel()

    @property
    def cross_mask(self) -> Tensor | None:
        """The mask as the kernels take it, (rows, 1 + source_len)."""
        return None if self.mask is None else self.mask[:, 0, 0]

    def select(self, rows: Tensor) -> "Encoded":
        """Rows become `rows` of these rows; the K/V stay where they are."""
        mask = None if self.mask is None else self.mask.index_select(0, rows)
        rows = rows.contiguous()
        return Encoded(self.keys, self.values, mask, self.guided, rows if self.source is None else self.source[rows])

    def dense(self) -> tuple[Tensor, Tensor]:
        """Keys and values with one entry per row, (layers, rows, heads, 1 + source_len, dim_head)."""
        if self.source is None:
            return self.keys, self.values
        if self._dense is None:
            self._dense = (self.keys.index_select(1, self.source), self.values.index_select(1, self.source))
        return self._dense


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Boolean attention mask (True = attend) -> additive float mask, built once instead of inside
    every layer's attention call; None when nothing is masked."""
    if mask is None or bool(mask.all()):
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


# Packing padded rows (`Decoder.run(..., real=)`) adds a handful of small kernels per layer and saves
# the padding tokens' products: worth it only when those are real work (measured on 2 cores: the
# verify pass of a speculative beam tree -31% at dim 256, -4% throughput lost at dim 128). Threshold on
# padding tokens x one layer's weight elements.
_PACK_MIN_WORK = 1 << 22


@dataclass
class _LayerWeights:
    """One decoder layer's parameters, gathered once per decode call (fused where it saves kernels)."""

    qkv: Tensor  # to_q and to_kv stacked, (dim, heads * d), or per head (heads, dim, d) for one bmm
    attn_out_t: Tensor  # (heads * d, dim), or column blocks (blocks, heads * d, dim / blocks)
    cross_q_t: Tensor  # (dim, heads * d), or per head (heads, dim, d)
    cross_out_t: Tensor  # like attn_out_t
    ff: _FeedForward


@dataclass
class _ExitHead:
    """to_early_exit_semantic_logits = Sequential(Residual(FeedForward), RMSNorm, Linear)."""

    ff: _FeedForward
    w_out_t: Tensor | Packed  # the RMSNorm folded in
    vocab_size: int
    kernel: kernels.Head | None = None  # the whole head in one call, where its products are on the kernel

    @classmethod
    def of(cls, head: torch.nn.Sequential) -> "_ExitHead":
        ff, w_out_t = _FeedForward.of(head[0].fn), _packed_or(_t(head[2].weight, head[1]))
        kernel = None
        if ff.blocks == 0 and isinstance(w_out_t, Packed):
            kernel = kernels.Head([ff.w_in.panels, ff.b_in, ff.w_out.panels, ff.b_out], w_out_t)
        return cls(ff, w_out_t, head[2].weight.shape[0], kernel)

    def __call__(self, h: Tensor) -> Tensor:
        h2 = h.reshape(-1, h.shape[-1])
        if self.kernel is not None:
            return self.kernel(h2).view(*h.shape[:-1], -1)
        return _normed_mm(self.ff.residual(h2), self.w_out_t).view(*h.shape[:-1], -1)


class Decoder:
    """Runs `model`'s decoder for `source_type` -> `target_type` one or several positions at a time."""

    def __init__(self, model: TextToSemantic, source_type: str = "text", target_type: str = "speech") -> None:
        if not isinstance(model, TextToSemantic):
            raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic, got {type(model).__name__}")
        self.model = model
        self.source_type = source_type
        self.target_type = target_type
        tt = model.target_transformer
        self.layers = tt.layers
        self.depth = len(tt.layers)
        self_attn = tt.layers[0][0]
        self.heads = self_attn.heads
        self.kv_heads = self_attn.kv_heads
        self.dim_head = self_attn.to_q[0].weight.shape[0] // self.heads
        self.rotary = self_attn.rotary_emb
        has_exit = model.target_has_early_exit and (source_type, target_type) == ("text", "speech")
        self.exit_layer: int | None = model.early_exit_layer if has_exit else None
        self.eos_id: int | None = model.eos_id[target_type] if model.autoset_eos_id[target_type] else None
        self.vocab_size = model.to_logits[target_type].weight.shape[0]
        self.layer_evals = [0] * self.depth  # token-layer evaluations, per layer (rows x tokens)
        self._rope: tuple[Tensor, Tensor] | None = None
        self._slot_table: Tensor | None = None
        self._prepared: list[_LayerWeights] | None = None
        self._fused_attention = False  # set with the prepared weights: `run` uses `_run_fused`
        self._stack: kernels.Stack | None = None  # the same weights for `kernels.Stack` (when fused)
        self._exit_head: _ExitHead | None = None
        self._cross_kv: tuple[Tensor, Tensor] | None = None  # stacked to_kv weights, null K/V (`encode`)
        self._encoder: SourceEncoder | None = None  # the source transformer on prepared weights (`encode`)
        self._target_head: Tensor | Packed | None = None  # (dim, vocab), final norm folded in
        self._target_kernel: kernels.Head | None = None  # the same for `kernels.decode_steps`
        self._state: tuple | None = None  # what the prepared weights were built from (`begin`)

    # ---- properties of the wrapped model -----------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.model.start_token[self.target_type].dtype

    @property
    def device(self) -> torch.device:
        return self.model.start_token[self.target_type].device

    # ---- source ----------------------------------------------------------------------------

    def encode(self, source: Tensor, guided: bool = False, mask: Tensor | None = None) -> Encoded:
        """Encode padded source ids (batch, n) exactly as `TextToSemantic.generate` does.

        mask: spear-tts's `source_mask`, True at the tokens to attend to, over the source as the model
        sees it (with its EOS set: n + 1 columns where the model sets one); default source != pad."""
        m = self.model
        pad = m.pad_id[self.source_type]
        if m.autoset_eos_id[self.source_type]:
            source = _spear.set_eos_id(source, m.eos_id[self.source_type], pad_id=pad)
        if mask is None:
            mask = source != pad
        elif mask.shape != source.shape:
            raise ValueError(f"source_mask must have shape {tuple(source.shape)} (the source with its EOS), "
                             f"got {tuple(mask.shape)}")
        else:
            mask = mask.to(source.device, torch.bool)
        if self._encoder is None:
            self._encoder = SourceEncoder(m.source_transformer)
        states = self._encoder(m.token_emb[self.source_type](source), mask)
        b, s = source.shape
        if self._cross_kv is None:  # every layer's to_kv in one product; null K/V (layers, 2, heads, 1, d)
            crosses = [cross for _, cross, _ in self.layers]
            self._cross_kv = (_packed_or(_t(torch.cat([c.to_kv[0].weight for c in crosses]))),
                              torch.stack([torch.stack(tuple(c.null_kv)) for c in crosses]).detach())
        w_kv, null_kv = self._cross_kv
        flat = states.reshape(b * s, -1)
        kv = (w_kv(flat) if isinstance(w_kv, Packed) else flat @ w_kv).view(b, s, self.depth, 2, null_kv.shape[2], -1)
        kv_all = states.new_empty(self.depth, 2, b, null_kv.shape[2], 1 + s, kv.shape[-1])  # null key first
        kv_all[..., :1, :] = null_kv[:, :, None]
        kv_all[..., 1:, :] = kv.permute(2, 3, 0, 4, 1, 5)
        keys, values = kv_all[:, 0], kv_all[:, 1]
        mask = F.pad(mask, (1, 0), value=True)
        rows = None
        if guided:  # a (cond, null) pair reads one source entry; the null row's mask hides all of it
            null_mask = F.pad(torch.zeros_like(mask[:, 1:]), (1, 0), value=True)
            mask = torch.stack((mask, null_mask), dim=1).flatten(0, 1)
            rows = torch.arange(b, device=source.device).repeat_interleave(2)
        return Encoded(keys, values, _additive(mask[:, None, None, :], states.dtype), guided, rows)

    # ---- rows and cache ----------------------------------------------------------------------

    @staticmethod
    def rows(index: Tensor, guided: bool) -> Tensor:
        """Sequence indices -> cache/context row indices."""
        if not guided:
            return index
        return torch.stack((2 * index, 2 * index + 1), dim=1).flatten()

    @staticmethod
    def per_row(per_seq: Tensor, guided: bool) -> Tensor:
        """A tensor indexed by sequence (dim 0) -> indexed by cache/context row."""
        return per_seq.repeat_interleave(2, dim=0) if guided else per_seq

    @staticmethod
    def start_of(pos: Tensor, guided: bool) -> int | Tensor:
        """Per-sequence start slots for `run`: an int when all are equal (the cache's fast path)."""
        first = int(pos[0])
        if bool((pos == first).all()):
            return first
        return Decoder.per_row(pos, guided)

    def new_cache(self, rows: int, capacity: int, by_reference: bool = False) -> KVCache:
        self._ensure_rope(capacity)
        return KVCache(
            self.depth, rows, self.kv_heads, self.dim_head, capacity, dtype=self.dtype, device=self.device,
            by_reference=by_reference,
        )

    def _rope_to(self, end: int, cache: KVCache) -> None:
        """Rotary tables covering positions below `end` (grown to twice the cache when they fall short)."""
        if self._rope is None or end > self._rope[0].shape[0]:
            self._ensure_rope(max(end, 2 * cache.capacity))

    def _ensure_rope(self, capacity: int) -> None:
        rope = self._rope
        if rope and rope[0].shape[0] >= capacity and (rope[0].dtype, rope[0].device) == (self.dtype, self.device):
            return
        self._rope = rope_tables(self.rotary, capacity, self.dtype, self.device)
        self._slot_table = torch.arange(capacity, device=self.device)  # slot ranges as views, no new tensor

    def _weights(self) -> list[_LayerWeights]:
        if self._prepared is None:
            self._prepared = [
                _LayerWeights(
                    self._cols(
                        _t(torch.cat((sa.to_q[0].weight, sa.to_kv[0].weight)), sa.norm), self.heads + 2 * self.kv_heads
                    ),
                    self._cols(_t(sa.to_out.weight)),
                    self._cols(_t(cross.to_q[0].weight, cross.norm), self.heads),
                    self._cols(_t(cross.to_out.weight)),
                    _FeedForward.of(ff),
                )
                for sa, cross, ff in self.layers
            ]
            # fused attention: heads in whole AVX2 vectors and every product on the kernel
            self._fused_attention = self.dim_head % 8 == 0 and all(
                isinstance(t, Packed) for w in self._prepared for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in)
            )
            flat = [
                t.panels if isinstance(t, Packed) else t
                for w in self._prepared
                for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in, w.ff.b_in, w.ff.w_out, w.ff.b_out)
            ]
            self._stack = kernels.Stack(flat, self.heads, self.kv_heads, self.dim_head) if self._fused_attention else None
        return self._prepared

    def _layer_elements(self) -> int:
        """Weight elements one decoder layer multiplies a token by (the cross-attention K/V excluded)."""
        w = self._weights()[0]
        return sum(t.numel() for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in, w.ff.w_out))

    def _cols(self, w_t: Tensor, blocks: int | None = None) -> Tensor | Packed:
        """Packed for the kernel where it runs; else (in, out), or `blocks` column blocks
        (blocks, in, out / blocks) when splitting pays."""
        if Packed.fits(w_t):
            return Packed(w_t)
        split = _split(w_t, blocks or self.heads, dim=1)
        return w_t if split is None else split

    def begin(self, params: Sequence[torch.nn.Parameter] | None = None) -> None:
        """Start a decode call. The prepared weights (transposed, packed, norms folded in: ~50 ms on
        the reference model, 5% of a 200-token beam search) are rebuilt only when the model's
        parameters may have changed since the last call: another storage, an in-place update (version
        counter), other values (a fingerprint of their bytes, or their norms without the kernels: also
        catches writes through `.data`, which bypass the version counter), or another thread count or
        kernel switch (they choose the layout).
        `params`: model.parameters() when the caller has them (`inputs.walk`)."""
        state = self._parameter_state(list(self.model.parameters()) if params is None else params)
        if state != self._state:
            self._prepared = None
            self._cross_kv = None
            self._encoder = None
            self._exit_head = None
            self._target_head = None
            self._state = state

    def _parameter_state(self, params: Sequence[torch.nn.Parameter]) -> tuple:
        # the values: a fingerprint of every byte on the CPU kernels (~0.3 ms on the shipped model),
        # else each tensor's norm (~1.2 ms there; misses value changes that keep the norm)
        values = kernels.fingerprint(params) if params else []
        if values is None:
            with torch.no_grad():
                values = torch.stack(torch._foreach_norm(params)).tolist()
        where = tuple((p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for p in params)
        return kernels.ENABLED, torch.get_num_threads(), where, tuple(values)

    # ---- target side -------------------------------------------------------------------------

    def embed(self, tokens: Tensor, guided: bool = False) -> Tensor:
        """Token ids (sequences, n) -> decoder inputs (rows, n, dim)."""
        x = F.embedding(tokens, self.model.token_emb[self.target_type].weight)
        return self.per_row(x, guided)

    def start(self, rows: int) -> Tensor:
        """The start token's input, (rows, 1, dim)."""
        return self.model.start_token[self.target_type].expand(rows, 1, -1)

    def run(
        self,
        x: Tensor,
        start: int | Tensor,
        layers: range,
        enc: Encoded,
        cache: KVCache,
        attn_mask: Tensor | None = None,
        positions: Tensor | None = None,
        real: Tensor | None = None,
    ) -> Tensor:
        """Run decoder `layers` on x (rows, n, dim) placed at cache slots start..start+n-1 of each row.

        Each query attends to its own row's cached keys at slots <= its own (causal), unless
        `attn_mask` (rows, 1, n, keys) is given. Rotary positions are the slots unless `positions`
        (rows, n) says otherwise (tree drafts: a node's position is its depth, not its slot).
        `real` (rows, n) bool marks the positions whose outputs matter when rows are padded to a common
        n (tree levels): when the padding is worth skipping (`_PACK_MIN_WORK`) projections and
        feed-forwards run on the real tokens only and padding positions get zero outputs and zero K/V;
        either way their outputs and K/V must not be read (the mask must let a padding query see its own
        slot and hide padding slots from real queries; the causal default does when a row's real
        positions come first).
        Writes K/V into `cache`; returns hidden states.
        """
        rows, n = x.shape[:2]
        end = (start if isinstance(start, int) else int(start.max())) + n  # one past the furthest slot
        rope_end = end if positions is None else max(end, int(positions.max()) + 1)
        self._rope_to(rope_end, cache)
        cache.claim(start, n)
        cos_t, sin_t = self._rope
        weights = self._weights()
        if self._fused_attention and (real is None or not self._packs(rows, n, real)):
            return self._run_fused(x, start, layers, enc, cache, attn_mask, positions, end)
        if positions is not None:
            if attn_mask is None:
                raise ValueError("positions other than the slots need an explicit attn_mask")
            cos, sin = cos_t[positions], sin_t[positions]
        elif isinstance(start, int):
            cos, sin = cos_t[start : start + n], sin_t[start : start + n]
            if attn_mask is None and n > 1:
                keys = torch.arange(start + n, device=x.device)
                attn_mask = keys <= start + torch.arange(n, device=x.device)[:, None]
        else:
            pos = start[:, None] + torch.arange(n, device=x.device)  # (rows, n)
            cos, sin = cos_t[pos], sin_t[pos]
            if attn_mask is None:
                keys = torch.arange(end, device=x.device)
                attn_mask = (keys <= pos[..., None])[:, None]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _additive(attn_mask, x.dtype)
        h_, d, kvh = self.heads, self.dim_head, self.kv_heads
        dim = x.shape[-1]
        x = x.reshape(rows * n, dim)
        # packed: the projections see only the real tokens; attention scatters them into the padded
        # (rows, n) layout (buffers zeroed once, padding entries stay zero) and gathers them back
        keep = real.reshape(-1).nonzero()[:, 0] if real is not None and self._packs(rows, n, real) else None
        if keep is not None:
            x = x.index_select(0, keep)
            cos, sin = self._packed_rope(cos, sin, rows, n, keep)
            heads_pad = x.new_zeros(h_ + 2 * kvh, rows * n, d)
            q_pad = x.new_zeros(rows * n, h_ * d)
        tokens = x.shape[0]
        enc_keys, enc_values = enc.dense()
        for i in layers:
            w = weights[i]
            # causal self-attention over the row's cache; q and k rotated together
            if isinstance(w.qkv, Tensor) and w.qkv.dim() == 3:  # heads first: (q + k + v heads, tokens, d)
                heads = torch.bmm(_unit(x).expand(w.qkv.shape[0], -1, -1), w.qkv)
            else:
                heads = _normed_mm(x, w.qkv).view(tokens, -1, d).transpose(0, 1)
            if keep is None:
                heads = heads.reshape(-1, rows, n, d)
                qk = rotate(heads[: h_ + kvh], cos, sin)
                v = heads[h_ + kvh :]
            else:
                heads_pad[: h_ + kvh].index_copy_(1, keep, rotate(heads[: h_ + kvh], cos, sin))
                heads_pad[h_ + kvh :].index_copy_(1, keep, heads[h_ + kvh :])
                padded = heads_pad.view(-1, rows, n, d)
                qk, v = padded[: h_ + kvh], padded[h_ + kvh :]
            q = qk[:h_].transpose(0, 1)
            keys, values = cache.write(i, qk[h_:].transpose(0, 1), v.transpose(0, 1), start)
            if kvh != h_:  # spear-tts repeats kv heads as '(g h)': query head j uses kv head j % kvh
                keys, values = keys.repeat(1, h_ // kvh, 1, 1), values.repeat(1, h_ // kvh, 1, 1)
            a = self._unpad(F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask), keep)
            x = _residual(x, a, w.attn_out_t)
            # cross-attention over the precomputed source K/V
            if isinstance(w.cross_q_t, Tensor) and w.cross_q_t.dim() == 3:  # per head: (heads, tokens, d)
                q = torch.bmm(_unit(x).expand(h_, -1, -1), w.cross_q_t)
                if keep is not None:
                    q = q_pad.view(h_, rows * n, d).index_copy_(1, keep, q)
                q = q.view(h_, rows, n, d).transpose(0, 1)
            else:
                q = _normed_mm(x, w.cross_q_t)
                if keep is not None:
                    q = q_pad.index_copy_(0, keep, q)
                q = q.view(rows, n, -1, d).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, enc_keys[i], enc_values[i], attn_mask=enc.mask)
            x = _residual(x, self._unpad(a, keep), w.cross_out_t)
            # feed-forward: RMSNorm, Linear, GEGLU, Linear
            x = w.ff.residual(x)
            self.layer_evals[i] += tokens
        if keep is not None:
            x = x.new_zeros(rows * n, dim).index_copy_(0, keep, x)
        return x.view(rows, n, dim)

    def _packs(self, rows: int, n: int, real: Tensor) -> bool:
        """Whether `run` computes only the real tokens of padded rows (see `_PACK_MIN_WORK`)."""
        padding = rows * n - int(real.sum())
        return bool(padding) and padding * self._layer_elements() >= _PACK_MIN_WORK

    def _run_fused(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
        attn_mask: Tensor | None, positions: Tensor | None, end: int,
    ) -> Tensor:
        """`run` on the CPU kernels (float32, AVX2): the layers in one `kernels.Stack.run` call, each
        attention in one kernel (rotary, cache write, attention, layout). Same contract as `run`; padding
        positions are computed like real ones."""
        rows, n, dim = x.shape
        table = self._slot_table
        slots = table[start : start + n].expand(rows, n) if isinstance(start, int) else start[:, None] + table[:n]
        pos = slots if positions is None else positions.expand(rows, n)
        mask = None
        if attn_mask is not None:  # a caller's mask (trees, beams); None: causal by slot
            if attn_mask.dtype == torch.bool:
                attn_mask = _additive(attn_mask, x.dtype)
            if attn_mask is not None:
                mask = attn_mask.reshape(-1, n, attn_mask.shape[-1])  # (1 or rows, n, keys)
                if mask.stride(-1) != 1:
                    mask = mask.contiguous()
        cross_mask = enc.cross_mask
        k_all, v_all = cache.buffers(end)
        x = self._stack.run(x.reshape(rows * n, dim), layers, *self._rope, pos, slots, k_all, v_all, cache.table, mask,
                            end, enc.keys, enc.values, cross_mask, enc.source)
        for i in layers:
            self.layer_evals[i] += rows * n
        return x.view(rows, n, dim)

    @staticmethod
    def _packed_rope(cos: Tensor, sin: Tensor, rows: int, n: int, keep: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin of the padded layout ((n, d) or (rows, n, d)) -> one row per kept token, (tokens, d)."""
        shape = (rows, n, cos.shape[-1])
        return (cos.expand(shape).reshape(rows * n, -1).index_select(0, keep),
                sin.expand(shape).reshape(rows * n, -1).index_select(0, keep))

    @staticmethod
    def _unpad(a: Tensor, keep: Tensor | None) -> Tensor:
        """Attention output (rows, heads, n, d) -> (tokens, heads * d), real tokens only when packed."""
        rows, _, n, _ = a.shape
        a = a.transpose(1, 2).reshape(rows * n, -1)
        return a if keep is None else a.index_select(0, keep)

    def target_logits(self, h: Tensor) -> Tensor:
        """Final norm + tied output projection on the last layer's hidden state."""
        return _normed_mm(h.reshape(-1, h.shape[-1]), self._target_weight()).view(*h.shape[:-1], -1)

    def _target_weight(self) -> Tensor | Packed:
        if self._target_head is None:
            final_norm = self.model.target_transformer.final_norm
            self._target_head = _packed_or(_t(self.model.to_logits[self.target_type].weight, final_norm))
            self._target_kernel = None
        return self._target_head

    def sample_steps(
        self, x: Tensor, pos: Tensor, steps: int, temperature: float, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, top_k: int | None = None, top_p: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor] | None:
        """Up to `steps` steps of plain sampling in one kernel call, or None where it does not run (the
        caller then steps with `run` and `target_logits`). x (rows, 1, dim): each row's pending input;
        pos (seqs,): each sequence's slot (guided: (cond, null) row pairs mixed with `cond_scale`). Each
        token is the target's argmax (temperature 0) or drawn as `speculative.sample_loop` draws it step
        by step (the same filters, the same random numbers from `generator`); the steps end early after
        one in which some sequence picked EOS. Returns the tokens (seqs, steps taken) and the next input
        (rows, 1, dim)."""
        if not self._steps_fused():
            return None
        w = self._target_weight()
        if not isinstance(w, Packed):
            return None
        if self._target_kernel is None:
            self._target_kernel = kernels.Head([], w)
        out = self._steps(x, pos, range(self.depth), self._target_kernel, steps, temperature, generator, enc, cache,
                          top_k=top_k, top_p=top_p, cond_scale=cond_scale, eos=self.eos_id)
        return out[2], out[4][:, None]

    def draft(
        self, x: Tensor, pos: Tensor, gamma: int, temperature: float, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, confidence: float | None = None, top_k: int | None = None,
        top_p: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None] | None:
        """The draft phase of a speculative sampling cycle in one kernel call, or None where it does not
        run (no fused kernels: the caller then drafts step by step with `run` and `draft_logits`).
        x (rows, 1, dim): each row's pending input; pos (seqs,): each sequence's slot (guided: rows are
        (cond, null) pairs, one per sequence, whose draft logits are mixed with `cond_scale` as
        `sampling.cfg_mix` mixes them). Each draft token is the exit head's argmax (temperature 0) or
        drawn from softmax(logits / temperature), `top_k`/`top_p`-filtered as `sampling.filter_logits`
        filters, with one exponential race per step, drawn from `generator` as
        `sampling.draw` draws it; `confidence`: the early draft stops of `speculative.sample_loop`.
        Returns the exit states of the pending input and the drafts (rows, steps + 1, dim), the draft
        distributions (seqs, steps, V) (None when greedy), the drafts (seqs, steps) and each sequence's
        proposed count (None without confidence)."""
        if not self._steps_fused():
            return None
        head = self._draft_head()
        if head.kernel is None:
            return None
        exits, q, drafts, limit, _ = self._steps(
            x, pos, range(self.exit_layer), head.kernel, gamma, temperature, generator, enc, cache, top_k=top_k,
            top_p=top_p, cond_scale=cond_scale, confidence=confidence, tail=True)
        return exits, q, drafts, limit

    def _steps_fused(self) -> bool:
        """Whether `_steps` can run: the weights are prepared (and the layout chosen) first, since
        begin() may have dropped them."""
        self._weights()
        return self._fused_attention

    def _steps(
        self, x: Tensor, pos: Tensor, layers: range, head: kernels.Head, steps: int, temperature: float,
        generator: torch.Generator | None, enc: Encoded, cache: KVCache, *, top_k: int | None, top_p: float | None,
        cond_scale: float, confidence: float | None = None, eos: int | None = None, tail: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None, Tensor]:
        """`kernels.decode_steps` from each row's pending input x (rows, 1, dim) at pos (seqs,)."""
        end = int(pos.max()) + steps + 1
        self._rope_to(end, cache)
        if cache.table is not None:
            raise ValueError("decode steps need a cache by value")
        k_all, v_all = cache.buffers(end)
        emb = self.model.token_emb[self.target_type].weight.detach()
        out = kernels.decode_steps(
            self._stack, head, emb, x[:, 0], layers, self.per_row(pos, enc.guided), steps, temperature, generator,
            *self._rope, k_all, v_all, enc.keys, enc.values, enc.cross_mask, top_k=top_k, top_p=top_p,
            guidance=cond_scale if enc.guided else 0.0, confidence=confidence, eos=eos, tail=tail, enc_rows=enc.source)
        taken = out[2].shape[1] + int(tail)  # tokens through the layers, per row
        for i in layers:
            self.layer_evals[i] += x.shape[0] * taken
        return out

    def draft_logits(self, h: Tensor) -> Tensor:
        """The early-exit head on the exit layer's hidden state."""
        return self._draft_head()(h)

    def _draft_head(self) -> _ExitHead:
        if self.exit_layer is None:
            raise ValueError("this model has no early-exit head (target_early_exit_layer is None)")
        if self._exit_head is None:
            self._exit_head = _ExitHead.of(self.model.to_early_exit_semantic_logits)
        return self._exit_head
