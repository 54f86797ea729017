"""gamma="auto": the draft length chosen from what decoding costs on this machine and what gets accepted.

Speculation pays only where verifying gamma + 1 tokens costs about one plain step; whether it does
depends on the model's size, the device, the kernels and the thread count, so it is measured, not
assumed: `measure_sampling` times real decoder calls on a short dummy decode (its own cache, so no
output changes) and `Costs` keeps the result per (parameters, dtype, device, threads). From those costs
and the acceptance observed while decoding, `choose_gamma` picks the gamma with the most expected tokens
per unit of time, and 0 (plain decoding) unless speculation is predicted to win by `MARGIN`; the cost
device decides whether it drafts with stops (`stops_pay`). Changing gamma between cycles keeps speculative
sampling exact: each cycle is lossless on its own. Beam search is decided once per call, from timed short
plain and speculative beam searches (`measure_beam`, `choose_beam_gamma`).

Costs are in plain target steps (batch 1): a plain step costs 1, a draft step c, and v(n) is the rest of
a speculative cycle that verifies n tokens (the target pass over them, the accept rule, the cycle's
bookkeeping), so a cycle with gamma drafts costs gamma * c + v(gamma + 1) and yields
(1 - alpha^(gamma+1)) / (1 - alpha) tokens on average (Leviathan et al. 2022).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
from torch import Tensor

from .beam import beam_search_loop, encode_beams
from .decoder import Decoder
from .results import DecodeStats
from .sampling import SamplingConfig
from .speculative import probe_cycle

AUTO = "auto"
MAX_GAMMA = 10  # most drafts per cycle auto considers (and measures v for)
# speculation must be predicted to beat plain decoding by 5%: the costs are medians of a few timings and
# the acceptance an estimate, so a predicted tie is a likely loss
MARGIN = 1.05
PRIOR_ALPHA = 0.8  # acceptance assumed before any draft was judged (typical for a trained exit head)
PRIOR_WEIGHT = 4.0  # the prior counts as this many judged drafts
# draft stops: a row stops drafting after a draft its draft head gave less than DRAFT_CONFIDENCE. They cut
# the drafts that follow an unsure one, mostly rejected, saving their draft steps and verify cost; since
# unsure drafts end a row's run, the drafts that go on are sure ones, so with stops a row may draft as far
# as a draft that is always right would pay for. Whether they beat the fixed gamma the cost model picks
# depends on more than it models (docs/performance.md, CPU: stops won at batch 1 on the shipped model and
# its width-512 widening and lost at batch 4, where the rows' ragged drafts pad a compute-bound verify),
# so on the CPU auto times both while it decodes (`SamplingPolicy`). On torch's path on a GPU the rule
# needs a host copy per draft step, and on a GPU greedy decoding with stops lost to a fixed gamma
# (docs/performance.md): there auto drafts a fixed gamma.
DRAFT_CONFIDENCE = 0.9
# the timed choice between a fixed gamma and draft stops (`WayTimes`, kept across calls of one decoder
# per batch size). A cycle's seconds per token swing with its acceptance (at batch 1 a fixed-gamma cycle
# emits 1..gamma+1 tokens in the same time), so a few lucky cycles must not settle it: after EXPLORE
# cycles of each (alternating), each cycle takes the way whose seconds per token, drawn from its estimate
# and standard error, is lower (Thompson sampling: the slower way runs about as often as it might still
# be the faster), and the other way every EXPLORE_EVERY cycles whatever the draws. A way's sums fade by
# TIME_KEEP per cycle it runs: the estimate follows a slow drift (longer prefixes) but rests on up to
# 1 / (1 - TIME_KEEP) cycles.
EXPLORE = 4
EXPLORE_EVERY = 32
TIME_KEEP = 0.99
# observations fade by half every HALF_LIFE generated tokens: acceptance moves along an utterance, and
# while auto decodes plainly (nothing judged) the prior returns, so speculation gets tried again
HALF_LIFE = 32.0
# beam steps a speculative beam cycle at gamma 1, 2 commits before any was observed: below what the
# shipped exit head commits at draft width 2K (1.71 and 2.17 over 8 held-out sentences, K = 4), so a
# weaker head is not assumed to do better than ours
BEAM_PRIOR_STEPS = (1.5, 1.9)
BEAM_PRIOR_WEIGHT = 4.0  # the prior counts as this many cycles

SAMPLE_GAMMAS = (0, 1, 2, 4, 7, 10)  # cycles timed; v is interpolated between them
BEAM_GAMMAS = (1, 2)  # speculative beam cycles timed (longer ones lose more wherever measured)
SOURCE_LENGTH = 48  # dummy source tokens (a sentence)
PREFIX = 64  # dummy decoded positions before the timed calls: attention over a typical prefix
PLAIN_PROBE_STEPS = 4  # steps per timed fused plain run
REPS = 5  # timed repetitions per call (median), after one untimed warm-up
# beam searches are timed whole (a few steps each): fewer, on a short source whose encoding, taken out of
# the timings, costs little next to them
BEAM_PROBE_LENGTH = 4
BEAM_SOURCE_LENGTH = 8
BEAM_REPS = 3
KEEP = 4  # cost models kept per decoder (a training loop changes parameters every call)


@dataclass(frozen=True)
class CostModel:
    """What speculative sampling costs on this machine, measured by `measure_sampling`."""

    t_step: float  # seconds of one plain target step (all layers + target head, one token, batch 1)
    c: float  # one draft step (layers 1..E + exit head) / t_step
    v: tuple[float, ...]  # v[n - 1]: the rest of a cycle verifying n tokens / t_step, n = 1..MAX_GAMMA + 1
    device: str = "cpu"  # the device type measured on

    def cycle(self, gamma: int) -> float:
        """A cycle with `gamma` drafts, in plain steps."""
        return gamma * self.c + self.v[min(gamma + 1, len(self.v)) - 1]


@dataclass(frozen=True)
class BeamCosts:
    """What beam search costs on this machine for one beam size and draft width (`measure_beam`)."""

    step: float  # seconds of one plain beam step
    cycles: tuple[float, ...]  # cycles[g - 1]: seconds of one speculative beam cycle at gamma g


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a row emits per cycle: accepted drafts + the correction or bonus token."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def choose_gamma(c: float, v: Sequence[float], alpha: float, max_gamma: int, margin: float = MARGIN) -> int:
    """The gamma in 0..max_gamma with the most expected tokens per unit of time,
    E[tokens] / (gamma * c + v(gamma + 1)) with v(n) = v[n - 1], against plain decoding's 1 token per
    1.0 step; 0 unless that is at least `margin` times plain's (so never speculation that loses).
    Pure: the same numbers give the same answer. max_gamma is capped at len(v) - 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if c < 0 or not v or min(v) <= 0:
        raise ValueError("c must be >= 0 and v non-empty and positive")
    best, best_rate = 0, 1.0
    for gamma in range(1, min(max_gamma, len(v) - 1) + 1):
        rate = expected_tokens(alpha, gamma) / (gamma * c + v[gamma])
        if rate > best_rate:  # ties keep the shorter draft
            best, best_rate = gamma, rate
    return best if best_rate >= margin else 0


