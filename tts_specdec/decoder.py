"""The model adapter: a `TextToSemantic`'s own submodules as incremental decoding takes them. No
sampling, no search; how the layers run is the backend's (`backends/`: `Decoder.backend`).

`encode` runs the source once and precomputes every decoder layer's cross-attention K/V.
`run` pushes new tokens (or exit hidden states) through any contiguous range of decoder layers,
writing self-attention K/V into a `KVCache` at explicit positions (`Backend.run_layers`). `target_logits`
and `draft_logits` are the model's two heads. Together they equal `TextToSemantic.forward` position for position.

Classifier-free guidance doubles the rows: row 2i is sequence i with its source, row 2i+1 the same
sequence with the source masked out (spear-tts's null pass). Search loops see N sequences; they
map sequence indices to rows with `Decoder.rows` and mix the two logits with `sampling.cfg_mix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._upstream import TextToSemantic, _spear
from .cache import KVCache
from .encoder import SourceEncoder
from . import backends, kernels, tiles
from .backends import Backend
from .kernels import Packed
from .masks import additive
from .weights import _c, _FeedForward, _normed_mm, _packed_or, _split, _store, _t, compute_dtype, rope_tables


@dataclass
class Encoded:
    """Source side of a decode: cross-attention K/V of every decoder layer, one entry per source, and
    the entry each row reads (the beams of an item share one: a beam step reads it, never a copy)."""

    keys: Tensor  # (layers, sources, heads, 1 + source_len, dim_head), null key first
    values: Tensor
    mask: Tensor | None  # (rows, 1, 1, 1 + source_len) additive (0 or -inf); None: nothing masked
    guided: bool  # rows come in (cond, null) pairs
    source: Tensor | None = None  # (rows,) int64: the entry of each row; None: row i reads entry i
    _dense: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # `dense`'s, made once (torch's path)

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

    def dense(self, multiple: int = 1) -> tuple[Tensor, Tensor]:
        """Keys and values with one entry per row, (layers, rows, heads, keys, dim_head): 1 + source_len
        keys, padded with zeros to a multiple of `multiple` (what tiled attention pads, `tiles.key_multiple`)."""
        if multiple not in self._dense:
            keys, values = self.keys, self.values
            if self.source is not None:
                keys, values = keys.index_select(1, self.source), values.index_select(1, self.source)
            pad = -keys.shape[-2] % multiple
            if pad:
                keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
            self._dense[multiple] = (keys, values)
        return self._dense[multiple]


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
    def of(cls, head: torch.nn.Sequential, store: torch.dtype | None = None) -> "_ExitHead":
        ff = _FeedForward.of(head[0].fn, store)
        w_out_t = _packed_or(_t(head[2].weight, head[1]), store or _store(head[2].weight))
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

    def __init__(
        self, model: TextToSemantic, source_type: str = "text", target_type: str = "speech", compile: bool | str = False,
    ) -> None:
        """compile: run on static compiled steps (`backends.static_compiled`): True (torch.compile's
        inductor) or the name of a torch.compile backend."""
        if not isinstance(model, TextToSemantic):
            raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic, got {type(model).__name__}")
        self.model = model
        self.compile = compile
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
        self._backend: Backend | None = None  # chosen with the prepared weights (`backends.select`)
        self._exit_head: _ExitHead | None = None
        self._cross_kv: tuple[Tensor, Tensor] | None = None  # stacked to_kv weights, null K/V (`encode`)
        self._encoder: SourceEncoder | None = None  # the source transformer on prepared weights (`encode`)
        self._target_head: Tensor | Packed | None = None  # (dim, vocab), final norm folded in
        self._state: tuple | None = None  # what the prepared weights were built from (`begin`)

    # ---- properties of the wrapped model -----------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """What decoding computes in (`weights.compute_dtype`: float32 for a half-precision model on the
        CPU): the cache, the prepared weights, the logits."""
        start = self.model.start_token[self.target_type]
        return compute_dtype(start.dtype, start.device)

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
        states = self._encoder(m.token_emb[self.source_type](source).to(self.dtype), mask)
        b, s = source.shape
        if self._cross_kv is None:  # every layer's to_kv in one product; null K/V (layers, 2, heads, 1, d)
            crosses = [cross for _, cross, _ in self.layers]
            w = torch.cat([c.to_kv[0].weight for c in crosses])
            self._cross_kv = (_packed_or(_t(w), _store(w)),
                              _c(torch.stack([torch.stack(tuple(c.null_kv)) for c in crosses])))
        w_kv, null_kv = self._cross_kv
        flat = states.reshape(b * s, -1)
        kv = w_kv(flat) if isinstance(w_kv, Packed) else tiles.rows(lambda t: t @ w_kv, flat)
        kv = kv.view(b, s, self.depth, 2, null_kv.shape[2], -1)
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
        return Encoded(keys, values, additive(mask[:, None, None, :], states.dtype), guided, rows)

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
        # output_size: on CUDA, without it the op reads the output's length back from the device
        return per_seq.repeat_interleave(2, dim=0, output_size=2 * per_seq.shape[0]) if guided else per_seq

    def start_of(self, pos: Tensor, guided: bool, known: Sequence[int] | None = None) -> int | Tensor:
        """Per-sequence start slots for `run`: an int when all are equal (the cache's fast path); always
        the tensor on a backend of static shapes (positions are its inputs: testing them would read
        them back from the device). known: pos's values where the caller holds them as ints (the test
        then reads no tensor: ~20 us a speculative cycle on the shipped model)."""
        if self.backend.static_shapes:
            return Decoder.per_row(pos, guided)
        if known is not None:
            return known[0] if all(p == known[0] for p in known) else Decoder.per_row(pos, guided)
        first = int(pos[0])
        if bool((pos == first).all()):
            return first
        return Decoder.per_row(pos, guided)

    def cache_bytes(self, rows: int, capacity: int) -> int:
        """Bytes of K and V that `new_cache(rows, capacity)` allocates."""
        per_slot = 2 * self.depth * self.kv_heads * self.dim_head * self.dtype.itemsize
        return rows * self.backend.capacity(capacity) * per_slot

    def new_cache(self, rows: int, capacity: int, by_reference: bool = False) -> KVCache:
        capacity = self.backend.capacity(capacity)
        self._ensure_rope(capacity)
        return self.backend.new_cache(rows, capacity, by_reference)

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
            store = _store(self.layers[0][0].to_out.weight)
            self._prepared = [
                _LayerWeights(
                    self._cols(
                        _t(torch.cat((sa.to_q[0].weight, sa.to_kv[0].weight)), sa.norm), self.heads + 2 * self.kv_heads,
                        store,
                    ),
                    self._cols(_t(sa.to_out.weight), store=store),
                    self._cols(_t(cross.to_q[0].weight, cross.norm), self.heads, store),
                    self._cols(_t(cross.to_out.weight), store=store),
                    _FeedForward.of(ff),
                )
                for sa, cross, ff in self.layers
            ]
            self._backend = backends.select(self)
        return self._prepared

    @property
    def backend(self) -> Backend:
        """What runs the layers (`backends`): chosen once per set of prepared weights."""
        self._weights()
        return self._backend

    def _layer_elements(self) -> int:
        """Weight elements one decoder layer multiplies a token by (the cross-attention K/V excluded)."""
        w = self._weights()[0]
        return sum(t.numel() for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in, w.ff.w_out))

    def _cols(self, w_t: Tensor, blocks: int | None = None, store: torch.dtype = torch.float32) -> Tensor | Packed:
        """Packed for the kernel where it runs (panels in `store`, `weights._store`); else (in, out), or
        `blocks` column blocks (blocks, in, out / blocks) when splitting pays."""
        if Packed.fits(w_t):
            return Packed(w_t, store=store)
        split = _split(w_t, blocks or self.heads, dim=1)
        return w_t if split is None else split

    def begin(self, params: Sequence[torch.nn.Parameter] | None = None) -> None:
        """Start a decode call. The prepared weights (transposed, packed, norms folded in: a cost worth
        paying once, not per call) are rebuilt only when the model's
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
        # the values: a fingerprint of every byte on the CPU kernels (cheaper than norms), else each
        # tensor's norm (misses value changes that keep the norm)
        values = kernels.fingerprint(params) if params else []
        if values is None:
            with torch.no_grad():
                values = torch.stack(torch._foreach_norm(params)).tolist()
        where = tuple((p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for p in params)
        return kernels.ENABLED, torch.get_num_threads(), where, tuple(values)

    # ---- target side -------------------------------------------------------------------------

    def embed(self, tokens: Tensor, guided: bool = False) -> Tensor:
        """Token ids (sequences, n) -> decoder inputs (rows, n, dim)."""
        x = F.embedding(tokens, self.model.token_emb[self.target_type].weight).to(self.dtype)
        return self.per_row(x, guided)

    def start(self, rows: int) -> Tensor:
        """The start token's input, (rows, 1, dim)."""
        return self.model.start_token[self.target_type].to(self.dtype).expand(rows, 1, -1)

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
        """Run decoder `layers` on x (rows, n, dim) placed at cache slots start..start+n-1 of each row
        (on `self.backend`).

        Each query attends to its own row's cached keys at slots <= its own (causal), unless
        `attn_mask` (rows, 1, n, keys) is given. Rotary positions are the slots unless `positions`
        (rows, n) says otherwise (tree drafts: a node's position is its depth, not its slot).
        `real` (rows, n) bool marks the positions whose outputs matter when rows are padded to a common
        n (tree levels): when the padding is worth skipping (`backends.torch_eager._PACK_MIN_WORK`)
        projections and feed-forwards run on the real tokens only and padding positions get zero outputs
        and zero K/V; either way their outputs and K/V must not be read (the mask must let a padding query
        see its own slot and hide padding slots from real queries; the causal default does when a row's
        real positions come first).
        Writes K/V into `cache`; returns hidden states.
        """
        return self.backend.run_layers(x, start, layers, enc, cache, attn_mask, positions, real)

    def target_logits(self, h: Tensor) -> Tensor:
        """Final norm + tied output projection on the last layer's hidden state."""
        return _normed_mm(h.reshape(-1, h.shape[-1]), self._target_weight()).view(*h.shape[:-1], -1)

    def _target_weight(self) -> Tensor | Packed:
        if self._target_head is None:
            final_norm = self.model.target_transformer.final_norm
            weight = self.model.to_logits[self.target_type].weight
            self._target_head = _packed_or(_t(weight, final_norm), _store(weight))
        return self._target_head

    def draft_logits(self, h: Tensor) -> Tensor:
        """The early-exit head on the exit layer's hidden state."""
        return self._draft_head()(h)

    def _draft_head(self) -> _ExitHead:
        if self.exit_layer is None:
            raise ValueError("this model has no early-exit head (target_early_exit_layer is None)")
        if self._exit_head is None:
            # bfloat16 panels where the kernels run, whatever the model's dtype: the head (a feed-forward
            # block and the logits, ~21 MB at width 512) is read on every draft step, and a draft only
            # proposes (the accept rules and beam_step judge with the target alone), so its precision
            # moves acceptance, never an output: at width 512 gamma-4 cycles ran 8-10% faster
            self._exit_head = _ExitHead.of(self.model.to_early_exit_semantic_logits, torch.bfloat16)
        return self._exit_head
