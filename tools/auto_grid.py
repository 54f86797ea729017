"""gamma="auto" against plain decoding and the best fixed setting, over a grid: the shipped model and its
width-512 widening x batch sizes x thread counts x {sampling with gamma="auto", greedy decoding, beam
search}.

Each cell times three modes of its family on the same sentences (`--sentences` held-out sentences in
batches of the cell's size): plain (gamma 0), the fixed speculative setting (gamma 4; beam search:
gamma 1 at the default draft width, the width auto uses) and gamma="auto". One untimed warm-up pass, then
`--reps` passes; a pass runs each batch of sentences in the three modes one after another, in an order
that rotates from batch to batch and pass to pass (interleaved call by call: load elsewhere, which on
this 2-core machine moved whole passes by 10-20%, hits the modes alike); a mode's speed is its median
tokens/s over the passes, and auto / the faster of plain and the fixed setting comes with a 90% bootstrap
interval over the passes (`interval`), which tells a cell where auto is slower from one where the grid's
noise alone put it below a line. Sampling draws with a seed per batch and pass, the same in every mode of a
pass, so a mode's median is over several draws, not one draw repeated. One
`SpeculativeDecoder` per model serves every cell, as it would a user's session: what auto measures
and learns is kept across its calls. Greedy decoding and beam search must return plain decoding's tokens
under auto and the fixed setting: a cell where they do not is reported and the tool exits non-zero.

    python tools/auto_grid.py --json benchmarks/auto_grid.json         # the full grid (about an hour)
    python tools/auto_grid.py --quick                                   # shipped model, batch 1-2, 1 thread
    python tools/auto_grid.py --models width512 --batches 1 --threads 2 --families greedy --reps 5
    python tools/auto_grid.py --null --models shipped --families sample greedy   # the grid's own noise
    python tools/auto_grid.py --models shipped --batches 4 8 --families sample --reps 15   # tight intervals
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.results import DecodeStats  # noqa: E402
from tts_specdec.speech.atomic import write_json  # noqa: E402

MODELS = {"shipped": None, "width512": (512, 8)}  # widen(dim, heads) of the shipped checkpoint
FAMILIES = ("sample", "greedy", "beam")
BEAM_SIZE = 4
FIXED_GAMMA = 4  # the fixed speculative setting of sampling and greedy decoding
# and of beam search (at the default draft width, auto's): the fastest fixed one at batch 4 and on the shipped
# model; at width 512, batch 1, gamma 2 is faster since verified roots are ranked by the target (Intel Xeon,
# docs/performance.md), and auto runs it there, so this column understates the best fixed setting there
BEAM_GAMMA = 1
MIN_REPS = 3  # fewer passes give no median worth the name
LINE = 0.97  # what auto must reach of the faster setting in every cell (`verdict`)
# the bootstrap of a cell's auto / best (`interval`): its resamples, and the share of them outside the interval
# on each side (5%: a 90% interval); seeded, so a cell's passes give the same interval every time
BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_TAIL = 0.05
LEVEL = f"{round(100 * (1 - 2 * BOOTSTRAP_TAIL))}%"  # how the table and `verdict` name the interval
QUICK = dict(models=["shipped"], batches=[1, 2], threads=[1], reps=3)


@dataclass
class Mode:
    name: str  # "plain", "fixed" or "auto"
    # per batch: pass number (0: the warm-up) -> tokens, stats, the tokens
    calls: list[Callable[[int], tuple[int, DecodeStats, list[list[int]]]]]
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    gamma_hist: list[int] = field(default_factory=list)  # summed over the timed passes

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(n / t for n, t in zip(self.tokens, self.times))


def load(model: str) -> SpeculativeDecoder:
    from tts_specdec.speech.checkpoint import load_checkpoint
    from tts_specdec.speech.pipeline import ASSETS
    from tts_specdec.widen import widen

    ckpt = load_checkpoint(ASSETS)
    if MODELS[model] is not None:
        ckpt = widen(ckpt, *MODELS[model])
    return SpeculativeDecoder(ckpt.model.eval())


def batches(dec: SpeculativeDecoder, sentences: int, batch: int) -> list[tuple[torch.Tensor, int]]:
    """The held-out sentences in batches of `batch`, each with the pipeline's length cap."""
    from tts_specdec.speech.pipeline import default_max_length
    from tts_specdec.speech.references import heldout_sentences

    texts = heldout_sentences(sentences)
    sources = [dec.model.tokenizer_encode(texts[i : i + batch]) for i in range(0, sentences, batch)]
    return [(s, default_max_length(s)) for s in sources]