def stops_pay(costs: CostModel) -> bool:
    """Whether auto may draft with stops: on the CPU (see DRAFT_CONFIDENCE)."""
    return costs.device == "cpu"


def choose_beam_gamma(step: float, cycles: Sequence[float], steps_per_cycle: Sequence[float],
                      margin: float = MARGIN) -> int:
    """The gamma (1..len(cycles)) whose speculative beam search commits the most beam steps per second,
    steps_per_cycle[g - 1] / cycles[g - 1] against plain's 1 / step; 0 unless at least `margin` times
    plain's. Pure, like `choose_gamma`."""
    best, best_rate = 0, 1.0
    for gamma, (seconds, steps) in enumerate(zip(cycles, steps_per_cycle), start=1):
        rate = steps * step / seconds
        if rate > best_rate:
            best, best_rate = gamma, rate
    return best if best_rate >= margin else 0


class WayTimes:
    """Fading sums over the speculative cycles of each way (False: a fixed gamma, True: draft stops) of
    seconds, tokens and their squares and product (the ratio estimate of seconds per token and its
    variance), and the choice of way made from them: what `SamplingPolicy` asks, kept by `Costs` across
    calls."""

    def __init__(self) -> None:
        self.sums = {way: [0.0] * 6 for way in (False, True)}  # n, s, t, s*s, t*t, s*t
        self.runs = {False: 0, True: 0}
        # its own generator: the draws move neither torch's nor the caller's random state
        self._draw = random.Random(0)

    def add(self, way: bool, seconds: float, tokens: int) -> None:
        sums = self.sums[way]
        for i, x in enumerate((1.0, seconds, tokens, seconds * seconds, tokens * tokens, seconds * tokens)):
            sums[i] = TIME_KEEP * sums[i] + x
        self.runs[way] += 1

    def rate(self, way: bool) -> tuple[float, float]:
        """(seconds per token, its variance): the ratio estimator over the faded cycles."""
        n, s, t, ss, tt, st = self.sums[way]
        r = s / t
        residual = max(ss - 2.0 * r * st + r * r * tt, 0.0)  # sum of (s_i - r t_i)^2
        return r, residual / (t * t) * n / max(n - 1.0, 1e-9)

    def pick(self) -> bool:
        """The way for the next cycle (see EXPLORE)."""
        if min(self.runs.values()) < EXPLORE:
            return self.sums[True][0] <= self.sums[False][0]
        draws = {}
        for way in (True, False):
            rate, var = self.rate(way)
            draws[way] = self._draw.gauss(rate, math.sqrt(var))
        best = draws[True] <= draws[False]
        return (not best) if (self.runs[True] + self.runs[False]) % EXPLORE_EVERY == 0 else best


