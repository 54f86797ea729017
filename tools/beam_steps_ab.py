"""Plain beam search with its undecided steps in one C++ call (`kernels.beam_steps`) against the same
search stepped through `Backend.verify` and `beam.beam_step`, beside speculative beam search and auto, in
one process.

Every held-out sentence runs in every mode, one after another, in an order that flips from sentence to
sentence, so that a machine whose speed drifts over seconds slows every mode alike; tokens/s over the
passes after a warm-up pass (auto's probe and exploration), and each mode over the fused beam search.
Tokens must equal the fused beam search's in every call (the tool stops otherwise).

    .venv/bin/python tools/beam_steps_ab.py --widen 512 8 --sentences 12 --reps 2
    .venv/bin/python tools/beam_steps_ab.py --widen 0 --sentences 20 --reps 3 --semantics upstream
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark import default_model, machine_info, tool_parser, write_json  # noqa: E402

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.backends.base import Backend  # noqa: E402


def main() -> None:
    p = tool_parser(__doc__)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--semantics", choices=("standard", "upstream"), default="standard")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    widen = None if args.widen == [0] else args.widen
    setup = default_model("cpu", sentences=args.sentences, widen=widen)
    dec = SpeculativeDecoder(setup.model)
    backend = type(dec.decoder.backend)
    fused_steps = backend.beam_steps
    if fused_steps is Backend.beam_steps:
        raise SystemExit(f"the {dec.decoder.backend.name} backend has no fused beam steps")
    # mode -> (fused steps, gamma); auto only with the semantics it runs speculatively too
    modes = {"beam": (True, 0), "beam, step by step": (False, 0), "speculative beam (gamma 1)": (True, 1),
             "speculative beam (gamma 2)": (True, 2)}
    if args.semantics == "standard":
        modes["auto beam"] = (True, "auto")

    def run(name: str, source: torch.Tensor, max_length: int) -> tuple[list[list[int]], float]:
        fused, gamma = modes[name]
        backend.beam_steps = fused_steps if fused else Backend.beam_steps
        try:
            start = time.perf_counter()
            out = dec.beam_search(source, beam_size=args.beam_size, gamma=gamma, max_length=max_length,
                                  beam_semantics=args.semantics)
            return [t.tolist() for t in out.tokens], time.perf_counter() - start
        finally:
            backend.beam_steps = fused_steps

    calls = list(zip(setup.sources, setup.max_lengths))
    for source, max_length in calls:  # warm-up
        for name in modes:
            run(name, source, max_length)
    seconds = dict.fromkeys(modes, 0.0)
    tokens = dict.fromkeys(modes, 0)
    for rep in range(args.reps):
        for i, (source, max_length) in enumerate(calls):
            order = list(modes) if (rep + i) % 2 == 0 else list(reversed(modes))
            outs = {}
            for name in order:
                outs[name], took = run(name, source, max_length)
                seconds[name] += took
                tokens[name] += sum(len(t) for t in outs[name])
            if any(out != outs["beam"] for out in outs.values()):
                raise SystemExit(f"sentence {i}: the modes' tokens differ")
    rate = {name: tokens[name] / seconds[name] for name in modes}
    result = {
        "machine": machine_info("cpu"), "model": setup.description, "semantics": args.semantics, "beam_size": args.beam_size,
        "sentences": len(calls), "reps": args.reps, "threads": args.threads,
        "tokens_per_s": {name: round(r, 1) for name, r in rate.items()},
        "x_beam": {name: round(r / rate["beam"], 3) for name, r in rate.items()},
    }
    print(setup.description)
    for name, r in rate.items():
        print(f"{name:30s} {r:8.1f} tokens/s  {r / rate['beam']:.3f}x of beam")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
