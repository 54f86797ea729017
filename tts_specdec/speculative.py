"""Speculative sampling with the early-exit head as draft; gamma = 0 is plain sampling.

Per cycle, every row at its own length:
  draft   layers 1..E on the row's pending token, then on each drafted token: q_d, x_d ~ q_d
  verify  layers E+1..L on the gamma+1 exit states the draft kept -> p_1..p_{gamma+1}
  accept  Leviathan et al. accept/reject (greedy: draft == target argmax), rows keep different counts
  commit  append accepted tokens + correction/bonus, crop each row's cache, drop rows that ended
Layers 1..E are shared: their K/V, written by the draft, serve the target too, so no token passes
them twice (rejected drafts are the only wasted work). On the CPU kernels the whole draft phase is one
call (`Decoder.draft`), early draft stops, top-k/top-p and guidance included, and plain sampling
(gamma = 0) runs up to PLAIN_STEPS steps per call (`Decoder.sample_steps`), each drawn as the step-by-step
loop draws it. With gamma="auto" (`auto.SamplingPolicy`) gamma and draft stops may change from cycle to
cycle; every cycle is exact on its own, so the output law stays the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from .cache import KVCache
from .decoder import Decoder, Encoded
from .results import DecodeStats
from .sampling import Acceptance, SamplingConfig, cfg_mix, draw, greedy_accept, probabilities, speculative_accept
from .timing import PhaseClock

if TYPE_CHECKING:
    from .auto import SamplingPolicy


# plain sampling steps per kernel call: the call's fixed cost (~20 us) spread over them; a run ends early
# at EOS, so longer runs waste nothing
PLAIN_STEPS = 32


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
    every tensor op here costs a few microseconds of dispatch (the step's layers cost ~1 ms)."""

    index: list[int]  # original row of each active sequence
    pos: list[int]  # committed positions = position of the pending input
    x: Tensor  # (rows, 1, dim) pending input embedding (not yet through any layer)


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
    auto: SamplingPolicy | None = None,
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
    cache = dec.new_cache(enc.rows, min(max_length, 256) + gamma + 2)
    out: list[list[int]] = [[] for _ in range(batch)]
    rows = _Rows(list(range(batch)), [0] * batch, dec.start(enc.rows))
    clock = PhaseClock(device)

    while rows.index:
        g, confidence = auto.next() if auto is not None else (gamma, draft_confidence)
        trunk = range(dec.exit_layer) if g else range(0)
        upper = range(len(trunk), dec.depth)
        # plain sampling runs PLAIN_STEPS steps per kernel call (rows advance together: same length)
        steps = g or min(PLAIN_STEPS, max_length - len(out[rows.index[0]]))
        cache.grow(max(rows.pos) + steps + 2)
        pos_t = torch.tensor(rows.pos, device=device)
        t0 = clock.mark()
        run = None if g else dec.sample_steps(rows.x, pos_t, steps, cfg.temperature, generator, enc, cache,
                                              cfg.top_k, cfg.top_p, cond_scale)
        if run is not None:
            tokens, rows.x = run
            new = tokens.tolist()
            clock.add("verify", t0, clock.mark())
            _count(stats, [], None, 0, 0, passes=tokens.shape[1])
            if auto is not None:
                auto.plain(tokens.shape[1])
        else:
            new, rows.x, accepted, proposed = _cycle(dec, rows.x, pos_t, g, trunk, upper, enc, cache, cfg, generator,
                                                     guide, confidence, stats, clock)
            if auto is not None and proposed is not None:
                auto.observe(accepted, proposed)
            elif auto is not None:
                auto.plain(1)
        # commit: each row's new tokens (a plain run, or accepted drafts and the correction/bonus token);
        # a row ends at EOS or max_length
        keep = []
        for r, (i, tokens) in enumerate(zip(rows.index, new)):
            rows.pos[r] += len(tokens)
            if dec.eos_id is not None and dec.eos_id in tokens:
                tokens, ended = tokens[: tokens.index(dec.eos_id)], True
            else:
                ended = len(out[i]) + len(tokens) >= max_length
            out[i].extend(tokens[: max_length - len(out[i])])
            if not ended:
                keep.append(r)
        cache.crop(dec.per_row(torch.tensor(rows.pos, device=device), guide.on))
        if progress is not None:
            progress(max(len(o) for o in out))
        if len(keep) < len(rows.index):
            keep_t = torch.tensor(keep, dtype=torch.long, device=device)
            cache_rows = dec.rows(keep_t, guide.on)
            cache.reorder(cache_rows)
            enc = enc.select(cache_rows)
            rows = _Rows([rows.index[r] for r in keep], [rows.pos[r] for r in keep], rows.x[cache_rows])
    clock.into(stats)
    stats.generated_tokens += sum(len(o) for o in out)
    return [torch.tensor(o, dtype=torch.long, device=device) for o in out]