class SamplingPolicy:
    """gamma="auto" for one sampling call: each cycle's gamma and draft stops, from the cost model and the
    acceptance judged so far (a running estimate that starts at PRIOR_ALPHA).

    A cycle drafts the gamma `choose_gamma` picks at the estimated acceptance (0: plain steps, a fused run
    where the kernels have them), or, with draft stops, lets rows draft up to the gamma that would pay for
    a draft that is always right and stop after the first draft they are unsure of. The caller's
    `confidence` always stops; otherwise, where stops may pay (`stops_pay`), the two ways are timed
    against each other on the decoder's cycles (seconds per emitted token, `WayTimes`), the faster
    decoding most of them.
    Stops read only the draft's own distribution, so neither way changes what is sampled; but which way a
    cycle takes follows the clock, so seeded sampling under auto is not reproduced token for token."""

    def __init__(self, costs: CostModel, confidence: float | None = None, max_gamma: int = MAX_GAMMA,
                 ways: WayTimes | None = None) -> None:
        self.costs = costs
        self.max_gamma = max_gamma
        # the gamma a draft that is always right would pay for: the most drafts with stops; 0: speculation
        # cannot pay here at any acceptance, decode plainly throughout
        self.sure_gamma = self._choose(1.0)
        self.pays = self.sure_gamma > 0
        # the caller's draft stops (always), else stops timed against a fixed gamma where they may pay
        self.forced = confidence is not None
        self.stops = confidence if self.forced else DRAFT_CONFIDENCE if stops_pay(costs) else None
        self.used_confidence: float | None = None  # the draft stops some cycle used
        self._accepted = self._judged = 0.0  # fading sums over judged drafts
        self.ways = WayTimes() if ways is None else ways  # the two ways' timings (shared across calls)
        self._cycle: tuple[bool, float] | None = None  # (way, start) of the speculative cycle under way
        self._emitted = 0  # tokens it emitted (`observe`)

    @property
    def alpha(self) -> float:
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ALPHA) / (self._judged + PRIOR_WEIGHT)

    def next(self) -> tuple[int, float | None]:
        """(gamma, draft_confidence) for the next cycle; gamma 0: plain steps."""
        self._close()
        gamma = self._choose(self.alpha) if self.pays else 0
        if not gamma:
            return 0, None
        stops = self.stops is not None and (self.forced or self.ways.pick())
        self._cycle = (stops, time.perf_counter())
        if not stops:
            return gamma, None
        self.used_confidence = self.stops
        return self.sure_gamma, self.stops

    def _close(self) -> None:
        """Books the last speculative cycle's time (start to the next `next`) under its way."""
        if self._cycle is not None and self._emitted:
            way, start = self._cycle
            self.ways.add(way, time.perf_counter() - start, self._emitted)
        self._cycle, self._emitted = None, 0

    def observe(self, accepted: list[int], proposed: list[int]) -> None:
        """A cycle's accepted drafts and proposed drafts per row. A row judges its drafts up to its first
        rejection: accepted + 1 of them, or all when all were accepted."""
        self._fade(sum(a + 1 for a in accepted) / len(accepted))
        self._emitted = sum(a + 1 for a in accepted)
        self._accepted += sum(accepted)
        self._judged += sum(a + (a < n) for a, n in zip(accepted, proposed))

    def plain(self, steps: int) -> None:
        """`steps` plain steps ran: nothing judged, the estimate drifts back toward the prior."""
        self._cycle = None
        self._fade(steps)

    def _fade(self, tokens: float) -> None:
        keep = 0.5 ** (tokens / HALF_LIFE)
        self._accepted *= keep
        self._judged *= keep

    def _choose(self, alpha: float) -> int:
        return choose_gamma(self.costs.c, self.costs.v, alpha, self.max_gamma)


