"""The C++ kernels (`kernels.py`, `csrc/`): float32 on x86 CPUs with AVX2, every product packed and
heads in whole AVX2 vectors. A range of layers is one `kernels.Stack.run` call (each attention one
kernel: rotary, cache write, attention, layout); a draft phase or a run of plain steps is one
`kernels.decode_steps` call; padded tree rows run their products on the real tokens only. Where a call
does not fit (a head whose products are not on the kernel) the torch path below it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import kernels
from ..kernels import Packed
from ..masks import additive
from ..weights import _c
from .torch_eager import TorchEager

if TYPE_CHECKING:
    from ..cache import KVCache
    from ..decoder import Decoder, Encoded
    from ..sampling import SamplingConfig


def fits(dec: Decoder) -> bool:
    """Whether `dec`'s prepared weights run on the kernels: heads in whole AVX2 vectors, every product packed."""
    return dec.dim_head % 8 == 0 and all(
        isinstance(t, Packed) for w in dec._prepared for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in)
    )


class CpuKernels(TorchEager):
    name = "kernels"
    fused_plain = True

    def __init__(self, dec: Decoder) -> None:
        super().__init__(dec)
        flat = [
            t.panels if isinstance(t, Packed) else t
            for w in dec._prepared
            for t in (w.qkv, w.attn_out_t, w.cross_q_t, w.cross_out_t, w.ff.w_in, w.ff.b_in, w.ff.w_out, w.ff.b_out)
        ]
        self.stack = kernels.Stack(flat, dec.heads, dec.kv_heads, dec.dim_head)
        self._target_kernel: kernels.Head | None = None  # the target head for `kernels.decode_steps`
        # the token embeddings `kernels.decode_steps` reads, in the compute dtype once (a bf16 model's table
        # would otherwise be widened on every call)
        self._embedding = _c(dec.model.token_emb[dec.target_type].weight)

    def run_layers(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
        attn_mask: Tensor | None = None, positions: Tensor | None = None, real: Tensor | None = None,
    ) -> Tensor:
        """The layers in one `kernels.Stack.run` call; the products skip padding positions (`real`),
        which get zero K/V and zero outputs, as on torch's packed path."""
        rows, n, dim = x.shape
        keep = None
        if real is not None and not bool(real.all()):
            keep = real.reshape(-1).nonzero()[:, 0]
        dec = self.dec
        end = self._claim(n, start, positions, cache)
        table = dec._slot_table
        slots = table[start : start + n].expand(rows, n) if isinstance(start, int) else start[:, None] + table[:n]
        pos = slots if positions is None else positions.expand(rows, n)
        mask = None
        if attn_mask is not None:  # a caller's mask (trees, beams); None: causal by slot
            if attn_mask.dtype == torch.bool:
                attn_mask = additive(attn_mask, x.dtype)
            if attn_mask is not None:
                mask = attn_mask.reshape(-1, n, attn_mask.shape[-1])  # (1 or rows, n, keys)
                if mask.stride(-1) != 1:
                    mask = mask.contiguous()
        k_all, v_all = cache.buffers(end)
        x = self.stack.run(x.reshape(rows * n, dim), layers, *dec._rope, pos, slots, k_all, v_all, cache.table, mask,
                           end, enc.keys, enc.values, enc.cross_mask, enc.source, keep)
        for i in layers:
            dec.layer_evals[i] += rows * n if keep is None else keep.numel()
        return x.view(rows, n, dim)

    def beam_draft(
        self, x: Tensor, t: Tensor, score: Tensor, items: int, levels: int, width: int, temperature: float,
        eos: int | None, enc: Encoded, cache: KVCache, lengths: list[int], ready: Tensor | None = None,
        carried: Tensor | None = None, ready_count: int = 0,
    ) -> tuple[Tensor, ...] | None:
        """The draft and the verify pass in one kernel call (`kernels.beam_draft`): some 90 small tensor
        operations and a count read back per level in `spec_beam.draft` and `verify`, each costing ~10-20
        us beside passes that stream the weights, were about a tenth of a cycle at width 512. The verify
        pass's outputs (N, dim) by node and the target's log-probs by node (or None) come last."""
        dec = self.dec
        head = dec._draft_head()
        if levels < 1 or head.kernel is None or x.dtype != torch.float32:
            return None
        m = 1 + levels * width
        top = max(lengths)
        dec._rope_to(top + levels + 1, cache)
        k_all, v_all = cache.buffers(top + m)
        trunk, upper = range(dec.exit_layer), range(dec.exit_layer, dec.depth)
        target = self._target()
        # by reference, the call makes every row's tree slots its own (`KVCache.claim`)
        out = kernels.beam_draft(self.stack, head.kernel, self._embedding, x[:, 0].contiguous(), t, score.float(), items,
                                 levels, width, trunk, temperature, eos, *dec._rope, k_all, v_all, enc.keys, enc.values,
                                 enc.cross_mask, enc.source, upper, ready, cache.table, target, carried)
        for i in range(dec.depth):  # every node once in every layer, but ready roots above the trunk
            dec.layer_evals[i] += out[4].numel() - (ready_count if i >= dec.exit_layer else 0)
        return out

    def beam_steps(
        self, x: Tensor, t: int, limit: int, scores: Tensor, worst: Tensor, length: int, length_penalty: float,
        temperature: float, eos: int | None, enc: Encoded, cache: KVCache, ended: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """Beam steps in one kernel call (`kernels.beam_steps`): the head, log-softmax, ranking, slot
        table reorder and embedding of each step were ~2 ms of small operations beside a 14 ms layer pass
        at width 512 on a Zen 3, each slow right after the pass streamed every weight."""
        dec = self.dec
        target = self._target()
        if target is None or cache.table is None or enc.guided or x.dtype != torch.float32:
            return None
        dec._rope_to(min(t + limit + 1, cache.capacity), cache)
        k_all, v_all = cache.buffers(t + 1)
        steps, scores, x, pending = kernels.beam_steps(
            self.stack, target, self._embedding, x[:, 0].contiguous(), t, limit, scores, worst, length, length_penalty,
            temperature, eos, range(dec.depth), *dec._rope, k_all, v_all, cache.table, enc.keys, enc.values,
            enc.cross_mask, enc.source, ended)
        ran = steps.shape[0] + (pending is not None)
        cache.buffers(t + ran)  # what the call wrote: slots below t + ran
        for i in range(dec.depth):
            dec.layer_evals[i] += x.shape[0] * ran
        return steps, scores, x, pending

    def commit_beams(
        self, cache: KVCache, source: list[int], rows: list[int], src: list[int], dst: list[int], lengths: list[int],
        tokens: list[int], node: list[int], scores: list[float], logprobs: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None] | None:
        """The commit in one kernel call (`kernels.commit_beams`): some fifteen small tensor operations
        otherwise, each slow right after the draft's call streamed every weight (~0.4 ms a cycle at width
        512 on a Zen 3)."""
        if not (cache.k.is_contiguous() and cache.v.is_contiguous() and logprobs.dtype == torch.float32):
            return None
        t, x, score, ready, carried = kernels.commit_beams(
            cache.k, cache.v, cache.table, cache.high, source, rows, src, dst, lengths, tokens, node, scores,
            self._embedding, logprobs.contiguous())
        cache.crop(t)  # never changed in place: the next cycle's slots and the cache's lengths share it
        return t, x, score, ready, carried

    def plain_steps(
        self, x: Tensor, pos: Tensor, steps: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        """Up to `steps` steps in one kernel call, each drawn as the step-by-step loop draws it (the same
        filters, the same random numbers from `generator`), ending after a step in which some sequence
        picked EOS."""
        target = self._target()
        if target is None:
            return super().plain_steps(x, pos, steps, cfg, generator, enc, cache, cond_scale)
        out = self._steps(x, pos, range(self.dec.depth), target, steps, cfg, generator, enc, cache,
                          cond_scale=cond_scale, eos=self.dec.eos_id)
        return out[2], out[4][:, None]

    def _target(self) -> kernels.Head | None:
        """The target head in one kernel call (`Decoder.target_logits`'s product), where its weight is packed."""
        w = self.dec._target_weight()
        if self._target_kernel is None and isinstance(w, Packed):
            self._target_kernel = kernels.Head([], w)
        return self._target_kernel

    def verify(self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
               limit: Tensor | None = None) -> Tensor:
        """The target's pass, skipping the positions past each sequence's `limit` (`_verified`): the
        kernels' products are row-count invariant, so the others' logits are those of a pass over all."""
        real = self._verified(limit, x.shape[1], enc.guided)
        return self.dec.target_logits(self.run_layers(x, start, layers, enc, cache, real=real))

    def _verified(self, limit: Tensor | None, n: int, guided: bool) -> Tensor | None:
        """(rows, n) bool: the verify pass's positions a row reads, its pending token's and its proposed
        drafts' (0..limit); where a row stopped drafting early the positions past them are padding, which
        the products skip. None: every position (no limit)."""
        if limit is None:
            return None
        return self.dec.per_row(torch.arange(n, device=limit.device) <= limit[:, None], guided)

    def verify_accept(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache, drafts: Tensor,
        q: Tensor | None, limit: Tensor | None, cfg: SamplingConfig, generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The verify pass, then the target head, the accept rule, the read-back and the next input in one
        kernel call (`kernels.verify_accept`): on the shipped model those small operations took ~0.2 ms of a
        ~1.4 ms cycle. None where the kernel does not apply (guidance, a head not packed, other dtypes)."""
        target = self._target()
        if target is None or enc.guided or x.dtype != torch.float32 or (q is not None and q.dtype != torch.float32):
            return None
        real = self._verified(limit, drafts.shape[1] + 1, enc.guided)
        h = self.run_layers(x, start, layers, enc, cache, real=real)
        return kernels.verify_accept(target, self._embedding, h.view(-1, h.shape[-1]), drafts, q, limit, cfg.temperature,
                                     cfg.top_k, cfg.top_p, generator)

    def draft_phase(
        self, x: Tensor, pos: Tensor, gamma: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, *, confidence: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """The whole draft phase in one kernel call (one exponential race per step, drawn from `generator`
        as `sampling.draw` draws it), early draft stops, top-k/top-p and guidance included."""
        head = self.dec._draft_head()
        if head.kernel is None:
            return super().draft_phase(x, pos, gamma, cfg, generator, enc, cache, confidence=confidence,
                                       cond_scale=cond_scale)
        exits, q, drafts, limit, _ = self._steps(
            x, pos, range(self.dec.exit_layer), head.kernel, gamma, cfg, generator, enc, cache,
            cond_scale=cond_scale, confidence=confidence, tail=True)
        return exits, q, drafts, limit

    def _steps(
        self, x: Tensor, pos: Tensor, layers: range, head: kernels.Head, steps: int, cfg: SamplingConfig,
        generator: torch.Generator | None, enc: Encoded, cache: KVCache, *, cond_scale: float,
        confidence: float | None = None, eos: int | None = None, tail: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None, Tensor]:
        """`kernels.decode_steps` from each row's pending input x (rows, 1, dim) at pos (seqs,)."""
        dec = self.dec
        end = int(pos.max()) + steps + 1
        dec._rope_to(end, cache)
        if cache.table is not None:
            raise ValueError("decode steps need a cache by value")
        k_all, v_all = cache.buffers(end)
        out = kernels.decode_steps(
            self.stack, head, self._embedding, x[:, 0], layers, dec.per_row(pos, enc.guided), steps, cfg.temperature, generator,
            *dec._rope, k_all, v_all, enc.keys, enc.values, enc.cross_mask, top_k=cfg.top_k, top_p=cfg.top_p,
            guidance=cond_scale if enc.guided else 0.0, confidence=confidence, eos=eos, tail=tail, enc_rows=enc.source)
        taken = out[2].shape[1] + int(tail)  # tokens through the layers, per row
        if out[3] is not None and out[3].numel():  # draft stops: a sequence's rows ran up to its last draft's pass
            evals = (x.shape[0] // out[3].numel()) * int((out[3].clamp_max(taken - 1) + 1).sum())
        else:
            evals = x.shape[0] * taken
        for i in layers:
            dec.layer_evals[i] += evals
        return out
