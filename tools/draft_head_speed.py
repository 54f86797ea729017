"""The exit head read as bfloat16 panels (the default on the CPU kernels) against float32 panels, side by
side in one process: speculative greedy decoding and sampling at gamma 4 and speculative beam search, on
the same held-out sentences, passes interleaved in alternating order; medians of tokens/s, the ratio
bf16 / float32 per mode and the drafts accepted per cycle under each head. Only the draft changes: every
output of greedy decoding and beam search is the same (checked here), sampling keeps its law.

    .venv/bin/python tools/draft_head_speed.py --widen 512 8 --sentences 6 --reps 3 [--json F]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from benchmark import default_model, machine_info, tool_parser, write_json  # noqa: E402

from tts_specdec import SpeculativeDecoder  # noqa: E402
from tts_specdec.decoder import _ExitHead  # noqa: E402

MODES = {"greedy, gamma 4": dict(temperature=0.0, gamma=4), "sampling, gamma 4": dict(temperature=1.0, gamma=4),
         "beam search, gamma 1, W 8": dict(beam_size=4, gamma=1, draft_width=8)}


def main() -> None:
    p = tool_parser(__doc__, sentences=6)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setup = default_model("cpu", sentences=args.sentences, widen=None if args.widen == [0] else args.widen)
    dec = SpeculativeDecoder(setup.model)
    inputs = list(zip(setup.sources, setup.max_lengths))
    dec.sample(inputs[0][0], temperature=0.0, gamma=4, max_length=8)  # prepared weights, kernels
    head = dec.decoder.model.to_early_exit_semantic_logits
    heads = {"float32": _ExitHead.of(head, torch.float32), "bfloat16": _ExitHead.of(head, torch.bfloat16)}

    def run(store: str, mode: str) -> tuple[float, float, list]:
        dec.decoder._exit_head = heads[store]
        kw, tokens, accepted, cycles, outs = MODES[mode], 0, 0, 0, []
        start = time.perf_counter()
        for i, (source, n) in enumerate(inputs):
            if "beam_size" in kw:
                out = dec.beam_search(source, max_length=n, **kw)
                accepted += sum(j * c for j, c in enumerate(out.stats.committed_hist))
            else:
                out = dec.sample(source, max_length=n, generator=torch.Generator().manual_seed(i), **kw)
                accepted += out.stats.accepted
            cycles += out.stats.steps
            tokens += out.stats.generated_tokens
            outs.append([t.tolist() for t in out.tokens])
        return tokens / (time.perf_counter() - start), accepted / cycles, outs

    for mode in MODES:  # warm-up
        for store in heads:
            run(store, mode)
    speed: dict = {(m, s): [] for m in MODES for s in heads}
    per_cycle: dict = {}
    outputs: dict = {}
    for rep in range(args.reps):
        for mode in MODES:
            for store in (list(heads) if rep % 2 == 0 else list(heads)[::-1]):
                tps, acc, outs = run(store, mode)
                speed[(mode, store)].append(tps)
                per_cycle[(mode, store)] = acc
                outputs[(mode, store)] = outs
    print(f"{setup.description}; {args.threads} threads, {args.reps} interleaved passes (medians)")
    rows = []
    for mode in MODES:
        f32, b16 = (statistics.median(speed[(mode, s)]) for s in heads)
        same = outputs[(mode, "float32")] == outputs[(mode, "bfloat16")] if "sampling" not in mode else None
        if same is False:
            raise SystemExit(f"{mode}: the outputs differ between the heads")
        rows.append({"mode": mode, "float32_tokens_per_s": f32, "bfloat16_tokens_per_s": b16, "ratio": b16 / f32,
                     "per_cycle_float32": per_cycle[(mode, "float32")], "per_cycle_bfloat16": per_cycle[(mode, "bfloat16")]})
        print(f"{mode:28s} float32 head {f32:7.1f} tok/s, bfloat16 head {b16:7.1f} tok/s: {b16 / f32:.3f}x; "
              f"accepted (beam: committed) per cycle {per_cycle[(mode, 'float32')]:.2f} / {per_cycle[(mode, 'bfloat16')]:.2f}")
    if args.json:
        out = {"setup": setup.description, "machine": machine_info("cpu"), "threads": args.threads, "reps": args.reps,
               "rows": rows, "raw": {f"{m} / {s}": v for (m, s), v in speed.items()}}
        write_json(args.json, out)


if __name__ == "__main__":
    main()
