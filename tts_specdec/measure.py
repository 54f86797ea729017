"""What gamma="auto" knows about one decoder on this machine: the cost models it seeds its choices with,
measured on short dummy decodes (`measure_sampling`, `measure_beam`), and the timings of its own runs
(`auto.Arms`), kept by `Costs` per parameters, dtype, device and thread count.

The measurements run the real loops (`speculative.probe_cycle`, the beam search loops) on their own
caches; the policies in `auto` get only the numbers.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, TypeVar

import torch
from torch import Tensor

from .auto import (
    EXPLORE_CALLS, MAX_GAMMA, PLAIN, SPECULATIVE, Arms, BeamCosts, BeamPolicy, beam_steps_per_cycle,
    CostModel, row_class,
)
from .beam import beam_search_loop, encode_beams
from .decoder import Decoder
from .results import DecodeStats
from .sampling import SamplingConfig
from .speculative import probe_cycle

SAMPLE_GAMMAS = (0, 1, 2, 4, 7, 10)  # cycles timed; v is interpolated between them
BEAM_GAMMAS = (1, 2)  # speculative beam cycles timed (longer ones lose more wherever measured)
SOURCE_LENGTH = 48  # dummy source tokens (a sentence)
PREFIX = 64  # dummy decoded positions before the timed calls: attention over a typical prefix
PLAIN_PROBE_STEPS = 4  # steps per timed fused plain run
REPS = 5  # timed repetitions per call, after one untimed warm-up; each timing is their fastest (`fastest`)
# beam searches are timed whole, fewer, on a short source whose encoding, taken out of the timings, costs
# little next to them. A search lasts BEAM_PROBE_LENGTH steps, more where steps are cheap: up to
# BEAM_PROBE_MAX_LENGTH, as many as about BEAM_PROBE_SECONDS of plain steps. On a small model (its weights
# in the caches) attention over the growing cache and the loop's per-call costs weigh in a cycle as in
# real searches only past a few steps: with 4-step searches the shipped model's probe predicted
# speculative beam search at 0.70-0.96x of plain beam search, run to run, where whole calls ran it at
# 0.70-0.73x; with 24 steps 0.66-0.70x. Where a step streams the weights (width 512: ~11 ms) 4 steps
# predicted as well as 24, which took 4 s of the first call.
BEAM_PROBE_LENGTH = 4
BEAM_PROBE_MAX_LENGTH = 24
BEAM_PROBE_SECONDS = 0.03
BEAM_SOURCE_LENGTH = 8
BEAM_REPS = 3
KEEP = 4  # states kept per decoder (a training loop changes parameters every call)


class Costs:
    """The cost models of one decoder, each measured once per (parameters, dtype, device, threads) (and
    for beam search per beam size, draft width and batch row class), the timings of auto's arms, and the
    beam steps speculative beam search committed per cycle in auto calls."""

    def __init__(self) -> None:
        self._sampling: dict[tuple, CostModel] = {}
        self._beam: dict[tuple, dict[tuple[int, int, int], BeamCosts]] = {}  # (beam size, width, row class)
        self._arms: dict[tuple, dict[int, Arms]] = {}
        self._beam_steps: dict[int, tuple[float, float]] = {}  # gamma -> (committed steps, cycles)

    @staticmethod
    def key(dec: Decoder) -> tuple:
        """What the timings depend on. `Decoder.begin` (called first by every decode call) keeps its
        parameter state in `_state`: storage, versions and values of the parameters, the thread count and
        the kernel switch."""
        return dec._state, dec.dtype, dec.device, torch.get_num_threads()

    def sampling(self, dec: Decoder) -> CostModel:
        return _kept(self._sampling, self.key(dec), lambda: measure_sampling(dec))

    def arms(self, dec: Decoder, sampling: bool, guided: bool) -> dict[int, Arms]:
        """The timed arms of auto sampling (greedy or not, guided or not) by row class, kept across calls."""
        return _kept(self._arms, (self.key(dec), "sample", sampling, guided), dict)

    def beam(self, dec: Decoder, beam_size: int, draft_width: int, batch: int = 1) -> BeamCosts:
        """What beam search costs for a batch of `batch` items' row class (`auto.row_class`), measured on
        first use. A verify pass carries about 2-3 times a beam step's rows, so speculative beam search's
        worth falls with the batch (width 512, 2 threads: 1.05-1.14x of beam search with one item,
        0.65-0.69x with eight), which costs seeded from one item do not show. Where the backend runs
        static shapes (the compiled path: each new shape compiles its graphs, tens of seconds on a GPU)
        every batch gets the one-item costs."""
        batch = 1 if dec.backend.static_shapes else row_class(batch)
        costs = _kept(self._beam, self.key(dec), dict)
        if (beam_size, draft_width, batch) not in costs:
            costs[beam_size, draft_width, batch] = measure_beam(dec, beam_size, draft_width, batch)
        return costs[beam_size, draft_width, batch]

    def beam_policy(self, dec: Decoder, batch: int, beam_size: int, draft_width: int, guided: bool) -> BeamPolicy:
        """gamma="auto" for a beam search call: seeded by `beam` at the batch's row class, timed per row
        class."""
        tables = _kept(self._arms, (self.key(dec), "beam", beam_size, draft_width, guided), dict)
        rows = row_class(batch)
        table = tables.setdefault(rows, Arms(EXPLORE_CALLS))
        timed = [c for c, t in tables.items() if c < rows and {PLAIN, SPECULATIVE} <= set(t.sums)]
        steps = beam_steps_per_cycle(self._beam_steps, BEAM_GAMMAS)
        return BeamPolicy(self.beam(dec, beam_size, draft_width, batch), table, steps,
                          explore_all=not dec.backend.static_shapes, fewer_rows=tables[max(timed)] if timed else None)

    def observe_beam(self, gamma: int, committed_hist: list[int]) -> None:
        """What an auto speculative beam search at `gamma` committed per cycle ([k] = cycles committing k)."""
        committed, cycles = self._beam_steps.get(gamma, (0.0, 0.0))
        self._beam_steps[gamma] = (committed + sum(k * n for k, n in enumerate(committed_hist)),
                                   cycles + sum(committed_hist))


T = TypeVar("T")


def _kept(store: dict[tuple, T], key: tuple, measure: Callable[[], T]) -> T:
    """store[key], measured first if missing; the oldest entry goes beyond KEEP."""
    if key not in store:
        if len(store) >= KEEP:
            del store[next(iter(store))]  # the oldest
        store[key] = measure()
    return store[key]


def measure_sampling(dec: Decoder) -> CostModel:
    """Time greedy cycles at SAMPLE_GAMMAS drafts (batch 1, after a PREFIX-token dummy prefix) and plain
    steps; the draft's cost per step is the slope of the cycles' draft phases. Runs on its own cache and
    leaves the decoder's counters as they were. Call inside `inputs.eval_mode`, after `Decoder.begin`."""
    if dec.exit_layer is None:
        raise ValueError("speculative sampling needs an early-exit head: there is nothing to measure")
    evals = list(dec.layer_evals)
    try:
        enc = dec.encode(_dummy_source(dec, SOURCE_LENGTH))
        cache = dec.new_cache(1, PREFIX + max(MAX_GAMMA, PLAIN_PROBE_STEPS) + 4)
        dec.run(dec.start(1).expand(1, PREFIX, -1).contiguous(), 0, range(dec.depth), enc, cache)
        x, pos = dec.start(1), torch.tensor([PREFIX], device=dec.device)
        fused = dec.backend.fused_plain
        cycle: dict[int, list[float]] = {g: [] for g in SAMPLE_GAMMAS}
        draft: dict[int, list[float]] = {g: [] for g in SAMPLE_GAMMAS}
        plain: list[float] = []
        # round robin, the first round untimed: a burst of load elsewhere hits every gamma alike
        for rep in range(REPS + 1):
            for gamma in SAMPLE_GAMMAS:
                seconds, draft_seconds = _timed(dec.device, lambda: probe_cycle(dec, x, pos, gamma, enc, cache))
                if rep:
                    cycle[gamma].append(seconds)
                    draft[gamma].append(draft_seconds)
            if fused:
                seconds, run = _timed(
                    dec.device, lambda: dec.backend.plain_steps(x, pos, PLAIN_PROBE_STEPS, SamplingConfig(0.0), None,
                                                                enc, cache))
                if rep:
                    plain.append(seconds / run[0].shape[1])  # a run may end early, at EOS
    finally:
        dec.layer_evals = evals
    cycle_s = {g: fastest(t) for g, t in cycle.items()}
    # plain decoding takes its steps in fused runs where the kernels have them, else one cycle each; the
    # cheaper of the two is the step speculation has to beat
    t_step = min(cycle_s[0], fastest(plain)) if plain else cycle_s[0]
    drafting = [g for g in SAMPLE_GAMMAS if g]
    draft_s = {g: fastest(draft[g]) for g in drafting}
    # the draft phase's slope over gamma; under load elsewhere timings jump, and a slope above some
    # gamma's whole draft phase per draft would leave its verify negative: bounded by those
    per_draft = min(max(_slope(drafting, [draft_s[g] for g in drafting]), 0.0), *(draft_s[g] / g for g in drafting))
    # v at the measured n = gamma + 1 (never below what the verify phases themselves took), then linear
    # in between
    verify_s = {g: fastest([c - d for c, d in zip(cycle[g], draft[g])]) for g in SAMPLE_GAMMAS}
    measured = {g + 1: max(cycle_s[g] - g * per_draft, verify_s[g]) / t_step for g in SAMPLE_GAMMAS}
    v = tuple(_interpolate(measured, n) for n in range(1, MAX_GAMMA + 2))
    return CostModel(t_step, per_draft / t_step, v, dec.device.type)