class Costs:
    """The cost models of one decoder, each measured once per (parameters, dtype, device, threads) and
    kept, and the beam steps that speculative beam search committed per cycle in earlier auto calls."""

    def __init__(self) -> None:
        self._sampling: dict[tuple, CostModel] = {}
        self._beam: dict[tuple, BeamCosts] = {}
        self._beam_steps: dict[int, tuple[float, float]] = {}  # gamma -> (committed steps, cycles)
        self._ways: dict[tuple, WayTimes] = {}

    @staticmethod
    def key(dec: Decoder) -> tuple:
        """What the timings depend on. `Decoder.begin` (called first by every decode call) keeps its
        parameter state in `_state`: storage, versions and values of the parameters, the thread count and
        the kernel switch."""
        return dec._state, dec.dtype, dec.device, torch.get_num_threads()

    def sampling(self, dec: Decoder) -> CostModel:
        return _kept(self._sampling, self.key(dec), lambda: measure_sampling(dec))

    def ways(self, dec: Decoder, rows: int, sampling: bool) -> WayTimes:
        """The timed ways of auto sampling for `rows` sequences (greedy or sampling), kept across calls."""
        return _kept(self._ways, (self.key(dec), rows, sampling), WayTimes)

    def beam(self, dec: Decoder, beam_size: int, draft_width: int) -> BeamCosts:
        key = (self.key(dec), beam_size, draft_width)
        return _kept(self._beam, key, lambda: measure_beam(dec, beam_size, draft_width))

    def beam_gamma(self, dec: Decoder, beam_size: int, draft_width: int) -> int:
        """gamma for an auto beam search: 0 unless speculative beam search is predicted to win."""
        costs = self.beam(dec, beam_size, draft_width)
        steps = []
        for gamma in range(1, len(costs.cycles) + 1):
            committed, cycles = self._beam_steps.get(gamma, (0.0, 0.0))
            prior = BEAM_PRIOR_STEPS[min(gamma, len(BEAM_PRIOR_STEPS)) - 1]
            steps.append((committed + BEAM_PRIOR_WEIGHT * prior) / (cycles + BEAM_PRIOR_WEIGHT))
        return choose_beam_gamma(costs.step, costs.cycles, steps)

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


# ---- measurement --------------------------------------------------------------------------------


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
    cycle_s = {g: statistics.median(t) for g, t in cycle.items()}
    # plain decoding takes its steps in fused runs where the kernels have them, else one cycle each; the
    # cheaper of the two is the step speculation has to beat
    t_step = min(cycle_s[0], statistics.median(plain)) if plain else cycle_s[0]
    drafting = [g for g in SAMPLE_GAMMAS if g]
    draft_s = {g: statistics.median(draft[g]) for g in drafting}
    # the draft phase's slope over gamma; under load elsewhere timings jump, and a slope above some
    # gamma's whole draft phase per draft would leave its verify negative: bounded by those
    per_draft = min(max(_slope(drafting, [draft_s[g] for g in drafting]), 0.0), *(draft_s[g] / g for g in drafting))
    # v at the measured n = gamma + 1 (never below what the verify phases themselves took), then linear
    # in between
    verify_s = {g: statistics.median(c - d for c, d in zip(cycle[g], draft[g])) for g in SAMPLE_GAMMAS}
    measured = {g + 1: max(cycle_s[g] - g * per_draft, verify_s[g]) / t_step for g in SAMPLE_GAMMAS}
    v = tuple(_interpolate(measured, n) for n in range(1, MAX_GAMMA + 2))
    return CostModel(t_step, per_draft / t_step, v, dec.device.type)


def measure_beam(dec: Decoder, beam_size: int, draft_width: int) -> BeamCosts:
    """Time short plain and speculative (BEAM_GAMMAS, `draft_width`) beam searches on a short dummy
    source: seconds per beam step and per speculative cycle, the source's encoding taken out. These are
    the real loops, their Python bookkeeping included (what decides whether speculative beam search
    pays), each on its own cache. Call inside `inputs.eval_mode`, after `Decoder.begin`."""
    from .spec_beam import spec_beam_search_loop

    evals = list(dec.layer_evals)
    source = _dummy_source(dec, BEAM_SOURCE_LENGTH)
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
        encode = _median(dec.device, lambda: encode_beams(dec, source, beam_size, False))
        for rep in range(BEAM_REPS + 1):  # round robin, the first round untimed (as in measure_sampling)
            for run, seconds in zip(runs, times):
                elapsed, steps = _timed(dec.device, run)
                if rep:  # under load the encoding's median can exceed this run's own: a run never costs nothing
                    seconds.append(max(elapsed - encode, 0.1 * elapsed) / steps)
    finally:
        dec.layer_evals = evals
    step, *cycles = (statistics.median(t) for t in times)
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


def _median(device: torch.device, fn: Callable[[], object]) -> float:
    """Median seconds of REPS calls after an untimed one."""
    fn()
    return statistics.median(_timed(device, fn)[0] for _ in range(REPS))


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
