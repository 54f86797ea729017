"""gamma="auto": plain decoding or speculation, chosen from a cost model of this machine and corrected by
timings of auto's own runs.

The cost model (`CostModel`, measured once per decoder state by `measure.measure_sampling` on a dummy
decode at batch 1) seeds the choice: `choose_gamma` picks the gamma with the most expected tokens per
unit of time at the acceptance seen so far, and 0 (plain decoding) unless speculation is predicted to win
by MARGIN. The model knows batch 1 and its own formula only, so the runs correct it: plain decoding,
drafting that gamma, drafting with stops and (several rows on the CPU) a half and a third of that gamma
are arms (`Arms`) timed in seconds per emitted token on the decoder's own runs, per row count and kept
across calls; the fastest decodes almost all the time and the others are revisited rarely. With several
rows on the CPU, once those arms' cycles give it two gammas, a line of cycle seconds by gamma and tokens
carried (`Line`) and the acceptance by draft depth (`Depths`, per stage of the call: `STAGES`) pick the
gamma instead, and its price (cycle seconds over the tokens the stage's acceptance gives) and plain
steps' timed runs decide between them. Beam search chooses per call
between plain and speculative beam search the same way (`BeamPolicy`), seeded by timed short searches
(`BeamCosts`).
Every cycle, and every call, is exact on its own: no choice changes greedy tokens, beam search's result
or the law of sampled tokens. This module asks nothing of the loops; they ask the policies and tell them
what happened.

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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

AUTO = "auto"
MAX_GAMMA = 10  # most drafts per cycle auto considers (and measures v for)
# speculation must be predicted to beat plain decoding by 5%: the costs are the fastest of a few timings and
# the acceptance an estimate, so a predicted tie is a likely loss
MARGIN = 1.05
PRIOR_ALPHA = 0.8  # acceptance assumed before any draft was judged (typical for a trained exit head)
PRIOR_WEIGHT = 4.0  # the prior counts as this many judged drafts
# observations fade by half every HALF_LIFE generated tokens: acceptance moves along an utterance, and
# while auto decodes plainly (nothing judged) the prior returns, so speculation gets tried again
HALF_LIFE = 32.0
# draft stops: a row stops drafting after a draft its draft head gave less than DRAFT_CONFIDENCE. They cut
# the drafts that follow an unsure one, mostly rejected; since unsure drafts end a row's run, a row may
# draft as far as a draft that is always right would pay for. Whether they beat a fixed gamma depends on
# more than the cost model knows (on the CPU they won at batch 1; at batch 4 and 8 they lost while a stopped
# row's later passes were computed as padding; since the kernels skip those, 0.94-1.10x of gamma 4 there,
# width 512 and shipped), so on the CPU they are one more timed arm. On torch's path on a GPU the rule
# needs a host copy per draft step and lost to a fixed gamma (docs/performance-log.md): not an arm there.
DRAFT_CONFIDENCE = 0.9

# ---- the timed arms (`Arms`) ----
# A speculative cycle's seconds per token swing with its acceptance (at batch 1 a gamma-4 cycle emits 1..5
# tokens in about the same time), so a few lucky cycles must not settle the choice: every arm first runs
# EXPLORE_CYCLES times; a beam search call is one long run, steadier and dearer, so arms run
# EXPLORE_CALLS calls each. Its seconds per beam step still swing from call to call (speculative beam
# search's with the sentences' acceptance, both with load elsewhere: 10.8-12.6 ms a step at width 512,
# one item), and where the arms differ by 5-10% two calls each settled on the slower in two grid runs of
# three; only arms predicted within PLAUSIBLE of the fastest at the call's batch size are explored, where
# a wrong call costs little, so four.
EXPLORE_CYCLES = 4
EXPLORE_CALLS = 4
# after that, where plain decoding has the lowest seconds per token it runs; where a speculative arm has,
# the speculative arm with the lowest seconds per token drawn from its estimate and standard error runs
# (Thompson sampling among speculative arms, close alternatives: one runs about as often as it might
# still be the faster). Drawn against plain decoding too, four speculative arms' noisy estimates took a
# fifth of the time at 0.75-0.85x of plain on the shipped model at batch 4. An arm that has not run while
# the others ran REVISIT times its own run's seconds runs once whatever the draws (a slower arm gets at
# most ~1/REVISIT of the time, and an estimate made under other conditions is checked again). Plain
# decoding and the runner-up keep that interval, the other speculative arms wait as many times longer as
# there are arms besides the best: at width 512, batch 8, the best speculative arm led while gamma 10
# with and without stops, at 0.5-0.6x of its speed, took one share each. Plain decoding is never spread:
# a wrong early estimate of it (a few unlucky runs) must not let slower speculation run for long.
REVISIT = 64
# an arm's sums fade by TIME_KEEP per run of it: they follow a slow drift but rest on up to
# 1 / (1 - TIME_KEEP) runs
TIME_KEEP = 0.99
# a run of plain steps while another arm has the best estimate (exploring, revisiting, a lucky draw) lasts
# about EXPLORE_SECONDS (at least EXPLORE_STEPS steps), not a fused run's 32 steps: at width 512, batch 4,
# four 32-step runs per row class took about half as long as a whole 16-sentence benchmark pass. Shorter
# runs would time plain decoding unfairly: a loop iteration's fixed cost (under a millisecond) must stay a
# small part of a run, and on the shipped model, whose steps take ~0.5 ms, 8-step runs made plain decoding
# look slower than it is and auto speculated at 0.6-0.9x of plain.
EXPLORE_SECONDS = 0.05
EXPLORE_STEPS = 8
# beam search: an arm whose predicted speed is below PLAUSIBLE of the fastest prediction is not explored,
# only revisited (a call of a speculative beam search predicted at 0.4x of plain would cost 2.5 calls)
PLAUSIBLE = 0.8
# beam steps a speculative beam cycle at gamma 1, 2 commits before any was observed: below what the
# shipped exit head commits at the default draft width (`inputs.default_draft_width`, 5 for K = 4: 1.57
# and 1.88 over 8 held-out sentences; 1.42 and 1.63 at width K, 1.71 and 2.17 at 2K), so a weaker head
# is not assumed to do better than ours
BEAM_PRIOR_STEPS = (1.4, 1.6)
BEAM_PRIOR_WEIGHT = 4.0  # the prior counts as this many cycles
# speculative beam search is explored at a row class only where it ran at least this much faster than plain
# beam search with fewer rows (`BeamPolicy`): more rows never made it pay better, so a narrower win there
# bounds the gain here below what exploring it costs if it loses (width 512, Xeon: 1.01x at batch 4, then
# 0.88x at batch 8 for four of a grid cell's eight calls)
FEWER_ROWS_WIN = 1.05

PLAIN, FIXED, SHORT, THIRD, STOPS, SPECULATIVE = "plain", "fixed", "short", "third", "stops", "speculative"  # the arms
FITTED = "fitted"  # the gamma of most tokens per second by the row class's cycle times (`Line`)
# sampling's arms by the drafts a cycle makes, most first (stops draft up to the gamma a draft that is
# always right would pay for, no fewer than the model's gamma; the fitted gamma is chosen for the rows,
# so it is never pruned for drafting more than what won with fewer)
LONGEST_FIRST = (STOPS, FIXED, SHORT, THIRD, FITTED, PLAIN)
CHAINS = (FIXED, SHORT, THIRD, FITTED)  # the arms that draft a fixed gamma: their cycles time the line
# the line of a row class's cycle seconds over its verified slots decides the fitted gamma once it rests on
# LINE_CYCLES cycles and as much spread of slots as LINE_CYCLES cycles LINE_SPREAD from their mean: the
# model's gamma and half of it, explored EXPLORE_CYCLES times each, give that at any row class of several
# rows
LINE_CYCLES = 2 * EXPLORE_CYCLES
LINE_SPREAD = 2.0
# both terms of the line where gamma and slots are this far from collinear (1 - their squared correlation)
LINE_APART = 0.05
# the cycles of each (rows, gamma) the line keeps, of which it takes the median (`Line`)
LINE_WINDOW = 16
# a (rows, gamma) shape with this many cycles in the line's window is priced by their median, not by the
# line (`SamplingPolicy._fitted`, `_fitted_or_plain`): at 8 rows on the shipped model (greedy) the line
# priced gamma 2 and 3 9-12% below their cycles and gamma 4 and 5 1-3% below, and auto drafted 2-3 where 4
# and 5 ran 8-18% faster. Four: the median of four already drops an interrupted cycle
MEASURED_CYCLES = 4
# every DITHER-th fitted choice drafts one more, every DITHER-th (half a turn later) one fewer: the line
# keeps points on both sides of its choice, where the rate curve is flat (at 8 rows on the shipped model,
# gammas 4-6 within 1%), so they cost little, and a slow change of the costs moves the choice
DITHER = 16
# a decision holds for the cycles that start within HOLD_SECONDS of it while the rows stay: deciding (the
# cost model's gamma, the arms' estimates and draws, booking the last run) took 55-80 us, 3-5% of a
# shipped-model cycle at 1-2 rows (1.5-2 ms), and auto ran 0.96x of its own fastest arm at batch 1; a
# choice barely moves from one cycle to the next (a cycle that accepts no draft ends the hold: `observe`).
# Where cycles take 15-20 ms (width 512) every first or second one decides; runs exploring an arm
# (EXPLORE_CYCLES) stay one cycle each
HOLD_SECONDS = 0.02
DEPTH_HALF_LIFE = 256.0  # judged drafts: a row class's acceptance by depth follows the session slowly
# acceptance changes along an utterance, so a call has stages, each starting where a running row has
# emitted this many tokens on average: on the shipped model at batch 4 (sampling, gamma 5, 2 threads) 0.91
# of drafts were accepted over a row's first 16 tokens, 0.62 over the next 16 and 0.54 after. A row class
# keeps its acceptance by depth per stage, the fitted gamma is priced with the stage's, and a run of plain
# steps, or a held decision (HOLD_SECONDS), ends where the next stage starts, so each stage decides with
# its own. Pooled, the first choices set the price of every later one: where plain steps ran first (32 of
# them: past the first stage), speculation was judged only in the calls' middles, and auto decoded plainly
# in half of the fresh processes where gamma 3-4 ran 1.06x of plain. With stages (shipped model, 2 threads,
# fresh processes alternated, 10 a side): auto / the faster of plain and gamma 4, sampling at batch 2 / 4 /
# 8, 0.979 / 0.992 / 0.977 against 0.964 / 0.932 / 0.966
STAGES = (16, 32, 64)
AFTER_REJECT, AFTER_ALL = 0, 1  # how a row's previous cycle ended (`Depths`)


@dataclass(frozen=True)
class CostModel:
    """What speculative sampling costs on this machine, measured by `measure.measure_sampling`."""

    t_step: float  # seconds of one plain target step (all layers + target head, one token, batch 1)
    c: float  # one draft step (layers 1..E + exit head) / t_step
    v: tuple[float, ...]  # v[n - 1]: the rest of a cycle verifying n tokens / t_step, n = 1..MAX_GAMMA + 1
    device: str = "cpu"  # the device type measured on

    def cycle(self, gamma: int) -> float:
        """A cycle with `gamma` drafts, in plain steps."""
        return gamma * self.c + self.v[min(gamma + 1, len(self.v)) - 1]


@dataclass(frozen=True)
class BeamCosts:
    """What beam search costs on this machine for one beam size and draft width (`measure.measure_beam`)."""

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
    """Whether draft stops are an arm: on the CPU (see DRAFT_CONFIDENCE)."""
    return costs.device == "cpu"


def beam_steps_per_cycle(observed: dict[int, tuple[float, float]], gammas: Sequence[int]) -> list[float]:
    """Beam steps a speculative beam cycle at each of `gammas` is expected to commit, from `observed`
    (gamma -> committed steps, cycles) and the prior BEAM_PRIOR_STEPS (weight BEAM_PRIOR_WEIGHT cycles).
    The prior is scaled by how this head did against it where it was observed: a gamma never run would
    otherwise keep the prior, set low on purpose, and lose to an observed gamma it beats (width 512: auto
    ran gamma 2 at 1.93 steps a cycle, 0.96x of beam search, while gamma 1 at 1.59 ran 1.13x). Pure."""
    def prior(gamma: int) -> float:
        return BEAM_PRIOR_STEPS[min(gamma, len(BEAM_PRIOR_STEPS)) - 1]

    ran = {g: o for g, o in observed.items() if o[1] > 0}
    scale = 1.0
    if ran:  # committed / expected, with BEAM_PRIOR_WEIGHT cycles at the prior: a few cycles move it little
        typical = sum(prior(g) for g in ran) / len(ran)
        expected = sum(prior(g) * cycles for g, (_, cycles) in ran.items())
        scale = (sum(committed for committed, _ in ran.values()) + BEAM_PRIOR_WEIGHT * typical) / (
            expected + BEAM_PRIOR_WEIGHT * typical)
    out = []
    for gamma in gammas:
        committed, cycles = observed.get(gamma, (0.0, 0.0))
        guess = min(max(prior(gamma) * scale, 1.0), gamma + 1.0)  # a cycle commits 1 to gamma + 1 steps
        steps = (committed + BEAM_PRIOR_WEIGHT * guess) / (cycles + BEAM_PRIOR_WEIGHT)
        out.append(min(max(steps, 1.0), gamma + 1.0))
    return out


def beam_speedups(step: float, cycles: Sequence[float], steps_per_cycle: Sequence[float]) -> list[float]:
    """Predicted speed of speculative beam search at gamma 1..len(cycles) over plain beam search's:
    beam steps committed per second, steps_per_cycle[g - 1] / cycles[g - 1], against 1 / step. Pure."""
    if step <= 0 or min(cycles, default=1.0) <= 0:
        raise ValueError("beam seconds must be > 0")
    return [steps * step / seconds for seconds, steps in zip(cycles, steps_per_cycle)]


def row_class(rows: int) -> int:
    """The timings' row count for `rows` running rows: the power of two at or above it. Speculation's
    worth changes with the rows a verify pass carries; classes let a batch's shrinking tail (7, 6, 5
    rows...) share what it learns instead of exploring every count anew."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