def modes(dec: SpeculativeDecoder, family: str, inputs: list[tuple[torch.Tensor, int]], seed: int,
          null: bool = False) -> list[Mode]:
    """plain, fixed and auto of one family over `inputs`; `null`: the auto column decodes with gamma 0."""
    if family == "beam":
        method, settings = "beam_search", {"plain": dict(gamma=0), "fixed": dict(gamma=BEAM_GAMMA),
                                           "auto": dict(gamma="auto")}
        common: dict = dict(beam_size=BEAM_SIZE)
    else:
        method, settings = "sample", {"plain": dict(gamma=0), "fixed": dict(gamma=FIXED_GAMMA), "auto": dict(gamma="auto")}
        common = dict(temperature=1.0 if family == "sample" else 0.0)

    def call(setting: dict, i: int) -> Callable[[int], tuple[int, DecodeStats, list[list[int]]]]:
        source, max_length = inputs[i]

        def go(rep: int) -> tuple[int, DecodeStats, list[list[int]]]:
            kw = dict(common, **setting, max_length=max_length)
            if family == "sample":
                # each batch and pass its own seed, the same in every mode: a seed kept from pass to pass
                # would freeze a fixed gamma's draws (lengths, a batch's long last row) while auto's move,
                # and at width 512, batch 8, gamma 4 ran 1.33x or 1.59x of plain by the seed alone
                kw["generator"] = torch.Generator().manual_seed(seed + rep * len(inputs) + i)
            out = getattr(dec, method)(source, **kw)
            return out.stats.generated_tokens, out.stats, [t.tolist() for t in out.tokens]
        return go

    if null:
        settings["auto"] = dict(gamma=0)
    return [Mode(name, [call(setting, i) for i in range(len(inputs))]) for name, setting in settings.items()]


def measure(cell_modes: list[Mode], reps: int) -> bool:
    """The warm-up pass, then `reps` passes, each batch run in every mode in a rotating order; returns
    whether every mode returned the same tokens as plain in every pass (what greedy decoding and beam
    search must)."""
    same = True
    n_modes = len(cell_modes)
    for rep in range(reps + 1):
        seconds, tokens = [0.0] * n_modes, [0] * n_modes
        hists: list[list[int]] = [[] for _ in cell_modes]
        outs: list[list[list[int]]] = [[] for _ in cell_modes]
        for i in range(len(cell_modes[0].calls)):
            for m in [(rep + i + j) % n_modes for j in range(n_modes)]:
                start = time.perf_counter()
                n, call_stats, call_tokens = cell_modes[m].calls[i](rep)
                seconds[m] += time.perf_counter() - start
                tokens[m] += n
                hists[m] = _add(hists[m], call_stats.gamma_hist)
                outs[m] += call_tokens
        reference = outs[[m.name for m in cell_modes].index("plain")]
        same = same and all(out == reference for out in outs)
        if rep:  # pass 0 warms up: kernels, prepared weights, auto's cost model and first timings
            for m, mode in enumerate(cell_modes):
                mode.times.append(seconds[m])
                mode.tokens.append(tokens[m])
                mode.gamma_hist = _add(mode.gamma_hist, hists[m])
    return same


def _add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))]


def interval(per_pass: dict[str, list[float]], draws: int = BOOTSTRAP_DRAWS, tail: float = BOOTSTRAP_TAIL) -> tuple[float, float]:
    """The percentile bootstrap interval of auto / the faster of plain and fixed (each a median of tokens/s
    over the passes): passes drawn with replacement, a pass's three modes together (they ran side by side,
    so load that slowed one pass slowed its modes alike). With 3 passes it is coarse (10 distinct resamples);
    with 15 or more it shows whether auto is below a line for real or by the grid's noise. Pure: the same
    passes give the same interval."""
    n = len(per_pass["auto"])
    draw = random.Random(0)
    ratios = []
    for _ in range(draws):
        picks = [draw.randrange(n) for _ in range(n)]
        med = {m: statistics.median(per_pass[m][i] for i in picks) for m in ("plain", "fixed", "auto")}
        ratios.append(med["auto"] / max(med["plain"], med["fixed"]))
    ratios.sort()
    return ratios[int(tail * (draws - 1))], ratios[int((1 - tail) * (draws - 1))]


def cell_result(model: str, threads: int, batch: int, family: str, cell_modes: list[Mode], same: bool) -> dict:
    speed = {m.name: m.tokens_per_s for m in cell_modes}
    best = max(speed["plain"], speed["fixed"])
    per_pass = {m.name: [n / t for n, t in zip(m.tokens, m.times)] for m in cell_modes}
    per_pass_best = [a / max(p, f) for a, p, f in zip(per_pass["auto"], per_pass["plain"], per_pass["fixed"])]
    return {
        "model": model, "threads": threads, "batch": batch, "family": family,
        "tokens_per_s": speed,
        "auto_vs_plain": speed["auto"] / speed["plain"],
        "auto_vs_best": speed["auto"] / best,
        "fixed_vs_plain": speed["fixed"] / speed["plain"],
        "per_pass_auto_vs_plain": [a / p for a, p in zip(per_pass["auto"], per_pass["plain"])],
        # the spread of one pass's ratio: where auto does plain's work (beam cells decoding plainly) it
        # spans the machine's noise, which a cell's median shares
        "per_pass_auto_vs_best": per_pass_best,
        "auto_vs_best_interval": list(interval(per_pass)),  # 90%, bootstrap over the passes
        "auto_gamma_hist": next(m.gamma_hist for m in cell_modes if m.name == "auto"),
        "same_tokens": same if family != "sample" else None,
    }


