"""Torch's ops on the prepared weights (`weights.py`: plain, column-blocked or packed products): any
device and dtype, one op at a time. The reference the other backends are tested against, and what runs
where they do not (no kernels, another dtype or device, `TTS_SPECDEC_KERNELS=0`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tiles
from ..finite import marked
from ..masks import additive
from ..sampling import cfg_mix, draw, probabilities
from ..weights import _normed_mm, _residual, _unit, rotate
from .base import Backend

if TYPE_CHECKING:
    from ..cache import KVCache
    from ..decoder import Encoded
    from ..sampling import SamplingConfig


# Packing padded rows (`run_layers(..., real=)`) adds a handful of small kernels per layer and saves
# the padding tokens' products: worth it only when those are real work (it pays on a speculative beam
# tree's verify pass at dim 256 and loses at dim 128). Threshold on padding tokens x one layer's weight
# elements.
_PACK_MIN_WORK = 1 << 22


class TorchEager(Backend):
    name = "torch"

    def run_layers(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
        attn_mask: Tensor | None = None, positions: Tensor | None = None, real: Tensor | None = None,
    ) -> Tensor:
        dec = self.dec
        rows, n = x.shape[:2]
        end = self._claim(n, start, positions, cache)
        cos_t, sin_t = dec._rope
        weights = dec._weights()
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
            attn_mask = additive(attn_mask, x.dtype)
        h_, d, kvh = dec.heads, dec.dim_head, dec.kv_heads
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
        # in tiles (`tiles.on`) the tokens are padded once to whole tiles for every product of the pass
        # (zero rows: their norms give zero), and each attention's mask and the source's keys once for
        # every layer, instead of in every call
        padding = -tokens % tiles.ROWS if tiles.on(x) else 0
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        enc_keys, enc_values = enc.dense(tiles.key_multiple(x))
        cross_mask = tiles.prepare(x, n, enc.keys.shape[-2], enc.mask)
        # a tree's nodes (explicit positions) see scattered slots: each gathers its own (`tiles`)
        attend = tiles.attention if positions is None else tiles.gathered_attention
        self_mask = attn_mask if positions is not None else tiles.prepare(x, n, end, attn_mask)
        for i in layers:
            w = weights[i]
            # causal self-attention over the row's cache; q and k rotated together
            if isinstance(w.qkv, Tensor) and w.qkv.dim() == 3:  # heads first: (q + k + v heads, tokens, d)
                heads = tiles.rows(lambda t: torch.bmm(_unit(t).expand(w.qkv.shape[0], -1, -1), w.qkv), x, dim=1)
                heads = heads[:, :tokens]
            else:
                heads = _normed_mm(x, w.qkv)[:tokens].view(tokens, -1, d).transpose(0, 1)
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
            a = self._unpad(attend(q, keys, values, self_mask), keep, padding)
            x = _residual(x, a, w.attn_out_t)
            # cross-attention over the precomputed source K/V
            if isinstance(w.cross_q_t, Tensor) and w.cross_q_t.dim() == 3:  # per head: (heads, tokens, d)
                q = tiles.rows(lambda t: torch.bmm(_unit(t).expand(h_, -1, -1), w.cross_q_t), x, dim=1)[:, :tokens]
                if keep is not None:
                    q = q_pad.view(h_, rows * n, d).index_copy_(1, keep, q)
                q = q.view(h_, rows, n, d).transpose(0, 1)
            else:
                q = _normed_mm(x, w.cross_q_t)[:tokens]
                if keep is not None:
                    q = q_pad.index_copy_(0, keep, q)
                q = q.view(rows, n, -1, d).transpose(1, 2)
            a = self._unpad(tiles.attention(q, enc_keys[i], enc_values[i], cross_mask), keep, padding)
            x = _residual(x, a, w.cross_out_t)
            # feed-forward: RMSNorm, Linear, GEGLU, Linear
            x = w.ff.residual(x)
            dec.layer_evals[i] += tokens
        x = x[:tokens]
        if keep is not None:
            x = x.new_zeros(rows * n, dim).index_copy_(0, keep, x)
        return x.view(rows, n, dim)

    def _packs(self, rows: int, n: int, real: Tensor) -> bool:
        """Whether `run_layers` computes only the real tokens of padded rows (see `_PACK_MIN_WORK`)."""
        padding = rows * n - int(real.sum())
        return bool(padding) and padding * self.dec._layer_elements() >= _PACK_MIN_WORK

    @staticmethod
    def _packed_rope(cos: Tensor, sin: Tensor, rows: int, n: int, keep: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin of the padded layout ((n, d) or (rows, n, d)) -> one row per kept token, (tokens, d)."""
        shape = (rows, n, cos.shape[-1])
        return (cos.expand(shape).reshape(rows * n, -1).index_select(0, keep),
                sin.expand(shape).reshape(rows * n, -1).index_select(0, keep))

    @staticmethod
    def _unpad(a: Tensor, keep: Tensor | None, padding: int) -> Tensor:
        """Attention output (rows, heads, n, d) -> (tokens + padding, heads * d), real tokens only when
        packed, then `padding` zero rows (the pass's tiles)."""
        rows, _, n, _ = a.shape
        a = a.transpose(1, 2).reshape(rows * n, -1)
        a = a if keep is None else a.index_select(0, keep)
        return F.pad(a, (0, 0, 0, padding)) if padding else a

    def draft_phase(
        self, x: Tensor, pos: Tensor, gamma: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, *, confidence: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """Step by step: the layers below the exit and the exit head once per draft (the reference the
        fused draft phases are tested against)."""
        dec = self.dec
        start, trunk = dec.start_of(pos, enc.guided), range(dec.exit_layer)
        exits, q, drafts = [], [], []
        # the stopping rule runs on the host: one copy per step instead of ~7 small ops (a GPU's pace here);
        # the step already waited for the device to know whether any row still drafts. A row drafts while
        # its limit is gamma, as in the C++ draft (one stopping at the last draft ends the loop anyway).
        limit = None if confidence is None else [gamma] * len(pos)
        for d in range(gamma):
            h = self.run_layers(x, start + d, trunk, enc, cache)
            exits.append(h)
            draft_logits = dec.draft_logits(h[:, -1])
            if enc.guided:
                draft_logits = cfg_mix(draft_logits, cond_scale)
            if cfg.greedy:
                token = draft_logits.argmax(dim=-1)
            else:
                q.append(probabilities(draft_logits, cfg))
                token = draw(q[-1], generator)
            drafts.append(marked(draft_logits, token))
            x = dec.embed(token[:, None], enc.guided)
            if limit is not None:
                q_x = draft_logits.softmax(-1).amax(-1) if cfg.greedy else q[-1].gather(-1, token[:, None])[:, 0]
                for r, prob in enumerate(q_x.tolist()):  # exact values against the float, as the C++ draft
                    if limit[r] == gamma and prob < confidence:
                        limit[r] = d + 1
                if gamma not in limit:
                    break
        exits.append(self.run_layers(x, start + len(drafts), trunk, enc, cache))
        q_t = torch.stack(q, dim=1) if q else None
        limit_t = None if limit is None else torch.tensor(limit, device=pos.device)
        return torch.cat(exits, dim=1), q_t, torch.stack(drafts, dim=1), limit_t

    def plain_steps(
        self, x: Tensor, pos: Tensor, steps: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        """One step: every layer, the target head, the pick."""
        dec = self.dec
        logits = self.verify(x, dec.start_of(pos, enc.guided), range(dec.depth), enc, cache)
        if enc.guided:
            logits = cfg_mix(logits, cond_scale)
        p0 = logits[:, 0]
        token = p0.argmax(dim=-1) if cfg.greedy else draw(probabilities(p0, cfg), generator)
        return marked(p0, token)[:, None], dec.embed(token[:, None], enc.guided)
