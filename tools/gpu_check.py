"""`make gpu-check`: the GPU runbook in one command, sized for a short loan of a GPU (docs/gpu.md).

Stages, in priority order, each started only while the run is younger than --budget seconds (a GPU
session here has minutes of device time; what did not fit is listed under "skipped"):

1. shipped/compiled, shipped/recorded, shipped/eager: recipes/benchmark.py on the shipped model with
   `--compile` (one CUDA graph per step, the default), with `--compile` and recorded runs
   (TTS_SPECDEC_RECORD_RUNS=1: a plain run and a speculative sampling cycle as one CUDA graph each; the
   opt-in that may become the default on CUDA once it beats the default here), and without compile;
   batch 1 (the compiled path's targets are measured here);
2. tests: the CUDA tests (`pytest -m cuda`: compile=True against the default path on the GPU), spread
   over --test-workers processes (pytest-xdist, one per test by default) because each compiles its graphs
   (on an H200, 2026-11-29: the longest took 123 s with a warm compile cache, over 355 s cold);
3. exactness: recipes/device_check.py --compile on --exactness held-out sentences (0: skipped);
4. width1024/compiled, width1024/blas, width1024/eager: the shipped model widened function-preservingly
   to width 1024, 16 heads (`--widen 1024 16`: memory-bound steps); `blas` is compiled with cuBLAS's
   products (TTS_SPECDEC_PRODUCTS=blas) against the default's reduction kernels, measured so far on the
   shipped model only (docs/gpu.md);
5. only when named: width1024/recorded, shipped/blas.

With --cache-out DIR it packs torch.compile's cache into DIR/compile-cache.tar.gz at the end
(tools/compile_cache.py): copied into .gpu/ here, `.gpu/setup.sh` unpacks it before the next loan's
first compile.

One JSON, benchmarks/gpu_<device>.json, is rewritten after every stage: each benchmark run, the tests'
exit status, and the table this prints (each row's tokens/s eager and compiled, compiled / eager, each
speculative row's speedup over its plain baseline on both paths, the first call's compile time).

    python tools/gpu_check.py                                  # what `make gpu-check` runs
    python tools/gpu_check.py --stages shipped/compiled --reps 5 --out /tmp/gpu.json
    python tools/gpu_check.py --budget 900 --exactness 8 --bench --families sample
    python tools/gpu_check.py --stages shipped/compiled shipped/recorded       # the two compiled ways alone
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
# what every benchmark stage runs unless --bench says otherwise: the rows the targets name, plus greedy
# decoding (one draft-width setting and no draft-stop rows: each row compiles its own graphs)
DEFAULT_BENCH = ["--families", "sample", "greedy", "beam", "--draft-confidence", "0", "--beam-gamma", "1",
                 "--draft-width", "8", "--skip-upstream-beam"]
STAGES = ["shipped/compiled", "shipped/recorded", "shipped/eager", "tests", "exactness", "width1024/compiled",
          "width1024/blas", "width1024/eager"]
# on request only: the width-1024 model with recorded runs, the shipped model with cuBLAS's products
OPTIONAL = ["width1024/recorded", "shipped/blas"]
# the stages compiled under a setting of their own, each tabled in a column of its own beside `compiled`
SETTINGS = {"recorded": "TTS_SPECDEC_RECORD_RUNS=1", "blas": "TTS_SPECDEC_PRODUCTS=blas"}
SETUPS = {
    "shipped": ["--model", "default", "--skip-auto"],
    "width1024": ["--model", "default", "--widen", "1024", "16", "--skip-upstream", "--skip-auto"],
}


def device_slug() -> str:
    name = torch.cuda.get_device_name(0)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run(cmd: list[str], timeout: float | None) -> int:
    """`cmd` from the repository root, its output ours; its exit status, 124 when stopped at `timeout`."""
    print("$", " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"gpu-check: stopped after {timeout:.0f} s (the budget)", flush=True)
        return 124


def test_command(workers: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-o", "addopts=", "-v", "--durations=0", str(ROOT / "tests")]
    if workers > 1:
        try:
            import xdist  # noqa: F401
        except ImportError:
            return cmd
        cmd += ["-n", str(workers)]
    return cmd


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def table(runs: dict) -> list[dict]:
    """One line per (setup, mode): tokens/s eager and compiled, their ratio, speedups over baselines."""
    lines = []
    for setup, paths in runs.items():
        eager = {r["mode"]: r for r in paths.get("eager", {}).get("rows", [])}
        compiled = {r["mode"]: r for r in paths.get("compiled", {}).get("rows", [])}
        others = {k: {r["mode"]: r for r in paths.get(k, {}).get("rows", [])} for k in SETTINGS}
        for mode in dict.fromkeys([*compiled, *eager, *(m for rows in others.values() for m in rows)]):
            e, c = eager.get(mode), compiled.get(mode)
            line = {"setup": setup, "mode": mode}
            if e is not None:
                line.update(eager_tokens_per_s=e["tokens_per_s"], eager_speedup=e.get("speedup"), vs=e.get("vs"))
            if c is not None and not mode.startswith("spear-tts"):  # upstream rows: never compiled
                line.update(compiled_tokens_per_s=c["tokens_per_s"], compiled_speedup=c.get("speedup"),
                            vs=c.get("vs"), compile_warmup_s=c.get("warmup_s"))
                if e is not None:
                    line["compiled_over_eager"] = c["tokens_per_s"] / e["tokens_per_s"]
            for k, rows in others.items():
                r = rows.get(mode)
                if r is not None and not mode.startswith("spear-tts"):
                    line.update({f"{k}_tokens_per_s": r["tokens_per_s"], f"{k}_speedup": r.get("speedup")})
            lines.append(line)
    return lines


def print_table(lines: list[dict], device: str) -> None:
    def num(v, fmt):
        return format(v, fmt) if v is not None else ""

    print(f"\n{device}, batch 1 (tokens/s; speedup = over the row's plain baseline on the same path)")
    extra = [k for k in SETTINGS if any(f"{k}_tokens_per_s" in ln for ln in lines)]
    print(f"{'setup':10s} {'mode':48s} {'eager':>9s} {'speedup':>8s} {'compiled':>9s} {'speedup':>8s} {'c/e':>6s}"
          + "".join(f" {k:>9s} {'speedup':>8s}" for k in extra))
    for ln in lines:
        print(f"{ln['setup']:10s} {ln['mode'][:48]:48s} {num(ln.get('eager_tokens_per_s'), '9.1f'):>9s} "
              f"{num(ln.get('eager_speedup'), '8.2f'):>8s} {num(ln.get('compiled_tokens_per_s'), '9.1f'):>9s} "
              f"{num(ln.get('compiled_speedup'), '8.2f'):>8s} {num(ln.get('compiled_over_eager'), '6.2f'):>6s}"
              + "".join(f" {num(ln.get(k + '_tokens_per_s'), '9.1f'):>9s} {num(ln.get(k + '_speedup'), '8.2f'):>8s}"
                        for k in extra))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", choices=STAGES + OPTIONAL, default=STAGES, help="run these, in this order")
    p.add_argument("--budget", type=float, default=480,
                   help="seconds: a stage starts only while the run is younger, and is stopped when it runs past "
                        "(0: no limit)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--test-workers", type=int, default=9, help="pytest-xdist processes for the CUDA tests (9: one each)")
    p.add_argument("--exactness", type=int, default=0, metavar="N",
                   help="held-out sentences for recipes/device_check.py --compile (0: skip that stage)")
    p.add_argument("--out", type=Path, help="default: benchmarks/gpu_<device>.json")
    p.add_argument("--cache-out", type=Path, metavar="DIR",
                   help="at the end, pack torch.compile's cache into DIR/compile-cache.tar.gz for the next loan "
                        "(tools/compile_cache.py; on the device tool: --cache-out $OUT)")
    p.add_argument("--bench", nargs=argparse.REMAINDER, default=DEFAULT_BENCH,
                   help="the rest goes to every recipes/benchmark.py run instead of: " + " ".join(DEFAULT_BENCH))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks" / f"gpu_{device_slug()}.json"
    result: dict = {"device": device, "torch": torch.__version__, "commit": commit(), "stages": args.stages,
                    "bench_args": args.bench, "reps": args.reps, "pytest_cuda_rc": None, "exactness_rc": None,
                    "table": [], "runs": {}, "skipped": [], "errors": {}}

    def left() -> float | None:
        return None if not args.budget else args.budget - (time.perf_counter() - t0)

    def save() -> None:
        result["table"] = table(result["runs"])
        result["seconds"] = time.perf_counter() - t0
        write_atomic(out, json.dumps(result, indent=2))

    for stage in args.stages:
        if stage == "exactness" and not args.exactness:
            continue
        if left() is not None and left() <= 0:
            result["skipped"].append(stage)
            print(f"gpu-check: out of budget, skipping {stage}", flush=True)
            continue
        start = time.perf_counter()
        if stage == "tests":
            result["pytest_cuda_rc"] = run(test_command(args.test_workers), left())
            result["pytest_seconds"] = time.perf_counter() - start
        elif stage == "exactness":
            # float32, and bfloat16 as GPU users run it: whether speculation stays exact there (issue 33;
            # no invariance is built for a GPU's half-precision ops yet, so bf16 may report differences)
            cmd = [sys.executable, str(ROOT / "recipes" / "device_check.py"), "--device", "cuda", "--compile",
                   "--sentences", str(args.exactness), "--dtype", "float32", "bfloat16"]
            result["exactness_rc"] = run(cmd, left())
            result["exactness_seconds"] = time.perf_counter() - start
        else:
            setup, path = stage.split("/")
            json_path = out.with_name(f"{out.stem}.{setup}.{path}.json")
            cmd = [sys.executable, str(ROOT / "recipes" / "benchmark.py"), *SETUPS[setup], "--device", "cuda",
                   "--reps", str(args.reps), *args.bench, *(["--compile"] if path != "eager" else []),
                   "--json", str(json_path)]
            if path in SETTINGS:
                cmd = ["env", SETTINGS[path], *cmd]
            rc = run(cmd, left())
            if rc:  # keep the other stages' results
                result["errors"][stage] = f"exit status {rc}"
            else:
                run_result = json.loads(json_path.read_text())
                json_path.unlink()
                run_result["seconds"] = time.perf_counter() - start
                result["runs"].setdefault(setup, {})[path] = run_result
        save()
    save()
    print_table(result["table"], device)
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    if args.cache_out is not None:  # what this loan compiled, for the next one (.gpu/setup.sh loads it)
        sys.path.insert(0, str(ROOT / "tools"))
        from compile_cache import save as save_cache

        save_cache(args.cache_out)
    return 1 if result["pytest_cuda_rc"] or result["exactness_rc"] or result["errors"] else 0


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
