"""Where a speculative beam cycle's time goes on the CPU, beside plain beam search in the same process.

Times beam search and speculative beam search on the same held-out sentences, interleaved, and splits
each speculative cycle into its phases (`spec_beam.draft`: on the kernels the one call that drafts the tree
and runs the verify pass's layers; `verify`: the target head; `replay`: the beam steps; `commit`, with the
cache's `reorder` and `move_slots` inside it), the rest of the loop and what each call costs outside it
(encoding, the weights' fingerprint, the cache's storage), all per cycle.

    .venv/bin/python tools/spec_beam_phases.py --widen 512 8 --sentences 6 --reps 2
    .venv/bin/python tools/spec_beam_phases.py --widen 512 8 --fresh-storage   # also: caches on fresh pages

--fresh-storage alternates every pass with caches on fresh storage (the `cache.BufferPool` of the CPU
backends bypassed), to measure what handing on finished caches' storage saves.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark import default_model, tool_parser  # noqa: E402

from tts_specdec import SpeculativeDecoder, cache, spec_beam  # noqa: E402

PHASES = ((spec_beam, "draft"), (spec_beam, "verify"), (spec_beam, "replay"), (spec_beam, "commit"),
          (cache.KVCache, "reorder"), (cache.KVCache, "move_slots"), (spec_beam, "spec_beam_search_loop"))


def main() -> None:
    p = tool_parser(__doc__)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--beam-gamma", type=int, default=1)
    p.add_argument("--draft-width", type=int, default=5)
    p.add_argument("--fresh-storage", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setup = default_model("cpu", sentences=args.sentences, widen=None if args.widen == [0] else args.widen)
    dec = SpeculativeDecoder(setup.model)
    seconds: dict[str, float] = defaultdict(float)
    on = [False]  # phases are timed during the speculative passes only

    def timed(owner, name: str) -> None:
        inner = getattr(owner, name)

        def run(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if on[0]:
                    seconds[name] += time.perf_counter() - start

        setattr(owner, name, run)

    for owner, name in PHASES:
        timed(owner, name)
    fitted = cache.BufferPool._fitted

    def fresh(self, shape, dtype, device, owner):
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def search(gamma: int) -> tuple[float, int]:
        start, cycles = time.perf_counter(), 0
        for source, max_length in zip(setup.sources, setup.max_lengths):
            out = dec.beam_search(source, beam_size=args.beam_size, gamma=gamma, draft_width=args.draft_width,
                                  max_length=max_length)
            cycles += out.stats.steps
        return time.perf_counter() - start, cycles

    search(0), search(args.beam_gamma)  # warm-up
    storages = (True, False) if args.fresh_storage else (True,)
    times: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for rep in range(args.reps):
        for pooled in storages:
            cache.BufferPool._fitted = fitted if pooled else fresh
            times[pooled, 0].append(search(0)[0])
            seconds.clear()
            on[0] = True
            spec, cycles = search(args.beam_gamma)
            on[0] = False
            times[pooled, args.beam_gamma].append(spec)
            per = {k: round(v * 1e3 / cycles, 3) for k, v in seconds.items()}
            per["calls"] = round((spec - seconds["spec_beam_search_loop"]) * 1e3 / cycles, 3)
            print(f"rep {rep}{'' if pooled else ' fresh storage'}: beam search {times[pooled, 0][-1]:.3f} s, "
                  f"speculative {spec:.3f} s ({times[pooled, 0][-1] / spec:.3f}x), {cycles} cycles; ms per cycle: {per}",
                  flush=True)
    cache.BufferPool._fitted = fitted
    for pooled in storages:
        beam, spec = (statistics.median(times[pooled, g]) for g in (0, args.beam_gamma))
        print(f"{'pooled' if pooled else 'fresh'} storage: beam search {beam:.3f} s, speculative beam search "
              f"{spec:.3f} s, {beam / spec:.3f}x (medians of {args.reps})")


if __name__ == "__main__":
    main()
