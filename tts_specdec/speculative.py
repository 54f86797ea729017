"""Speculative sampling with the early-exit head as draft; gamma = 0 is plain sampling.

Per cycle, every row at its own length:
  draft   layers 1..E on the row's pending token, then on each drafted token: q_d, x_d ~ q_d
  verify  layers E+1..L on the gamma+1 exit states the draft kept -> p_1..p_{gamma+1}
  accept  Leviathan et al. accept/reject (greedy: draft == target argmax), rows keep different counts
  commit  append accepted tokens + correction/bonus, crop each row's cache, drop rows that ended
Layers 1..E are shared: their K/V, written by the draft, serve the target too, so no token passes
them twice (rejected drafts are the only wasted work). On the CPU kernels the whole draft phase is one
call (`Backend.draft_phase`), early draft stops, top-k/top-p and guidance included, and plain sampling
(gamma = 0) runs up to PLAIN_STEPS steps per call (`Backend.plain_steps`), each drawn as the step-by-step
loop draws it. With gamma="auto" a `Policy` (`auto.SamplingPolicy`) picks each cycle's gamma and draft
stops; every cycle is exact on its own, so the output law stays the target's.
A step whose target logits, or whose draft distribution the accept rule read, were not all finite ends
the decode with `finite.NonFiniteLogits` (found in what each cycle reads back anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from .cache import KVCache
from .decoder import Decoder, Encoded
from .finite import NONFINITE, NONFINITE_DRAFT, first_marked
from .results import DecodeStats
from .sampling import Acceptance, Draws, SamplingConfig, cfg_mix, draw, greedy_accept, probabilities, speculative_accept
from .timing import PhaseClock


# plain sampling steps per kernel call: the call's fixed cost spread over them; a run ends early
# at EOS, so longer runs waste nothing
PLAIN_STEPS = 32
# speculative cycles per run where a backend records cycles (`Backend.records`: CUDA graphs). Several
# cycles a run give one launch and one read-back per run (a row's cycles after its end are computed and
# dropped, as a plain run's steps are; runs of n, n/2, .. 1 cycles, each length a recorded graph, as many as
# fit the cache's capacity). On an H100 4 cycles a run ran 0.54x and 8 cycles 0.34x of one cycle a run, but
# that measurement also recorded every graph again on every decode (fixed since: `_Run` kept the cache
# alive); one cycle a run, the faster one measured, until a GPU compares them again (docs/gpu.md).
CYCLES_PER_RUN = 1


class Policy(Protocol):
    """What the loop asks before each cycle and tells after it (gamma="auto": `auto.SamplingPolicy`)."""

    def next(self, rows: int) -> tuple[int, float | None]:
        """(gamma, draft_confidence) for the next cycle of `rows` running rows; gamma 0: a run of plain steps."""

    def observe(self, accepted: list[int], proposed: list[int]) -> None:
        """A speculative cycle's accepted and proposed drafts per row."""

    def plain(self, steps: int) -> None:
        """A run of `steps` plain steps (every running row advanced by that many)."""

    def kept(self, tokens: int) -> None:
        """The tokens the last cycle or run kept, EOS and max_length applied."""

    def finish(self) -> None:
        """The call ended after the last cycle or run `kept` told of."""

    plain_steps: int | None  # after `next` gave gamma 0: the most steps of that run (None or more: PLAIN_STEPS)


@dataclass(frozen=True)
class _Guidance:
    """Classifier-free guidance of one decode call: rows are (cond, null) pairs when `on`; the target's
    logits are mixed at `scale`, the draft's at `draft_scale` (any draft keeps sampling exact)."""

    on: bool
    scale: float
    draft_scale: float

    def target(self, logits: Tensor) -> Tensor:
        return cfg_mix(logits, self.scale) if self.on else logits

    def draft(self, logits: Tensor) -> Tensor:
        return cfg_mix(logits, self.draft_scale) if self.on else logits


