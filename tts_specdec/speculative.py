"""Speculative sampling with the early-exit head as draft; gamma = 0 is plain sampling.

Per cycle, every row at its own length:
  draft   layers 1..E on the row's pending token, then on each drafted token: q_d, x_d ~ q_d
  verify  layers E+1..L on the gamma+1 exit states the draft kept -> p_1..p_{gamma+1}
  accept  Leviathan et al. accept/reject (greedy: draft == target argmax), rows keep different counts
  commit  append accepted tokens + correction/bonus, crop each row's cache, drop rows that ended
Layers 1..E are shared: their K/V, written by the draft, serve the target too, so no token passes
them twice (rejected drafts are the only wasted work).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .decoder import Decoder
from .results import DecodeStats
from .sampling import Acceptance, SamplingConfig, cfg_mix, draw, greedy_accept, probabilities, speculative_accept


@dataclass
class _Rows:
    """Active sequences: original index, committed length, output so far, pending decoder input."""

    index: Tensor  # (n,) original row of each active sequence
    pos: Tensor  # (n,) committed positions = position of the pending input
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
) -> list[Tensor]:
    """Returns each row's generated tokens (EOS and everything after it removed).

    draft_confidence: a row stops drafting after a token its draft gave less than this probability
    (up to gamma drafts per cycle); the cycle's drafting ends when every row stopped. The stopping
    rule reads only the draft's own distribution, so acceptance stays exact for each row's length.
    """
    batch, device = source.shape[0], source.device
    guided = cond_scale > 1
    enc = dec.encode(source, guided)
    cache = dec.new_cache(enc.rows, min(max_length, 256) + gamma + 2)
    out = torch.zeros(batch, max_length + gamma + 1, dtype=torch.long, device=device)
    out_len = torch.zeros(batch, dtype=torch.long, device=device)
    final_len = torch.full((batch,), max_length, dtype=torch.long, device=device)
    rows = _Rows(torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device), dec.start(enc.rows))
    trunk = range(dec.exit_layer) if gamma else range(0)
    upper = range(len(trunk), dec.depth)
    logits_of = lambda h, head: cfg_mix(head(h), cond_scale) if guided else head(h)  # noqa: E731

    while rows.index.numel():
        cache.grow(int(rows.pos.max()) + gamma + 2)
        start = dec.start_of(rows.pos, guided)
        # draft: gamma tokens from the exit head, keeping every exit state for the target
        t0 = time.perf_counter()
        x, exits, q, drafts = rows.x, [], [], []
        limit = torch.full_like(rows.pos, gamma)  # drafts each row proposes this cycle
        drafting = torch.ones_like(rows.pos, dtype=torch.bool)
        for d in range(gamma):
            h = dec.run(x, start + d, trunk, enc, cache)
            exits.append(h)
            draft_logits = logits_of(h[:, -1], dec.draft_logits)
            if cfg.greedy:
                token = draft_logits.argmax(dim=-1)
            else:
                q.append(probabilities(draft_logits, cfg))
                token = draw(q[-1], generator)
            drafts.append(token)
            x = dec.embed(token[:, None], guided)
            if draft_confidence is not None:
                q_x = draft_logits.softmax(-1).amax(-1) if cfg.greedy else q[-1].gather(-1, token[:, None])[:, 0]
                stop = drafting & (q_x < draft_confidence)
                limit = torch.where(stop, d + 1, limit)
                drafting &= ~stop
                if not bool(drafting.any()):
                    break
        if drafts:
            exits.append(dec.run(x, start + len(drafts), trunk, enc, cache))
            x = torch.cat(exits, dim=1)
        t1 = time.perf_counter()
        # verify: the layers above the exit on all gamma + 1 positions at once
        target_logits = logits_of(dec.run(x, start, upper, enc, cache), dec.target_logits)
        # accept: rows keep different numbers of drafts
        acc = _accept(target_logits, drafts, q, cfg, generator, None if draft_confidence is None else limit)
        t2 = time.perf_counter()
        # commit
        emitted = acc.next_token[:, None]
        if drafts:
            emitted = torch.cat((torch.stack(drafts, dim=1), emitted), dim=1)
            emitted.scatter_(1, acc.accepted[:, None], acc.next_token[:, None])
        count = acc.accepted + 1
        ended = _write(out, out_len, final_len, rows.index, emitted, count, dec.eos_id, max_length)
        _count(stats, acc.accepted, limit if drafts else None, len(drafts), gamma, t1 - t0, t2 - t1)
        rows.pos = rows.pos + count
        rows.x = dec.embed(acc.next_token[:, None], guided)
        cache.crop(dec.per_row(rows.pos, guided))
        if ended.any():
            keep = (~ended).nonzero()[:, 0]
            cache_rows = dec.rows(keep, guided)
            cache.reorder(cache_rows)
            enc = enc.select(cache_rows)
            rows = _Rows(rows.index[keep], rows.pos[keep], rows.x[cache_rows])
    stats.generated_tokens += int(final_len.sum())
    return [out[i, : final_len[i]] for i in range(batch)]


def _accept(
    target_logits: Tensor, drafts: list[Tensor], q: list[Tensor], cfg: SamplingConfig,
    generator: torch.Generator | None, limit: Tensor | None,
) -> Acceptance:
    """p at the verified positions against the drafts; gamma = 0 simply draws from p."""
    if not drafts:
        p0 = target_logits[:, 0]
        token = p0.argmax(dim=-1) if cfg.greedy else draw(probabilities(p0, cfg), generator)
        return Acceptance(torch.zeros_like(token), token)
    drafts_t = torch.stack(drafts, dim=1)
    if cfg.greedy:
        return greedy_accept(target_logits.argmax(dim=-1), drafts_t, limit)
    return speculative_accept(probabilities(target_logits, cfg), torch.stack(q, dim=1), drafts_t, generator, limit)


def _write(
    out: Tensor, out_len: Tensor, final_len: Tensor, index: Tensor, emitted: Tensor, count: Tensor,
    eos_id: int | None, max_length: int,
) -> Tensor:
    """Append each active row's emitted tokens; record where rows end. Returns the rows that ended."""
    width = emitted.shape[1]
    offset = torch.arange(width, device=emitted.device)
    valid = offset < count[:, None]
    cols = out_len[index][:, None] + offset
    out[index[:, None].expand_as(cols)[valid], cols[valid]] = emitted[valid]
    new_len = out_len[index] + count
    ended = new_len >= max_length
    if eos_id is not None:
        is_eos = (emitted == eos_id) & valid
        has_eos = is_eos.any(dim=1)
        eos_at = out_len[index] + is_eos.long().argmax(dim=1)
        final_len[index[has_eos]] = eos_at[has_eos].clamp(max=max_length)
        ended |= has_eos
    out_len[index] = new_len
    return ended


def _count(
    stats: DecodeStats, accepted: Tensor, limit: Tensor | None, draft_steps: int, gamma: int,
    draft_s: float, verify_s: float,
) -> None:
    stats.steps += 1
    stats.target_passes += 1
    stats.draft_passes += draft_steps
    stats.draft_time += draft_s
    stats.verify_time += verify_s
    if limit is not None:
        stats.drafted += int(limit.sum())
        stats.accepted += int(accepted.sum())
        stats.rejections += int((accepted < limit).sum())
        hist = torch.bincount(accepted, minlength=gamma + 1).tolist()
        if not stats.accepted_hist:
            stats.accepted_hist = [0] * (gamma + 1)
        stats.accepted_hist = [a + b for a, b in zip(stats.accepted_hist, hist)]
