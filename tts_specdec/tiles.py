"""Fixed tiles for torch's ops: a token's result must not depend on how many tokens share the call
(speculation's exactness rests on it, docs/design.md). torch's products and attention pick their kernels
and blocking by the call's shape: a verify pass over gamma + 1 tokens then sums a token's terms in
another order than a one-token step, and a near-tie breaks differently. Here every product sees its
tokens in calls of exactly `ROWS` rows, and attention its queries in calls of `ROWS` queries over keys
padded (masked) to a multiple of `KEYS`; a tree pass's nodes gather the keys they see first
(`gathered_attention`). Every call then has a shape the number of tokens does not choose.
On torch's CPU ops in bfloat16 (2026-11-30) products kept the invariance at every row count and attention
broke it both ways (by the number of queries, and by an unpadded key count). In float32 (AMD EPYC Zen 4,
torch 2.11, 2026-12-01) both broke it: a product's row took other bits in calls of 4 rows or more than in
calls of 1-3 (at 2 threads at other counts as well), and attention's query by the number of queries and
keys; in tiles every row and query kept its bits at every count (tests/test_tiles.py). The C++ kernels'
products and attention keep the invariance by construction; the source encoder's attention runs here on
every path. Float32 is tiled on the CPU only (`on`). Float32 attention in tiles is written out
(`_chunked`: keys padded to a multiple of KEYS, where torch's own op needed 512). What the tiles cost: on torch's CPU ops
a step computes `ROWS` rows where it had one (shipped model, batch 1, greedy: plain decoding and
gamma 4 0.4-0.55x of untiled, torch's path padding a pass's tokens and masks once: `prepare`);
on a GPU (half precision) not measured: a call of n tokens makes ceil(n / ROWS) calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS = 16  # tokens per product call and queries per attention call: one GPU MMA tile; a CPU step's rows fit
# attention's keys padded to a multiple of this (16 sufficed on the CPU; 64 is a GPU kernel block), and the
# chunks `_chunked` sums the values in
KEYS = 64
HALF = (torch.bfloat16, torch.float16)


def on(t: Tensor) -> bool:
    """Whether ops on `t` run in tiles: half precision on every device, float32 and float64 on the CPU,
    where torch's own ops were measured to break the invariance. A GPU's float32 runs untiled as before
    (on an H100 every speculative mode matched its plain mode untiled, 20 sentences): not measured tiled."""
    return t.dtype in HALF or t.device.type == "cpu"


Attend = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]


def _sdpa(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _chunked(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention written out, for keys padded to a multiple of KEYS: the values are summed chunk
    by chunk of KEYS keys (one batched product, then the chunks added in order), so every product has one
    shape whatever the key count and the padding's chunks add exact zeros last. torch's own op sums a
    float32 query's keys in blocks of 512 (the CPU flash kernel's split): with keys padded to multiples of
    64, 128 or 256 a query of a verify pass whose keys ran past 512 took other bits than its one-query
    step (8 of ~1,600 queries), so it needed keys padded to a multiple of 512; this one reads 64 (AMD
    EPYC Zen 4, torch 2.11: a source of 40 tokens and a decoder step's self-attention over a short
    prefix read 8-12 times fewer keys; past ~512 keys it costs up to ~2x torch's op)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    p = scores.softmax(dim=-1)
    *lead, n, m = p.shape
    chunks = m // KEYS
    parts = torch.matmul(p.view(*lead, n, chunks, KEYS).transpose(-3, -2),
                         values.reshape(*values.shape[:-2], chunks, KEYS, values.shape[-1]))  # (.., chunks, n, d)
    out = parts[..., 0, :, :]
    for c in range(1, chunks):
        out = out + parts[..., c, :, :]
    return out


def default_op(q: Tensor) -> Attend:
    """The attention `attention` runs for queries like q when the caller names none: torch's own op in half
    precision and untiled, the chunked one (`_chunked`) for float32 and float64 in tiles (the CPU)."""
    return _chunked if on(q) and q.dtype not in HALF else _sdpa


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def rows(f: Callable[..., Tensor], *xs: Tensor, dim: int = 0) -> Tensor:
    """f over the tokens of xs (each (tokens, ...)) in calls of exactly ROWS tokens (the last padded with
    zeros), the outputs joined along `dim` (where f puts the tokens) and the padding cut off; f(*xs)
    where they are not tiled (`on`)."""
    tokens = xs[0].shape[0]
    if tokens == 0 or not on(xs[0]):
        return f(*xs)
    pad = -tokens % ROWS
    if pad:  # zero rows: a norm of zero gives zero, never NaN
        xs = tuple(F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) for x in xs)
    outs = [f(*(x[i : i + ROWS] for x in xs)) for i in range(0, tokens + pad, ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)
    return out.narrow(dim, 0, tokens) if pad else out


@dataclass(frozen=True)
class Mask:
    """An additive mask as `attention` pads it: (1 or rows, 1 or heads, queries + their padding, keys +
    theirs), the padding keys hidden. Made once (`prepare`) for the layers of a pass that share a mask,
    instead of once in every layer's call."""

    padded: Tensor