def _cycle(
    dec: Decoder, x0: Tensor, pos_t: Tensor, gamma: int, trunk: range, upper: range, enc, cache, cfg: SamplingConfig,
    generator: torch.Generator | None, guide: _Guidance, draft_confidence: float | None, stats: DecodeStats,
    clock: PhaseClock,
) -> tuple[list[list[int]], Tensor, list[int], list[int] | None]:
    """One draft -> verify -> accept cycle (gamma = 0: one plain step) from each row's pending input x0
    (rows, 1, dim) at pos_t; returns each sequence's new tokens (accepted drafts, then the correction or
    bonus token), the next pending input, and each sequence's accepted and proposed drafts (None
    without drafts)."""
    t0 = clock.mark()
    start = dec.start_of(pos_t, guide.on)
    # draft: gamma tokens from the exit head, keeping every exit state for the target
    # limit: per-row draft counts, only when rows may stop early
    x, q, drafts, limit = x0, None, None, None
    if gamma:  # the whole draft phase in one kernel call, else step by step
        fused = dec.draft(x0, pos_t, gamma, cfg.temperature, generator, enc, cache, draft_confidence, cfg.top_k,
                          cfg.top_p, guide.draft_scale)
        x, q, drafts, limit = fused if fused is not None else _draft_steps(
            dec, x0, start, pos_t, gamma, trunk, enc, cache, cfg, generator, guide, draft_confidence)
    t1 = clock.mark()
    # verify: the layers above the exit on all gamma + 1 positions at once
    target_logits = guide.target(dec.target_logits(dec.run(x, start, upper, enc, cache)))
    # accept: rows keep different numbers of drafts
    acc = _accept(target_logits, drafts, q, cfg, generator, limit)
    clock.add("draft", t0, t1)
    clock.add("verify", t1, clock.mark())
    accepted, next_token = acc.accepted.tolist(), acc.next_token.tolist()
    drafted = drafts.tolist() if drafts is not None else [[] for _ in accepted]
    proposed = None  # drafts each row proposed this cycle
    if drafts is not None:
        proposed = limit.tolist() if limit is not None else [drafts.shape[1]] * len(accepted)
    _count(stats, accepted, proposed, len(drafted[0]), gamma)
    new = [d[:k] + [t] for d, k, t in zip(drafted, accepted, next_token)]
    return new, dec.embed(acc.next_token[:, None], guide.on), accepted, proposed


def probe_cycle(dec: Decoder, x: Tensor, pos: Tensor, gamma: int, enc: Encoded, cache: KVCache) -> float:
    """One greedy unguided cycle at `gamma` (0: one plain step) from pending input x (rows, 1, dim) at
    slots pos (rows,), committing nothing: the cache keeps its lengths and a second call overwrites the
    same slots. What `auto` times to measure what a cycle costs; returns its draft phase's seconds."""
    trunk = range(dec.exit_layer) if gamma else range(0)
    stats, clock = DecodeStats(), PhaseClock(x.device)
    _cycle(dec, x, pos, gamma, trunk, range(len(trunk), dec.depth), enc, cache, SamplingConfig(0.0), None,
           _Guidance(False, 1.0, 1.0), None, stats, clock)
    clock.into(stats)
    return stats.draft_time


def _draft_steps(
    dec: Decoder, x: Tensor, start: int | Tensor, pos_t: Tensor, gamma: int, trunk: range, enc, cache, cfg: SamplingConfig,
    generator: torch.Generator | None, guide: _Guidance, draft_confidence: float | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """The draft phase step by step (without the kernels; the reference `Decoder.draft` is tested
    against): returns the exit states (rows, drafts + 1, dim), q (seqs, drafts, V) or None when greedy,
    the drafts (seqs, drafts) and each sequence's proposed count (None: all)."""
    exits, q, drafts = [], [], []
    # the stopping rule runs on the host: one copy per step instead of ~7 small ops (a GPU's pace here);
    # the step already waited for the device to know whether any row still drafts. A row drafts while
    # its limit is gamma, as in the C++ draft (one stopping at the last draft ends the loop anyway).
    limit = None if draft_confidence is None else [gamma] * len(pos_t)
    for d in range(gamma):
        h = dec.run(x, start + d, trunk, enc, cache)
        exits.append(h)
        draft_logits = guide.draft(dec.draft_logits(h[:, -1]))
        if cfg.greedy:
            token = draft_logits.argmax(dim=-1)
        else:
            q.append(probabilities(draft_logits, cfg))
            token = draw(q[-1], generator)
        drafts.append(token)
        x = dec.embed(token[:, None], guide.on)
        if limit is not None:
            q_x = draft_logits.softmax(-1).amax(-1) if cfg.greedy else q[-1].gather(-1, token[:, None])[:, 0]
            for r, prob in enumerate(q_x.tolist()):  # exact values against the float, as the C++ draft
                if limit[r] == gamma and prob < draft_confidence:
                    limit[r] = d + 1
            if gamma not in limit:
                break
    exits.append(dec.run(x, start + len(drafts), trunk, enc, cache))
    q_t = torch.stack(q, dim=1) if q else None
    limit_t = None if limit is None else torch.tensor(limit, device=pos_t.device)
    return torch.cat(exits, dim=1), q_t, torch.stack(drafts, dim=1), limit_t


def _accept(
    target_logits: Tensor, drafts: Tensor | None, q: Tensor | None, cfg: SamplingConfig,
    generator: torch.Generator | None, limit: Tensor | None,
) -> Acceptance:
    """p at the verified positions against the drafts (rows, steps); no drafts: simply draw from p."""
    if drafts is None:
        p0 = target_logits[:, 0]
        token = p0.argmax(dim=-1) if cfg.greedy else draw(probabilities(p0, cfg), generator)
        return Acceptance(torch.zeros_like(token), token)
    if cfg.greedy:
        return greedy_accept(target_logits.argmax(dim=-1), drafts, limit)
    return speculative_accept(probabilities(target_logits, cfg), q, drafts, generator, limit)


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
