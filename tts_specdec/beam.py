"""Beam search: the beam state, ONE exact step function, and the plain loop over it.

Semantics (the reference that speculative beam search must equal):
- K live beams per item, scored by the sum of target log-probs;
- one step takes the top 2K of (live beam x token) candidates and walks them best first: an EOS
  candidate ranked among the first K becomes a finished hypothesis with score sum / len**length_penalty
  (len counts generated tokens including EOS); other candidates fill the next K live beams;
- an item is done when it has K finished hypotheses and its best live beam, normalised by the
  current length, cannot beat the worst of them; at max_length live beams are finalised as they are.

spear-tts's own `generate(beam_search_decode=True)` is another search ("upstream" semantics):
- every live beam proposes its K best tokens (torch.topk of its log-probs); the K * K candidates,
  beam-major as spear-tts stacks them, are ranked by summed log-prob with torch.sort (descending)
  and the first K are the new beams; no length normalisation, no finished set;
- a beam that emitted EOS keeps expanding: its later tokens still add to its score (the caller masks
  them); the search stops when every beam of every item holds an EOS, or at max_length;
- the result is the first beam (cut after its first EOS).
The same sums, topk and sort on rows of the same length give the same ranking, ties included.
Beams live in the batch dimension: row a*K + j is beam j of active item a.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import Tensor

from . import kernels
from .decoder import Decoder, Encoded
from .finite import NonFiniteLogits
from .sampling import cfg_mix

BeamSemantics = Literal["standard", "upstream"]
SEMANTICS = ("standard", "upstream")


@dataclass
class BeamState:
    """Live beams of the active items plus every item's finished hypotheses."""

    beam_size: int
    length_penalty: float
    eos_id: int | None
    items: list[int]  # original item index of each active item, in row order
    # (active * K) tokens of each live beam, on the host: a step reads its new beams back anyway, and a
    # list per beam costs less than the two tensor ops (gather, concatenate) a step took per beam set
    history: list[list[int]]
    scores: Tensor  # (active, K) summed log-probs of the live beams
    device: torch.device  # where results are returned
    # per original item: min-heap of (score, tie, tokens incl. EOS), at most K entries
    finished: list[list[tuple[float, int, list[int]]]] = field(default_factory=list)
    semantics: BeamSemantics = "standard"
    # upstream: (active * K,) the live beam holds an EOS; the items stop together when all of theirs do,
    # unless `stop_together` is False (the caller then ends them: `spec_beam` runs items one by one)
    ended: Tensor | None = None
    stop_together: bool = True
    length: int = 0  # tokens generated so far (every live beam's)
    _tie: int = 0
    _all_ended: bool | None = None  # upstream: `ended.all()` after the last step, read with its check

    @classmethod
    def initial(
        cls, batch: int, beam_size: int, length_penalty: float, eos_id: int | None, device: torch.device,
        semantics: BeamSemantics = "standard", stop_together: bool = True,
    ) -> "BeamState":
        scores = torch.full((batch, beam_size), -math.inf, dtype=torch.float64, device=device)
        scores[:, 0] = 0.0  # all K beams start equal: let only the first one expand
        return cls(
            beam_size,
            length_penalty,
            eos_id,
            list(range(batch)),
            [[] for _ in range(batch * beam_size)],
            scores,
            torch.device(device),
            [[] for _ in range(batch)],
            semantics,
            torch.zeros(batch * beam_size, dtype=torch.bool, device=device) if semantics == "upstream" else None,
            stop_together,
        )

    @property
    def tokens(self) -> Tensor:
        """(active * K, length) the live beams' tokens."""
        return torch.tensor(self.history, dtype=torch.long, device=self.device).view(len(self.history), self.length)

    @property
    def active(self) -> int:
        return len(self.items)

    def advance(self, taken: Tensor, scores: Tensor) -> None:
        """Steps that needed no decision, taken by `Backend.beam_steps`: taken (steps, 2, rows) int64 each
        new beam's parent row and token, `scores` (active, K) after them (upstream: `ended` updated there)."""
        for parents, tokens in taken.tolist():
            self.history = [self.history[p] + [tk] for p, tk in zip(parents, tokens)]
        self.length += taken.shape[0]
        self.scores = scores
        self._all_ended = None

    def _add_finished(self, item: int, score: float, tokens: list[int]) -> None:
        heap = self.finished[item]
        self._tie += 1
        entry = (score, -self._tie, tokens)  # on equal scores the earlier hypothesis ranks higher
        if len(heap) < self.beam_size:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)

    def best(self, item: int) -> tuple[list[int], float]:
        """Item's best finished hypothesis (tokens on the host; `on_device` sends results together)."""
        score, _, tokens = max(self.finished[item])
        return tokens, score

    def all_ended(self) -> bool:
        """upstream: every live beam of every active item holds an EOS (then they all do from now on:
        every later beam extends one of them)."""
        if self._all_ended is None:
            self._all_ended = bool(self.ended.all())
        return self._all_ended

    def first_beam(self, i: int) -> tuple[list[int], float]:
        """upstream: active item i's result if the search stopped now: its first beam, cut after its
        first EOS, and that beam's summed log-prob."""
        tokens = self.history[i * self.beam_size]
        if self.eos_id is not None and self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id) + 1]
        return tokens, float(self.scores[i, 0])


