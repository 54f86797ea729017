"""`make gpu-check`: the GPU runbook in one command (see docs/gpu.md, "make gpu-check").

1. the CUDA tests (`pytest -m cuda`: compile=True against the default path on the GPU);
2. recipes/benchmark.py on the GPU, with and without `--compile`, on the shipped model and on the
   shipped model widened function-preservingly to width 1024, 16 heads (`--widen 1024 16`);
3. one JSON, benchmarks/gpu_<device>.json, holding the four runs and the table this prints: each row's
   tokens/s eager and compiled, compiled / eager, and each speculative row's speedup over its plain
   baseline on both paths.

    python tools/gpu_check.py                 # what `make gpu-check` runs
    python tools/gpu_check.py --reps 3 --skip-tests --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT))

import benchmark  # noqa: E402

# the shipped model at batch 1 (its targets: compiled plain sampling >= 1,000 tokens/s, speculative
# sampling >= 2x plain, speculative beam search >= 1.5x beam search; docs/gpu.md), then the
# width-1024 model (memory-bound steps)
SETUPS = {
    "shipped": ["--model", "default", "--skip-auto"],
    "width1024": ["--model", "default", "--widen", "1024", "16", "--skip-upstream", "--skip-auto"],
}


def device_slug() -> str:
    name = torch.cuda.get_device_name(0)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_tests() -> int:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", str(ROOT / "tests")]
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def table(runs: dict) -> list[dict]:
    """One line per (setup, mode): tokens/s eager and compiled, their ratio, speedups over baselines."""
    lines = []
    for setup in SETUPS:
        eager = {r["mode"]: r for r in runs[setup]["eager"]["rows"]}
        compiled = {r["mode"]: r for r in runs[setup]["compiled"]["rows"]}
        for mode, e in eager.items():
            c = compiled.get(mode)
            line = {"setup": setup, "mode": mode, "eager_tokens_per_s": e["tokens_per_s"],
                    "eager_speedup": e.get("speedup"), "vs": e.get("vs")}
            if c is not None and not mode.startswith("spear-tts"):  # upstream rows: never compiled
                line.update(compiled_tokens_per_s=c["tokens_per_s"], compiled_speedup=c.get("speedup"),
                            compiled_over_eager=c["tokens_per_s"] / e["tokens_per_s"])
            lines.append(line)
    return lines


def print_table(lines: list[dict], device: str) -> None:
    def num(v, fmt):
        return format(v, fmt) if v is not None else ""

    print(f"\n{device}, batch 1 (tokens/s; speedup = over the row's plain baseline on the same path)")
    print(f"{'setup':10s} {'mode':48s} {'eager':>9s} {'speedup':>8s} {'compiled':>9s} {'speedup':>8s} {'c/e':>6s}")
    for ln in lines:
        print(f"{ln['setup']:10s} {ln['mode'][:48]:48s} {ln['eager_tokens_per_s']:9.1f} "
              f"{num(ln['eager_speedup'], '8.2f'):>8s} {num(ln.get('compiled_tokens_per_s'), '9.1f'):>9s} "
              f"{num(ln.get('compiled_speedup'), '8.2f'):>8s} {num(ln.get('compiled_over_eager'), '6.2f'):>6s}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--out", type=Path, help="default: benchmarks/gpu_<device>.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks" / f"gpu_{device_slug()}.json"
    tests_rc = None if args.skip_tests else run_tests()
    runs: dict = {}
    for setup, flags in SETUPS.items():
        runs[setup] = {}
        for path, extra in (("eager", []), ("compiled", ["--compile"])):
            argv_b = [*flags, "--device", "cuda", "--reps", str(args.reps), *extra]
            print(f"\n$ recipes/benchmark.py {' '.join(argv_b)}", flush=True)
            start = time.perf_counter()
            runs[setup][path] = benchmark.main(argv_b)
            runs[setup][path]["seconds"] = time.perf_counter() - start
    lines = table(runs)
    print_table(lines, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "torch": torch.__version__, "pytest_cuda_rc": tests_rc,
                               "table": lines, "runs": runs}, indent=2))
    print(f"\nwrote {out}")
    return 1 if tests_rc else 0


if __name__ == "__main__":
    sys.exit(main())
