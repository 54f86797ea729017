"""Greedy decoding with draft trees against draft chains, timed side by side, for a head as good as the
shipped one or weaker: does a tree pay where the head is worse?

Chains are what `sample(temperature=0, gamma=...)` drafts. Trees come from speculative beam search with
one beam in spear-tts's semantics (`beam_search(beam_size=1, beam_semantics="upstream", gamma=g,
draft_width=W)`): the exit head's beam search keeps the W best draft paths at each of g levels, the
target verifies every node in one pass, and the beam step replayed on the target's log-probs takes its
argmax, so the search follows greedy decoding's path (its tokens are checked against `gamma=0` here).
That is a tree ranked by the draft's summed log-probs (EAGLE-2's reranking), not a tree of the k best
children of every node.

`--noise s` adds Gaussian noise of s times the weights' standard deviation to the exit head's output
projection (seeded): a weaker head, as a Spear-TTS model trained without distilling its exit head may
have; its acceptance is printed as tokens per target pass.

    python tools/greedy_tree_ab.py --widen 0                        # shipped model, its own head
    python tools/greedy_tree_ab.py --noise 4 --json benchmarks/greedy_tree_ab_w512_noise4.json  # width 512
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


def main(argv: list[str] | None = None) -> None:
    from benchmark import default_model, machine_info, tool_parser, write_json
    from tts_specdec import SpeculativeDecoder

    p = tool_parser(__doc__)
    p.add_argument("--noise", type=float, default=0.0, help="exit head noise, in weight standard deviations")
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    setup = default_model("cpu", sentences=args.sentences, widen=None if args.widen == [0] else args.widen)
    head = setup.model.to_early_exit_semantic_logits[-1]
    if args.noise:
        with torch.no_grad():
            noise = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0))
            head.weight.add_(noise * args.noise * head.weight.std())
    sd = SpeculativeDecoder(setup.model)

    modes = {"plain": lambda s, n: sd.sample(s, temperature=0, gamma=0, max_length=n),
             "chain auto": lambda s, n: sd.sample(s, temperature=0, max_length=n)}
    for g in args.gammas:
        modes[f"chain {g}"] = lambda s, n, g=g: sd.sample(s, temperature=0, gamma=g, max_length=n)
    for g in args.gammas:
        for w in args.widths:
            modes[f"tree {g}x{w}"] = lambda s, n, g=g, w=w: sd.beam_search(
                s, beam_size=1, beam_semantics="upstream", gamma=g, draft_width=w, max_length=n)

    seconds: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    passes: dict[str, int] = {}
    for _ in range(args.reps):
        for name, run in modes.items():  # interleaved: load elsewhere hits every mode alike
            start, out = time.perf_counter(), []
            for source, most in zip(setup.sources, setup.max_lengths):
                out.append(run(source, most))
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = [t.tolist() for o in out for t in o.tokens]
            passes[name] = sum(o.stats.target_passes for o in out)
    plain = statistics.median(seconds["plain"])
    emitted = sum(len(t) for t in tokens["plain"])
    rows = []
    for name in modes:
        row = {"mode": name, "seconds": statistics.median(seconds[name]),
               "x_plain": plain / statistics.median(seconds[name]),
               "tokens_per_target_pass": emitted / passes[name], "same_tokens": tokens[name] == tokens["plain"]}
        rows.append(row)
        print(f"{name:12s} {row['x_plain']:.2f}x plain  {row['tokens_per_target_pass']:.2f} tokens a target pass"
              f"  same tokens: {row['same_tokens']}")
    if args.json:
        write_json(args.json, {"machine": machine_info("cpu"), "model": setup.description, "noise": args.noise,
                               "threads": args.threads, "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
