"""A speculative cycle's verify tail in one C++ call (`Backend.verify_accept`: the target head, the accept
rule, the read-back and the next input after the verify pass) against the same cycles stepped through
`Backend.verify` and the torch operations of `speculative._cycles`, in one process.

Each mode (gamma 4 and gamma="auto", sampling and greedy) runs every batch of held-out sentences with the
fused tail and stepped, the two in an order that flips from pass to pass, from the same generator seed;
tokens/s per pass after a warm-up pass (auto's cost model and first timings), medians, and fused /
stepped. The fixed gamma must give the same tokens both ways (the tool stops otherwise); auto's arms
follow the clock, so only its greedy tokens are checked there (they are plain greedy decoding's).

    .venv/bin/python tools/verify_tail_ab.py --widen 0 --sentences 20 --reps 3
    .venv/bin/python tools/verify_tail_ab.py --widen 0 --sentences 24 --batch 4 --reps 3
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark import default_model, machine_info, tool_parser, write_json  # noqa: E402

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.backends.base import Backend  # noqa: E402

MODES = {"gamma 4 sampling": dict(gamma=4, temperature=1.0), "gamma 4 greedy": dict(gamma=4, temperature=0.0),
         "auto sampling": dict(gamma="auto", temperature=1.0), "auto greedy": dict(gamma="auto", temperature=0.0)}


def main() -> None:
    p = tool_parser(__doc__, sentences=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    widen = None if args.widen == [0] else args.widen
    setup = default_model("cpu", batch=args.batch, sentences=args.sentences, widen=widen)
    dec = SpeculativeDecoder(setup.model)
    backend = type(dec.decoder.backend)
    fused_tail = backend.verify_accept
    if fused_tail is Backend.verify_accept:
        raise SystemExit(f"the {dec.decoder.backend.name} backend has no fused verify tail")
    calls = list(zip(setup.sources, setup.max_lengths))

    def run(kw: dict, fused: bool) -> tuple[list[list[list[int]]], int, float]:
        backend.verify_accept = fused_tail if fused else Backend.verify_accept
        try:
            outs, tokens, seconds = [], 0, 0.0
            for i, (source, max_length) in enumerate(calls):
                start = time.perf_counter()
                out = dec.sample(source, max_length=max_length, generator=torch.Generator().manual_seed(i), **kw)
                seconds += time.perf_counter() - start
                tokens += out.stats.generated_tokens
                outs.append([t.tolist() for t in out.tokens])
            return outs, tokens, seconds
        finally:
            backend.verify_accept = fused_tail

    rates: dict[str, dict[bool, list[float]]] = {name: {True: [], False: []} for name in MODES}
    for rep in range(args.reps + 1):  # pass 0 warms up
        for name, kw in MODES.items():
            outs = {}
            for fused in ((True, False) if rep % 2 else (False, True)):
                outs[fused], tokens, seconds = run(kw, fused)
                if rep:
                    rates[name][fused].append(tokens / seconds)
            if (kw["gamma"] != "auto" or kw["temperature"] == 0) and outs[True] != outs[False]:
                raise SystemExit(f"{name}: the fused tail's tokens differ from the stepped cycle's")
    result = {"machine": machine_info("cpu"), "model": setup.description, "batch": args.batch,
              "sentences": args.sentences, "reps": args.reps, "threads": args.threads, "modes": {}}
    print(setup.description)
    for name in MODES:
        fused, stepped = (statistics.median(rates[name][f]) for f in (True, False))
        per_pass = [round(a / b, 3) for a, b in zip(rates[name][True], rates[name][False])]
        result["modes"][name] = {"fused_tokens_per_s": round(fused, 1), "stepped_tokens_per_s": round(stepped, 1),
                                 "fused_over_stepped": round(fused / stepped, 3), "per_pass": per_pass}
        print(f"{name:18s} fused {fused:8.1f}  stepped {stepped:8.1f} tokens/s  {fused / stepped:.3f}x  (passes {per_pass})")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
