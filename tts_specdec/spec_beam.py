"""Exact speculative beam search: the early-exit head drafts beam continuations, the target verifies.

Per cycle, every active item at its own length t (its live beams' pending inputs sit at slot t):
  draft   beam search with the exit head for gamma levels from the K live beams, width W per level;
          every node is kept in its root beam's own cache row, at the next free slot after t, with
          its rotary position t + depth (tree attention: a node sees the committed prefix and its
          own ancestors only), so drafting copies no cache
  verify  ONE pass of layers E+1..L over every node of every root row (roots included): the target
          log-probs after every draft node and after every live beam
  replay  `beam.beam_step` on those log-probs while every live beam is a verified node; the first
          step whose new beams leave the tree is still committed (its log-probs were exact)
  commit  new beam j = its root's row (one reorder per cycle), its accepted path's K/V moved from
          their tree slots to slots t+1.., cropped to t + committed steps
The result is token for token what `beam.beam_search_loop` returns, for either beam semantics. With
spear-tts's ("upstream"), items advance at different rates but the search stops for all of them
together (`_Together`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .beam import BeamSemantics, BeamState, beam_step, encode_beams, item_rows, step_logprobs
from .cache import KVCache
from .decoder import Decoder, Encoded
from .finite import NonFiniteLogits
from .results import DecodeStats
from .timing import PhaseClock


@dataclass
class _Live:
    """Active items at the start of a cycle; root row a*K + j is beam j of active item a."""

    items: list[int]  # original index of each active item
    states: list[BeamState]  # one per active item: items advance by different numbers of steps
    pos: Tensor  # (A,) generated tokens = slot and position of every live beam's pending input
    lengths: list[int]  # the same on the host (no read-back to size a cycle)
    x: Tensor  # (A * K * g, 1, dim) pending inputs (not yet through any layer)
    enc: Encoded  # one entry per cache row


@dataclass
class _Tree:
    """The draft forest of one cycle. Node ids: roots 0..R-1 (= root rows), then in creation order."""

    row: Tensor  # (N,) root row holding the node
    index: Tensor  # (N,) the node's place in its row: slot = t + index (roots: 0)
    depth: Tensor  # (N,)
    parent: Tensor  # (N,) parent node, -1 for roots
    anc: Tensor  # (R, M, M) anc[r, i, j]: node j of row r is an ancestor of node i, or i itself
    h: Tensor  # (R * g, M, dim) exit states by row and index
    count: Tensor  # (R,) nodes per row
    children: dict[tuple[int, int], int]  # (parent node, token) -> node


@dataclass
class _Advance:
    """What replay committed for one item."""

    steps: int
    parents: list[int] | None  # the node each new live beam extends; None: the item is done
    tokens: Tensor | None  # (K,) pending input of each new live beam


@dataclass
class _Together:
    """spear-tts's stopping rule for items that advance at different rates. Its search stops at the
    first length T at which every beam of every item holds an EOS (or at max_length), and returns each
    item's first beam at T. An item's beams, once all ended, stay so; T is the largest length at which
    an item's beams all ended. So each item keeps its first beam at every length from its own on, and
    runs until T is known and reached."""

    items: int
    max_length: int
    ended_at: dict[int, int] = field(default_factory=dict)  # item -> length its beams all ended at
    first: dict[int, dict[int, tuple[Tensor, float]]] = field(default_factory=dict)  # item -> length -> result

    @property
    def stop(self) -> int:
        """T if known, else max_length (an upper bound)."""
        if len(self.ended_at) < self.items:
            return self.max_length
        return min(self.max_length, max(self.ended_at.values()))

    def record(self, item: int, state: BeamState) -> bool:
        """After a beam step of `item`: keep its result at this length if it can be T; True: it is done."""
        kept = self.first.setdefault(item, {})
        if state.active == 0:  # finalised at max_length
            kept[state.length] = state.best(0)
            return True
        if state.all_ended():
            self.ended_at.setdefault(item, state.length)
            kept[state.length] = state.first_beam(0)
        return state.length >= self.stop

    def result(self, item: int) -> tuple[Tensor, float]:
        return self.first[item][self.stop]


def cache_positions(max_length: int, gamma: int, width: int) -> int:
    """Positions a speculative beam search's cache starts with: the prefix and a cycle's whole tree."""
    return min(max_length, 256) + 2 + gamma * width


def tree_bytes(dec: Decoder, roots: int, guided: bool, gamma: int, width: int, positions: int) -> int:
    """Bytes of a cycle's tree tensors every backend allocates, for `roots` beams at `gamma` levels of
    `width` nodes: the ancestor masks (roots, m, m) of the m = 1 + gamma * width nodes a row may hold
    (`draft`), and a tree pass's boolean mask over the cache's positions (rows, m, positions) with the
    additive copy the backends attend with. A lower bound of the cycle's peak (attention takes more)."""
    m, rows = 1 + gamma * width, roots * (2 if guided else 1)
    return roots * m * m + rows * m * dec.backend.capacity(positions) * (1 + dec.dtype.itemsize)