def measure_beam(dec: Decoder, beam_size: int, draft_width: int, batch: int = 1) -> BeamCosts:
    """Time short plain and speculative (BEAM_GAMMAS, `draft_width`) beam searches of `batch` items on a
    short dummy source: seconds per beam step and per speculative cycle, the source's encoding taken out.
    These are the real loops, their Python bookkeeping included (what decides whether speculative beam
    search pays), each on its own cache. Call inside `inputs.eval_mode`, after `Decoder.begin`."""
    from .spec_beam import spec_beam_search_loop

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    evals = list(dec.layer_evals)
    source = _dummy_source(dec, BEAM_SOURCE_LENGTH).repeat(batch, 1)
    kw = dict(beam_size=beam_size, length_penalty=1.0, max_length=BEAM_PROBE_LENGTH, cond_scale=1.0)

    def plain() -> int:
        return beam_search_loop(dec, source, **kw)[2]

    def speculative(gamma: int) -> int:
        stats = DecodeStats()
        spec_beam_search_loop(dec, source, **kw, gamma=gamma, draft_width=draft_width, stats=stats)
        return stats.steps

    runs = [plain] + [lambda g=g: speculative(g) for g in BEAM_GAMMAS]
    times: list[list[float]] = [[] for _ in runs]
    try:
        encode = _fastest_of(dec.device, lambda: encode_beams(dec, source, beam_size, False))
        elapsed, steps = _timed(dec.device, plain)  # untimed: its steps' seconds set the searches' length
        step = max(elapsed - encode, 0.1 * elapsed) / steps
        kw["max_length"] = max(BEAM_PROBE_LENGTH, min(BEAM_PROBE_MAX_LENGTH, int(BEAM_PROBE_SECONDS / step)))
        for rep in range(BEAM_REPS + 1):  # round robin, the first round untimed (as in measure_sampling)
            for run, seconds in zip(runs, times):
                elapsed, steps = _timed(dec.device, run)
                if rep:  # under load the encoding's time can exceed this run's own: a run never costs nothing
                    seconds.append(max(elapsed - encode, 0.1 * elapsed) / steps)
    finally:
        dec.layer_evals = evals
    step, *cycles = (fastest(t) for t in times)
    return BeamCosts(step, tuple(cycles))


