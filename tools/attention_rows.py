"""Microbenchmark of the CPU kernel's decode-time self-attention over a long cache: the K/V a step reads
grows with the position, and at a few hundred keys a step's attention reads as many bytes as its weights
(width 512: 64 KB of K and V per position and row, over its 16 layers). Times one step's self-attention over
16 layers (one `kernels.self_attention` call per layer, each layer's cache its own memory, as in a
decoder) for each row count and number of keys, rows and key counts interleaved within each repetition,
and prints the rate at which the K and V it attends over are read. `--queries N`: N queries a row, causal
by slot, as in a verify pass of N - 1 drafts (the K and V it reads: the keys' once, whatever N).

    .venv/bin/python tools/attention_rows.py [--threads 2] [--reps 9] [--queries 1] [--json benchmarks/attention_rows.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from benchmark import machine_info  # noqa: E402

from tts_specdec import kernels  # noqa: E402
from tts_specdec.speech.atomic import write_json  # noqa: E402

LAYERS, HEADS, D = 16, 8, 64  # the shipped model widened to 512 (`tts_specdec.widen`): 8 heads of 64
ROWS = (1, 4, 8)
KEYS = (128, 512, 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--queries", type=int, default=1, help="queries a row (a verify pass: drafts + 1)")
    p.add_argument("--json", type=Path, help="also write the medians here")
    args = p.parse_args()
    if args.queries < 1 or args.reps < 1:
        p.error("--queries and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    n = args.queries
    if not kernels.available():
        sys.exit(f"the kernels are not available: {kernels.unavailable_reason()}")
    capacity = max(KEYS) + n + 8
    cos = torch.randn(capacity, D)
    sin = torch.randn(capacity, D)
    caches = {rows: [(torch.randn(rows, HEADS, capacity, D), torch.randn(rows, HEADS, capacity, D)) for _ in range(LAYERS)]
              for rows in ROWS}
    heads = {rows: torch.randn(rows * n, 3 * HEADS * D) for rows in ROWS}
    times: dict[tuple[int, int], list[float]] = {(r, k): [] for r in ROWS for k in KEYS}

    def step(rows: int, keys: int) -> float:
        pos = (torch.arange(n) + keys - 1).repeat(rows, 1)  # the last query sees keys + n - 1
        start = time.perf_counter()
        for k, v in caches[rows]:
            kernels.self_attention(heads[rows], cos, sin, pos, pos, k, v, None, keys + n - 1, HEADS, HEADS)
        return time.perf_counter() - start

    for rows, keys in times:
        step(rows, keys)
    for _ in range(args.reps):
        for rows, keys in times:
            times[rows, keys].append(step(rows, keys))
    # (the attention kernel is AVX2 on every CPU: `kernels.isa` names the products' tiles, not it)
    print(f"{args.threads} threads, {LAYERS} layers x {HEADS} heads of {D}, {n} quer{'y' if n == 1 else 'ies'} a row, "
          f"median of {args.reps}")
    out = []
    for (rows, keys), t in times.items():
        median = statistics.median(t)
        read = 2 * LAYERS * rows * HEADS * keys * D * 4  # K and V attended over
        print(f"rows {rows}, keys {keys:5d}: {median * 1e3:6.2f} ms a step, K/V read at {read / median / 1e9:5.1f} GB/s")
        out.append({"rows": rows, "keys": keys, "ms": median * 1e3, "kv_gb_per_s": read / median / 1e9})
    if args.json:
        write_json(args.json, {"command": " ".join(["tools/attention_rows.py", *sys.argv[1:]]),
                               "machine": machine_info("cpu"), "threads": args.threads, "reps": args.reps, "queries": n, "results": out})


if __name__ == "__main__":
    main()