@dataclass
class _Rows:
    """Active sequences. Bookkeeping is in Python lists: a decoding step has a handful of rows, and
    every tensor op here would cost more in dispatch than the Python list operation it replaces."""

    index: list[int]  # original row of each active sequence
    pos: list[int]  # committed positions = position of the pending input
    x: Tensor  # (rows, 1, dim) pending input embedding (not yet through any layer)
    pos_t: Tensor  # the committed positions on the device, advanced there (a copy of `pos` would wait for a GPU)


def cache_positions(max_length: int, gamma: int) -> int:
    """Positions a sampling call's cache starts with (it grows as rows get longer)."""
    return min(max_length, 256) + gamma + 2


def sample_loop(
    dec: Decoder,
    source: Tensor,
    cfg: SamplingConfig,
    *,
    gamma: int,
    cond_scale: float,
    max_length: int,
    generator: torch.Generator | None,
    stats: DecodeStats,
    draft_confidence: float | None = None,
    draft_cond_scale: float | None = None,
    auto: Policy | None = None,
    source_mask: Tensor | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Tensor]:
    """Returns each row's generated tokens (EOS and everything after it removed).

    draft_confidence: a row stops drafting after a token its draft gave less than this probability
    (up to gamma drafts per cycle); the cycle's drafting ends when every row stopped. The stopping
    rule reads only the draft's own distribution, so acceptance stays exact for each row's length.
    draft_cond_scale: the guidance scale of the draft's logits (None: cond_scale).
    auto: picks each cycle's gamma and draft stops instead (`gamma`: the most it picks) and is told what
    every cycle accepted.
    source_mask: spear-tts's source mask (`Decoder.encode`).
    progress: told the longest row's length after every cycle.
    """
    batch, device = source.shape[0], source.device
    guide = _Guidance(cond_scale > 1, cond_scale, cond_scale if draft_cond_scale is None else draft_cond_scale)
    enc = dec.encode(source, guide.on, source_mask)
    cache = dec.new_cache(enc.rows, cache_positions(max_length, gamma))
    out: list[list[int]] = [[] for _ in range(batch)]
    rows = _Rows(list(range(batch)), [0] * batch, dec.start(enc.rows), torch.zeros(batch, dtype=torch.long, device=device))
    clock = PhaseClock(device)

    while rows.index:
        g, confidence = auto.next(len(rows.index)) if auto is not None else (gamma, draft_confidence)
        upper = range(dec.exit_layer if g else 0, dec.depth)  # the verify pass's layers
        # plain sampling runs PLAIN_STEPS steps per kernel call (rows advance together: same length)
        most = PLAIN_STEPS if auto is None or auto.plain_steps is None else min(PLAIN_STEPS, auto.plain_steps)
        steps = g or min(most, max_length - len(out[rows.index[0]]))
        cache.grow(max(rows.pos) + steps + 2)
        pos_t = rows.pos_t
        t0 = clock.mark()
        if not g:  # plain steps, several per call where the backend fuses them
            tokens, rows.x = dec.backend.plain_steps(rows.x, pos_t, steps, cfg, generator, enc, cache, cond_scale)
            cycles, advance = [_CycleOut(tokens.tolist(), [], None, 0)], tokens.shape[1]
            clock.add("verify", t0, clock.mark())
            _count(stats, [], None, 0, 0, passes=tokens.shape[1])
            if auto is not None:
                auto.plain(tokens.shape[1])
        else:
            count = _run_length(dec, rows, g, cache, max_length - min(len(out[i]) for i in rows.index))
            cycles, rows.x, advance = _cycles(dec, rows.x, pos_t, g, upper, enc, cache, cfg, generator, guide,
                                              confidence, clock, count, pos=rows.pos)
        # commit, cycle by cycle: each row's new tokens (a plain run, or accepted drafts and the correction or
        # bonus token); a row ends at EOS or max_length, and what a run computed for it after that is
        # dropped. A step picked from non-finite logits is marked (`finite`).
        alive = list(range(len(rows.index)))  # the rows still running, by place in `rows`
        kept = 0  # tokens emitted by the run, a row's EOS included, nothing after it
        for c in cycles:
            if not alive:  # the run's later cycles: computed for rows that had ended
                _count(stats, [], None, c.drafts, g)
                continue
            index = [rows.index[r] for r in alive]
            new = [c.new[r] for r in alive]
            first_marked(index, new, [len(out[i]) for i in index], dec.eos_id, max_length)
            if g:
                accepted = [c.accepted[r] for r in alive]
                proposed = None if c.proposed is None else [c.proposed[r] for r in alive]
                _count(stats, accepted, proposed, c.drafts, g)
                if auto is not None:
                    auto.observe(accepted, proposed)
            still = []
            for r, i, tokens in zip(alive, index, new):
                rows.pos[r] += len(tokens)
                if dec.eos_id is not None and dec.eos_id in tokens:
                    tokens, ended = tokens[: tokens.index(dec.eos_id)], True
                    kept += 1
                else:
                    ended = len(out[i]) + len(tokens) >= max_length
                added = tokens[: max_length - len(out[i])]
                out[i].extend(added)
                kept += len(added)
                if not ended:
                    still.append(r)
            alive = still
        if auto is not None:  # the run's time is booked against what all its cycles kept
            auto.kept(kept)
        # a row that goes on took exactly its `advance` (accepted drafts and the next token of every cycle; a
        # plain run's steps): the device's positions stay equal to `rows.pos` (an ended row's are dropped below)
        rows.pos_t = pos_t + advance
        cache.crop(dec.per_row(rows.pos_t, guide.on))
        if progress is not None:
            progress(max(len(o) for o in out))
        if len(alive) < len(rows.index):
            keep_t = torch.tensor(alive, dtype=torch.long, device=device)
            cache_rows = dec.rows(keep_t, guide.on)
            cache.reorder(cache_rows)
            enc = enc.select(cache_rows)
            rows = _Rows([rows.index[r] for r in alive], [rows.pos[r] for r in alive], rows.x[cache_rows],
                         rows.pos_t[keep_t])
    if auto is not None:
        auto.finish()
    clock.into(stats)
    stats.generated_tokens += sum(len(o) for o in out)
    return [torch.tensor(o, dtype=torch.long, device=device) for o in out]


