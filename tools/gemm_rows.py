"""Microbenchmark of the CPU kernel's few-row products on weights streamed from memory: the time of an
n-row product over 40 packed (512, 1536) matrices (126 MB, far beyond the L3 cache) relative to a 1-row
one. What a verify pass over n tokens costs in products, next to a plain step (docs/performance.md).

    .venv/bin/python tools/gemm_rows.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tts_specdec import kernels
from tts_specdec.kernels import Packed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"the CPU kernels do not run here: {kernels.unavailable_reason()}")
    mats = [Packed(torch.randn(512, 1536)) for _ in range(40)]
    size = sum(m.panels.numel() * 4 for m in mats)
    base = None
    for rows in (1, 2, 4, 5, 6, 8, 9, 12):
        x = torch.randn(rows, 512)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for m in mats:
                m(x)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        base = base or t
        print(f"rows {rows:2d}: {t * 1e3:6.2f} ms, weights read at {size / t / 1e9:5.1f} GB/s, {t / base:.2f}x of one row")


if __name__ == "__main__":
    main()