def spec_beam_search_loop(
    dec: Decoder,
    source: Tensor,
    *,
    beam_size: int,
    length_penalty: float,
    max_length: int,
    cond_scale: float,
    gamma: int,
    draft_width: int,
    stats: DecodeStats,
    semantics: BeamSemantics = "standard",
    temperature: float = 1.0,
    source_mask: Tensor | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Tensor], list[float], int]:
    """Returns (best tokens per item incl. final EOS if any, their scores, beam steps of the longest
    item), as plain beam search. `progress` is told the longest item's length after every cycle."""
    batch, k, device = source.shape[0], beam_size, source.device
    guided = cond_scale > 1
    width = min(draft_width, k * dec.vocab_size)
    enc = encode_beams(dec, source, k, guided, source_mask)
    cache = dec.new_cache(enc.rows, cache_positions(max_length, gamma, width))
    together = _Together(batch, max_length) if semantics == "upstream" else None
    states = [BeamState.initial(1, k, length_penalty, dec.eos_id, device, semantics, stop_together=False)
              for _ in range(batch)]
    live = _Live(list(range(batch)), states, torch.zeros(batch, dtype=torch.long, device=device), [0] * batch,
                 dec.start(enc.rows), enc)
    done: dict[int, BeamState] = {}
    stats.committed_hist = [0] * (gamma + 2)
    clock = PhaseClock(device)
    while live.items:
        # no drafting past max_length: replay can commit at most max_length - t steps
        levels = min(gamma, max_length - 1 - min(live.lengths))
        cache.grow(max(live.lengths) + 2 + levels * width)
        t0 = clock.mark()
        tree = draft(dec, live, cache, levels, width, cond_scale, temperature)
        t1 = clock.mark()
        logprobs = verify(dec, live, tree, cache, cond_scale, temperature)
        clock.add("draft", t0, t1)
        clock.add("verify", t1, clock.mark())
        advances = replay(live, tree, logprobs, max_length, together)
        if progress is not None:
            progress(max(s.length for s in live.states))
        for a, adv in enumerate(advances):
            stats.committed_hist[adv.steps] += 1
            if adv.parents is None:
                done[live.items[a]] = live.states[a]
        live = commit(dec, live, tree, advances, cache, guided)
        stats.steps += 1
        stats.target_passes += 1
        stats.draft_passes += levels
    clock.into(stats)
    if together is not None:
        best = [together.result(i) for i in range(batch)]
        return [t for t, _ in best], [s for _, s in best], together.stop
    best = [done[i].best(0) for i in range(batch)]
    return [t for t, _ in best], [s for _, s in best], max(done[i].length for i in range(batch))


