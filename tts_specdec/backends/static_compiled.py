"""Static-shape steps for `torch.compile` (`SpeculativeDecoder(model, compile=True)`): the path for GPUs,
where a step is fast only as one captured graph (`mode="reduce-overhead"`: CUDA graphs).

Inside a compiled step nothing depends on tensor values: the KV cache is the caller's preallocated
`KVCache` (capacity in power-of-two buckets, so a long decode meets a handful of shapes), written with
`index_copy_` at position tensors; attention reads every slot of the cache under a mask built on the
device from those positions (slot <= the query's position); rotary tables are indexed by the same
tensors; picks are argmax, or an exponential race on noise drawn outside the graph from the caller's
generator (exactly the numbers `sampling.draw` would draw), marked inside the graph where the logits
were not finite (`finite.py`: read with the tokens); no `.item()`, `.tolist()` or branch on a tensor value. The loops read results once per call: a run of plain steps (`plain_steps`, N steps per
call: the caller discards what follows an EOS or max_length), a draft phase, a verify pass.

Compiled here: plain steps (greedy and sampling, guidance, top-k/top-p), the draft phase without draft
stops, the verify pass, which is also plain beam search's layer step, and speculative beam search's tree
passes (every draft level and the verify pass, padded to fixed sizes: `Backend.static_shapes`). The beam
bookkeeping between passes (candidate ranking, replay, commit) stays on the host. Draft stops are
found on the device after gamma draft steps (`StaticCompiled.draft_phase`).

`compile`: True (inductor) or the name of a `torch.compile` backend ("eager", "aot_eager": tests).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tiles
from ..cache import BufferPool, KVCache
from ..finite import marked
from ..sampling import Draws, cfg_mix, filter_logits
from ..weights import _c, _normed_mm, _residual, _t, _unit, rotate
from .torch_eager import TorchEager

if TYPE_CHECKING:
    from ..decoder import Decoder, Encoded
    from ..sampling import SamplingConfig

# each distinct (step kind, batch, capacity bucket, source length, sampling settings) is one graph;
# dynamo's default of 8 per function would fall back to eager after a few calls with other settings
RECOMPILE_LIMIT = 64
MIN_CAPACITY = 64
# cache buffers kept for the next decode, by shape (the most recent shapes)
POOLED_SHAPES = 8
# Recorded runs (TTS_SPECDEC_RECORD_RUNS=1; off by default): on CUDA a run of plain steps and a whole
# speculative sampling cycle are each recorded as one CUDA graph and replayed, one launch per run instead of
# one graph replay per step (each a Python call, dynamo's guards and input copies). Measured once on an H100
# (docs/gpu.md): plain sampling 1.20x the per-step graphs in tools/gpu_profile.py, but slower in the
# benchmark's interleaved runs and in speculative sampling, for reasons not established on a GPU yet.
RECORD_RUNS = os.environ.get("TTS_SPECDEC_RECORD_RUNS", "0") == "1"
# TTS_SPECDEC_AUTOTUNE=1 (off by default, CUDA and inductor only): the steps compiled with inductor's
# max-autotune, which times Triton templates against cuBLAS for each product. On an H100 a speculative cycle
# took ~3.2 plain steps of device time for ~1.6 plain steps of ops; its most expensive kernels were cuBLAS
# tiled float32 GEMMs of ~8.7 us each, about 49 a cycle (likely the verify pass's 5-row products; one-row
# products ran as ~2-4 us GEMV kernels) (docs/gpu.md). Not measured with autotuning yet; each graph then
# compiles for longer.
AUTOTUNE = os.environ.get("TTS_SPECDEC_AUTOTUNE", "0") == "1"
RECORDED = 16  # recorded runs kept (each holds its graph and its memory), the most recently used
# How a step writes its products (`products`). "blas": torch.mm / addmm / matmul, which inductor hands to
# cuBLAS; on an H200 a one-row product ran there as a GEMV kernel of 2-3 us, but a verify pass's five-row
# products as tiled float32 GEMMs of ~8.4 us with split-K reductions of their own (47% of speculative
# sampling's kernel time). "all": every product, attention's two included, written as a broadcast multiply
# and a sum over the inputs, which inductor generates as a reduction kernel of its own (the norm's division
# in front and the bias and residual after fused into it), whose cost barely grows with the rows; the
# weights are then stored (out, in) so that the sum runs along memory. "linear": the layers' and heads' products alone. On an
# H200 (2026-11-30, docs/performance.md) "all" ran every mode faster than "blas" (plain sampling 1.34x,
# speculative sampling 1.57x, beam search 1.51x) with the same tokens, so it is the default on CUDA; the
# CPU keeps "blas" (its compiled path is not where the CPU decodes: the C++ kernels are).
# TTS_SPECDEC_PRODUCTS (read at import) sets one for every device: the A/B switch.
PRODUCTS = os.environ.get("TTS_SPECDEC_PRODUCTS") or None
if PRODUCTS not in (None, "blas", "linear", "all"):
    raise ValueError(f"TTS_SPECDEC_PRODUCTS must be blas, linear or all, not {PRODUCTS!r}")


def products(device: torch.device) -> str:
    """How the steps on `device` write their products: `PRODUCTS` when set, else "all" on CUDA, "blas"
    elsewhere."""
    return PRODUCTS or ("all" if device.type == "cuda" else "blas")


@dataclass(frozen=True)
class _Layer:
    qkv: Tensor  # (dim, (heads + 2 kv_heads) * d), the RMSNorm gain folded in
    attn_out: Tensor  # (heads * d, dim)
    cross_q: Tensor  # (dim, heads * d), norm folded in
    cross_out: Tensor  # (heads * d, dim)
    ff_in: Tensor  # (dim, 2 * inner), norm folded in
    ff_in_b: Tensor
    ff_out: Tensor  # (inner, dim)
    ff_out_b: Tensor


@dataclass(frozen=True)
class _Weights:
    """The decoder's weights as plain tensors (no packed kernel weights: a graph can hold no C++ call)."""

    layers: tuple[_Layer, ...]
    target: Tensor  # (dim, V), final norm folded in
    exit_ff: _Layer | None  # the exit head's Residual(FeedForward) (ff fields only)
    exit_out: Tensor | None  # (dim, V), the exit head's RMSNorm folded in
    emb: Tensor  # (V, dim) target token embeddings