@dataclass
class _CycleOut:
    """What one cycle (or a run of plain steps) gave each row, read back on the host."""

    new: list[list[int]]  # each row's new tokens: accepted drafts, then the correction or bonus token
    accepted: list[int]  # accepted drafts per row (empty for plain steps)
    proposed: list[int] | None  # drafts each row proposed (None without drafts)
    drafts: int  # draft steps the cycle made


def _run_length(dec: Decoder, rows: _Rows, gamma: int, cache: KVCache, remaining: int) -> int:
    """Cycles in the next run: 1 unless the backend records cycles; there CYCLES_PER_RUN, halved until the
    run's slots (gamma + 1 a cycle for every row) fit the cache's capacity and the row with the most tokens
    left can use every cycle (a cycle takes at least one token), at least 1."""
    if not dec.backend.records(rows.x.device):
        return 1
    count = CYCLES_PER_RUN
    while count > 1 and (max(rows.pos) + count * (gamma + 1) + 2 > cache.capacity or count > remaining):
        count //= 2
    return count


def _cycles(
    dec: Decoder, x0: Tensor, pos_t: Tensor, gamma: int, upper: range, enc, cache, cfg: SamplingConfig,
    generator: torch.Generator | None, guide: _Guidance, draft_confidence: float | None, clock: PhaseClock,
    count: int = 1, recorded: bool = True, pos: list[int] | None = None,
) -> tuple[list[_CycleOut], Tensor, Tensor]:
    """`count` draft -> verify -> accept cycles, each from the last one's pending input (the first from x0
    (rows, 1, dim) at pos_t), every row in every cycle; returns what each cycle gave each row, the next pending
    input and on the device how many tokens each row took in all (accepted + 1 per cycle).
    recorded: let a backend that records cycles run the device part as one graph (`Backend.run_cycle`;
    the whole run then counts as verify time); False: one cycle step by step, the draft phase timed on its
    own. pos: pos_t's values as ints, where the caller holds them."""
    recorded = recorded and dec.backend.records(x0.device)
    if count > 1 and not recorded:
        raise ValueError("runs of several cycles are for a backend that records them")
    t0 = clock.mark()
    marks = [t0]
    # the read-back's layout: verified positions, drafts, a proposed count; a replayed graph runs no
    # Python, and a backend that replays one drafts all gamma with static shapes
    layout = {"n": gamma + 1, "s": gamma, "limit": bool(gamma) and draft_confidence is not None}

    def one(x0: Tensor, pos_t: Tensor, enc: Encoded, known: list[int] | None) -> tuple[Tensor, Tensor, Tensor]:
        """Draft, verify, accept: (the cycle's read-back, the next pending input, each row's advance)."""
        start = dec.start_of(pos_t, guide.on, known)
        # draft: gamma tokens from the exit head, keeping every exit state for the target
        # limit: per-row draft counts, only when rows may stop early
        x, q, drafts, limit = x0, None, None, None
        if gamma:
            x, q, drafts, limit = dec.backend.draft_phase(x0, pos_t, gamma, cfg, generator, enc, cache,
                                                          confidence=draft_confidence, cond_scale=guide.draft_scale)
        if not recorded:
            marks.append(clock.mark())
        if drafts is not None and not guide.on and not recorded:  # the rest in one call where the backend can
            fused = dec.backend.verify_accept(x, start, upper, enc, cache, drafts, q, limit, cfg, generator)
            if fused is not None:
                layout.update({"n": drafts.shape[1] + 1, "s": drafts.shape[1], "limit": limit is not None})
                return fused
        # verify: the layers above the exit on all gamma + 1 positions at once (a row that stopped drafting
        # early is not read past its drafts, which the CPU kernels skip: `Backend.verify`)
        target_logits = guide.target(dec.backend.verify(x, start, upper, enc, cache, limit=limit))
        # accept: rows keep different numbers of drafts (a NONFINITE draft is rejected)
        acc = _accept(target_logits, drafts, q, cfg, dec.backend.draws(generator), limit)
        # one read-back: accepted, next token, each verified position's logit sum (in float64: NaN or
        # +-inf exactly where a logit is; the counts and tokens are exact too), the drafts and each row's
        # proposed count
        sums = target_logits.sum(dim=-1, dtype=torch.float64)
        got = {"n": sums.shape[1], "s": 0 if drafts is None else drafts.shape[1], "limit": limit is not None}
        if recorded and got != layout:  # a replay runs no Python: the layout must be known before the run
            raise RuntimeError(f"a recorded cycle's read-back is laid out as {got}, not {layout}")
        layout.update(got)
        parts = [acc.accepted[:, None], acc.next_token[:, None], sums] + [t for t in (drafts, limit) if t is not None]
        read = torch.cat([t.to(sums.dtype).view(sums.shape[0], -1) for t in parts], dim=1)
        return read, dec.embed(acc.next_token[:, None], guide.on), acc.accepted + 1

    def device_part(x: Tensor, pos_t: Tensor, enc: Encoded) -> tuple[Tensor, Tensor, Tensor]:
        """`count` cycles on the device, each at the positions the last one reached: (their read-backs
        (count, rows, ...), the next pending input, each row's advance over the run)."""
        reads, advance = [], None
        for _ in range(count):
            known = pos if advance is None and not recorded else None  # a replayed graph gets other positions
            read, x, step = one(x, pos_t if advance is None else pos_t + advance, enc, known)
            reads.append(read)
            advance = step if advance is None else advance + step
        return torch.stack(reads), x, advance

    if recorded:
        key = ("cycle", gamma, count, upper.start, upper.stop, cfg, guide.on, guide.scale, guide.draft_scale,
               draft_confidence)
        reads, x_next, advance = dec.backend.run_cycle(device_part, key, x0, pos_t, enc, cache, generator)
        clock.add("verify", t0, clock.mark())
    else:
        reads, x_next, advance = device_part(x0, pos_t, enc)
        clock.add("draft", t0, marks[1])
        clock.add("verify", marks[1], clock.mark())
    n, s = layout["n"], layout["s"]
    return [_decode_cycle(read, n, s, layout["limit"], gamma) for read in reads.tolist()], x_next, advance


