"""Fixed tiles for torch's half-precision ops: a token's result must not depend on how many tokens share
the call (speculation's exactness rests on it, docs/design.md). torch's bfloat16 and float16 products and
attention pick their blocking by the call's shape, and a half-precision rounding turns a moved last bit
into a visible one: a verify pass over gamma + 1 tokens rounded differently from a one-token step. Here
every product sees its tokens in calls of exactly `ROWS` rows, and attention its queries in calls of
`ROWS` queries over keys padded (masked) to a multiple of `KEYS`; a tree pass's nodes gather the keys
they see first (`gathered_attention`). Every call then has a shape the number of tokens does not choose.
On torch's CPU ops in bfloat16 (2026-11-30) products kept the invariance at every row count and attention
broke it both ways (by the number of queries, and by an unpadded key count); the tiles were needed and
sufficed there. Half precision computes in its own dtype on a GPU (on the CPU it widens to float32,
`weights.compute_dtype`); what the tiles cost there is not measured: a call of n tokens makes
ceil(n / ROWS) calls. Float32 runs untiled: the C++ kernels keep the invariance by construction, torch's
float32 ops in every check so far."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS = 16  # tokens per product call and queries per attention call: one GPU MMA tile; a CPU step's rows fit
KEYS = 64  # attention's keys padded to a multiple of this (16 sufficed on the CPU; 64 is a GPU kernel block)
HALF = (torch.bfloat16, torch.float16)


Attend = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]


def _sdpa(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def on(dtype: torch.dtype) -> bool:
    """Whether ops computing in `dtype` run in tiles."""
    return dtype in HALF


def rows(f: Callable[..., Tensor], *xs: Tensor, dim: int = 0) -> Tensor:
    """f over the tokens of xs (each (tokens, ...)) in calls of exactly ROWS tokens (the last padded with
    zeros), the outputs joined along `dim` (where f puts the tokens) and the padding cut off; f(*xs) when
    xs are not half precision."""
    tokens = xs[0].shape[0]
    if not on(xs[0].dtype) or tokens == 0:
        return f(*xs)
    pad = -tokens % ROWS
    if pad:  # zero rows: a norm of zero gives zero, never NaN
        xs = tuple(F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) for x in xs)
    outs = [f(*(x[i : i + ROWS] for x in xs)) for i in range(0, tokens + pad, ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)
    return out.narrow(dim, 0, tokens) if pad else out


def attention(q: Tensor, keys: Tensor, values: Tensor, attn_mask: Tensor | None = None, op: Attend = _sdpa) -> Tensor:
    """`F.scaled_dot_product_attention(q, keys, values, attn_mask)` for q (rows, h, n, d) and an additive
    mask broadcastable to (rows, h, n, m), in tiles: the keys padded to a multiple of KEYS with zeros that
    the mask hides, the queries in calls of ROWS (padding queries see every key; their rows are dropped);
    the op itself when q is not half precision. `op(q, keys, values, mask)`: the attention to tile
    (`F.scaled_dot_product_attention` by default); a bool mask (True: attend) is made additive."""
    if not on(q.dtype):
        return op(q, keys, values, attn_mask)
    n, m = q.shape[-2], keys.shape[-2]
    if n == 0:
        return op(q, keys, values, attn_mask)
    mask = q.new_zeros(1, 1, n, m) if attn_mask is None else _additive(attn_mask, q.dtype)
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(-1, -1, n, m)
    key_pad, q_pad = -m % KEYS, -n % ROWS
    if key_pad:
        keys, values = F.pad(keys, (0, 0, 0, key_pad)), F.pad(values, (0, 0, 0, key_pad))
        mask = F.pad(mask, (0, key_pad), value=float("-inf"))
    if q_pad:
        q = F.pad(q, (0, 0, 0, q_pad))
        mask = F.pad(mask, (0, 0, 0, q_pad))
    out = [op(q[:, :, i : i + ROWS], keys, values, mask[:, :, i : i + ROWS])
           for i in range(0, n + q_pad, ROWS)]
    return torch.cat(out, dim=2)[:, :, :n] if len(out) > 1 or q_pad else out[0]


def gathered_attention(q: Tensor, keys: Tensor, values: Tensor, attn_mask: Tensor | None, op: Attend = _sdpa) -> Tensor:
    """`attention` where queries see scattered keys (a tree pass: a node sees its prefix and its
    ancestors, its siblings' slots lie between them): each query's visible keys are gathered first, in
    slot order, so they sit where a one-token step over the same prefix has them, and the sums meet them in
    the same lanes. attn_mask: additive or bool, broadcastable to (rows, 1, n, m) (the same for every head)."""
    if not on(q.dtype) or attn_mask is None:  # no mask: every key is seen, in slot order already
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