def _ff_of(ff: torch.nn.Sequential) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _t(ff[1].weight, ff[0]), _c(ff[1].bias), _t(ff[4].weight), _c(ff[4].bias)


def _weights_of(dec: Decoder) -> _Weights:
    layers = tuple(
        _Layer(_t(torch.cat((sa.to_q[0].weight, sa.to_kv[0].weight)), sa.norm), _t(sa.to_out.weight),
               _t(cross.to_q[0].weight, cross.norm), _t(cross.to_out.weight), *_ff_of(ff))
        for sa, cross, ff in dec.layers
    )
    m = dec.model
    target = _t(m.to_logits[dec.target_type].weight, m.target_transformer.final_norm)
    exit_ff = exit_out = None
    if dec.exit_layer is not None:
        head = m.to_early_exit_semantic_logits
        none = torch.empty(0)
        exit_ff = _Layer(none, none, none, none, *_ff_of(head[0].fn))
        exit_out = _t(head[2].weight, head[1])
    w = _Weights(layers, target, exit_ff, exit_out, _c(m.token_emb[dec.target_type].weight))
    return w if products(dec.device) == "blas" else _reduction_layout(w)


def _reduction_layout(w: _Weights) -> _Weights:
    """Every product's (in, out) matrix as a view of (out, in) memory: a reduction over `in` then reads
    along memory (`_mm`)."""
    def rows_major(t: Tensor) -> Tensor:
        return t.t().contiguous().t() if t.dim() == 2 else t  # the exit head's unused fields are empty 1-D

    def layer(lw: _Layer) -> _Layer:
        return replace(lw, **{f: rows_major(getattr(lw, f))
                              for f in ("qkv", "attn_out", "cross_q", "cross_out", "ff_in", "ff_out")})

    return replace(w, layers=tuple(layer(lw) for lw in w.layers), target=rows_major(w.target),
                   exit_ff=None if w.exit_ff is None else layer(w.exit_ff),
                   exit_out=None if w.exit_out is None else rows_major(w.exit_out))


# ---- the static step: pure functions of tensors (what torch.compile traces) -----------------------------


def _mm(a: Tensor, w: Tensor) -> Tensor:
    """a (tokens, in) @ w (in, out), as `products` says: torch.mm, or a sum of products that inductor
    writes as a reduction kernel of its own."""
    if products(a.device) == "blas":
        return torch.mm(a, w)
    return (a[:, :, None] * w).sum(1)


def _addmm(b: Tensor, a: Tensor, w: Tensor) -> Tensor:
    """b + a @ w."""
    return torch.addmm(b, a, w) if products(a.device) == "blas" else b + _mm(a, w)