def table(cells: list[dict]) -> str:
    """The grid as a markdown table: auto / plain and auto / the faster of plain and fixed, per cell, its
    90% interval (`interval`), and the range of auto / the faster over the passes (each pass's own ratio)."""
    lines = [f"| model | threads | batch | family | plain tok/s | fixed / plain | auto / plain | auto / best | {LEVEL} interval | one pass |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        flag = "" if c["same_tokens"] in (True, None) else " (tokens differ!)"
        lo, hi = min(c["per_pass_auto_vs_best"]), max(c["per_pass_auto_vs_best"])
        lines.append(f"| {c['model']} | {c['threads']} | {c['batch']} | {c['family']} | {c['tokens_per_s']['plain']:.1f} | "
                     f"{c['fixed_vs_plain']:.2f} | {c['auto_vs_plain']:.2f} | {c['auto_vs_best']:.2f}{flag} | "
                     "{:.2f}-{:.2f} | {:.2f}-{:.2f} |".format(*c["auto_vs_best_interval"], lo, hi))
    return "\n".join(lines)


def verdict(cells: list[dict], line: float = LINE) -> str:
    """How many cells' intervals lie wholly below `line` (auto slower for real), straddle it (the passes
    cannot tell) or lie at or above it, naming the cells below."""
    below = [c for c in cells if c["auto_vs_best_interval"][1] < line]
    above = [c for c in cells if c["auto_vs_best_interval"][0] >= line]
    names = ", ".join(f"{c['model']} {c['threads']}t b{c['batch']} {c['family']}" for c in below)
    return (f"auto / best against {line}: {len(below)} cells below it for sure{f' ({names})' if below else ''}, "
            f"{len(cells) - len(below) - len(above)} undecided by the passes, {len(above)} at or above it "
            f"({LEVEL} intervals)")


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return {"cpu": cpu, "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--sentences", type=int, default=8, help="held-out sentences per cell (default 8)")
    p.add_argument("--reps", type=int, default=3, help=f"timed passes per cell, at least {MIN_REPS} (default 3)")
    p.add_argument("--seed", type=int, default=0, help="sampling's generator seed")
    p.add_argument("--quick", action="store_true",
                   help="a small grid to check the tool: shipped model, batches 1 and 2, 1 thread, 3 passes "
                        "(flags given explicitly still apply)")
    p.add_argument("--null", action="store_true",
                   help="an A/A run: the auto column decodes with gamma=0, the same work as plain, so its "
                        "ratios show what the grid's noise alone gives a mode exactly as fast as plain")
    p.add_argument("--json", type=Path, help="also write the cells here")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    for name in ("batches", "threads"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            p.error(f"--{name} must be >= 1, got {bad}")
    if args.reps < MIN_REPS:
        p.error(f"--reps must be >= {MIN_REPS} (a median of passes), got {args.reps}")
    if args.sentences < 1:
        p.error(f"--sentences must be >= 1, got {args.sentences}")

    cells = []
    for model in args.models:
        dec = load(model)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                inputs = batches(dec, args.sentences, batch)
                for family in args.families:
                    cell_modes = modes(dec, family, inputs, args.seed, args.null)
                    same = measure(cell_modes, args.reps)
                    cells.append(cell_result(model, threads, batch, family, cell_modes, same))
                    c = cells[-1]
                    print(f"{model} threads {threads} batch {batch} {family}: auto/plain {c['auto_vs_plain']:.3f} "
                          f"auto/best {c['auto_vs_best']:.3f} fixed/plain {c['fixed_vs_plain']:.3f}"
                          f"{'' if c['same_tokens'] in (True, None) else '  TOKENS DIFFER'}", file=sys.stderr, flush=True)
    if args.null:
        print("An A/A grid (--null): the auto column decoded with gamma=0, the same work as plain.")
    print(table(cells))
    print(verdict(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, {"machine": machine(), "sentences": args.sentences, "reps": args.reps,
                               "beam_size": BEAM_SIZE, "fixed_gamma": FIXED_GAMMA, "beam_gamma": BEAM_GAMMA,
                               "null": args.null, "cells": cells})
    return 0 if all(c["same_tokens"] in (True, None) for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