def on_device(results: list[tuple[list[int], float]], device: torch.device) -> tuple[list[Tensor], list[float]]:
    """Each item's (tokens, score) with its tokens on `device`: one send for all items, since on a GPU
    every send waits for the device's queue."""
    lengths = [len(tokens) for tokens, _ in results]
    flat = torch.tensor([t for tokens, _ in results for t in tokens], dtype=torch.long, device=device)
    return list(flat.split(lengths)), [score for _, score in results]


@dataclass
class StepOutput:
    parents: Tensor  # (active' * K,) old row of each new live beam (finished items dropped)
    tokens: Tensor  # (active' * K,) the token each new live beam appended
    kept: Tensor | None  # (active',) old index of each item still active; None: every item
    # the same parents and tokens, and the new beams' scores, on the host (read with the step's one
    # read-back: a caller that needs them reads nothing more)
    host: tuple[list[int], list[int], list[float]]


def beam_step(state: BeamState, logprobs: Tensor, last: bool = False, rows: list[int] | None = None) -> StepOutput:
    """Advance every active item by one exact beam-search step; mutates `state`.

    logprobs: next-token log-probs with a row per live beam, (active * K, V), or any rows of which `rows`
    names each live beam's. `last` finalises at max_length.
    """
    if state.semantics == "upstream":
        return _upstream_step(state, logprobs if rows is None else logprobs[rows], last)
    k, a = state.beam_size, state.active
    vocab = logprobs.shape[-1]
    n = min(2 * k, k * vocab)
    norm = (state.length + 1) ** state.length_penalty
    device = state.device
    # the ranked candidates as Python numbers: a few dozen values, cheaper to test here than with tensor
    # ops; on the CPU in one kernel call with the new beams' tensors (`kernels.beam_top`), else with
    # torch.topk (`_ranked`: one read-back where that waits for the device)
    fast = kernels.beam_top(state.scores, logprobs, rows, n)
    if fast is None:
        if rows is not None:
            logprobs = logprobs[rows]
        top_scores, top_index, read = _ranked(state, logprobs, n)
    else:
        read = fast[:2]
    best, flat = [row[:k] for row in read[0]], [row[:k] for row in read[1]]
    if any(v != v for row in best for v in row):
        # topk ranks NaN first: some beam's log-probs hold NaN (`step_logprobs`: its logits were not all
        # finite). A live beam's is an error; a padding beam's (-inf score) is never read, but must not
        # outrank real candidates
        if fast is not None and rows is not None:
            logprobs = logprobs[rows]
        fast = None
        _raise_nonfinite(state, logprobs.view(a, k, vocab))
        top_scores, top_index, read = _ranked(state, logprobs, n, nan=-math.inf)
        best, flat = [row[:k] for row in read[0]], [row[:k] for row in read[1]]
    if all(math.isfinite(v) for row in best for v in row) and (
        state.eos_id is None or all(f % vocab != state.eos_id for row in flat for f in row)
    ):
        # the common case: no EOS and no -inf among the K best, so they are the new beams
        host = ([i * k + f // vocab for i, row in enumerate(flat) for f in row],
                [f % vocab for row in flat for f in row], [v for row in best for v in row])
        if fast is not None:
            parents, tokens, scores = fast[2:]
        else:
            scores = top_scores[:, :k].to(torch.float64)  # the values of `best`, exactly
            if transfers_wait(device):  # formed on the device from the same indices
                best_index = top_index[:, :k]
                parents = (torch.arange(a, device=device)[:, None] * k + torch.div(best_index, vocab, rounding_mode="floor")).flatten()
                tokens = (best_index % vocab).flatten()
            else:  # on the CPU one tensor from the lists costs less than the five ops above
                parents, tokens = torch.tensor(host[0] + host[1], device=device).view(2, a * k)
    else:
        parents, tokens, scores, host = _walk(state, *read, vocab, norm)
    best_live = host[2][::k]  # beams are in score order
    state.history = [state.history[p] + [tk] for p, tk in zip(host[0], host[1])]
    state.length += 1
    state.scores = scores

    if last:
        for i in range(a):
            for j in range(k):
                score = host[2][i * k + j]  # = scores[i, j], on the host
                if score > -math.inf:
                    state._add_finished(state.items[i], score / norm, state.history[i * k + j])
        keep = []
    else:
        keep = [i for i in range(a) if not _is_done(state, i, best_live[i], norm)]
    if len(keep) == a:  # no item finished: rows stay where they are
        return StepOutput(parents, tokens, None, host)
    kept = torch.tensor(keep, dtype=torch.long, device=device)
    rows_kept = item_rows(kept, k)
    state.items = [state.items[i] for i in keep]
    host_rows = [i * k + j for i in keep for j in range(k)]
    state.history = [state.history[r] for r in host_rows]
    state.scores = state.scores[kept]
    return StepOutput(parents[rows_kept], tokens[rows_kept], kept, tuple([h[r] for r in host_rows] for h in host))


def _ranked(state: BeamState, logprobs: Tensor, n: int, nan: float | None = None) -> tuple[Tensor, Tensor, tuple]:
    """The n best candidates per item with torch.topk: (scores, flat indices, the same read back);
    `nan` replaces NaN candidates first."""
    k, a, vocab = state.beam_size, state.active, logprobs.shape[-1]
    cand = (state.scores.to(logprobs.dtype)[:, :, None] + logprobs.view(a, k, vocab)).view(a, k * vocab)
    if nan is not None:
        cand.nan_to_num_(nan=nan, posinf=math.inf, neginf=-math.inf)
    top_scores, top_index = cand.topk(n, dim=1)
    return top_scores, top_index, _read(top_scores, top_index)


def transfers_wait(device: torch.device) -> bool:
    """Whether a copy between the host and `device` waits for the device's queued work (PyTorch completes
    such a copy before going on): on an accelerator a loop reads back as rarely as it can and forms its
    small tensors on the device; on the CPU plain copies are the cheaper way."""
    return device.type != "cpu"


def _read(top_scores: Tensor, top_index: Tensor) -> tuple[list[list[float]], list[list[int]]]:
    """The ranked candidates' scores and flat indices of every item: in one read-back where that waits
    (float64 holds both exactly), else two."""
    if not transfers_wait(top_scores.device):
        return top_scores.tolist(), top_index.tolist()
    read = torch.stack((top_scores.to(torch.float64), top_index.to(torch.float64))).tolist()
    return read[0], [[int(f) for f in row] for row in read[1]]


def _upstream_step(state: BeamState, logprobs: Tensor, last: bool) -> StepOutput:
    """One step of spear-tts's beam search (module docstring) for every active item."""
    k, a, device = state.beam_size, state.active, state.device
    top, top_tokens = logprobs.topk(k, dim=-1)  # (a * K, K): spear-tts's per-beam candidates, best first
    beams = 1 if state.length == 0 else k  # spear-tts starts from one beam, then keeps K
    top, top_tokens = top.view(a, k, k)[:, :beams], top_tokens.view(a, k, k)[:, :beams]
    # every beam it keeps is read (an ended beam's later log-probs still add to its score): NaN log-probs
    # (`step_logprobs`: logits not all finite), which topk ranks first, are an error (read back below)
    bad = top[:, :, 0].isnan().any(dim=1)
    step, items = state.length, state.items
    # float sums in the log-probs' dtype, as spear-tts adds them (scores hold those values exactly)
    cand = (state.scores[:, :beams].to(logprobs.dtype)[:, :, None] + top).flatten(1)
    order = cand.sort(dim=1, descending=True).indices[:, :k]  # (a, K) flat index beam * K + rank
    beam = torch.div(order, k, rounding_mode="floor")
    parents = (beam + torch.arange(a, device=device)[:, None] * k).flatten()
    tokens = top_tokens.flatten(1).gather(1, order).flatten()
    state.scores = cand.gather(1, order).to(torch.float64)
    state.ended = state.ended[parents]
    if state.eos_id is not None:
        state.ended |= tokens == state.eos_id
    # one read-back: the items' checks, whether every beam ended (`all_ended`, here or in the caller), and
    # the new beams (float64 holds the indices exactly)
    flags = torch.cat((bad, state.ended.all()[None])).to(torch.float64)
    read = torch.cat((flags, parents.to(torch.float64), tokens.to(torch.float64), state.scores.flatten())).tolist()
    if any(read[:a]):
        raise NonFiniteLogits(items[next(i for i, v in enumerate(read[:a]) if v)], step)
    state._all_ended = bool(read[a])
    n = a * k
    host = ([int(v) for v in read[a + 1 : a + 1 + n]], [int(v) for v in read[a + 1 + n : a + 1 + 2 * n]],
            read[a + 1 + 2 * n :])
    state.history = [state.history[p] + [tk] for p, tk in zip(host[0], host[1])]
    state.length += 1
    if last or (state.stop_together and state.all_ended()):
        for i in range(a):
            tokens_i, score = state.first_beam(i)
            state._add_finished(state.items[i], score, tokens_i)
        state.items = []
        state.history, state.scores, state.ended = [], state.scores[:0], state.ended[:0]
        return StepOutput(parents[:0], tokens[:0], torch.zeros(0, dtype=torch.long, device=device), ([], [], []))
    return StepOutput(parents, tokens, None, host)


def _worst(state: BeamState) -> Tensor:
    """(active,) float64: each active item's worst finished score where it has K finished hypotheses
    (`_is_done` compares its best live beam with it), else -inf."""
    return torch.tensor([heap[0][0] if len(heap) == state.beam_size else -math.inf
                         for heap in (state.finished[i] for i in state.items)], dtype=torch.float64)


def _raise_nonfinite(state: BeamState, logprobs: Tensor) -> None:
    """`NonFiniteLogits` for the first item (in row order) with a live beam whose log-probs (active, K, V)
    hold NaN (`step_logprobs` makes a row NaN where its logits were not all finite)."""
    bad = (logprobs.isnan().any(dim=-1) & (state.scores > -math.inf)).any(dim=-1).tolist()
    if any(bad):
        raise NonFiniteLogits(state.items[bad.index(True)], state.length)


def _walk(
    state: BeamState, scores_l: list[list[float]], index_l: list[list[int]], vocab: int, norm: float
) -> tuple[Tensor, Tensor, Tensor, tuple[list[int], list[int], list[float]]]:
    """The 2K best candidates per item, best first: an EOS among the first K ranks finishes a
    hypothesis, the others fill the K live beams. Returns (parents, tokens, scores), each (active, K),
    and the same flattened on the host."""
    k, a, device = state.beam_size, state.active, state.device
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
                    state._add_finished(item, score / norm, state.history[row] + [token])
                continue
            parents[i, filled], tokens[i, filled], scores[i, filled] = row, token, score
            filled += 1
            if filled == k:
                break
        parents[i, filled:] = i * k  # padding beams: -inf score, never expanded
    host = (parents.flatten().tolist(), tokens.flatten().tolist(), scores.flatten().tolist())  # CPU tensors
    return parents.flatten().to(device), tokens.flatten().to(device), scores.to(device), host


def _is_done(state: BeamState, i: int, best_live: float, norm: float) -> bool:
    if best_live == -math.inf:
        return True
    heap = state.finished[state.items[i]]
    return len(heap) == state.beam_size and best_live / norm <= heap[0][0]


def cache_positions(max_length: int) -> int:
    """Positions a beam search's cache starts with (it grows as the beams get longer)."""
    return min(max_length, 256) + 1


def beam_search_loop(
    dec: Decoder,
    source: Tensor,
    *,
    beam_size: int,
    length_penalty: float,
    max_length: int,
    cond_scale: float,
    semantics: BeamSemantics = "standard",
    temperature: float = 1.0,
    source_mask: Tensor | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Tensor], list[float], int]:
    """Plain batched beam search: one forward pass per step for all beams of all items.

    Returns (best tokens per item incl. EOS, their scores, number of steps). `progress` is told the
    beams' length after every step, or after the steps one `Backend.beam_steps` call took.
    """
    batch, k = source.shape[0], beam_size
    guided = cond_scale > 1
    enc = encode_beams(dec, source, k, guided, source_mask)
    # by reference: a beam step reorders slot tables, never K/V (every row writes slot t at step t),
    # where the backend reads slot tables
    cache = dec.new_cache(enc.rows, cache_positions(max_length), by_reference=dec.backend.by_reference)
    state = BeamState.initial(batch, k, length_penalty, dec.eos_id, source.device, semantics)
    layers = range(dec.depth)
    x = dec.start(enc.rows)
    # `Backend.beam_steps` may take the steps that need no decision; a backend that declines once declines
    # for the whole call (what it checks does not change), so it is not asked again
    fused = not guided
    t = 0  # steps taken
    while t < max_length:
        cache.grow(t + 1)
        ran = dec.backend.beam_steps(x, t, max_length - 1 - t, state.scores, _worst(state), state.length,
                                     length_penalty, temperature, dec.eos_id, enc, cache, state.ended) if fused else None
        fused = ran is not None
        if ran is None:
            logprobs = step_logprobs(dec.backend.verify(x, t, layers, enc, cache)[:, -1], cond_scale, temperature)
        else:
            taken, scores, x, logprobs = ran
            if taken.shape[0]:
                state.advance(taken, scores)
                t += taken.shape[0]
                if progress is not None:
                    progress(t)
            if logprobs is None:  # the cache's capacity stopped it
                continue
        out = beam_step(state, logprobs, last=t + 1 == max_length)
        t += 1
        if progress is not None:
            progress(t)
        if state.active == 0:
            break
        rows = dec.rows(out.parents, guided)
        cache.reorder(rows)
        if rows.numel() != enc.rows:
            enc = enc.select(dec.rows(item_rows(out.kept, k), guided))
        x = dec.embed(out.tokens[:, None], guided)
    return (*on_device([state.best(i) for i in range(batch)], state.device), t)