def _tiled(x: Tensor) -> bool:
    """Whether this path runs `x`'s dtype in `tiles`: half precision only. In float32 its products as
    reductions (a GPU: `products`) sum alike for any row count by construction, and its attention reads the
    whole static cache; tiled, its graphs took several times as long to compile in the CPU tests."""
    return x.dtype in tiles.HALF


def _normed(x: Tensor, w: Tensor) -> Tensor:
    """_unit(x) @ w (`weights._normed_mm`)."""
    if not _tiled(x):
        return _mm(_unit(x), w)
    return _normed_mm(x, w) if products(x.device) == "blas" else tiles.rows(lambda t: _mm(_unit(t), w), x)


def _plus(x: Tensor, a: Tensor, w: Tensor) -> Tensor:
    """x + a @ w (`weights._residual`)."""
    if not _tiled(x):
        return _addmm(x, a, w)
    return _residual(x, a, w) if products(x.device) == "blas" else tiles.rows(lambda t, u: _addmm(t, u, w), x, a)


def _ff_residual(w: _Layer, x: Tensor) -> Tensor:
    """x + FeedForward(x) (RMSNorm, Linear, GEGLU, Linear) for x (tokens, dim)."""
    def ff(x: Tensor) -> Tensor:
        h, gate = _addmm(w.ff_in_b, _unit(x), w.ff_in).chunk(2, dim=-1)
        return _addmm(x + w.ff_out_b, F.gelu(gate) * h, w.ff_out)
    return tiles.rows(ff, x) if _tiled(x) else ff(x)


def _untiled(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, op: tiles.Attend) -> Tensor:
    return op(q, keys, values, mask)


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention of q (rows, h, n, d) over keys and values (rows, h, m, d), the additive mask
    broadcast to (rows, h, n, m); a query that may see nothing gets zeros, as scaled_dot_product_attention
    gives. Written out rather than through that op: on a GPU, float32 attention there is the
    memory-efficient kernel, built for long blocks of queries, and a step of the shipped model spent 72% of
    its device time in it at 37 us a call for one to a few queries (H200, benchmarks/gpu_nvidia_h200.json);
    written out it is two small products (batched GEMMs, or reduction kernels: `products`) and one fused
    softmax."""
    reduce = products(q.device) == "all"  # each product a reduction kernel of inductor's own
    if reduce:
        scores = (q[..., :, None, :] * keys[..., None, :, :]).sum(-1) * q.shape[-1] ** -0.5
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    p = scores.softmax(dim=-1).nan_to_num(0.0)
    if reduce:
        return (p[..., :, :, None] * values[..., None, :, :]).sum(-2)
    return torch.matmul(p, values)


def _layers(
    w: _Weights, layers: range, x: Tensor, pos: Tensor, k_all: Tensor, v_all: Tensor, enc_k: Tensor, enc_v: Tensor,
    enc_mask: Tensor | None, cos_t: Tensor, sin_t: Tensor, heads: int, slots: Tensor | None = None,
    allowed: Tensor | None = None,
) -> Tensor:
    """Decoder `layers` on x (rows, n, dim) at rotary positions pos (rows, n), written at `slots` (rows, n;
    default pos) of k_all/v_all (layers, rows, kv_heads, capacity, d) by index_copy_; each query sees the
    slots `allowed` (rows, 1, n, capacity) bool marks, default those <= its own (causal by slot). Returns
    the hidden states."""
    rows, n, dim = x.shape
    kvh, cap, d = k_all.shape[2], k_all.shape[3], k_all.shape[4]
    cos, sin = cos_t[pos], sin_t[pos]  # (rows, n, d)
    if slots is None:
        slots = pos
    # a tree's nodes see scattered slots: in half precision each gathers its own first (`tiles`)
    attend = _untiled if not _tiled(x) else tiles.attention if allowed is None else tiles.gathered_attention
    if allowed is None:
        allowed = torch.arange(cap, device=x.device) <= slots[:, None, :, None]
    mask = torch.zeros(rows, 1, n, cap, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
    # flat index of (row, kv head, slot) in a layer's (rows * kv_heads * capacity, d) view
    base = (torch.arange(rows, device=x.device)[:, None] * kvh + torch.arange(kvh, device=x.device)) * cap
    where = (base[:, :, None] + slots[:, None, :]).reshape(-1)
    x = x.reshape(rows * n, dim)
    for i in layers:
        lw = w.layers[i]
        qkv = _normed(x, lw.qkv).view(rows, n, -1, d).transpose(1, 2)  # (rows, h + 2kvh, n, d)
        qk = rotate(qkv[:, : heads + kvh], cos[:, None], sin[:, None])
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kvh :]
        k_layer, v_layer = k_all[i], v_all[i]
        k_layer.view(-1, d).index_copy_(0, where, k.reshape(-1, d))
        v_layer.view(-1, d).index_copy_(0, where, v.reshape(-1, d))
        keys, values = k_layer, v_layer
        if kvh != heads:  # spear-tts repeats kv heads as '(g h)': query head j uses kv head j % kvh
            keys, values = keys.repeat(1, heads // kvh, 1, 1), values.repeat(1, heads // kvh, 1, 1)
        a = attend(q, keys, values, mask, _attend)
        x = _plus(x, a.transpose(1, 2).reshape(rows * n, -1), lw.attn_out)
        q = _normed(x, lw.cross_q).view(rows, n, heads, d).transpose(1, 2)
        a = (tiles.attention if _tiled(x) else _untiled)(q, enc_k[i], enc_v[i], enc_mask, _attend)
        x = _plus(x, a.transpose(1, 2).reshape(rows * n, -1), lw.cross_out)
        x = _ff_residual(lw, x)
    return x.view(rows, n, dim)


def _pick(
    logits: Tensor, noise: Tensor | None, cfg: SamplingConfig, guided: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Mixed logits (guided) -> (token, the token marked where the logits were not finite (`finite.marked`),
    distribution): argmax when greedy (no distribution), else the exponential race of `sampling.draw`
    on `noise`."""
    if guided:
        logits = cfg_mix(logits, scale)
    if noise is None:
        token, probs = logits.argmax(dim=-1), None
    else:
        probs = filter_logits(logits, cfg).softmax(dim=-1)
        token = (probs / noise).argmax(dim=-1)
    return token, marked(logits, token), probs