def _decode_cycle(read: list[list[float]], n: int, s: int, limit: bool, gamma: int) -> _CycleOut:
    """One cycle's read-back (rows: accepted, next token, n verified positions' logit sums, s drafts, the
    proposed count where rows may stop early) -> each row's new tokens."""
    accepted = [int(r[0]) for r in read]
    drafted = [[int(v) for v in r[2 + n : 2 + n + s]] for r in read]
    proposed = None  # drafts each row proposed this cycle
    if gamma:
        proposed = [int(r[-1]) for r in read] if limit else [s] * len(accepted)
    new = []
    for r, (d, k, row) in enumerate(zip(drafted, accepted, read)):
        # the row's tokens come from p_0..p_k and q_0..q_k (q_k: the draft it stopped at, if proposed): the
        # first of those that was not finite ends them with a marker (the loop raises unless an EOS
        # before it ended the row); later positions were never read
        p_sums = row[2 : k + 3]
        bad = None if math.isfinite(sum(p_sums)) else next(j for j, v in enumerate(p_sums) if not math.isfinite(v))
        if d and NONFINITE in d[: min(k + 1, proposed[r])]:
            j = d.index(NONFINITE)
            if bad is None or j < bad:
                new.append(d[:j] + [NONFINITE_DRAFT])
                continue
        new.append(d[:k] + [int(row[1])] if bad is None else d[:bad] + [NONFINITE])
    return _CycleOut(new, accepted, proposed, s)


