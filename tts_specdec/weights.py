"""A `TextToSemantic`'s weights as the decoding products take them: transposed to (in, out), RMSNorm
gains folded in, packed for the CPU kernel where it runs, or split into blocks for one bmm where that
pays; and the rotary tables. Shared by the decoder (`decoder.py`) and the source encoder (`encoder.py`)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels, tiles
from .kernels import PANEL, Packed


def _unit(x: Tensor) -> Tensor:
    # F.normalize(x, dim=-1) in three kernels instead of five
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


# TTS_SPECDEC_HALF=native: half precision computes in its own dtype on the CPU too, as on a GPU (on torch's
# path, in `tiles`): how the GPU's case is checked on a machine without one. Read once, at import.
NATIVE_HALF = os.environ.get("TTS_SPECDEC_HALF", "") == "native"


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype decoding computes in for parameters of `dtype` on `device`: float32 for half-precision
    parameters on the CPU, else their own. bf16 and fp16 values widen to float32 exactly, and float32
    runs on the CPU kernels, whose sums for a row do not depend on how many rows share the call;
    speculation's exactness rests on that, and torch's half-precision CPU products do not keep it (a
    verify pass over several tokens rounded differently from a one-token step). On a GPU the
    parameters' dtype is kept, and torch's ops run in fixed tiles there (`tiles`)."""
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and device.type == "cpu" and not NATIVE_HALF else dtype


def _c(t: Tensor) -> Tensor:
    """A parameter as decoding computes with it (`compute_dtype`), detached."""
    return t.detach().to(compute_dtype(t.dtype, t.device))


def _t(weight: Tensor, norm: torch.nn.Module | None = None) -> Tensor:
    """A Linear weight (out, in) stored as a contiguous (in, out) matrix: `x @ w` on that layout is
    measurably faster for the few-row products of decoding than `x @ weight.t()` (MKL, CPU).

    `norm`: the spear-tts RMSNorm (F.normalize(x) * sqrt(dim) * gamma) in front of the Linear; its
    per-channel weight is folded into the matrix's rows, so the norm costs no multiply at run time."""
    w_t = _c(weight).t()
    if norm is not None:
        w_t = w_t * (_c(norm.gamma) * norm.scale)[:, None]
    return w_t.contiguous()


# Where the small-product kernel (kernels.py) does not run: MKL runs a product with a handful of rows
# on one thread however many it may use; one bmm over column (or row) blocks of the weight spreads it
# over the threads. Worth it for large matrices only: on small ones the extra blocks cost more than
# the threads save (on 2 cores a gain at dim 256, a loss at dim 128). Threshold: a (256, 256) matrix.
_SPLIT_MIN_ELEMENTS = 1 << 16


def _store(weight: Tensor) -> torch.dtype:
    """The dtype the kernel's panels keep a model weight in: bfloat16 for a bfloat16 model (half the bytes
    to stream each step; the weight as prepared, its norm folded in, rounded to bfloat16 once, then widened
    exactly in every product), else float32."""
    return torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32


def _packed_or(w_t: Tensor, store: torch.dtype = torch.float32) -> Tensor | Packed:
    """The kernel's packed layout (panels in `store`) where it runs, else the (in, out) matrix. For the
    heads: a vocabulary that is not whole panels (e.g. 130) gets zero columns, sliced off the product's
    result."""
    if not kernels.available(w_t.device, w_t.dtype):
        return w_t
    return Packed(F.pad(w_t, (0, -w_t.shape[1] % PANEL)), width=w_t.shape[1], store=store)


# torch's products below run in `tiles`: a token's bits must not depend on how many tokens share the
# call; the kernels' (Packed) keep that by construction.

# In tiles, torch's float32 products with 5-7 or 9-11 columns still gave a row other bits by its place
# among the tile's rows (MKL, AMD EPYC Zen 4, torch 2.11; 1-4, 8 and 12-71 columns, 127, 130 and 1025 did
# not): a weight of fewer columns takes zero columns up to this many (a head over a tiny vocabulary)
_NARROW = 16


