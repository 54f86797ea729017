"""How steady gamma="auto"'s cost model is when other processes load the machine while it is measured.

`measure.measure_sampling` times every cycle shape several times, round robin, and takes each timing at
its fastest repetition (`measure.fastest`). This tool measures the cost model `--reps` times that way and
`--reps` times with each timing's median instead, alternated in one process, first on the quiet machine,
then while `--busy` processes each spin for 20-300 ms and sleep for 20-500 ms at random (a test suite or
another job beside a decoder's first call), or spin throughout (`--steady`). It prints c, v(5), v(11),
the plain step, and the gamma the model picks at acceptance 0.8 / 0.9 / 1 (`auto.choose_gamma`; at 1:
the longest auto drafts with stops).

    .venv/bin/python tools/cost_model_load.py --widen 512 8 --reps 4 [--busy 2] [--steady] [--json F]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from tts_specdec import SpeculativeDecoder, measure  # noqa: E402
from tts_specdec.auto import MAX_GAMMA, CostModel, choose_gamma  # noqa: E402
from tts_specdec.speech.atomic import write_json  # noqa: E402

BUSY = """
import random, time
while True:
    start, on = time.perf_counter(), random.uniform(0.02, 0.3)
    while time.perf_counter() - start < on:
        pass
    time.sleep(random.uniform(0.02, 0.5))
"""
STEADY = """
while True:
    pass
"""
STATS = {"fastest": measure.fastest, "median": statistics.median}  # the library's, and medians for comparison


def summary(costs: CostModel) -> dict:
    return {"c": round(costs.c, 3), "v5": round(costs.v[4], 3), "v11": round(costs.v[10], 3),
            "step_ms": round(costs.t_step * 1e3, 3),
            **{f"gamma_at_{a}": choose_gamma(costs.c, costs.v, a, MAX_GAMMA) for a in (0.8, 0.9, 1.0)}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widen", type=int, nargs="+", default=[512, 8], metavar="N",
                   help="DIM HEADS [DEPTH]; 0: shipped size")
    p.add_argument("--reps", type=int, default=4, help="measurements per statistic and load")
    p.add_argument("--busy", type=int, default=2, help="busy processes while loaded (0: quiet only)")
    p.add_argument("--steady", action="store_true", help="the busy processes spin throughout, not in bursts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.reps < 1 or args.busy < 0:
        p.error("--reps must be >= 1 and --busy >= 0")
    from benchmark import default_model, machine_info

    torch.set_num_threads(args.threads)
    setup = default_model("cpu", widen=None if args.widen == [0] else args.widen)
    dec = SpeculativeDecoder(setup.model)
    dec.sample(setup.sources[0], gamma=0, max_length=8)  # warm-up: weights packed, kernels loaded
    kept = measure.fastest
    out: dict[str, list[dict]] = {}
    loads = ("quiet", "loaded") if args.busy else ("quiet",)
    try:
        for load in loads:
            busy = [subprocess.Popen([sys.executable, "-c", STEADY if args.steady else BUSY])
                    for _ in range(args.busy if load == "loaded" else 0)]
            try:
                for _ in range(args.reps):
                    for name, stat in STATS.items():
                        measure.fastest = stat
                        dec.costs = measure.Costs()  # nothing kept: `cost_model` measures afresh
                        out.setdefault(f"{load}, {name}", []).append(summary(dec.cost_model()))
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
    finally:
        measure.fastest = kept
    print(setup.description)
    for key, rows in out.items():
        print(key)
        for row in rows:
            print("   ", "  ".join(f"{k} {v}" for k, v in row.items()))
    report = {"command": " ".join(["tools/cost_model_load.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_info("cpu"), "model": setup.description, "threads": args.threads, "busy": args.busy,
              "pattern": "steady" if args.steady else "bursts",
              "measurements": out}
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
