"""Microbenchmark of the CPU kernel's many-row products on weights streamed from memory: the time of
an n-row product over 40 packed (512, 1536) matrices (126 MB, far beyond the L3 cache) relative to a
1-row one, row counts interleaved within each repetition. What a verify pass over n tokens costs in
products, next to a plain step (docs/performance.md).

It also times the same tiles on one 3 MB matrix that stays in the L3 cache (no memory stream), and prints
the floor their best rate there sets: an n-row streamed product takes at least the longer of a one-row
pass (the stream) and its arithmetic at that rate, however well the two overlap.

    .venv/bin/python tools/gemm_rows.py [--threads 2] [--isa avx2] [--store bfloat16] [--json benchmarks/gemm_rows.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tts_specdec import kernels
from tts_specdec.kernels import Packed
from tts_specdec.speech.atomic import write_json

ROWS = (1, 2, 4, 5, 6, 8, 9, 12, 16, 20, 24, 32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--isa", choices=["auto", "avx2", "avx512"], help="tiles to run (default: auto where the CPU has AVX-512)")
    p.add_argument("--store", choices=["float32", "bfloat16"], default="float32", help="the panels' dtype (a bf16 model's)")
    p.add_argument("--json", type=Path, help="also write the medians here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"the CPU kernels do not run here: {kernels.unavailable_reason()}")
    isa = kernels.isa(args.isa or "")
    mats = [Packed(torch.randn(512, 1536), store=getattr(torch, args.store)) for _ in range(40)]
    size = sum(m.panels.numel() * m.panels.element_size() for m in mats)
    xs = {rows: torch.randn(rows, 512) for rows in ROWS}
    times: dict[int, list[float]] = {rows: [] for rows in ROWS}
    for rep in range(args.reps + 1):
        for rows in ROWS:
            start = time.perf_counter()
            for m in mats:
                m(xs[rows])
            if rep:  # the first pass warms up
                times[rows].append(time.perf_counter() - start)
    median = {rows: statistics.median(t) for rows, t in times.items()}
    in_cache = _in_cache_gflops(args.store, args.reps)
    best = max(in_cache.values())
    m_size = mats[0].panels.element_size()  # bytes per weight
    print(f"{isa}, {args.store} panels, {args.threads} threads, weights {size / 1e6:.0f} MB, median of {args.reps}")
    own, floor = {}, {}  # the arithmetic alone at the tiles' in-cache rate for that row count, and at their best
    for rows in ROWS:
        t, flops = median[rows], 2 * rows * size / m_size
        own[rows] = flops / (in_cache[rows] * 1e9) / median[1]
        floor[rows] = max(1.0, flops / (best * 1e9) / median[1])
        print(f"rows {rows:2d}: {t * 1e3:6.2f} ms, weights read at {size / t / 1e9:5.1f} GB/s, "
              f"{flops / t / 1e9:5.1f} GFLOPS, {t / median[1]:.2f}x of one row; arithmetic alone at "
              f"{in_cache[rows]:5.1f} GFLOPS (in cache) {own[rows]:.2f}x, floor {floor[rows]:.2f}x")
    print(f"floor: the longer of the stream (one row) and the arithmetic at the tiles' best in-cache rate, {best:.1f} GFLOPS")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
        from benchmark import machine_info

        out = {"command": " ".join(["tools/gemm_rows.py", *sys.argv[1:]]), "machine": machine_info("cpu"), "isa": isa,
               "store": args.store,
               "threads": args.threads, "weights_mb": size / 1e6, "best_in_cache_gflops": best,
               "rows": {str(r): {"ms": median[r] * 1e3, "x_one_row": median[r] / median[1],
                                 "in_cache_gflops": in_cache[r], "arithmetic_x_one_row": own[r],
                                 "floor_x_one_row": floor[r]} for r in ROWS}}
        write_json(args.json, out)


def _in_cache_gflops(store: str, reps: int) -> dict[int, float]:
    """GFLOPS of the same tiles on one (512, 1536) matrix (3 MB as float32) that stays in the L3 cache:
    each row count's product repeated, so its weights never come from memory. The best of them is the
    rate the tiles' arithmetic reaches on this machine and thread count (few rows are bound by reading
    the cache instead)."""
    inp, out = 512, 1536
    mat = Packed(torch.randn(inp, out), store=getattr(torch, store))
    calls = 40
    rate: dict[int, float] = {}
    for rows in ROWS:
        x = torch.randn(rows, inp)
        mat(x)
        runs = []
        for _ in range(max(3, reps)):
            start = time.perf_counter()
            for _ in range(calls):
                mat(x)
            runs.append(time.perf_counter() - start)
        rate[rows] = 2 * rows * inp * out * calls / statistics.median(runs) / 1e9
    return rate


if __name__ == "__main__":
    main()