def stage(position: float) -> int:
    """The stage of a call (`STAGES`) where a running row has emitted `position` tokens on average."""
    return sum(position >= start for start in STAGES)


class Line:
    """Least squares through a row class's speculative cycles: seconds = a + b * gamma + c * rows x (gamma +
    1). Drafting costs each draft step a kernel call whatever the rows (b), the verify pass and the draft
    steps' products cost by the tokens they carry (c): at 8 rows on the shipped model, one term in verified
    slots alone (a row count moves them as a gamma does) predicted gamma 2's cycles 18% dearer than they
    ran. A cycle's time varies little at a given gamma and row count, while the tokens it emits swing from
    1 to gamma + 1 per row; so the line, with the acceptance by depth (`Depths`), tells gammas apart in a
    few cycles where their seconds per token (`Arms`) take many: at 4-8 rows on the shipped model those
    estimates still ranked the arms wrongly after three passes over 24 sentences.

    Each (rows, gamma) enters the fit as the median of its last LINE_WINDOW cycles, weighted by how many
    those are: at 2 threads a few cycles ran 2-5x the usual (the other thread interrupted; 17 ms where 4 is
    usual), and a shape's first cycles in a process 1.5-2x. Through means, such cycles lifted the fitted
    cost at gamma 0 of the shipped model's cycles at 4 rows from ~1.1 ms to 1.4-2.9 ms in a third of the
    runs, and auto decoded plainly where gamma 4 ran 1.15-1.2x of plain. A shape's window keeps its recent
    cycles only (the costs drift with the machine), and the far gammas explored first keep theirs however
    long the fitted gamma runs, so the slopes are not lost."""

    def __init__(self) -> None:
        self.cycles: dict[tuple[int, int], deque[float]] = {}  # (rows, gamma) -> its latest seconds
        self._medians: dict[tuple[int, int], float] = {}  # (rows, gamma) -> the median of its window
        # n, g, s, g*g, g*s, s*s, t, g*t, s*t for gamma g, slots s = rows x (g + 1), seconds t (a shape's
        # median), each shape counted as many times as its window holds cycles; kept as shapes change, not
        # summed over every shape at each fit (~20 us a cycle with 20 shapes, as much as the rest of auto)
        self._sums = [0.0] * 9
        self._fit: tuple[float, float, float] | None | bool = False  # `fit` since the last add (False: none)
        self.turn = 0  # counts fitted choices (`SamplingPolicy._fitted`: DITHER)

    def add(self, rows: int, gamma: int, seconds: float) -> None:
        window = self.cycles.setdefault((rows, gamma), deque(maxlen=LINE_WINDOW))
        if window:
            self._count(rows, gamma, -len(window))
        window.append(seconds)
        self._medians[rows, gamma] = statistics.median(window)
        self._count(rows, gamma, len(window))
        self._fit = False

    def measured(self, rows: int, gamma: int) -> float | None:
        """The median seconds of the latest cycles of `rows` rows drafting `gamma`, where MEASURED_CYCLES
        or more ran; else None."""
        window = self.cycles.get((rows, gamma))
        return self._medians[rows, gamma] if window is not None and len(window) >= MEASURED_CYCLES else None

    def _count(self, rows: int, gamma: int, weight: int) -> None:
        """Adds the shape's median `weight` times to the sums (a negative weight takes it out)."""
        g, x, t = float(gamma), float(rows * (gamma + 1)), self._medians[rows, gamma]
        for i, v in enumerate((1.0, g, x, g * g, g * x, x * x, t, g * t, x * t)):
            self._sums[i] += weight * v

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c); None while the line rests on fewer than LINE_CYCLES cycles or on less spread of slots
        than LINE_CYCLES cycles LINE_SPREAD apart from their mean give (a slope's error shrinks with both the
        cycles and their spread: once settled, the dithers of hundreds of cycles keep it), or where the
        cycles' seconds do not rise with their slots (noise). Where gamma and slots hardly vary apart or
        either term comes out below 0 (noise: on the shipped model at 4 rows, sampling, the slots' term did
        for a pass), the slots alone. None too where a cycle would cost nothing at gamma 0 (a <= 0): a slope
        that steep rests on noise (on the shipped model at 4 rows, greedy, 2 threads, the first fit of one
        process rested on six shapes with one interrupted gamma-10 cycle at 9.2 ms, not ~5.5; it gave a =
        -0.12 ms, so gamma 1 looked fastest, plain steps then beat gamma 1-2 on timed runs, and auto decoded
        plainly for three passes where gamma 4 ran 1.21-1.24x of plain)."""
        if self._fit is not False:
            return self._fit
        n, g, x, gg, gx, xx, t, gt, xt = self._sums
        self._fit = None
        if n < LINE_CYCLES:
            return None
        # centred sums: n x (co)variances
        sgg, sgx, sxx = gg - g * g / n, gx - g * x / n, xx - x * x / n
        sgt, sxt = gt - g * t / n, xt - x * t / n
        if sxx < LINE_SPREAD * LINE_SPREAD * LINE_CYCLES:
            return None
        det = sgg * sxx - sgx * sgx
        b, c = 0.0, sxt / sxx
        if det > LINE_APART * sgg * sxx:  # gamma and slots vary apart: both terms, where both are >= 0
            both = (sgt * sxx - sxt * sgx) / det, (sxt * sgg - sgt * sgx) / det
            if both[0] >= 0 and both[1] > 0:
                b, c = both
        a = (t - b * g - c * x) / n
        if c <= 0 or a <= 0:
            return None
        self._fit = (a, b, c)
        return self._fit


class Depths:
    """Drafts judged and accepted at each draft depth k (index k - 1) of cycles whose row starts after a
    cycle that accepted all its drafts (`AFTER_ALL`) or after one that rejected a draft (`AFTER_REJECT`),
    over sums that fade by half every DEPTH_HALF_LIFE judged drafts: the chance that a row's k-th draft
    is accepted once the k - 1 before it were. Acceptance runs in stretches, so it differs from depth to
    depth and a gamma's tokens (`expected`) are not alpha's (Leviathan et al.'s formula). And it differs by
    how the row's last cycle ended: on the shipped model at 4 rows (greedy, 2 threads) the first draft after
    a rejection was accepted 77-79% of the time, after an all-accepted cycle 94%. A longer gamma ends
    more cycles in a rejection, so depths pooled over one gamma's cycles undercount a shorter gamma's
    tokens (auto's own cycles at gamma 6-7 made gamma 4 look 16% poorer than its own cycles showed, and
    auto drafted 7 where 4 ran 1.18x of plain). Kept across calls with a row class's timings: a call
    starts with what earlier calls judged, not with the prior (at the prior, plain decoding looked faster
    at 4-8 rows, and its runs judge nothing)."""

    def __init__(self, depths: int = MAX_GAMMA) -> None:
        # [AFTER_REJECT, AFTER_ALL][k]
        self.reached = [[0.0] * depths, [0.0] * depths]
        self.passed = [[0.0] * depths, [0.0] * depths]

    def observe(self, accepted: Sequence[int], proposed: Sequence[int], after_all: Sequence[bool | None]) -> None:
        """A cycle's accepted and proposed drafts per row, and whether each row's previous cycle accepted
        all its drafts (None: not known, e.g. the call's first cycle or after plain steps; not counted).
        A row judged its drafts up to its first rejection."""
        judged = sum(a + (a < n) for a, n, s in zip(accepted, proposed, after_all) if s is not None)
        keep = 0.5 ** (judged / DEPTH_HALF_LIFE)
        for sums in (*self.reached, *self.passed):
            sums[:] = [keep * v for v in sums]
        depths = len(self.reached[0])
        for a, n, s in zip(accepted, proposed, after_all):
            if s is None:
                continue
            start = AFTER_ALL if s else AFTER_REJECT
            for k in range(min(a + (a < n), depths)):
                self.reached[start][k] += 1.0
            for k in range(min(a, depths)):
                self.passed[start][k] += 1.0

    def expected(self, most: int) -> list[float]:
        """[g - 1]: tokens a row emits per cycle of g drafts, g = 1..most (at most the depths kept), where
        every cycle drafts g: from each start, 1 plus, for each depth k <= g, the chance that its first k
        drafts were all accepted, mixed by the share of cycles that start after an all-accepted one when
        every cycle drafts g (the stationary share of the two-state chain: a cycle from start s accepts all
        with chance all_s(g)). Each depth counts PRIOR_WEIGHT drafts at a prior: PRIOR_ALPHA for the first,
        the estimate of the depth before it for the others. Acceptance runs in stretches, so a draft after
        k accepted ones is accepted about as often as the one before it (greedy, shipped model, batch 8:
        0.89, 0.91, 0.90, 0.93, 0.91 at depths 1-5); a depth past the gammas that ran sat at PRIOR_ALPHA,
        below what the head does there, so the line's gamma stayed short of it (at 8 rows E[4], E[5] came to
        3.77, 4.10 tokens where gamma 4 and 5 emitted 4.10, 4.72 a row-cycle) and it was never judged."""
        out = []
        runs = [1.0, 1.0]
        tokens = [1.0, 1.0]
        prior = [PRIOR_ALPHA, PRIOR_ALPHA]
        for k in range(min(most, len(self.reached[0]))):
            for s in (AFTER_REJECT, AFTER_ALL):
                prior[s] = (self.passed[s][k] + PRIOR_WEIGHT * prior[s]) / (self.reached[s][k] + PRIOR_WEIGHT)
                runs[s] *= prior[s]
                tokens[s] += runs[s]
            leave_all = 1.0 - runs[AFTER_ALL] + runs[AFTER_REJECT]
            share = runs[AFTER_REJECT] / leave_all if leave_all > 0 else 1.0
            out.append(share * tokens[AFTER_ALL] + (1.0 - share) * tokens[AFTER_REJECT])
        return out


class Arms:
    """Fading sums over the runs of each arm (a speculative cycle, a fused run of plain steps, a beam
    search call) of seconds, tokens and their squares and product (the ratio estimate of seconds per
    token and its variance), and the choice of the next arm from them (see EXPLORE_CYCLES, REVISIT).
    Kept across calls by `measure.Costs`, one per row class."""

    def __init__(self, explore: int) -> None:
        if explore < 1:
            raise ValueError(f"explore must be >= 1, got {explore}")
        self.explore = explore
        self.sums: dict[str, list[float]] = {}  # arm -> n, s, t, s*s, t*t, s*t
        self.runs: dict[str, int] = {}
        self.explored: set[str] = set()  # the arms `pick` was asked to explore (others only revisited)
        self.seconds = 0.0  # booked under every arm
        self._last: dict[str, float] = {}  # arm -> `seconds` when it last ran
        self._rates: dict[str, tuple[float, float]] = {}  # `rate` by arm until the next `add`
        self._rows: dict[str, list[float]] = {}  # arm -> fading sums of tokens x rows, tokens (`rows`)
        self.line = Line()  # the chain arms' cycle seconds by verified slots (`SamplingPolicy`)
        self.depths = [Depths() for _ in range(len(STAGES) + 1)]  # acceptance by draft depth, by stage
        # its own generator: the draws move neither torch's nor the caller's random state
        self._draw = random.Random(0)

    def add(self, arm: str, seconds: float, tokens: float, rows: int = 1) -> None:
        """A run of `arm` took `seconds` for `tokens` tokens (every row's) over `rows` rows."""
        sums = self.sums.setdefault(arm, [0.0] * 6)
        for i, x in enumerate((1.0, seconds, tokens, seconds * seconds, tokens * tokens, seconds * tokens)):
            sums[i] = TIME_KEEP * sums[i] + x
        weighted = self._rows.setdefault(arm, [0.0, 0.0])
        weighted[0] = TIME_KEEP * weighted[0] + tokens * rows
        weighted[1] = TIME_KEEP * weighted[1] + tokens
        self.runs[arm] = self.runs.get(arm, 0) + 1
        self.seconds += seconds
        self._last[arm] = self.seconds
        self._rates.clear()

    def rows(self, arm: str) -> float:
        """The rows the arm's runs carried, weighted by the tokens they emitted (as its `rate` is)."""
        weighted = self._rows[arm]
        return weighted[0] / weighted[1]

    def rate(self, arm: str) -> tuple[float, float]:
        """(seconds per token, its variance): the ratio estimator over the arm's faded runs."""
        known = self._rates.get(arm)
        if known is not None:  # asked ~12 times a pick, between adds (a pick runs every cycle)
            return known
        n, s, t, ss, tt, st = self.sums[arm]
        r = s / t
        residual = max(ss - 2.0 * r * st + r * r * tt, 0.0)  # sum of (s_i - r t_i)^2
        known = self._rates[arm] = (r, residual / (t * t) * n / max(n - 1.0, 1e-9))
        return known

    def pick(self, arms: Sequence[str], explore: Sequence[str] | None = None) -> str:
        """The arm to run next among `arms`: while an arm of `explore` (default: all of `arms`) ran fewer
        than `self.explore` times, the one that ran least (in turn: load elsewhere hits each alike); else
        the first arm due for a revisit (`due`); else, where plain decoding (or plain beam search) is the
        fastest, that; else the lowest draw among the speculative arms of `explore` (an arm outside it runs
        where its estimate is the lowest, or when due)."""
        explore = arms if explore is None else explore
        self.explored.update(explore)
        least = min(explore, key=lambda arm: self.runs.get(arm, 0))
        if self.runs.get(least, 0) < self.explore:
            return least
        ran = [arm for arm in arms if arm in self.sums]
        if not ran:
            return arms[0]
        best = self.best(ran)
        due = self.due(arms, ran, best)
        if due is not None:
            return due
        if best == PLAIN:
            # no draws against plain decoding: where it is the fastest, a draft arm drawn under it ran
            # often at batch 2-4 on the shipped model (a fifth of the time at 0.75-0.85x of plain: five
            # arms' noisy estimates each drew below plain's now and then), only revisits check it
            return best
        ran = [arm for arm in ran if arm != PLAIN and (arm in explore or arm == best)]
        draws = {}
        for arm in ran:
            rate, var = self.rate(arm)
            draws[arm] = self._draw.gauss(rate, math.sqrt(var))
        drawn = min(ran, key=draws.__getitem__)
        # draws are per second, not per run: an arm drawn over the one of the best estimate runs with the
        # odds of their run lengths
        if drawn != best and self._draw.random() * self._seconds(drawn) > self._seconds(best):
            return best
        return drawn

    def due(self, arms: Sequence[str], ran: Sequence[str], best: str) -> str | None:
        """The first arm due for a revisit: one that has not run while the others ran REVISIT times its
        own run's seconds. Plain decoding (what every speculative arm must beat) and the runner-up (the
        fastest arm but the best) keep that interval; the other speculative arms' is as many times longer
        as there are arms besides the best (together they cost about one more such share, not one each)."""
        typical = sum(self._seconds(a) for a in ran) / len(ran)  # seconds of a run
        runner = self.best([arm for arm in ran if arm != best])  # None: only the best ran
        spread = len(arms) - 1
        for arm in arms:
            if arm == best:
                continue
            own = self._seconds(arm) if arm in self.sums else typical
            every = REVISIT * (1 if arm in (PLAIN, runner) else spread)
            if self.seconds - self._last.get(arm, 0.0) >= every * own:
                return arm
        return None

    def best(self, arms: Sequence[str]) -> str | None:
        """The arm of `arms` with the lowest estimated seconds per token; None before any ran."""
        ran = [arm for arm in arms if arm in self.sums]
        return min(ran, key=lambda arm: self.rate(arm)[0]) if ran else None

    def _seconds(self, arm: str) -> float:
        """The arm's mean seconds per run."""
        return self.sums[arm][1] / self.sums[arm][0]


class _Run:
    """The timing of the run under way: its arm and table, when it started, what it emitted; a held
    decision's answer, until when it holds and when each of its later cycles started (`HOLD_SECONDS`)."""

    def __init__(self, table: Arms, arm: str, start: float, rows: int = 0, gamma: int = 0,
                 stage: int | None = None) -> None:
        self.table, self.arm, self.start, self.tokens = table, arm, start, 0.0
        self.rows, self.gamma = rows, gamma
        # the call's stage where the line's gamma or plain steps were chosen by it (a held decision ends
        # with it); None: the choice did not read the stage
        self.stage = stage
        self.answer: tuple[int, float | None] | None = None
        self.until = start
        self.starts: list[float] = []


class SamplingPolicy:
    """gamma="auto" for one sampling call: each cycle's gamma and draft stops. The loop asks `next(rows)`
    before every cycle and tells `observe` (a speculative cycle) or `plain` (a run of plain steps) after,
    then `kept` (the tokens it kept, which its time is booked against), and `finish` when the call ends.

    The cost model at the acceptance judged so far (a running estimate that starts at PRIOR_ALPHA) gives
    the gamma, or 0 (plain steps, a fused run where the kernels have them) where speculation is not
    predicted to win. Where it is, the arms decide, timed on the decoder's runs for the row class
    (`tables`, kept across calls): plain steps, the model's gamma, or (`stops_pay`) draft stops up to the
    gamma a draft that is always right would pay for, and with several rows a half and a third of the
    model's gamma (`arms_at`). Where it is not, at an acceptance no lower than the prior, draft stops
    (which take no gamma from the acceptance) are timed against plain steps: a head better than the
    prior shows it only by drafting. The caller's `confidence` replaces the drafting arms. With more rows
    than a class already timed, arms that draft more than the fastest drafting arm there are only
    revisited (`_worth_exploring`). With several rows on the CPU, once the class's line is known, the
    gamma it predicts fastest (FITTED) and plain steps are the only arms (`_fitted`), its price (cycle
    seconds over the tokens the acceptance of the call's stage gives) and plain steps' timed runs deciding
    between them (`_fitted_or_plain`).
    Stops read only the draft's own distribution, so no arm changes what is sampled; but the arm a cycle
    takes follows the clock, so seeded sampling under auto is not reproduced token for token."""

    def __init__(self, costs: CostModel, tables: dict[int, Arms], confidence: float | None = None,
                 max_gamma: int = MAX_GAMMA, clock: Callable[[], float] | None = None,
                 hold_seconds: float = HOLD_SECONDS) -> None:
        """`hold_seconds`: how long a decision holds (`HOLD_SECONDS`; 0: every cycle decides)."""
        self.costs = costs
        self.hold_seconds = hold_seconds
        self.tables = tables
        self.max_gamma = max_gamma
        # the gamma a draft that is always right would pay for: the most drafts with stops; 0: speculation
        # cannot pay here at any acceptance, decode plainly throughout
        self.sure_gamma = self._choose(1.0)
        self.pays = self.sure_gamma > 0
        self.stops = confidence if confidence is not None else DRAFT_CONFIDENCE if stops_pay(costs) else None
        drafting = (STOPS,) if confidence is not None else (STOPS, FIXED) if self.stops else (FIXED,)
        self.arms = drafting + (PLAIN,)
        self.used_confidence: float | None = None  # the draft stops some cycle used
        self._accepted = self._judged = 0.0  # fading sums over judged drafts
        self._ends: list[bool] | None = None  # per row: its last cycle accepted all its drafts
        # tokens a running row has emitted in this call, on average (`stage`): each run's kept tokens over the
        # rows it started with, so a row that ends within a run leaves it a little behind the rows that go on
        self._position = 0.0
        # cycles time the row class's line where the arms include the chain arms of several rows (`arms_at`;
        # the line and the depths are read only there, so one row keeps neither)
        self._fits = self.arms[:2] == (STOPS, FIXED)
        self._clock = clock or time.perf_counter
        self._run: _Run | None = None
        # the most plain steps the run `next` chose may take (None: as many as the loop fuses)
        self.plain_steps: int | None = None

    @property
    def alpha(self) -> float:
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ALPHA) / (self._judged + PRIOR_WEIGHT)

    def next(self, rows: int) -> tuple[int, float | None]:
        """(gamma, draft_confidence) for the next cycle of `rows` running rows; gamma 0: plain steps."""
        now = self._clock()
        run = self._run
        if (run is not None and run.answer is not None and rows == run.rows and now < run.until
                and run.stage in (None, stage(self._position))):
            run.starts.append(now)
            return run.answer
        self._book(now)
        cls = row_class(rows)
        table = self.tables.get(cls)
        if table is None:  # made only when missing: a table's seeded generator costs ~30 us, a cycle ~2 ms
            table = self.tables[cls] = Arms(EXPLORE_CYCLES)
        gamma = self._choose(self.alpha) if self.pays else 0
        fitted, fitted_cost = 0, math.inf
        if gamma:
            arms = self.arms_at(rows, gamma)
            if SHORT in arms:
                fitted, fitted_cost = self._fitted(table, rows)
                if fitted:  # the line replaces the model's gamma, its fractions and draft stops
                    arms = (FITTED, PLAIN)
        elif self.pays and self.stops is not None and (self.alpha >= PRIOR_ALPHA or self._judged < 1.0):
            # no gamma pays at this acceptance, but no draft judged lately (its weight fades with
            # HALF_LIFE) says the head is worse than the prior: draft stops take no gamma from it, so the
            # timings decide (the shipped model's cost model predicts 0.91x at the prior and 1.15x at
            # alpha 0.9; its head accepts 0.88-0.91, and with stops it ran 1.08-1.19x of plain at batch 1)
            arms = (STOPS, PLAIN)
        else:
            arms = (PLAIN,)
        if fitted:
            arm = self._fitted_or_plain(table, rows, fitted_cost)
        else:
            arm = table.pick(arms, self._worth_exploring(cls, arms)) if len(arms) > 1 else PLAIN
        self.plain_steps = None
        chosen = {PLAIN: 0, FIXED: gamma, SHORT: gamma // 2, THIRD: gamma // 3, FITTED: fitted}.get(arm)
        here = stage(self._position)
        run = self._run = _Run(table, arm, now, rows, self.sure_gamma if chosen is None else chosen,
                               here if fitted else None)
        if arm == PLAIN:
            if len(arms) > 1 and table.best(arms) != PLAIN:
                self.plain_steps = max(EXPLORE_STEPS, math.ceil(EXPLORE_SECONDS / self.costs.t_step))
            if fitted and here < len(STAGES):  # the next stage decides anew (EXPLORE_STEPS: a fair timing)
                cap = max(EXPLORE_STEPS, math.ceil(STAGES[here] - self._position))
                self.plain_steps = cap if self.plain_steps is None else min(self.plain_steps, cap)
            return 0, None
        answer = (chosen, None) if chosen is not None else (self.sure_gamma, self.stops)
        if answer[1] is not None:
            self.used_confidence = answer[1]
        if table.runs.get(arm, 0) >= table.explore:  # explored: the choice holds a while
            run.answer, run.until = answer, now + self.hold_seconds
        return answer

    def _fitted_or_plain(self, table: Arms, rows: int, cost: float) -> str:
        """FITTED or PLAIN for `rows` rows: each is explored EXPLORE_CYCLES times (the fitted gamma's cycles
        add to the line, which may rest on few cycles yet), then each runs when due for a revisit
        (`Arms.due`), else the faster. Plain steps are priced by their timed runs; the fitted gamma by
        `cost` (`_fitted`): cycle seconds over the tokens the acceptance of the call's stage gives. Not by
        the fitted arm's timed runs: their seconds per token carry the acceptance of the stage they ran in
        (`STAGES`), and a losing arm runs rarely, so a few runs in the middle of calls decided for long: on
        the shipped model at 4 rows (sampling, 2 threads) they priced the fitted gamma at 327-363 us a token
        against plain's 205-218, where it ran 160 at the calls' starts, and auto decoded plainly for whole
        passes where gamma 3-4 ran 1.06x of plain."""
        least = min((FITTED, PLAIN), key=lambda arm: table.runs.get(arm, 0))
        if table.runs.get(least, 0) < table.explore:
            return least
        # plain steps' seconds per token at these rows: a step's time taken as the same at every row count
        # of the class, so its seconds per token grow as rows end (at 8 rows on the shipped model plain
        # runs timed at 8 rows made them look faster than gamma 4 at 5-6 rows, where they were 1.3x slower)
        plain = table.rate(PLAIN)[0] * table.rows(PLAIN) / rows
        best = FITTED if cost < plain else PLAIN
        ran = [arm for arm in (FITTED, PLAIN) if arm in table.sums]
        return table.due((FITTED, PLAIN), ran, best) or best

    def _fitted(self, table: Arms, rows: int) -> tuple[int, float]:
        """(gamma, its seconds per token): the gamma with the most expected tokens per second for `rows`
        rows by the row class's cycle seconds (the median of its own cycles at these rows where
        `Line.measured` has one, else the line) and the acceptance by depth of the call's stage; (0, inf)
        while the line is not known. Every DITHER-th choice drafts one more, every other DITHER-th one
        fewer."""
        fit = table.line.fit()
        if fit is None:
            return 0, math.inf
        a, b, c = fit
        priced = []  # [gamma - 1]: seconds per token
        for gamma, expected in enumerate(table.depths[stage(self._position)].expected(self.max_gamma), 1):
            seconds = table.line.measured(rows, gamma)
            if seconds is None:  # not run enough at these rows: the line's
                seconds = a + b * gamma + c * rows * (gamma + 1)
            priced.append(seconds / (rows * expected))
        best = 1 + min(range(len(priced)), key=priced.__getitem__)  # ties keep the shorter draft
        table.line.turn = (table.line.turn + 1) % DITHER
        if table.line.turn == 0:
            best = min(best + 1, len(priced))
        elif table.line.turn == DITHER // 2:
            best = max(best - 1, 1)
        return best, priced[best - 1]

    def arms_at(self, rows: int, gamma: int) -> tuple[str, ...]:
        """The arms for a cycle of `rows` running rows whose cost model gives `gamma`: with several rows on
        the CPU also half that gamma (SHORT) and a third of it (THIRD, where that is shorter still). A
        verify pass carries rows x (gamma + 1) tokens, and past ~12 the CPU's products turn compute-bound
        (tools/gemm_rows.py), which the cost model, measured at one row, does not see: its gamma (9-10 at
        width 512) overshoots at batch 4 and 8, where gamma 3-5 were fastest and sampling at batch 8 with
        gamma 10 or 5 ran at 0.89x and 1.23x of plain, gamma 3 at 1.34x (docs/performance-log.md)."""
        if rows > 1 and gamma >= 2 and self.arms[:2] == (STOPS, FIXED):
            shorter = (THIRD,) if 0 < gamma // 3 < gamma // 2 else ()
            return self.arms[:2] + (SHORT,) + shorter + self.arms[2:]
        return self.arms

    def _worth_exploring(self, rows: int, arms: tuple[str, ...]) -> tuple[str, ...]:
        """The arms explored and drawn at row class `rows`: where a drafting arm was the fastest at a
        smaller class (the nearest whose arms were all explored), none that drafts more per cycle than it
        (plain steps are always kept); the others are only revisited. A verify pass carries rows x
        (gamma + 1) tokens, so more rows never made longer drafts pay better: at width 512, 2 threads, the
        model's gamma (7-10) and stops ran 1.2-1.6x the seconds per token of gamma 3-5 with 4 and 8 rows,
        and took a tenth of auto's cycles there while explored and drawn. Where plain steps were the
        fastest with fewer rows, every arm is explored: the ranking of arms that all lost says little, and
        a verify pass of many rows can use the products better than a plain step of a few (the shipped
        model, 2 threads: gamma 4 ran 0.82-0.90x of plain decoding at batch 4, 1.00-1.15x at batch 8)."""
        for fewer in (self.tables[c] for c in sorted(self.tables, reverse=True) if c < rows):
            shared = [arm for arm in arms if arm in fewer.sums]  # (one row has no half gamma)
            # arms only revisited there (pruned by this rule) need not have run `explore` times
            if PLAIN in shared and len(shared) > 1 and all(
                    fewer.runs[arm] >= fewer.explore for arm in shared if arm in fewer.explored):
                break
        else:
            return arms
        best = fewer.best(shared)
        if best == PLAIN:
            return arms
        return tuple(arm for arm in arms if LONGEST_FIRST.index(arm) >= LONGEST_FIRST.index(best))

    def observe(self, accepted: list[int], proposed: list[int]) -> None:
        """A cycle's accepted drafts and proposed drafts per row. A row judges its drafts up to its first
        rejection: accepted + 1 of them, or all when all were accepted."""
        self._fade(sum(a + 1 for a in accepted) / len(accepted))
        self._accepted += sum(accepted)
        self._judged += sum(a + (a < n) for a, n in zip(accepted, proposed))
        ends = self._ends if self._ends is not None and len(self._ends) == len(accepted) else [None] * len(accepted)
        if self._run is not None and self._times_line(self._run):
            # (not draft stops: a row that stops after an unsure draft leaves the confident ones judged)
            self._run.table.depths[stage(self._position)].observe(accepted, proposed, ends)
        # how each row's cycle ended; rows keep their order while none ends (the count tells)
        self._ends = [a == n for a, n in zip(accepted, proposed)]
        if self._run is not None and not any(accepted):
            # a cycle that accepted no draft moves the acceptance, on which the choice rests, the most (a
            # draft that stopped fitting: every cycle): the next cycle decides again
            self._run.answer = None

    def plain(self, steps: int) -> None:
        """`steps` plain steps ran: nothing judged, the estimate drifts back toward the prior."""
        self._fade(steps)
        self._ends = None

    def kept(self, tokens: int) -> None:
        """The tokens the last cycle or run of plain steps kept, EOS and max_length applied (summed over the
        cycles of a held decision): what its time is booked against (not every row's tokens: a run of 32
        plain steps makes many past a row's end, and a batch's ending rows made plain runs look faster than
        they were). They also move the call on (`stage`)."""
        if self._run is not None:
            self._run.tokens += tokens
            self._position += tokens / self._run.rows

    def finish(self) -> None:
        """The call ended: books its last run. A batch's last row often ends the call in one run (on the
        shipped model at batch 2, 2 threads, a run of plain steps exploring plain decoding for row class
        1, in most calls); left unbooked, that class never finished exploring, and every call's tail ran
        plainly while speculation was 1.6x faster there."""
        self._book(self._clock())

    def _book(self, now: float) -> None:
        """Books the last run's time (its `next` to this one) under its arm, and each of its cycles' on the
        line."""
        run, self._run = self._run, None
        if run is not None and run.tokens:
            run.table.add(run.arm, now - run.start, run.tokens, run.rows)
            if self._times_line(run) and run.gamma:
                starts = [run.start, *run.starts]
                for start, end in zip(starts, starts[1:] + [now]):
                    run.table.line.add(run.rows, run.gamma, end - start)

    def _times_line(self, run: _Run) -> bool:
        """Whether `run` feeds its class's line and acceptance by depth: a chain arm's run of several rows,
        where the arms include the chain arms (`_fits`; one row reads neither)."""
        return self._fits and run.arm in CHAINS and run.rows > 1

    def _fade(self, tokens: float) -> None:
        keep = 0.5 ** (tokens / HALF_LIFE)
        self._accepted *= keep
        self._judged *= keep

    def _choose(self, alpha: float) -> int:
        return choose_gamma(self.costs.c, self.costs.v, alpha, self.max_gamma)


class BeamPolicy:
    """gamma="auto" for one beam search call: plain beam search or speculative beam search, at the gamma
    whose cycles `BeamCosts` and the committed steps `steps_per_cycle` predict fastest. The arms are timed
    in seconds per beam step over whole calls (`table`, per row class, kept across calls); the first calls
    explore the arms predicted within PLAUSIBLE of the fastest, the others are only revisited (REVISIT).
    Ask `gamma()` before the call and tell `done(steps)` after it."""

    def __init__(self, costs: BeamCosts, table: Arms, steps_per_cycle: Sequence[float],
                 clock: Callable[[], float] | None = None, explore_all: bool = True,
                 fewer_rows: Arms | None = None) -> None:
        """`explore_all=False`: only the arm predicted fastest is explored, the other only revisited (the
        compiled path, where an arm's first call compiles its graphs: tens of seconds on a GPU).
        `fewer_rows`: the timed arms of the nearest smaller row class where both ran. Where speculative beam
        search was not FEWER_ROWS_WIN faster than plain beam search there, it is only revisited here: a
        batch's verify passes carry more rows than its beam steps, so more rows never made speculation pay
        better (width 512, batch 8: exploring it cost two of a job's eight calls at 0.54x)."""
        speedups = beam_speedups(costs.step, costs.cycles, steps_per_cycle)
        self.spec_gamma = 1 + max(range(len(speedups)), key=speedups.__getitem__) if speedups else 0
        predicted = {PLAIN: 1.0, SPECULATIVE: max(speedups, default=0.0)}
        self.arms = tuple(sorted(predicted, key=predicted.__getitem__, reverse=True))
        plausible = PLAUSIBLE if explore_all else 1.0
        self.explore = [arm for arm in self.arms if predicted[arm] >= plausible * predicted[self.arms[0]]]
        if fewer_rows is not None and fewer_rows.rate(PLAIN)[0] < FEWER_ROWS_WIN * fewer_rows.rate(SPECULATIVE)[0]:
            self.explore = [PLAIN]
        if table.explored:
            # chosen at the row class's first call: after a revisit the committed steps observed (above
            # the prior) lifted the shipped model's prediction past PLAUSIBLE, and three more calls ran it
            # at 0.6-0.7x of plain; from then on measurements decide (`Arms.pick`), not predictions
            self.explore = [arm for arm in self.arms if arm in table.explored]
        self.table = table
        self._clock = clock or time.perf_counter
        self._run: _Run | None = None

    def gamma(self) -> int:
        """The call's gamma (0: plain beam search); its clock starts."""
        arm = self.table.pick(self.arms, self.explore) if self.spec_gamma else PLAIN
        self._run = _Run(self.table, arm, self._clock())
        return self.spec_gamma if arm == SPECULATIVE else 0

    def done(self, steps: int) -> None:
        """The call ran `steps` beam steps: books its seconds under its arm."""
        run, self._run = self._run, None
        if run is not None and steps > 0:
            run.table.add(run.arm, self._clock() - run.start, steps)