def _mm(a: Tensor, w: Tensor, add: Tensor | None = None) -> Tensor:
    """a @ w (add + a @ w with `add`), a narrow w widened with zero columns (`_NARROW`) and the product
    cut back."""
    n = w.shape[1]
    if n < _NARROW:
        w = F.pad(w, (0, _NARROW - n))
        add = None if add is None else F.pad(add, (0, _NARROW - n))
    out = torch.mm(a, w) if add is None else torch.addmm(add, a, w)
    return out if n >= _NARROW else out[:, :n]


def _normed_mm(x: Tensor, w: Tensor | Packed) -> Tensor:
    """_unit(x) @ w; the kernel scales the sums by the row norms instead of normalising x first."""
    return w(x, normalize=True) if isinstance(w, Packed) else tiles.rows(lambda t: _mm(_unit(t), w), x)


def _residual(x: Tensor, a: Tensor, w: Tensor | Packed) -> Tensor:
    """x + a @ w for w packed, (in, out), or its column blocks (blocks, in, out / blocks)."""
    if isinstance(w, Packed):
        return w(a, residual=x)
    return tiles.rows(lambda t, u: _residual_mm(t, u, w), x, a)


def _residual_mm(x: Tensor, a: Tensor, w: Tensor) -> Tensor:
    if w.dim() == 2:
        return _mm(a, w, add=x)
    b = w.shape[0]
    out = torch.bmm(a.expand(b, -1, -1), w)  # (blocks, tokens, out / blocks)
    res = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.add(x.reshape(x.shape[0], b, -1), out.transpose(0, 1), out=res.view(x.shape[0], b, -1))
    return res