def draft(
    dec: Decoder, live: _Live, cache: KVCache, levels: int, width: int, cond_scale: float, temperature: float = 1.0
) -> _Tree:
    """Beam search with the exit head for `levels` levels of width W per item; every node is kept."""
    guided = cond_scale > 1
    g = 2 if guided else 1
    a_n, k = len(live.states), live.states[0].beam_size
    r_n, device, vocab, eos = a_n * k, live.pos.device, dec.vocab_size, dec.eos_id
    m_max = 1 + levels * width
    t = live.pos.repeat_interleave(k)  # (R,) slot of each root
    n_max = r_n + levels * a_n * width
    row = torch.zeros(n_max, dtype=torch.long, device=device)
    index = torch.zeros(n_max, dtype=torch.long, device=device)
    depth = torch.zeros(n_max, dtype=torch.long, device=device)
    parent = torch.full((n_max,), -1, dtype=torch.long, device=device)
    tokens = torch.zeros(n_max, dtype=torch.long, device=device)
    row[:r_n] = torch.arange(r_n, device=device)
    anc = torch.zeros(r_n, m_max, m_max, dtype=torch.bool, device=device)
    anc[:, 0, 0] = True
    count = torch.ones(r_n, dtype=torch.long, device=device)
    hs = live.x.new_zeros(r_n * g, m_max, live.x.shape[-1])
    score = torch.cat([s.scores for s in live.states]).flatten()  # (R,) target scores of the roots
    level = torch.arange(r_n, device=device)  # nodes of the current level, item-major
    x, n_nodes, trunk = live.x, r_n, range(dec.exit_layer)
    static = dec.backend.static_shapes
    for d in range(levels + 1):
        # lay this level's nodes out per row: (R, c) with padding where a row got fewer (static shapes:
        # c is the most a row can get, the draft width, instead of the count read back from the device)
        lrow, lidx = row[level], index[level]
        per_row = _per_row(lrow, r_n)
        if d == 0:  # the roots: one per row
            c = 1
        else:
            c = width if static else int(per_row.max())
        first = count - per_row  # index of the row's first new node
        col = lidx - first[lrow]  # 0.. within the row's level
        slot_of = torch.full((r_n, c), -1, dtype=torch.long, device=device)
        slot_of[lrow, col] = lidx
        real = slot_of >= 0
        idx = torch.where(real, slot_of, first[:, None] + torch.arange(c, device=device))
        if d > 0:
            xs = x.new_zeros(r_n * g, c, x.shape[-1])
            xs.view(r_n, g, c, -1)[lrow, :, col] = x.view(-1, g, x.shape[-1])
            x = xs
        h = dec.run(x, dec.per_row(t + first, guided), trunk, live.enc, cache,
                    attn_mask=_tree_mask(anc, idx, real, t, cache.capacity if static else int((t + first).max()) + c,
                                         guided),
                    positions=dec.per_row((t + d)[:, None].expand(-1, c), guided), real=dec.per_row(real, guided))
        hv = h.view(r_n, g, c, -1)
        hs.view(r_n, g, m_max, -1)[lrow, :, lidx] = hv[lrow, :, col]
        if d == levels:
            break
        # expand: candidates of every node of this level, top W per item by draft score
        lp = step_logprobs(dec.draft_logits(hv[lrow, :, col].flatten(0, 1)), cond_scale, temperature)
        if eos is not None and live.states[0].semantics == "standard":
            lp[:, eos] = -math.inf  # EOS ends a hypothesis: it is never a node to expand
        per = level.numel() // a_n
        cand = (score.to(lp.dtype)[:, None] + lp).view(a_n, per * vocab)
        top, flat = cand.topk(min(width, per * vocab), dim=1)
        par = level.view(a_n, per).gather(1, flat // vocab).flatten()
        new = torch.arange(n_nodes, n_nodes + par.numel(), device=device)
        prow = row[par]
        # index within the row: after the row's existing nodes, in creation order
        order = torch.argsort(prow * new.numel() + torch.arange(new.numel(), device=device))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(new.numel(), device=device)
        per_row = _per_row(prow, r_n)
        before = torch.cumsum(per_row, 0) - per_row
        nidx = count[prow] + rank - before[prow]
        row[new], index[new], depth[new], parent[new], tokens[new] = prow, nidx, d + 1, par, (flat % vocab).flatten()
        anc[prow, nidx] = anc[prow, index[par]]
        anc[prow, nidx, nidx] = True
        count += per_row
        n_nodes += new.numel()
        level, score = new, top.flatten()
        x = dec.embed(tokens[new][:, None], guided)
    parent_l, token_l = torch.stack((parent[r_n:n_nodes], tokens[r_n:n_nodes])).tolist()  # one read-back
    children = {(p, tk): n + r_n for n, (p, tk) in enumerate(zip(parent_l, token_l))}
    return _Tree(row[:n_nodes], index[:n_nodes], depth[:n_nodes], parent[:n_nodes], anc, hs, count, children)


def verify(
    dec: Decoder, live: _Live, tree: _Tree, cache: KVCache, cond_scale: float, temperature: float = 1.0
) -> Tensor:
    """One target pass (layers E+1..L) over every node of every root row; log-probs per node (N, V)."""
    guided = cond_scale > 1
    k = live.states[0].beam_size
    r_n = tree.count.numel()
    t = live.pos.repeat_interleave(k)
    static = dec.backend.static_shapes  # the whole tree's size instead of the largest row's, read back
    m = tree.anc.shape[1] if static else int(tree.count.max())
    idx = torch.arange(m, device=t.device).expand(r_n, m)
    real = idx < tree.count[:, None]
    depth = torch.zeros(r_n, m, dtype=torch.long, device=t.device)
    depth[tree.row, tree.index] = tree.depth
    upper = range(dec.exit_layer, dec.depth)
    h = dec.run(tree.h[:, :m], dec.start_of(t, guided), upper, live.enc, cache,
                attn_mask=_tree_mask(tree.anc, idx, real, t, cache.capacity if static else int(t.max()) + m, guided),
                positions=dec.per_row(t[:, None] + depth, guided), real=dec.per_row(real, guided))
    lp = step_logprobs(dec.target_logits(h), cond_scale, temperature)  # (R, m, V)
    return lp[tree.row, tree.index]


def replay(
    live: _Live, tree: _Tree, logprobs: Tensor, max_length: int, together: _Together | None = None
) -> list[_Advance]:
    """Exact beam steps on target log-probs, per item, while every live beam is a verified node."""
    advances = []
    for a, state in enumerate(live.states):
        k = state.beam_size
        nodes = list(range(a * k, (a + 1) * k))  # the roots: this item's live beams
        steps = 0
        if together is not None and state.length >= together.stop:  # T became known after it passed T
            advances.append(_Advance(0, None, None))
            continue
        while True:
            try:
                out = beam_step(state, logprobs[nodes], last=state.length + 1 == max_length)
            except NonFiniteLogits as e:  # the state holds one item: name its row in the batch
                raise NonFiniteLogits(live.items[a], e.step, e.head) from None
            steps += 1
            if together is not None and together.record(live.items[a], state) or state.active == 0:
                advances.append(_Advance(steps, None, None))
                break
            rows, tokens, scores = out.host
            parents = [nodes[j] for j in rows]
            nxt = [tree.children.get(pt) for pt in zip(parents, tokens)]
            # a -inf beam (fewer than K candidates) never expands again: any verified node serves it
            dead = [s == -math.inf for s in scores]
            nxt = [p if n is None and dd else n for n, p, dd in zip(nxt, parents, dead)]
            if None in nxt:  # a new beam left the tree: this step is committed, the cycle ends
                advances.append(_Advance(steps, parents, out.tokens))
                break
            nodes = nxt
    return advances


def commit(
    dec: Decoder, live: _Live, tree: _Tree, advances: list[_Advance], cache: KVCache, guided: bool
) -> _Live:
    """New beam j takes its root's row, then its accepted path's K/V move to slots t+1.., t+steps-1."""
    kept = [a for a, adv in enumerate(advances) if adv.parents is not None]
    device, k = live.pos.device, live.states[0].beam_size
    if not kept:
        return _Live([], [], live.pos[:0], [], live.x[:0], live.enc)
    steps_l = [advances[a].steps for a in kept]
    # one copy to the device (each copy of host data waits for a GPU): kept items, their steps, the nodes
    sent = torch.tensor(kept + steps_l + [p for a in kept for p in advances[a].parents], device=device)
    kept_t, steps, node = sent[: len(kept)], sent[len(kept) : 2 * len(kept)], sent[2 * len(kept) :]
    pos = live.pos[kept_t] + steps
    cache.reorder(dec.rows(tree.row[node], guided))
    # the accepted path of each new beam: ancestors of its parent node at depths 1..steps-1
    s_max = max(steps_l) - 1
    if s_max > 0:
        path = torch.zeros(node.numel(), s_max, dtype=torch.long, device=device)
        cur = node.clone()
        for _ in range(s_max):  # walk up: depth d node goes to column d - 1
            d = tree.depth[cur]
            has = d > 0
            path[has, (d - 1)[has]] = tree.index[cur][has]
            cur = torch.where(has, tree.parent[cur], cur)
        t = live.pos[kept_t].repeat_interleave(k)
        span = torch.arange(1, s_max + 1, device=device)
        valid = span <= (steps.repeat_interleave(k) - 1)[:, None]
        dst = t[:, None] + span
        src = torch.where(valid, t[:, None] + path, dst)  # invalid columns copy a slot onto itself
        rows = torch.arange(node.numel(), device=device)
        cache.move_slots(dec.rows(rows, guided), dec.per_row(src, guided), dec.per_row(dst, guided))
    cache.crop(dec.per_row(pos.repeat_interleave(k), guided))
    tokens = torch.cat([advances[a].tokens for a in kept])
    # the source side only changes when an item finished (every beam of an item shares it)
    enc = live.enc if len(kept) == len(advances) else live.enc.select(dec.rows(item_rows(kept_t, k), guided))
    lengths = [live.lengths[a] + n for a, n in zip(kept, steps_l)]
    return _Live([live.items[a] for a in kept], [live.states[a] for a in kept], pos, lengths,
                 dec.embed(tokens[:, None], guided), enc)


def _per_row(rows: Tensor, r_n: int) -> Tensor:
    """How many of `rows` name each row 0..r_n-1 (torch.bincount reads the largest back from a GPU)."""
    return torch.zeros(r_n, dtype=torch.long, device=rows.device).index_add_(0, rows, torch.ones_like(rows))


def _tree_mask(anc: Tensor, idx: Tensor, real: Tensor, t: Tensor, keys: int, guided: bool) -> Tensor:
    """(R*g, 1, c, keys) bool over cache slots 0..keys-1: a query node sees slots < t (the committed
    prefix) and the slots of its own ancestors; a padding query sees only its own slot (its output is
    never read)."""
    r_n, m = anc.shape[0], anc.shape[1]
    keys = torch.arange(keys, device=t.device)
    rel = keys[None, :] - t[:, None]  # (R, keys) tree index of each key slot
    in_tree = (rel >= 0) & (rel < m)
    own = anc[torch.arange(r_n, device=t.device)[:, None], idx.clamp(max=m - 1)]  # (R, c, M)
    tree = own.gather(2, rel.clamp(0, m - 1)[:, None, :].expand(-1, idx.shape[1], -1)) & in_tree[:, None, :]
    mask = (rel < 0)[:, None, :] | tree
    mask = torch.where(real[..., None], mask, rel[:, None, :] == idx[..., None])
    return Decoder.per_row(mask, guided)[:, None]

