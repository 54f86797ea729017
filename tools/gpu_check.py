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
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
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


def run_tests(timeout: float | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-o", "addopts=", "-v", "--durations=0", str(ROOT / "tests")]
    print("$", " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"gpu-check: the CUDA tests ran past {timeout:.0f} s and were stopped", flush=True)
        return 124


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_benchmark(argv: list[str], json_path: Path, timeout: float | None) -> str | None:
    """recipes/benchmark.py in its own process (a hung compile cannot stall the other stages); None or
    what went wrong."""
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark.py"), *argv, "--json", str(json_path)]
    try:
        rc = subprocess.call(cmd, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout:.0f} s (the budget)"
    return None if rc == 0 else f"exit status {rc}"


def table(runs: dict) -> list[dict]:
    """One line per (setup, mode): tokens/s eager and compiled, their ratio, speedups over baselines."""
    lines = []
    for setup, paths in runs.items():
        eager = {r["mode"]: r for r in paths.get("eager", {}).get("rows", [])}
        compiled = {r["mode"]: r for r in paths.get("compiled", {}).get("rows", [])}
        for mode in dict.fromkeys([*compiled, *eager]):
            e, c = eager.get(mode), compiled.get(mode)
            line = {"setup": setup, "mode": mode}
            if e is not None:
                line.update(eager_tokens_per_s=e["tokens_per_s"], eager_speedup=e.get("speedup"), vs=e.get("vs"))
            if c is not None and not mode.startswith("spear-tts"):  # upstream rows: never compiled
                line.update(compiled_tokens_per_s=c["tokens_per_s"], compiled_speedup=c.get("speedup"),
                            vs=c.get("vs"), compile_warmup_s=c.get("warmup_s"))
                if e is not None:
                    line["compiled_over_eager"] = c["tokens_per_s"] / e["tokens_per_s"]
            lines.append(line)
    return lines


def print_table(lines: list[dict], device: str) -> None:
    def num(v, fmt):
        return format(v, fmt) if v is not None else ""

    print(f"\n{device}, batch 1 (tokens/s; speedup = over the row's plain baseline on the same path)")
    print(f"{'setup':10s} {'mode':48s} {'eager':>9s} {'speedup':>8s} {'compiled':>9s} {'speedup':>8s} {'c/e':>6s}")
    for ln in lines:
        print(f"{ln['setup']:10s} {ln['mode'][:48]:48s} {num(ln.get('eager_tokens_per_s'), '9.1f'):>9s} "
              f"{num(ln.get('eager_speedup'), '8.2f'):>8s} {num(ln.get('compiled_tokens_per_s'), '9.1f'):>9s} "
              f"{num(ln.get('compiled_speedup'), '8.2f'):>8s} {num(ln.get('compiled_over_eager'), '6.2f'):>6s}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests-last", action="store_true", help="the CUDA tests after the benchmarks")
    p.add_argument("--test-timeout", type=float, help="stop the CUDA tests after this many seconds")
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--paths", nargs="+", choices=["compiled", "eager"], default=["eager", "compiled"],
                   help="benchmark runs per setup, in this order")
    p.add_argument("--budget", type=float,
                   help="seconds: a stage (a benchmark run, the tests) starts only while the run is younger")
    p.add_argument("--bench", nargs=argparse.REMAINDER, default=[],
                   help="the rest is passed to every recipes/benchmark.py run (e.g. --families sample beam)")
    p.add_argument("--out", type=Path, help="default: benchmarks/gpu_<device>.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks" / f"gpu_{device_slug()}.json"
    result: dict = {"device": device, "torch": torch.__version__, "commit": commit(), "pytest_cuda_rc": None,
                    "bench_args": args.bench, "reps": args.reps, "table": [], "runs": {}, "skipped": [], "errors": {}}

    def in_budget(stage: str) -> bool:
        if args.budget is None or time.perf_counter() - t0 < args.budget:
            return True
        result["skipped"].append(stage)
        print(f"gpu-check: out of budget, skipping {stage}", flush=True)
        return False

    def left() -> float | None:
        return None if args.budget is None else max(1.0, args.budget - (time.perf_counter() - t0))

    def save() -> None:
        result["table"] = table(result["runs"])
        result["seconds"] = time.perf_counter() - t0
        write_atomic(out, json.dumps(result, indent=2))

    def tests() -> None:
        if not args.skip_tests and in_budget("tests"):
            limits = [x for x in (args.test_timeout, left()) if x is not None]
            timeout = min(limits) if limits else None
            start = time.perf_counter()
            result["pytest_cuda_rc"] = run_tests(timeout)
            result["pytest_seconds"] = time.perf_counter() - start
            save()

    if not args.tests_last:
        tests()
    for setup in args.setups:
        for path in args.paths:
            stage = f"{setup}/{path}"
            if not in_budget(stage):
                continue
            argv_b = [*SETUPS[setup], "--device", "cuda", "--reps", str(args.reps), *args.bench,
                      *(["--compile"] if path == "compiled" else [])]
            print(f"\n$ recipes/benchmark.py {' '.join(argv_b)}", flush=True)
            start = time.perf_counter()
            err = run_benchmark(argv_b, out.with_name(f"{out.stem}.{setup}.{path}.json"), left())
            if err:  # keep the other stages' results
                result["errors"][stage] = err
            else:
                run = json.loads(out.with_name(f"{out.stem}.{setup}.{path}.json").read_text())
                out.with_name(f"{out.stem}.{setup}.{path}.json").unlink()
                run["seconds"] = time.perf_counter() - start
                result["runs"].setdefault(setup, {})[path] = run
            save()
    if args.tests_last:
        tests()
    save()
    print_table(result["table"], device)
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 1 if result["pytest_cuda_rc"] or result["errors"] else 0


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