def step_logprobs(logits: Tensor, cond_scale: float, temperature: float = 1.0) -> Tensor:
    """Beam scores' log-probs: log_softmax of the CFG-mixed logits over the temperature, computed as
    spear-tts computes them (temperature 0 divides by 1e-10: near-greedy ranking)."""
    if cond_scale > 1:
        logits = cfg_mix(logits, cond_scale)
    if temperature != 1.0:  # x / 1.0 == x: skipping it changes no value
        logits = logits / max(temperature, 1e-10)
    # + 0 where a row's logits are all finite, NaN where one is not (`beam_step` reports it): log_softmax
    # alone makes NaN or +inf NaN at some entries only, and a -inf logit a plain log-prob of -inf
    return logits.log_softmax(dim=-1).add_(logits.sum(dim=-1, keepdim=True).mul_(0))


def encode_beams(dec: Decoder, source: Tensor, k: int, guided: bool, mask: Tensor | None = None) -> Encoded:
    """Encode each item once and give each of its K beams (item-major rows) that source side."""
    items = torch.arange(source.shape[0], device=source.device)
    return dec.encode(source, guided, mask).select(dec.rows(items.repeat_interleave(k), guided))


def item_rows(items: Tensor, k: int) -> Tensor:
    """Rows of the K beams of each of `items` (beams live in the batch dimension, item-major)."""
    return (items[:, None] * k + torch.arange(k, device=items.device)).flatten()
