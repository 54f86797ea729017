"""Beam search: the beam state, ONE exact step function, and the plain loop over it.

Semantics (the reference that speculative beam search must equal):
- K live beams per item, scored by the sum of target log-probs;
- one step takes the top 2K of (live beam x token) candidates and walks them best first: an EOS
  candidate ranked among the first K becomes a finished hypothesis with score sum / len**length_penalty
  (len counts generated tokens including EOS); other candidates fill the next K live beams;
- an item is done when it has K finished hypotheses and its best live beam, normalised by the
  current length, cannot beat the worst of them; at max_length live beams are finalised as they are.
Beams live in the batch dimension: row a*K + j is beam j of active item a.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .decoder import Decoder, Encoded
from .sampling import cfg_mix


@dataclass
class BeamState:
    """Live beams of the active items plus every item's finished hypotheses."""

    beam_size: int
    length_penalty: float
    eos_id: int | None
    items: list[int]  # original item index of each active item, in row order
    tokens: Tensor  # (active * K, t) tokens of the live beams
    scores: Tensor  # (active, K) summed log-probs of the live beams
    # per original item: min-heap of (score, tie, tokens incl. EOS), at most K entries
    finished: list[list[tuple[float, int, Tensor]]] = field(default_factory=list)
    _tie: int = 0

    @classmethod
    def initial(
        cls, batch: int, beam_size: int, length_penalty: float, eos_id: int | None, device: torch.device
    ) -> "BeamState":
        scores = torch.full((batch, beam_size), -math.inf, dtype=torch.float64, device=device)
        scores[:, 0] = 0.0  # all K beams start equal: let only the first one expand
        return cls(
            beam_size,
            length_penalty,
            eos_id,
            list(range(batch)),
            torch.zeros(batch * beam_size, 0, dtype=torch.long, device=device),
            scores,
            [[] for _ in range(batch)],
        )

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def active(self) -> int:
        return len(self.items)

    def _add_finished(self, item: int, score: float, tokens: Tensor) -> None:
        heap = self.finished[item]
        self._tie += 1
        entry = (score, -self._tie, tokens)  # on equal scores the earlier hypothesis ranks higher
        if len(heap) < self.beam_size:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)

    def best(self, item: int) -> tuple[Tensor, float]:
        score, _, tokens = max(self.finished[item])
        return tokens, score


@dataclass
class StepOutput:
    parents: Tensor  # (active' * K,) old row of each new live beam (finished items dropped)
    tokens: Tensor  # (active' * K,) the token each new live beam appended
    kept: Tensor  # (active',) old index of each item still active