def probe_cycle(dec: Decoder, x: Tensor, pos: Tensor, gamma: int, enc: Encoded, cache: KVCache) -> float:
    """One greedy unguided cycle at `gamma` (0: one plain step) from pending input x (rows, 1, dim) at
    slots pos (rows,), committing nothing: the cache keeps its lengths and a second call overwrites the
    same slots. What `measure` times to measure what a cycle costs; returns its draft phase's seconds."""
    stats, clock = DecodeStats(), PhaseClock(x.device)
    _cycles(dec, x, pos, gamma, range(dec.exit_layer if gamma else 0, dec.depth), enc, cache, SamplingConfig(0.0), None,
            _Guidance(False, 1.0, 1.0), None, clock, recorded=False)
    clock.into(stats)
    return stats.draft_time


def _accept(
    target_logits: Tensor, drafts: Tensor | None, q: Tensor | None, cfg: SamplingConfig, draws: Draws,
    limit: Tensor | None,
) -> Acceptance:
    """p at the verified positions against the drafts (rows, steps); no drafts: simply draw from p."""
    if drafts is None:
        p0 = target_logits[:, 0]
        token = p0.argmax(dim=-1) if cfg.greedy else draw(probabilities(p0, cfg), race=draws.exponential(p0.shape, p0))
        return Acceptance(torch.zeros_like(token), token)
    if cfg.greedy:
        return greedy_accept(target_logits.argmax(dim=-1), drafts, limit)
    return speculative_accept(probabilities(target_logits, cfg), q, drafts, limit=limit, draws=draws)


def _count(
    stats: DecodeStats, accepted: list[int], limit: list[int] | None, draft_steps: int, gamma: int,
    passes: int = 1,
) -> None:
    """One cycle's counters; `limit`: drafts each row proposed (None without drafts); `passes`: target
    passes (plain steps) the cycle made; `gamma`: its most drafts per row (0: plain)."""
    stats.steps += passes
    stats.target_passes += passes
    stats.draft_passes += draft_steps
    _grow(stats.gamma_hist, gamma + 1)
    stats.gamma_hist[gamma] += passes
    if limit is not None:
        stats.drafted += sum(limit)
        stats.accepted += sum(accepted)
        stats.rejections += sum(a < n for a, n in zip(accepted, limit))
        _grow(stats.accepted_hist, gamma + 1)
        for a in accepted:
            stats.accepted_hist[a] += 1


def _grow(hist: list[int], size: int) -> None:
    """A histogram long enough for `size` bins (auto's gamma can grow from cycle to cycle)."""
    hist.extend([0] * (size - len(hist)))