def _next_input(w: _Weights, token: Tensor, guided: bool) -> Tensor:
    x = F.embedding(token[:, None], w.emb)
    return x.repeat_interleave(2, dim=0) if guided else x


def _plain_step(w, x, pos, noise, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, *, heads, cfg, guided, scale):
    """One plain step for every row: pos (rows,) -> (token (seqs,) marked as `_pick` marks it, next input,
    pos + 1)."""
    h = _layers(w, range(len(w.layers)), x, pos[:, None], k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, heads)
    token, mark, _ = _pick(_normed(h[:, 0], w.target), noise, cfg, guided, scale)
    return mark, _next_input(w, token, guided), pos + 1


def _draft_step(w, x, pos, noise, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, *, heads, exit_layer, cfg,
                guided, scale, stops):
    """One draft step: layers below the exit and the exit head -> (exit state, token marked as `_pick`
    marks it, q or None, the probability draft stops test (`stops`; else None), next input, pos + 1)."""
    h = _layers(w, range(exit_layer), x, pos[:, None], k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, heads)
    logits = _normed(_ff_residual(w.exit_ff, h[:, 0]), w.exit_out)
    if guided:
        logits = cfg_mix(logits, scale)
    token, mark, q = _pick(logits, noise, cfg, False, 1.0)
    conf = None
    if stops:  # what the draft gave its token: q's entry, or when greedy the softmax's largest
        conf = logits.softmax(dim=-1).amax(dim=-1) if q is None else q.gather(-1, token[:, None])[:, 0]
    return h, mark, q, conf, _next_input(w, token, guided), pos + 1


def _run(w, x, pos, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, *, heads, first, stop, head):
    """Layers first..stop-1 on x (rows, n, dim) at slots pos (rows, n); with `head`, the target logits
    instead."""
    h = _layers(w, range(first, stop), x, pos, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, heads)
    if not head:
        return h
    return _normed(h.reshape(-1, h.shape[-1]), w.target).view(*h.shape[:2], -1)


def _exit_states(w, x, pos, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, *, heads, stop):
    """The draft phase's last pass: layers below the exit on the pending input x (rows, 1, dim)."""
    return _layers(w, range(stop), x, pos, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, heads)


def _tree(w, x, pos, slots, allowed, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, *, heads, first, stop):
    """A speculative beam tree pass: layers first..stop-1 on the nodes x (rows, n, dim) at rotary positions
    pos (their depths), written at `slots`, each seeing the slots `allowed` marks (prefix and ancestors)."""
    return _layers(w, range(first, stop), x, pos, k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t, heads,
                   slots, allowed)


# ---- the backend ------------------------------------------------------------------------------------


