"""Where a batch decode's time goes, row count by row count: plain decoding, fixed gammas and
gamma="auto" timed by the rows still running, side by side.

A batch call ends with fewer rows than it started with (its tail: the longest sentences' last tokens),
and speculation pays differently there than with every row running: on the shipped model at batch 8,
gamma 4 is about as fast as plain decoding with 8 rows and 1.3-1.5x faster with 1-2. A grid cell's one
ratio (tools/auto_grid.py) hides where auto gained or lost; this table shows microseconds a token at
each row count for every mode, and which arms auto ran there.

Every mode runs `SpeculativeDecoder.sample(gamma="auto")` with the policy the API builds wrapped: the
fixed modes answer every cycle with their gamma (nothing learned, nothing else changed in the loop), auto
asks the real policy. One decoder serves every mode and pass, as in a user's session: auto keeps what
it learned. The first pass is a warm-up (untimed), the modes run one after another in each pass, in an
order that rotates from pass to pass, on the same sentences and seeds.

    .venv/bin/python tools/auto_rows.py --widen 0 --batch 8 --gammas 0 2 4 6 --sentences 32 --reps 3
    .venv/bin/python tools/auto_rows.py --batch 4 --temperature 0 --json benchmarks/auto_rows.json
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from benchmark import default_model, machine_info, tool_parser  # noqa: E402

from tts_specdec import SpeculativeDecoder, api  # noqa: E402
from tts_specdec.auto import AUTO  # noqa: E402
from tts_specdec.speech.atomic import write_json  # noqa: E402


class _Timings:
    """Seconds and tokens by (mode, running rows, arm, gamma), booked from one `next` to the next."""

    def __init__(self) -> None:
        self.by: dict[tuple[str, int, str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # s, tokens, runs
        self.mode = "warm-up"
        self.force: int | None = None  # the fixed gamma of the mode running (None: auto)


def _policy(timings: _Timings) -> type:
    """The API's sampling policy, wrapped: fixed modes answer their gamma, every run is timed."""

    class Timed(api.SamplingPolicy):
        _open: tuple[tuple[str, int, str, int], float, float] | None = None

        def next(self, rows: int) -> tuple[int, float | None]:
            now = time.perf_counter()
            self._close(now)
            if timings.force is None:
                answer = super().next(rows)
                arm = self._run.arm  # every `next` leaves a run under way
            else:
                self.plain_steps = None
                answer, arm = (timings.force, None), "fixed"
            self._open = ((timings.mode, rows, arm, answer[0]), now, 0.0)
            return answer

        def _close(self, now: float) -> None:
            if self._open is not None:
                key, start, tokens = self._open
                entry = timings.by[key]
                entry[0] += now - start
                entry[1] += tokens
                entry[2] += 1
                self._open = None

        def kept(self, tokens: int) -> None:
            if self._open is not None:
                key, start, before = self._open
                self._open = (key, start, before + tokens)
            if timings.force is None:
                super().kept(tokens)

        def observe(self, accepted: list[int], proposed: list[int]) -> None:
            if timings.force is None:
                super().observe(accepted, proposed)

        def plain(self, steps: int) -> None:
            if timings.force is None:
                super().plain(steps)

        def finish(self) -> None:
            self._close(time.perf_counter())
            if timings.force is None:
                super().finish()

    return Timed


def main(argv: list[str] | None = None) -> int:
    p = tool_parser(__doc__, sentences=32, reps=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gammas", type=int, nargs="+", default=[0, 4], help="the fixed modes (0: plain decoding)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy decoding")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    if args.batch < 1 or args.reps < 1 or args.sentences < 1:
        p.error("--batch, --reps and --sentences must be >= 1")
    if any(g < 0 for g in args.gammas):
        p.error("--gammas must be >= 0")
    torch.set_num_threads(args.threads)
    widen = None if args.widen == [0] else args.widen
    setup = default_model("cpu", sentences=args.sentences, batch=args.batch, widen=widen)
    dec = SpeculativeDecoder(setup.model)
    modes = [(f"gamma {g}", g) for g in args.gammas] + [(AUTO, None)]
    timings = _Timings()
    wrapped, api.SamplingPolicy = api.SamplingPolicy, _policy(timings)
    try:
        passes: dict[str, list[float]] = defaultdict(list)
        generated: dict[str, int] = defaultdict(int)  # tokens the timed passes generated, by mode
        for rep in range(args.reps + 1):
            for name, force in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                timings.mode, timings.force = (name if rep else "warm-up"), force
                start, tokens = time.perf_counter(), 0
                for src, most in zip(setup.sources, setup.max_lengths):
                    out = dec.sample(src, temperature=args.temperature, gamma=AUTO, max_length=most,
                                     generator=torch.Generator().manual_seed(rep))
                    tokens += out.stats.generated_tokens
                if rep:
                    passes[name].append(tokens / (time.perf_counter() - start))
                    generated[name] += tokens
    finally:
        api.SamplingPolicy = wrapped

    names = [name for name, _ in modes]
    summed: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (mode, rows) -> s, tokens
    for (mode, rows, _, _), (seconds, tokens, _) in timings.by.items():
        summed[mode, rows][0] += seconds
        summed[mode, rows][1] += tokens
    rows_table = []
    for rows in range(args.batch, 0, -1):
        row: dict = {"rows": rows}
        for name in names:
            seconds, tokens = summed[name, rows]
            row[name] = {"seconds": seconds, "tokens": tokens, "us_per_token": 1e6 * seconds / tokens if tokens else None}
        row["auto_arms"] = {f"{k[2]} {k[3]}": {"seconds": v[0], "tokens": v[1], "runs": v[2]}
                            for k, v in sorted(timings.by.items()) if k[0] == AUTO and k[1] == rows}
        rows_table.append(row)

    print(f"{setup.description}, batch {args.batch}, temperature {args.temperature}, {args.threads} threads, {args.reps} passes")
    print("tokens/s by pass: " + "; ".join(f"{n} " + " ".join(f"{x:.0f}" for x in passes[n]) for n in names))
    print("rows | " + " | ".join(f"{n:>9s}" for n in names) + " | us a token; share of the mode's time")
    total = {name: sum(r[name]["seconds"] for r in rows_table) for name in names}
    for row in rows_table:
        cells = []
        for name in names:
            cell = row[name]
            cells.append(f"{cell['us_per_token']:5.0f} {cell['seconds'] / total[name]:4.0%}" if cell["tokens"] else "        -")
        print(f"{row['rows']:4d} | " + " | ".join(cells))
        arms = ", ".join(f"{a} {v['seconds'] / max(v['tokens'], 1) * 1e6:.0f} us ({v['seconds'] * 1e3:.0f} ms)"
                         for a, v in row["auto_arms"].items())
        if arms:
            print(f"       auto ran: {arms}")
    if args.json:
        write_json(args.json, {"machine": machine_info("cpu"), "setup": setup.description, "batch": args.batch,
                               "temperature": args.temperature, "threads": args.threads, "reps": args.reps,
                               "sentences": args.sentences, "passes_tokens_per_s": passes,
                               "generated_tokens": generated, "rows": rows_table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
