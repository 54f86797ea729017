"""Whether tree drafts could pay for greedy decoding on this machine: chain speculation against a tree of
drafts verified in one pass, side by side on the same held-out sentences, interleaved in one process.

The tree is the one speculative beam search already drafts and verifies: `beam_search(beam_size=1,
gamma=g, draft_width=W)` drafts g levels with the exit head keeping the W best nodes of each level by
their cumulative draft log-probability (EAGLE-2's reranked tree), every node kept in the one row's cache
with a tree mask; the target verifies all 1 + g W nodes in one pass and the replay follows its argmax
down the tree (a beam of one is greedy decoding: the tool checks the tokens against gamma=0's). Trees run
level by level here (the kernels' one-call draft is turned off, so that the verify pass is timed on its
own); their bookkeeping is speculative beam search's, not a tree decoder's, so the measured speed
understates a dedicated one; the bound does not:

    bound = (tree tokens / chain tokens per cycle) x chain cycle / (chain cycle - chain verify + tree verify)

the tree's speed over the chain's of the same depth if drafting the tree cost what drafting the chain
costs and its bookkeeping nothing, so only its larger verify pass (layers above the exit over 1 + g W
tokens, timed in both) is charged. Where the bound is below a target, no tree decoder of that shape
reaches the target on this machine.

    .venv/bin/python tools/tree_bound.py --widen 512 8 --sentences 6 --reps 2 [--trees 8,2 8,3] [--json F]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import default_model, machine_info, tool_parser, write_json  # noqa: E402
from spec_beam_bound import PassTimer  # noqa: E402

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.backends.kernels_cpu import CpuKernels  # noqa: E402


def _tree(spec: str) -> tuple[int, int]:
    gamma, width = (int(v) for v in spec.split(","))
    if gamma < 1 or width < 1:
        raise ValueError(f"--trees: GAMMA,WIDTH of at least 1 each, got {spec!r}")
    return gamma, width


def main() -> None:
    p = tool_parser(__doc__, sentences=6, reps=2)
    p.add_argument("--trees", nargs="+", type=_tree, default=[(6, 2), (8, 2), (8, 3)], metavar="GAMMA,WIDTH")
    p.add_argument("--target", type=float, default=1.25, help="the tree's speedup over the chain compared with")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    CpuKernels.beam_draft = lambda *a, **k: None  # trees level by level: the verify pass timed on its own
    setup = default_model("cpu", sentences=args.sentences, widen=None if args.widen == [0] else args.widen)
    dec = SpeculativeDecoder(setup.model)
    inputs = list(zip(setup.sources, setup.max_lengths))
    modes = {"plain": ("chain", 0, 0)}
    for g in sorted({g for g, _ in args.trees}):
        modes[f"chain gamma {g}"] = ("chain", g, 0)
    for g, w in args.trees:
        modes[f"tree gamma {g}, W {w}"] = ("tree", g, w)

    def run(kind: str, gamma: int, width: int) -> tuple[dict, list]:
        start, stats = time.perf_counter(), []
        for source, n in inputs:
            if kind == "tree":
                out = dec.beam_search(source, beam_size=1, gamma=gamma, draft_width=width, length_penalty=0.0, max_length=n)
            else:
                out = dec.sample(source, temperature=0.0, gamma=gamma, max_length=n)
            stats.append(out)
        wall = time.perf_counter() - start
        kinds = timer.take()
        cycles = sum(o.stats.steps for o in stats)
        res = {"wall_s": wall, "tokens": sum(o.stats.generated_tokens for o in stats), "cycles": cycles,
               "upper_s": kinds.get("upper", [0.0])[0]}
        return res, [t.tolist() for o in stats for t in o.tokens]

    dec.sample(inputs[0][0], temperature=0.0, gamma=4, max_length=8)  # kernels, prepared weights, backend
    timer = PassTimer(dec.decoder.backend, dec.decoder.exit_layer)
    reference = run(*modes["plain"])[1]
    same = {m: True for m in modes}
    results: dict = {m: [] for m in modes}
    for rep in range(args.reps + 1):  # the first pass warms up
        for m, spec in modes.items():
            res, tokens = run(*spec)
            same[m] &= tokens == reference
            if rep:
                results[m].append(res)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    plain = med["plain"]
    print(f"{setup.description}; {args.threads} threads, {args.reps} interleaved reps (medians)")
    rows = []
    for m, (kind, g, w) in modes.items():
        r = med[m]
        row = {"mode": m, "tokens_per_s": r["tokens"] / r["wall_s"], "x_plain": plain["wall_s"] / r["wall_s"],
               "tokens_per_cycle": r["tokens"] / r["cycles"], "cycle_ms": r["wall_s"] / r["cycles"] * 1e3,
               "verify_ms": r["upper_s"] / r["cycles"] * 1e3, "same_tokens_as_plain": same[m]}
        if kind == "tree":
            c = med[f"chain gamma {g}"]
            chain_cycle, chain_verify = c["wall_s"] / c["cycles"], c["upper_s"] / c["cycles"]
            gain = row["tokens_per_cycle"] / (c["tokens"] / c["cycles"])
            row["bound_over_chain"] = gain * chain_cycle / (chain_cycle - chain_verify + row["verify_ms"] / 1e3)
            row["measured_over_chain"] = c["wall_s"] / r["wall_s"]
        rows.append(row)
        extra = (f"; over the chain: measured {row['measured_over_chain']:.2f}x, bound {row['bound_over_chain']:.2f}x"
                 f" ({'below' if row['bound_over_chain'] < args.target else 'not below'} {args.target:g}x)"
                 if kind == "tree" else "")
        print(f"{m:22s} {row['tokens_per_s']:7.1f} tokens/s ({row['x_plain']:.2f}x plain), {row['tokens_per_cycle']:.2f} "
              f"tokens a cycle of {row['cycle_ms']:.2f} ms (verify {row['verify_ms']:.2f} ms)"
              f"{'' if same[m] else ', OTHER TOKENS than plain'}{extra}")
    if args.json:
        write_json(args.json, {"setup": setup.description, "machine": machine_info("cpu"), "threads": args.threads,
                               "reps": args.reps, "command": " ".join(["tools/tree_bound.py", *sys.argv[1:]]), "rows": rows})
    if not all(same.values()):
        raise SystemExit("a mode returned other tokens than plain greedy decoding")


if __name__ == "__main__":
    main()