class StaticCompiled(TorchEager):
    name = "compiled"
    fused_plain = True
    by_reference = False  # a graph reads the cache by position: beam steps reorder K/V
    static_shapes = True

    def __init__(self, dec: Decoder, compile_backend: str = "inductor") -> None:
        super().__init__(dec)
        self.compile_backend = compile_backend
        self.w = _weights_of(dec)
        self._graphs: dict[tuple, Callable] = {}
        self._runs: OrderedDict[tuple, _Run] = OrderedDict()
        self._draws: _Logged | None = None  # the recorded run being run, recorded or replayed
        # None: record runs on CUDA with inductor; True off CUDA runs the same buffers and code without
        # recording (what the CPU tests check); False: a graph per step (the default: RECORD_RUNS)
        self.record_runs: bool | None = None if RECORD_RUNS else False
        self._pool = BufferPool(POOLED_SHAPES)
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT

    @staticmethod
    def capacity(n: int) -> int:
        """Cache capacities in power-of-two buckets (each capacity is a shape: a graph)."""
        return max(MIN_CAPACITY, 1 << (n - 1).bit_length())

    def new_cache(self, rows: int, capacity: int, by_reference: bool = False) -> KVCache:
        """A cache whose storage comes from this backend's `cache.BufferPool`: captured CUDA graphs keep
        reading the same addresses from one decode to the next (a new address makes a graph record
        again and, past torch's limit on those, run without CUDA graphs)."""
        dec = self.dec
        return KVCache(dec.depth, rows, dec.kv_heads, dec.dim_head, capacity, dtype=dec.dtype, device=dec.device,
                       by_reference=by_reference, pool=self._pool)

    def _graph(self, fn: Callable, device: torch.device, **static) -> Callable:
        """`fn` with its keyword-only arguments bound to `static`, compiled once per (fn, arguments)."""
        cuda_graphs = device.type == "cuda" and self.compile_backend == "inductor"
        mode = "reduce-overhead" if cuda_graphs else None
        if (fn in _IN_RUNS or self._draws is not None) and self.records(device):
            mode = None  # a recorded run's graph holds this function's kernels
        if AUTOTUNE and cuda_graphs:
            mode = "max-autotune" if mode else "max-autotune-no-cudagraphs"
        key = (fn.__name__, device.type, mode, tuple(sorted(static.items())))
        graph = self._graphs.get(key)
        if graph is None:
            # a code object of its own per key: dynamo's cache (and its recompile limit) is per code object
            code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(self._graphs)}")
            own = type(fn)(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
            own.__kwdefaults__ = dict(static)
            compiled = torch.compile(own, fullgraph=True, backend=self.compile_backend, mode=mode)
            graph = compiled if mode in (None, "max-autotune-no-cudagraphs") else partial(_replay, compiled)
            self._graphs[key] = graph
            if device.type == "cuda":  # weights at fixed addresses: the captured graph reads them in place
                for t in _tensors(self.w):
                    torch._dynamo.mark_static_address(t)
        return graph

    def _inputs(self, enc: Encoded, cache: KVCache, end: int | None = None) -> tuple:
        """The cache, the source K/V and mask, and rotary tables cut to the cache's capacity (shapes from
        the buckets only). `end`: one past the furthest slot the call writes when the host knows it;
        else the cache counts as written up to its capacity (the slots are device values: reading them
        back would wait for the device; the loops grow the cache before each call, so every slot
        written is within it)."""
        if cache.table is not None:
            raise ValueError("static steps need a cache by value")
        dec = self.dec
        dec._rope_to(cache.capacity, cache)
        k_all, v_all = cache.buffers(cache.capacity if end is None else end)
        if k_all.device.type == "cuda":
            torch._dynamo.mark_static_address(k_all)
            torch._dynamo.mark_static_address(v_all)
        enc_k, enc_v = enc.dense()
        cos_t, sin_t = dec._rope
        return k_all, v_all, enc_k, enc_v, enc.mask, cos_t[: cache.capacity], sin_t[: cache.capacity]

    def plain_steps(
        self, x: Tensor, pos: Tensor, steps: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        """`steps` steps for every row, nothing read back (the caller checks for EOS once per call and
        discards what follows it): one recorded graph on CUDA, else one compiled graph per step."""
        dec, guided = self.dec, enc.guided
        inputs = self._inputs(enc, cache)
        static = dict(heads=dec.heads, cfg=_key(cfg), guided=guided, scale=float(cond_scale) if guided else 1.0)
        step = self._graph(_plain_step, x.device, **static)
        fixed, source = _split(inputs)
        seqs = pos.numel()

        def run(x: Tensor, row_pos: Tensor, *source: Tensor | None) -> tuple[Tensor, Tensor]:
            draws, tokens, layer_inputs = self.draws(generator), [], _join(fixed, source)
            for _ in range(steps):
                token, x, row_pos = step(self.w, x, row_pos, self._noise(cfg, draws, seqs, x), *layer_inputs)
                tokens.append(token)
            return torch.stack(tokens, dim=1), x

        # inputs as every later step's (one graph): x contiguous, positions per cache row
        copied = (x.contiguous(), dec.per_row(pos, guided), *source)
        out = self._recorded(("plain", steps, *static.items()), run, copied, fixed, generator)
        for i in range(dec.depth):
            dec.layer_evals[i] += x.shape[0] * steps
        return out

    def draft_phase(
        self, x: Tensor, pos: Tensor, gamma: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, *, confidence: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """gamma compiled draft steps and the exit state of the last draft, nothing read back. With draft
        stops every row drafts all gamma steps and its proposed count is found on the device: the first
        draft its draft gave less than `confidence`, else gamma, the count the step-by-step rule gives
        (compared in float64, as that rule compares the value read back with the Python float). Drafts
        past a row's count are never accepted; sampling draws noise for them too, so a seeded run's
        tokens can differ from the step-by-step loop's when every row stopped early (each is still
        exact: the output law is the target's)."""
        dec, guided = self.dec, enc.guided
        inputs = self._inputs(enc, cache)
        stops = confidence is not None
        step = self._graph(_draft_step, x.device, heads=dec.heads, exit_layer=dec.exit_layer, cfg=_key(cfg),
                           stops=stops, guided=guided, scale=float(cond_scale) if guided else 1.0)
        tail = self._graph(_exit_states, x.device, heads=dec.heads, stop=dec.exit_layer)
        fixed, source = _split(inputs)
        seqs = pos.numel()

        def run(x: Tensor, row_pos: Tensor, *source: Tensor | None) -> tuple:
            layer_inputs = _join(fixed, source)
            draws, exits, qs, drafts, confs = self.draws(generator), [], [], [], []
            for _ in range(gamma):
                h, token, q, conf, x, row_pos = step(self.w, x, row_pos, self._noise(cfg, draws, seqs, x),
                                                     *layer_inputs)
                exits.append(h)
                drafts.append(token)
                if q is not None:
                    qs.append(q)
                if conf is not None:
                    confs.append(conf)
            exits.append(tail(self.w, x, row_pos[:, None], *layer_inputs))
            limit = None
            if stops:
                below = torch.stack(confs, dim=1).to(torch.float64) < confidence
                limit = torch.where(below.any(dim=1), below.to(torch.int8).argmax(dim=1) + 1, gamma)
            return torch.cat(exits, dim=1), torch.stack(qs, dim=1) if qs else None, torch.stack(drafts, dim=1), limit

        copied = (x.contiguous(), dec.per_row(pos, guided), *source)
        key = ("draft", gamma, confidence, guided, float(cond_scale) if guided else 1.0, _key(cfg))
        out = self._recorded(key, run, copied, fixed, generator)
        for i in range(dec.exit_layer):
            dec.layer_evals[i] += x.shape[0] * (gamma + 1)
        return out

    def run_cycle(
        self, cycle: Callable[[Tensor, Tensor, Encoded], tuple[Tensor, ...]], key: tuple, x: Tensor, pos: Tensor,
        enc: Encoded, cache: KVCache, generator: torch.Generator | None,
    ) -> tuple[Tensor, ...]:
        """The whole cycle as one recorded graph on CUDA: its draft phase, verify pass and acceptance, a
        launch and a read-back per cycle. It reads the source's K/V and mask from its own copies."""
        fixed, source = _split(self._inputs(enc, cache))  # the cache counts as written up to its capacity

        def run(x: Tensor, pos: Tensor, enc_k: Tensor, enc_v: Tensor, enc_mask: Tensor | None) -> tuple[Tensor, ...]:
            return cycle(x, pos, replace(enc, keys=enc_k, values=enc_v, mask=enc_mask, source=None, _dense={}))

        return self._recorded(key, run, (x.contiguous(), pos, *source), fixed, generator)

    def draws(self, generator: torch.Generator | None) -> Draws:
        """Inside a recorded run, that run's buffers (drawn in order before each replay), else `generator`."""
        return self._draws if self._draws is not None else Draws(generator)

    def _noise(self, cfg: SamplingConfig, draws: Draws, seqs: int, x: Tensor) -> Tensor | None:
        """The exponential race's numbers for one step, drawn as `sampling.draw` draws them (greedy: none)."""
        if cfg.greedy:
            return None
        race = draws.exponential((seqs, self.dec.vocab_size), x)
        return race.clamp_min(torch.finfo(race.dtype).tiny)

    def records(self, device: torch.device) -> bool:
        """Whether runs of steps and speculative cycles are recorded as CUDA graphs here (`_recorded`)."""
        if self.record_runs is None:
            return device.type == "cuda" and self.compile_backend == "inductor"
        return self.record_runs

    def _recorded(self, key: tuple, run: Callable[..., Any], copied: tuple, fixed: tuple,
                  generator: torch.Generator | None) -> Any:
        """run(*copied), recorded (`_records`) as one graph per key, shapes and `fixed`'s addresses: a
        recorded run keeps its own copies of `copied` (refilled every call), reads `fixed` where it was
        recorded (the cache's pooled buffers and the rotary tables keep their addresses from call to call)
        and takes its random numbers from buffers refilled before each replay, in the order it asked for
        them (`draws`). Inside another recorded run, or not recording: run(*copied)."""
        device = copied[0].device
        if self._draws is not None or not self.records(device):
            return run(*copied)
        key = (*key, *(_layout(t, False) for t in copied), *(_layout(t, True) for t in fixed))
        rec = self._runs.get(key)
        if rec is None:
            rec = _Run(tuple(None if t is None else t.clone() for t in copied), self.dec)
            self._runs[key] = rec
            while len(self._runs) > RECORDED:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(key)
            for mine, t in zip(rec.inputs, copied):
                if mine is not None:
                    mine.copy_(t)
        self._draws = rec.draws
        try:
            return rec(run, device.type == "cuda", generator)
        except Exception:
            self._runs.pop(key, None)  # half-made: never replayed
            raise
        finally:
            self._draws = None

    def run_layers(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
        attn_mask: Tensor | None = None, positions: Tensor | None = None, real: Tensor | None = None,
    ) -> Tensor:
        """A tree pass (explicit positions and a boolean mask over the cache's whole capacity, as speculative
        beam search builds them on a backend with `static_shapes`) runs as one graph: padding tokens are
        computed, not packed (`real` unused). Any other pass runs on torch's ops (no search loop makes
        one under compile: tests/test_compiled.py counts them)."""
        tree = (positions is not None and attn_mask is not None and attn_mask.dtype == torch.bool
                and attn_mask.shape[-1] == cache.capacity)
        if not tree:
            return super().run_layers(x, start, layers, enc, cache, attn_mask, positions, real)
        rows, n = x.shape[:2]
        slots = torch.arange(n, device=x.device) + (start[:, None] if isinstance(start, Tensor) else start)
        inputs = self._inputs(enc, cache)
        graph = self._graph(_tree, x.device, heads=self.dec.heads, first=layers.start, stop=layers.stop)
        for i in layers:
            self.dec.layer_evals[i] += rows * n
        return graph(self.w, x.contiguous(), positions.contiguous(), slots.expand(rows, n).contiguous(),
                     attn_mask.contiguous(), *inputs)

    def verify(self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
               limit: Tensor | None = None) -> Tensor:
        """`layers` and the target head on x (rows, n, dim) at slots start.. of each row, in one graph; every
        position, those past a sequence's `limit` included: the graph's shapes stay static."""
        rows, n = x.shape[:2]
        if isinstance(start, int):
            pos = torch.arange(start, start + n, device=x.device).expand(rows, n)
            end = start + n
        else:
            pos, end = start[:, None] + torch.arange(n, device=x.device), None
        inputs = self._inputs(enc, cache, end)
        graph = self._graph(_run, x.device, heads=self.dec.heads, first=layers.start, stop=layers.stop, head=True)
        for i in layers:
            self.dec.layer_evals[i] += rows * n
        return graph(self.w, x.contiguous(), pos.contiguous(), *inputs)


class _Logged(Draws):
    """A recorded run's random numbers: the first run of its body draws them from the generator into
    buffers it keeps, in the order asked; later runs (the capture, and off CUDA every call) get the same
    buffers in the same order, which `refill` draws anew before each call, as the first run drew them."""

    def __init__(self) -> None:
        super().__init__(None)
        self.buffers: list[tuple[str, Tensor]] = []
        self.logged, self.next = False, 0

    def _take(self, kind: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        if not self.logged:
            t = self.fill(kind, like.new_empty(shape))
            self.buffers.append((kind, t))
            return t
        kind_was, t = self.buffers[self.next]
        if kind_was != kind or tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"a recorded run asked for {kind} {tuple(shape)} where it first asked for "
                               f"{kind_was} {tuple(t.shape)}")
        self.next += 1
        return t

    def exponential(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return self._take("exponential", shape, like)

    def rand(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return self._take("rand", shape, like)

    def refill(self, generator: torch.Generator | None) -> None:
        self.generator = generator
        for kind, t in self.buffers:
            self.fill(kind, t)
        self.generator = None


class _Run:
    """A run of compiled steps on its own input buffers (`inputs`) and random numbers (`draws`), recorded
    as one CUDA graph on its first call and replayed after (off CUDA: run again each call, on the same
    buffers). The body advances the decoder's layer counters (`layer_evals`): a replay adds what its first
    run added. The body comes with each call and is not kept: it closes over the decode's cache, and a
    cache kept alive never hands its storage back to the pool, so the next decode's cache would get new
    addresses and every decode would record its graph again."""

    def __init__(self, inputs: tuple, dec: Decoder) -> None:
        self.inputs, self.dec = inputs, dec
        self.draws = _Logged()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None
        self.added: list[int] | None = None

    def _body(self, run: Callable[..., Any]) -> Any:
        self.draws.next = 0
        return run(*self.inputs)

    def __call__(self, run: Callable[..., Any], record: bool, generator: torch.Generator | None) -> Any:
        if self.draws.logged:
            self.draws.refill(generator)
        else:
            self.draws.generator = generator
        if self.added is None:  # the first call: its body draws and counts
            before = list(self.dec.layer_evals)
            out = self._body(run)
            self.draws.logged, self.draws.generator = True, None
            self.added = [a - b for a, b in zip(self.dec.layer_evals, before)]
            if not record:
                return out
            # that run (on its own inputs) compiled, tuned and set up cuBLAS outside the capture; it wrote the
            # cache slots the replay writes, and the replay rewrites each before it reads it
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.out = self._body(run)
            except Exception as e:  # noqa: BLE001 -- a failed capture leaves the stream and allocator unusable
                raise RuntimeError(f"recording a run as one CUDA graph failed ({e}); TTS_SPECDEC_RECORD_RUNS=0 "
                                   "replays a graph per step instead") from e
            self.graph = graph
            self.dec.layer_evals[:] = [b + a for b, a in zip(before, self.added)]
        else:
            if not record:
                return self._body(run)  # counts as it runs
            self.dec.layer_evals[:] = [e + a for e, a in zip(self.dec.layer_evals, self.added)]
        self.graph.replay()
        # the outputs live in the graph's memory and the next replay overwrites them
        return tuple(None if t is None else t.clone() for t in self.out)


def _split(inputs: tuple) -> tuple[tuple, tuple]:
    """`_inputs`' tuple -> (what a recorded run reads where it was recorded: the cache's K/V and the rotary
    tables; the source's K/V and mask, which it copies in each call)."""
    k_all, v_all, enc_k, enc_v, enc_mask, cos_t, sin_t = inputs
    return (k_all, v_all, cos_t, sin_t), (enc_k, enc_v, enc_mask)


def _join(fixed: tuple, source: tuple) -> tuple:
    """The inverse of `_split`: a step's layer inputs in `_inputs`' order."""
    return (*fixed[:2], *source, *fixed[2:])


def _layout(t: Tensor | None, address: bool) -> tuple | None:
    return None if t is None else (t.data_ptr() if address else None, t.shape, t.stride(), t.dtype)


def _replay(graph: Callable, *args) -> tuple | Tensor:
    """A CUDA graph's call: its outputs live in the graph's memory and the next replay overwrites them
    (as gpt-fast does, what is kept or fed back is cloned)."""
    torch.compiler.cudagraph_mark_step_begin()
    out = graph(*args)
    if isinstance(out, Tensor):
        return out.clone()
    return tuple(None if t is None else t.clone() for t in out)


# the step functions a recorded run calls: compiled without CUDA graphs of their own there
_IN_RUNS = (_plain_step, _draft_step, _exit_states)


def _key(cfg: SamplingConfig) -> SamplingConfig:
    """A SamplingConfig as a hashable static argument (greedy: nothing else matters)."""
    from ..sampling import SamplingConfig

    return SamplingConfig(0.0) if cfg.greedy else cfg


def _tensors(w: _Weights) -> list[Tensor]:
    out = [w.target, w.emb] + [t for t in (w.exit_out,) if t is not None]
    for layer in w.layers + ((w.exit_ff,) if w.exit_ff is not None else ()):
        out += [t for t in vars(layer).values() if t.numel()]
    return out