def beam_step(state: BeamState, logprobs: Tensor, last: bool = False) -> StepOutput:
    """Advance every active item by one exact beam-search step; mutates `state`.

    logprobs: (active * K, V) next-token log-probs of the live beams. `last` finalises at max_length.
    """
    k, a = state.beam_size, state.active
    vocab = logprobs.shape[-1]
    cand = (state.scores.to(logprobs.dtype)[:, :, None] + logprobs.view(a, k, vocab)).view(a, k * vocab)
    top_scores, top_index = cand.topk(min(2 * k, k * vocab), dim=1)
    new_len = state.length + 1
    norm = new_len**state.length_penalty
    device = state.tokens.device
    # the K best as Python numbers: a few dozen values, cheaper to test here than with tensor ops
    best, flat = top_scores[:, :k].tolist(), top_index[:, :k].tolist()
    if all(math.isfinite(v) for row in best for v in row) and (
        state.eos_id is None or all(f % vocab != state.eos_id for row in flat for f in row)
    ):
        # the common case: no EOS and no -inf among the K best, so they are the new beams
        parents = torch.tensor([[i * k + f // vocab for f in row] for i, row in enumerate(flat)], device=device)
        tokens = torch.tensor([[f % vocab for f in row] for row in flat], device=device)
        scores = top_scores[:, :k].to(device, torch.float64)
        best_live = [row[0] for row in best]  # float32 values, exactly as in `scores`
    else:
        parents, tokens, scores = _walk(state, top_scores, top_index, vocab, norm)
        best_live = scores[:, 0].tolist()  # beams are in score order
    state.tokens = torch.cat((state.tokens[parents.flatten()], tokens.flatten()[:, None]), dim=1)
    state.scores = scores

    if last:
        for i in range(a):
            for j in range(k):
                if scores[i, j] > -math.inf:
                    state._add_finished(state.items[i], float(scores[i, j]) / norm, state.tokens[i * k + j])
        keep = []
    else:
        keep = [i for i in range(a) if not _is_done(state, i, best_live[i], norm)]
    if len(keep) == a:  # no item finished: rows stay where they are
        return StepOutput(parents.flatten(), tokens.flatten(), torch.arange(a, device=device))
    kept = torch.tensor(keep, dtype=torch.long, device=device)
    rows = item_rows(kept, k)
    state.items = [state.items[i] for i in keep]
    state.tokens = state.tokens[rows]
    state.scores = state.scores[kept]
    return StepOutput(parents.flatten()[rows], tokens.flatten()[rows], kept)


def _walk(
    state: BeamState, top_scores: Tensor, top_index: Tensor, vocab: int, norm: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The 2K best candidates per item, best first: an EOS among the first K ranks finishes a
    hypothesis, the others fill the K live beams. Returns (parents, tokens, scores), each (active, K)."""
    k, a, device = state.beam_size, state.active, state.tokens.device
    scores_l, index_l = top_scores.tolist(), top_index.tolist()
    parents = torch.zeros(a, k, dtype=torch.long)
    tokens = torch.zeros(a, k, dtype=torch.long)
    scores = torch.full((a, k), -math.inf, dtype=torch.float64)
    for i in range(a):
        item, filled = state.items[i], 0
        for rank, (score, flat) in enumerate(zip(scores_l[i], index_l[i])):
            if score == -math.inf:
                break
            beam, token = divmod(flat, vocab)
            row = i * k + beam
            if token == state.eos_id:
                if rank < k:
                    eos = torch.tensor([token], device=device)
                    state._add_finished(item, score / norm, torch.cat((state.tokens[row], eos)))
                continue
            parents[i, filled], tokens[i, filled], scores[i, filled] = row, token, score
            filled += 1
            if filled == k:
                break
        parents[i, filled:] = i * k  # padding beams: -inf score, never expanded
    return parents.to(device), tokens.to(device), scores.to(device)


def _is_done(state: BeamState, i: int, best_live: float, norm: float) -> bool:
    if best_live == -math.inf:
        return True
    heap = state.finished[state.items[i]]
    return len(heap) == state.beam_size and best_live / norm <= heap[0][0]


def beam_search_loop(
    dec: Decoder,
    source: Tensor,
    *,
    beam_size: int,
    length_penalty: float,
    max_length: int,
    cond_scale: float,
) -> tuple[list[Tensor], list[float], int]:
    """Plain batched beam search: one forward pass per step for all beams of all items.

    Returns (best tokens per item incl. EOS, their scores, number of steps).
    """
    batch, k = source.shape[0], beam_size
    guided = cond_scale > 1
    enc = encode_beams(dec, source, k, guided)
    # by reference: a beam step reorders slot tables, never K/V (every row writes slot t at step t)
    cache = dec.new_cache(enc.rows, min(max_length, 256) + 1, by_reference=True)
    state = BeamState.initial(batch, k, length_penalty, dec.eos_id, source.device)
    layers = range(dec.depth)
    x = dec.start(enc.rows)
    steps = 0
    for t in range(max_length):
        cache.grow(t + 1)
        logits = dec.target_logits(dec.run(x, t, layers, enc, cache)[:, -1])
        if guided:
            logits = cfg_mix(logits, cond_scale)
        out = beam_step(state, logits.log_softmax(dim=-1), last=t + 1 == max_length)
        steps += 1
        if state.active == 0:
            break
        rows = dec.rows(out.parents, guided)
        cache.reorder(rows)
        if rows.numel() != enc.rows:
            enc = enc.select(dec.rows(item_rows(out.kept, k), guided))
        x = dec.embed(out.tokens[:, None], guided)
    best = [state.best(i) for i in range(batch)]
    return [t for t, _ in best], [s for _, s in best], steps


def encode_beams(dec: Decoder, source: Tensor, k: int, guided: bool) -> Encoded:
    """Encode each item once and give each of its K beams (item-major rows) that source side."""
    items = torch.arange(source.shape[0], device=source.device)
    return dec.encode(source, guided).select(dec.rows(items.repeat_interleave(k), guided))


def item_rows(items: Tensor, k: int) -> Tensor:
    """Rows of the K beams of each of `items` (beams live in the batch dimension, item-major)."""
    return (items[:, None] * k + torch.arange(k, device=items.device)).flatten()