def _split(w_t: Tensor, blocks: int, dim: int) -> Tensor | None:
    """(in, out) -> `blocks` blocks along `dim` (1: columns, 0: rows) stacked for one bmm, or None
    when splitting would not pay (one thread, a small matrix, not on CPU, or uneven blocks) or would
    leave column blocks narrower than `_NARROW` (whose rows lose their bits' invariance)."""
    if (
        torch.get_num_threads() < 2 or w_t.device.type != "cpu" or w_t.numel() < _SPLIT_MIN_ELEMENTS
        or w_t.shape[dim] % blocks or (dim == 1 and w_t.shape[1] // blocks < _NARROW)
    ):
        return None
    if dim == 1:
        return w_t.view(w_t.shape[0], blocks, -1).transpose(0, 1).contiguous()  # (blocks, in, out/blocks)
    return w_t.view(blocks, -1, w_t.shape[1]).contiguous()  # (blocks, in/blocks, out)


# Blocks per GEGLU half when the feed-forward is split: the up-projection (the largest matrix) runs
# as 2 * _FF_BLOCKS column blocks and the down-projection as the matching _FF_BLOCKS row blocks, so
# the activation never leaves the blocked layout (4 blocks per half: the fastest setting measured on
# 2 cores).
_FF_BLOCKS = 4


@dataclass
class _FeedForward:
    """spear-tts FeedForward (RMSNorm, Linear, GEGLU, Dropout, Linear) as prepared weights."""

    # (dim, 2 * inner) with the norm folded in, or (2 * blocks, dim, inner / blocks): value blocks, then
    # gate blocks, or packed for the kernel (blocks 0, inner padded to whole panels)
    w_in: Tensor | Packed
    b_in: Tensor  # (2 * inner,) or (2 * blocks, 1, inner / blocks)
    w_out: Tensor | Packed  # (inner, dim), or (blocks, inner / blocks, dim): the matching row blocks
    b_out: Tensor
    blocks: int  # 1: plain products, 0: the kernel

    @classmethod
    def of(cls, ff: torch.nn.Sequential, store: torch.dtype | None = None) -> "_FeedForward":
        """`store`: the kernel panels' dtype (None: `_store` of the weights)."""
        w_in, b_in = _t(ff[1].weight, ff[0]), _c(ff[1].bias)
        w_out, b_out = _t(ff[4].weight), _c(ff[4].bias)

        def padded(multiple: int, least: int = 0) -> tuple[Tensor, Tensor, Tensor]:
            # inner (e.g. 682 = int(256 * 4 * 2 / 3)) padded with zero units (to at least `least`): a zero
            # gate column gives gelu(0) * h = 0 through a zero row of w_out, so the sum is unchanged
            pad = max(-w_out.shape[0] % multiple, least - w_out.shape[0])
            w_in_p = torch.cat([F.pad(half, (0, pad)) for half in w_in.chunk(2, dim=1)], dim=1)
            b_in_p = torch.cat([F.pad(half, (0, pad)) for half in b_in.chunk(2)])
            return w_in_p, b_in_p, F.pad(w_out, (0, 0, 0, pad))

        if Packed.fits(w_out):  # dim in whole panels; padding puts w_in's columns in whole panels too
            w_in_p, b_in_p, w_out_p = padded(PANEL)
            return cls(Packed(w_in_p, store=store or _store(ff[1].weight)), b_in_p,
                       Packed(w_out_p, store=store or _store(ff[4].weight)), b_out, 0)
        b = _FF_BLOCKS
        w_in_p, b_in_p, w_out_p = padded(b, b * _NARROW)  # blocks no narrower than _NARROW
        w_in_blocks = _split(w_in_p, 2 * b, dim=1)
        if w_in_blocks is None:
            return cls(w_in, b_in, w_out, b_out, 1)
        return cls(w_in_blocks, b_in_p.view(2 * b, 1, -1), w_out_p.view(b, -1, w_out_p.shape[1]), b_out, b)

    def residual(self, x: Tensor) -> Tensor:
        """x + ff(x) for x (tokens, dim), the residual add folded into the output product."""
        if self.blocks == 0:  # the kernel: GEGLU applied while reading w_out's input
            return self.w_out(self.w_in(x, self.b_in, normalize=True), self.b_out, residual=x, geglu=True)
        return tiles.rows(self._torch_residual, x)

    def _torch_residual(self, x: Tensor) -> Tensor:
        b = self.blocks
        xn = _unit(x)
        if b == 1:
            h, gate = torch.addmm(self.b_in, xn, self.w_in).chunk(2, dim=-1)
            return torch.addmm(x + self.b_out, F.gelu(gate) * h, self.w_out)
        y = torch.baddbmm(self.b_in, xn.expand(2 * b, -1, -1), self.w_in)  # (2b, tokens, inner / b)
        act = F.gelu(y[b:]).mul_(y[:b])  # GEGLU block by block
        return (x + self.b_out).add_(torch.bmm(act, self.w_out).sum(0))


def rope_tables(rotary: torch.nn.Module, capacity: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(cos, sin) (capacity, d) for `rotate`, from the model's own rotary module, so positions match
    it bit for bit; rotate_half's sign is folded into sin."""
    pos = torch.arange(capacity, device=device, dtype=dtype)
    if any(b.dtype in (torch.bfloat16, torch.float16) and b.dtype != dtype for b in rotary.buffers()):
        # a half-precision model's module: its copy in the compute dtype (`compute_dtype`; the module
        # itself would compute positions in half precision, where 257 rounds to 256), called without
        # seq_len so that it skips its position cache: filled in float32 before a `.to(torch.bfloat16)`
        # rounded it, the cache would give tables shorter than it rounded values and longer ones exact
        # values, so that a verify pass's longer table could disagree with a plain step's
        freqs = copy.deepcopy(rotary).to(dtype)(pos)
    else:  # the module as the model's own forward calls it (its cache included)
        freqs = rotary(pos, seq_len=capacity)
    sign = torch.tensor([-1.0, 1.0], dtype=freqs.dtype, device=freqs.device).repeat(freqs.shape[-1] // 2)
    return freqs.cos(), freqs.sin() * sign


def rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """t * cos + rotate_half(t) * sin on `rope_tables`, rotate_half(x)[2i, 2i+1] = (-x[2i+1], x[2i])."""
    swapped = t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(t * cos, swapped, sin)
