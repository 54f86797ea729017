"""A float32 model against its bfloat16 conversion (`model.to(torch.bfloat16)`, as a user converts it),
side by side in one process: greedy decoding with gamma=0 and with the default gamma="auto", and beam
search, on the same held-out sentences, passes interleaved (load elsewhere hits every mode alike);
medians of tokens/s, ratios to float32 greedy with gamma=0. On the CPU kernels a bfloat16 model's
products read bfloat16 panels (half the bytes of float32 ones) and sum in float32.

    .venv/bin/python tools/dtype_speed.py --widen 512 8 --sentences 8 --reps 3 [--json F]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from benchmark import default_model, machine_info, tool_parser, write_json  # noqa: E402

from tts_specdec import SpeculativeDecoder  # noqa: E402

MODES = {"greedy, gamma=0": dict(temperature=0.0, gamma=0), 'greedy, gamma="auto"': dict(temperature=0.0),
         "beam search (4 beams), gamma=0": dict(beam_size=4, gamma=0)}


def main() -> None:
    p = tool_parser(__doc__)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setup = default_model("cpu", sentences=args.sentences, widen=None if args.widen == [0] else args.widen)
    models = {"float32": setup.model, "bfloat16": copy.deepcopy(setup.model).to(torch.bfloat16)}
    decoders = {name: SpeculativeDecoder(m) for name, m in models.items()}
    inputs = list(zip(setup.sources, setup.max_lengths))

    gammas: dict[str, list[int]] = {}  # auto's cycles per gamma (0: plain steps), summed over passes

    def run(dec: SpeculativeDecoder, mode: dict, name: str = "") -> tuple[float, list]:
        start, tokens, out = time.perf_counter(), 0, []
        for source, n in inputs:
            kw = dict(mode)
            r = dec.beam_search(source, max_length=n, **kw) if "beam_size" in kw else dec.sample(source, max_length=n, **kw)
            tokens += r.stats.generated_tokens
            out.append([t.tolist() for t in r.tokens])
            if name and "gamma" not in kw:
                hist = gammas.setdefault(name, [])
                hist.extend([0] * (len(r.stats.gamma_hist) - len(hist)))
                for g, c in enumerate(r.stats.gamma_hist):
                    hist[g] += c
        return tokens / (time.perf_counter() - start), out

    for dec in decoders.values():  # warm-up: kernels, prepared weights, auto's costs
        for mode in MODES.values():
            run(dec, mode)
    speed: dict[tuple[str, str], list[float]] = {}
    same: dict[str, bool] = {}
    for rep in range(args.reps):
        for name, dec in decoders.items():
            outs = {}
            for label, mode in MODES.items():
                tps, outs[label] = run(dec, mode, name)
                speed.setdefault((name, label), []).append(tps)
            same[name] = outs['greedy, gamma="auto"'] == outs["greedy, gamma=0"]
    med = {key: statistics.median(v) for key, v in speed.items()}
    base = med["float32", "greedy, gamma=0"]
    print(f"{setup.description}; {args.threads} threads, {args.reps} interleaved passes (medians)")
    print("| model | mode | tokens/s | x float32 greedy gamma=0 |")
    print("|---|---|---|---|")
    for (name, label), tps in med.items():
        print(f"| {name} | {label} | {tps:.1f} | {tps / base:.2f} |")
    print("auto's greedy tokens equal gamma=0's:", same)
    print("auto's cycles per gamma (0: runs of plain steps):", gammas)
    if not all(same.values()):
        raise SystemExit("greedy decoding under gamma='auto' returned other tokens than gamma=0")
    if args.json:
        out = {"command": " ".join(["tools/dtype_speed.py", *sys.argv[1:]]), "setup": setup.description,
               "machine": machine_info("cpu"), "threads": args.threads, "reps": args.reps,
               "tokens_per_s": {f"{n} / {m}": v for (n, m), v in med.items()},
               "x_float32_greedy": {f"{n} / {m}": v / base for (n, m), v in med.items()}, "auto_gamma_hist": gammas}
        write_json(args.json, out)


if __name__ == "__main__":
    main()
