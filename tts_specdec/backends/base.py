"""The backend interface: how a `Decoder`'s layers and heads are executed.

The search loops call these verbs and never ask which backend they are on. Each backend is one file:
`torch_eager.py` (torch's ops, any device and dtype; the reference), `kernels_cpu.py` (the C++ kernels
of `csrc/`, float32 on x86 CPUs), `static_compiled.py` (static shapes for `torch.compile` and CUDA graphs).
`select` in `__init__.py` picks one per set of prepared weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..cache import BufferPool, KVCache
from ..sampling import Draws

if TYPE_CHECKING:
    from ..decoder import Decoder, Encoded
    from ..sampling import SamplingConfig


class Backend:
    """Runs `dec`'s decoder layers against a `KVCache`. Shapes: x (rows, n, dim) inputs; pos (seqs,)
    each sequence's slot (guided: rows are (cond, null) pairs, one pair per sequence)."""

    name = "base"
    # plain_steps takes several steps per call (auto times those runs instead of one-step cycles)
    fused_plain = False
    # beam search may keep its cache by reference (`KVCache` slot tables), which run_layers reads
    by_reference = True
    # speculative beam search pads its tree passes to sizes fixed per cycle shape (a level: the draft
    # width; verify: the whole tree) with masks over the cache's capacity, instead of cutting them to the
    # nodes present (which reads counts back from the device): a graph per shape, not per tree
    static_shapes = False

    def __init__(self, dec: Decoder) -> None:
        self.dec = dec
        # storage of finished caches for the next ones (on the CPU: fresh pages cost their faults)
        self._storage = BufferPool(2, fit=True)

    def run_layers(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
        attn_mask: Tensor | None = None, positions: Tensor | None = None, real: Tensor | None = None,
    ) -> Tensor:
        """`layers` on x placed at cache slots start..start+n-1 of each row; see `Decoder.run`."""
        raise NotImplementedError

    def new_cache(self, rows: int, capacity: int, by_reference: bool = False) -> KVCache:
        """An empty cache for the decoder's layers (`capacity` already rounded by `capacity`)."""
        dec = self.dec
        return KVCache(dec.depth, rows, dec.kv_heads, dec.dim_head, capacity, dtype=dec.dtype, device=dec.device,
                       by_reference=by_reference, pool=self._storage if dec.device.type == "cpu" else None)

    @staticmethod
    def capacity(n: int) -> int:
        """The capacity a new cache for n positions gets (a backend of static shapes rounds it up)."""
        return n

    def _claim(self, n: int, start: int | Tensor, positions: Tensor | None, cache: KVCache) -> int:
        """Before writing slots start..start+n-1: rotary tables that cover them (and `positions`), the
        slots claimed in a cache by reference; returns one past the furthest slot."""
        end = (start if isinstance(start, int) else int(start.max())) + n
        rope_end = end if positions is None else max(end, int(positions.max()) + 1)
        self.dec._rope_to(rope_end, cache)
        cache.claim(start, n)
        return end

    def verify(self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache,
               limit: Tensor | None = None) -> Tensor:
        """The target's pass over `layers` (the ones above the exit, or all) on x, causal by slot:
        the target's logits (rows, n, V), guidance not mixed. limit (seqs,) or None: the drafts each
        sequence proposed; its logits past position limit are not read. Every position is computed here:
        skipping the others changes the row count of the products, which only a backend whose products are
        row-count invariant may do (`CpuKernels`; torch's float32 CPU products are not, docs/design.md)."""
        return self.dec.target_logits(self.run_layers(x, start, layers, enc, cache))

    def verify_accept(
        self, x: Tensor, start: int | Tensor, layers: range, enc: Encoded, cache: KVCache, drafts: Tensor,
        q: Tensor | None, limit: Tensor | None, cfg: SamplingConfig, generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """An unguided speculative sampling cycle from its verify pass on: `verify`, the accept rule, the
        read-back, the next input and each row's advance of `speculative._cycles`, in one call where a
        backend has it (the same numbers as those steps); None: take the steps one by one."""
        return None

    def draft_phase(
        self, x: Tensor, pos: Tensor, gamma: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, *, confidence: float | None = None, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """The draft phase of a speculative sampling cycle from each row's pending input x (rows, 1, dim).

        Each draft token is the exit head's argmax (greedy) or drawn from its `cfg`-filtered
        distribution with `sampling.draw` (guided: logits mixed with `cond_scale` by `sampling.cfg_mix`);
        `confidence`: a sequence stops drafting after a token its draft gave less than this probability.
        Returns the exit states of the pending input and the drafts (rows, steps + 1, dim), the draft
        distributions (seqs, steps, V) (None when greedy), the drafts (seqs, steps), `finite.NONFINITE` at
        a draft picked from logits that were not all finite, and each sequence's proposed count (None
        without confidence). Past a sequence's proposed drafts (and its last draft's exit state) nothing is
        read, so nothing there is defined: the kernels leave zeros, the step-by-step reference computes on."""
        raise NotImplementedError

    def beam_draft(
        self, x: Tensor, t: Tensor, score: Tensor, items: int, levels: int, width: int, temperature: float,
        eos: int | None, enc: Encoded, cache: KVCache, lengths: list[int], ready: Tensor | None = None,
        carried: Tensor | None = None, ready_count: int = 0,
    ) -> tuple[Tensor, ...] | None:
        """A speculative beam cycle's whole draft and verify pass in one call, where the backend has one
        (unguided): the exit head's beam search for `levels` levels of `width` nodes per item from the roots
        x (R, 1, dim) at slots t (R,) with scores `score` (R,), R = items x beams, every node kept, then the
        layers above the exit over every node but the `ready` roots (R,) bool, whose K/V at slot t it leaves
        as they are, and whose log-probs are their rows of `carried` (`kernels.beam_draft` says what it
        returns). `lengths` (the items' lengths) and `ready_count` (ready's True count) are what t and
        ready hold, as the caller has them on the host. None: `spec_beam.draft` builds the tree level by level and `spec_beam.verify`
        passes over it instead."""
        return None

    def beam_steps(
        self, x: Tensor, t: int, limit: int, scores: Tensor, worst: Tensor, length: int, length_penalty: float,
        temperature: float, eos: int | None, enc: Encoded, cache: KVCache, ended: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """Plain beam search's steps in one call, where the backend has one (unguided, a cache by
        reference): from each row's input x (R, 1, dim) at slot t, every step that needs no decision
        (`kernels.beam_steps` says which, and what it returns; `ended`: spear-tts's semantics), up to but
        not including step `limit`. None: `beam.beam_search_loop` steps through `verify` and `beam_step`."""
        return None

    def commit_beams(
        self, cache: KVCache, source: list[int], rows: list[int], src: list[int], dst: list[int], lengths: list[int],
        tokens: list[int], node: list[int], scores: list[float], logprobs: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None] | None:
        """A speculative beam cycle's commit in one call, where the backend has one (unguided, no item
        finished): the cache's rows become `source`, each new row's accepted path moves from slots src to dst
        and its length becomes its item's (`lengths`); returns the next cycle's slots t, inputs x, scores by
        row and ready, carried (`kernels.commit_beams`). None: `spec_beam.commit` does it with the cache's
        verbs."""
        return None

    def run_cycle(
        self, cycle: Callable[[Tensor, Tensor, Encoded], tuple[Tensor, ...]], key: tuple, x: Tensor, pos: Tensor,
        enc: Encoded, cache: KVCache, generator: torch.Generator | None,
    ) -> tuple[Tensor, ...]:
        """cycle(x, pos, enc): a speculative sampling cycle's device part (draft phase, verify pass,
        acceptance), which asks `draws(generator)` for its random numbers. A backend may run it as it
        pleases with the same result: on CUDA the compiled path records it as one CUDA graph per `key`
        (its settings; shapes and addresses are the backend's to add)."""
        return cycle(x, pos, enc)

    def records(self, device: torch.device) -> bool:
        """Whether `run_cycle` records cycles (what a replayed cycle cannot do: time its draft phase apart)."""
        return False

    def draws(self, generator: torch.Generator | None) -> Draws:
        """Where the random numbers of the pass being built come from (`sampling.Draws`)."""
        return Draws(generator)

    def plain_steps(
        self, x: Tensor, pos: Tensor, steps: int, cfg: SamplingConfig, generator: torch.Generator | None,
        enc: Encoded, cache: KVCache, cond_scale: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        """1 to `steps` plain decoding steps (all layers, target head, pick) from each row's pending input
        x (rows, 1, dim): each token the target's argmax (greedy) or drawn with `sampling.draw` from its
        filtered distribution. A backend may stop after a step in which some sequence picked EOS, or run
        past it (the caller discards what follows an EOS). Returns the tokens (seqs, steps taken),
        `finite.NONFINITE` at a step whose logits were not all finite (the backend may stop after it), and
        the next pending input (rows, 1, dim)."""
        raise NotImplementedError