def key_multiple(q: Tensor) -> int:
    """The multiple `attention` pads keys to for queries like q (1 where q is not tiled)."""
    return KEYS if on(q) else 1


def prepare(q: Tensor, n: int, m: int, attn_mask: Tensor | None) -> "Tensor | Mask | None":
    """What `attention` takes as the mask for `n` queries like q's (its dtype and device) over `m` keys:
    `attn_mask` (additive or bool, broadcastable to (rows, h, n, m)) padded once where q's dtype and
    device run in tiles, else `attn_mask` itself."""
    if n == 0 or not on(q):
        return attn_mask
    mask = q.new_zeros(1, 1, n, m) if attn_mask is None else _additive(attn_mask, q.dtype)
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(-1, -1, n, m)
    key_pad, q_pad = -m % key_multiple(q), -n % ROWS
    if key_pad:
        mask = F.pad(mask, (0, key_pad), value=float("-inf"))
    if q_pad:  # padding queries see every key; their rows are dropped
        mask = F.pad(mask, (0, 0, 0, q_pad))
    return Mask(mask)


def attention(q: Tensor, keys: Tensor, values: Tensor, attn_mask: "Tensor | Mask | None" = None,
              op: Attend | None = None) -> Tensor:
    """`F.scaled_dot_product_attention(q, keys, values, attn_mask)` for q (rows, h, n, d) and an additive
    mask broadcastable to (rows, h, n, m), in tiles: the keys padded to a multiple of KEYS with zeros that
    the mask hides, the queries in calls of ROWS (padding queries see every key; their rows are dropped);
    the op itself where q is not tiled (`on`). `op(q, keys, values, mask)`: the attention to tile
    (default: `default_op`), which must sum a query's keys in an order their count does not choose
    (torch's own op does not in float32: `_chunked`); a bool mask (True: attend) is made additive. A
    `Mask` from `prepare` is taken as it is, its keys padded to its width if they are not already."""
    n, m = q.shape[-2], keys.shape[-2]
    op = op or default_op(q)
    if n == 0 or not on(q):
        return op(q, keys, values, attn_mask)
    mask = attn_mask.padded if isinstance(attn_mask, Mask) else prepare(q, n, m, attn_mask).padded
    key_pad, q_pad = mask.shape[-1] - m, -n % ROWS
    if key_pad:
        keys, values = F.pad(keys, (0, 0, 0, key_pad)), F.pad(values, (0, 0, 0, key_pad))
    if q_pad:
        q = F.pad(q, (0, 0, 0, q_pad))
    out = [op(q[:, :, i : i + ROWS], keys, values, mask[:, :, i : i + ROWS])
           for i in range(0, n + q_pad, ROWS)]
    return torch.cat(out, dim=2)[:, :, :n] if len(out) > 1 or q_pad else out[0]


def gathered_attention(q: Tensor, keys: Tensor, values: Tensor, attn_mask: Tensor | None, op: Attend | None = None) -> Tensor:
    """`attention` where queries see scattered keys (a tree pass: a node sees its prefix and its
    ancestors, its siblings' slots lie between them): each query's visible keys are gathered first, in
    slot order, so they sit where a one-token step over the same prefix has them, and the sums meet them in
    the same lanes. attn_mask: additive or bool, broadcastable to (rows, 1, n, m) (the same for every head)."""
    if not on(q) or attn_mask is None:  # no mask: every key is seen, in slot order already
        return attention(q, keys, values, attn_mask, op)
    rows_, h, n, d = q.shape
    m = keys.shape[-2]
    seen = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
    seen = seen.reshape((1,) * (4 - seen.dim()) + tuple(seen.shape)).expand(rows_, -1, n, m)[:, 0]  # (rows, n, m)
    order = torch.sort((~seen).to(torch.uint8), dim=-1, stable=True).indices  # visible keys first, in slot order
    index = order[:, None, :, :, None].expand(rows_, h, n, m, d)

    def per_query(t: Tensor) -> Tensor:  # (rows, h, m, d) -> each query's keys, (rows * n, h, m, d)
        return t[:, :, None].expand(rows_, h, n, m, d).gather(3, index).transpose(1, 2).reshape(rows_ * n, h, m, d)

    visible = torch.arange(m, device=q.device) < seen.sum(-1).reshape(rows_ * n, 1, 1, 1)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out = attention(q.transpose(1, 2).reshape(rows_ * n, h, 1, d), per_query(keys), per_query(values), mask, op)
    return out.reshape(rows_, n, h, d).transpose(1, 2)
