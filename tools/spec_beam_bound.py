"""How fast speculative beam search could be on this machine: its layer passes, timed inside real
decodes, against plain beam search, interleaved in one process.

Speculative beam search returns exactly what beam search returns; it can only win by committing more
beam steps per cycle (s, measured) than a cycle's passes cost in beam steps. This tool times every call
of the backend's `run_layers` (the decoder layers, the kernels' work) during both searches on the same
held-out sentences, and reports per cycle: the time in layer passes, the rest (heads, tree bookkeeping,
replay, commit; split into each call's work before its first cycle, spread over its cycles, and the
cycle's own), and the speedup over beam search if everything but the layer passes cost nothing (on
the kernels a cycle's draft and verify passes are one call, `Backend.beam_draft`, timed whole: its exit
head and tree bookkeeping count as passes there):

    bound = s * (beam step, all its time) / (a cycle's layer passes)

Where that bound is below a target, no bookkeeping work can reach the target with these passes; only
cheaper passes (fewer rows, fewer trunk passes) or more committed steps (a better draft) could.

    .venv/bin/python tools/spec_beam_bound.py --widen 512 8 --sentences 8 [--draft-width 4 8] [--by-level] [--json F]
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


class PassTimer:
    """Wraps a backend's `run_layers` and sums the seconds spent inside it, in all and per kind of pass
    ("trunk": layers below the exit, "upper": the layers above it, "all"), with the tokens passed."""

    def __init__(self, backend, exit_layer: int) -> None:
        self.exit_layer = exit_layer
        self.by_kind: dict[str, list[float]] = {}
        inner = backend.run_layers

        def timed(x, start, layers, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(x, start, layers, *args, **kwargs)
            finally:
                kind = ("trunk" if layers.stop <= exit_layer else "upper" if layers.start >= exit_layer else "all")
                entry = self.by_kind.setdefault(kind, [0.0, 0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
                entry[2] += x.shape[0] * x.shape[1]

        backend.run_layers = timed
        # the kernels draft and verify a cycle's tree in one call: its passes are counted whole (with the
        # little tree bookkeeping done in the same C++ call), as kind "tree call"
        draft = backend.beam_draft
        self.one_call = True  # False: the kernels' one call is declined, the tree is built level by level
        self.first_cycle: float | None = None  # when a call's first cycle began (its per-call work done)

        def timed_draft(*args, **kwargs):
            t0 = time.perf_counter()
            if self.first_cycle is None:
                self.first_cycle = t0
            if not self.one_call:
                return None
            out = draft(*args, **kwargs)
            if out is not None:
                entry = self.by_kind.setdefault("tree call", [0.0, 0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
                entry[2] += out[4].numel()
            return out

        backend.beam_draft = timed_draft

    def take(self) -> dict[str, list[float]]:
        out, self.by_kind = self.by_kind, {}
        return out


def main() -> None:
    p = tool_parser(__doc__)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--beam-gamma", type=int, default=1)
    p.add_argument("--draft-width", type=int, nargs="+", default=[4, 8])
    p.add_argument("--target", type=float, default=1.15, help="the speedup the bound is compared with")
    p.add_argument("--by-level", action="store_true",
                   help="also run each width with the tree built level by level (no one-call draft), side by side")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    widen = None if args.widen == [0] else args.widen
    setup = default_model("cpu", sentences=args.sentences, widen=widen)
    dec = SpeculativeDecoder(setup.model)
    inputs = list(zip(setup.sources, setup.max_lengths))
    k = args.beam_size

    def run(gamma: int, width: int | None, by_level: bool = False) -> dict:
        kw = {} if gamma == 0 else {"draft_width": width}
        timer.one_call = not by_level
        start = time.perf_counter()
        stats, per_call = [], 0.0
        for s, n in inputs:
            timer.first_cycle = None
            t0 = time.perf_counter()
            stats.append(dec.beam_search(s, beam_size=k, gamma=gamma, max_length=n, **kw).stats)
            if timer.first_cycle is not None:  # checking the weights, encoding the text, the caches
                per_call += timer.first_cycle - t0
        wall = time.perf_counter() - start
        kinds = timer.take()
        cycles = sum(st.steps for st in stats)
        committed = sum(sum(i * c for i, c in enumerate(st.committed_hist)) for st in stats) if gamma else cycles
        out = {"wall_s": wall, "per_call_s": per_call, "layer_s": sum(v[0] for v in kinds.values()), "cycles": cycles, "steps": committed,
               "tokens": sum(st.generated_tokens for st in stats)}
        for kind, (sec, calls, toks) in kinds.items():
            out.update({f"{kind}_s": sec, f"{kind}_calls": calls, f"{kind}_tokens": toks})
        return out

    settings = [(0, None, False)] + [(args.beam_gamma, w, False) for w in args.draft_width]
    if args.by_level:
        settings += [(args.beam_gamma, w, True) for w in args.draft_width]
    dec.beam_search(inputs[0][0], beam_size=k, gamma=0, max_length=8)  # kernels, prepared weights, backend
    timer = PassTimer(dec.decoder.backend, dec.decoder.exit_layer)
    for s in settings:  # warm-up
        run(*s)
    results: dict = {s: [] for s in settings}
    for _ in range(args.reps):  # interleaved repetitions
        for s in settings:
            results[s].append(run(*s))
    med = {s: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for s, rs in results.items()}
    plain = med[(0, None, False)]
    beam_step = plain["wall_s"] / plain["steps"]
    print(f"{setup.description}; {args.threads} threads, {args.reps} interleaved reps (medians)")
    print(f"beam search (K={k}): {beam_step * 1e3:.2f} ms per step, of which layer passes "
          f"{plain['layer_s'] / plain['steps'] * 1e3:.2f} ms")
    rows = []
    for g, w, by_level in settings[1:]:
        m = med[(g, w, by_level)]
        s = m["steps"] / m["cycles"]
        cycle, layers = m["wall_s"] / m["cycles"], m["layer_s"] / m["cycles"]
        # what each call does once before its first cycle, spread over its cycles; the rest of the cycle
        # is the cycle's own work outside the layer passes (what a leaner cycle could save)
        per_call = m["per_call_s"] / m["cycles"]
        row = {"gamma": g, "draft_width": w, "by_level": by_level, "steps_per_cycle": s, "cycle_ms": cycle * 1e3,
               "layer_passes_ms": layers * 1e3, "rest_ms": (cycle - layers) * 1e3,
               "per_call_ms_per_cycle": per_call * 1e3, "cycle_rest_ms": (cycle - layers - per_call) * 1e3,
               "measured_speedup": plain["wall_s"] / m["wall_s"], "bound_if_rest_free": s * beam_step / layers}
        rows.append(row)
        verdict = "below" if row["bound_if_rest_free"] < args.target else "not below"
        for kind in ("trunk", "upper", "tree call"):
            if f"{kind}_s" in m:
                row[f"{kind}_ms_per_cycle"] = m[f"{kind}_s"] / m["cycles"] * 1e3
                row[f"{kind}_tokens_per_pass"] = m[f"{kind}_tokens"] / m[f"{kind}_calls"]
                row[f"{kind}_passes_per_cycle"] = m[f"{kind}_calls"] / m["cycles"]
        if "tree call_ms_per_cycle" in row:
            print(f"  per cycle: draft and verify in one call {row['tree call_ms_per_cycle']:.2f} ms "
                  f"({row['tree call_tokens_per_pass']:.1f} nodes); other passes {layers * 1e3 - row['tree call_ms_per_cycle']:.2f} ms")
        else:
            print(f"  per cycle: trunk passes {row.get('trunk_ms_per_cycle', 0):.2f} ms ({row.get('trunk_passes_per_cycle', 0):.1f} "
                  f"passes of {row.get('trunk_tokens_per_pass', 0):.1f} tokens), verify {row.get('upper_ms_per_cycle', 0):.2f} ms "
                  f"({row.get('upper_tokens_per_pass', 0):.1f} token slots per pass)")
        print(f"speculative beam gamma={g} W={w}{' (level by level)' if by_level else ''}: {s:.2f} steps per cycle; a cycle {cycle * 1e3:.2f} ms = layer passes "
              f"{layers * 1e3:.2f} ms + rest {(cycle - layers) * 1e3:.2f} ms (per-call work {per_call * 1e3:.2f} ms, "
              f"the cycle's own {(cycle - layers - per_call) * 1e3:.2f} ms); measured {row['measured_speedup']:.2f}x beam "
              f"search; bound with the rest free {row['bound_if_rest_free']:.2f}x ({verdict} the {args.target:g}x target)")
    if args.json:
        out = {"setup": setup.description, "machine": machine_info("cpu"), "threads": args.threads, "reps": args.reps, "beam_size": k,
               "beam_step_ms": beam_step * 1e3, "beam_layer_ms_per_step": plain["layer_s"] / plain["steps"] * 1e3,
               "rows": rows, "raw": {f"gamma={g},W={w}{',by level' if b else ''}": r for (g, w, b), r in results.items()}}
        write_json(args.json, out)


if __name__ == "__main__":
    main()