def _dummy_source(dec: Decoder, length: int) -> Tensor:
    """(1, length) ids of the source vocabulary, no padding: only the length matters."""
    m = dec.model
    vocab = m.num_text_token_ids if dec.source_type == "text" else m.num_semantic_token_ids
    ids = [i for i in range(vocab) if i != m.pad_id[dec.source_type]]
    return torch.tensor([[ids[i % len(ids)] for i in range(length)]], device=dec.device)


def _timed(device: torch.device, fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of fn(), with the device's queued work included."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _fastest_of(device: torch.device, fn: Callable[[], object]) -> float:
    """The fastest seconds of REPS calls after an untimed one."""
    fn()
    return fastest([_timed(device, fn)[0] for _ in range(REPS)])


def fastest(seconds: Sequence[float]) -> float:
    """What a repeated timing stands for: its fastest repetition. Load elsewhere only ever slows a timing,
    and in bursts that can cover most repetitions of one timing and none of another's (they are taken
    round robin), so medians carry the bursts into the costs' ratios. Width 512, 2 threads, Intel Xeon VM,
    with two processes busy for 20-300 ms at a time (`tools/cost_model_load.py`,
    benchmarks/cost_model_load_width512_2threads_xeon.json), four measurements each way: with medians v(5)
    came to 0.96-2.52 and the step to 4.7-7.5 ms, and the gamma the model picks at acceptance 0.8 to 1-7
    (quiet: 4-5); with the fastest repetitions 1.21-1.25, 4.5-4.8 ms and 4-5, as on the quiet machine."""
    return min(seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _interpolate(points: dict[int, float], n: int) -> float:
    """points at n, or linear between the nearest measured n on each side."""
    if n in points:
        return points[n]
    lo, hi = max(k for k in points if k < n), min(k for k in points if k > n)
    return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
