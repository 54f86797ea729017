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
  commit  new beam j keeps its root's row if it is the first new beam from that root, else takes a row of
          its item that no new beam descends from (one reorder per cycle, of those rows only: in a cache
          by reference a slot table's rows, the root's prefix shared, not copied); its
          accepted path's K/V moved from their tree slots to slots t+1.., cropped to t + committed steps.
          Where its pending token is itself a verified node (the cycle ended because another beam left
          the tree), that node's K/V move too and its log-probs are kept: the next cycle's verify pass
          skips it (`_Live.ready`), a root less in a pass whose cost grows with its rows
The result is token for token what `beam.beam_search_loop` returns, for either beam semantics. With
spear-tts's ("upstream"), items advance at different rates but the search stops for all of them
together (`_Together`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .beam import BeamSemantics, BeamState, beam_step, encode_beams, on_device, step_logprobs
from .cache import KVCache
from .decoder import Decoder, Encoded
from .finite import NonFiniteLogits
from .masks import additive
from .results import DecodeStats
from .timing import PhaseClock


@dataclass
class _Live:
    """Active items at the start of a cycle. Cache rows a*K..a*K+K-1 hold active item a's K live beams, in
    any order: a new beam stays in its root's row where it is the first to descend from it (`commit`), so
    a cycle moves the K/V of only the other new beams."""

    items: list[int]  # original index of each active item
    states: list[BeamState]  # one per active item: items advance by different numbers of steps
    t: Tensor  # (A * K,) by cache row: its item's generated tokens = slot and position of its pending input
    lengths: list[int]  # (A,) the same per item on the host (no read-back to size a cycle)
    rows: list[int]  # (A * K) the cache row of each live beam, in the states' beam order
    score: Tensor  # (A * K,) by cache row: its beam's score (float64, or float32 as the kernels' draft takes it)
    x: Tensor  # (A * K * g, 1, dim) pending inputs (not yet through any layer), by cache row
    enc: Encoded  # one entry per cache row
    # by row (A * K,): the pending input is a node the last verify pass took through every layer (its
    # K/V already at its slot), and that pass's target log-probs after it (rows not ready: unset); None:
    # no row is ready. ready_count: how many are, on the host
    ready: Tensor | None = None
    carried: Tensor | None = None
    ready_count: int = 0


@dataclass
class _Tree:
    """The draft forest of one cycle. Node ids: roots 0..R-1 (= root rows), then level by level, each level
    item-major (`draft`)."""

    row: Tensor  # (N,) root row holding the node
    index: Tensor  # (N,) the node's place in its row: slot = t + index (roots: 0)
    path: Tensor  # (N, levels) index of the node's ancestor at depth 1..levels (itself at its depth; 0 below it)
    anc: Tensor  # (R, M, M) anc[r, i, j]: node j of row r is an ancestor of node i, or i itself (every i)
    depth: Tensor  # (R, M) depth of the node at each index of each row (0: roots and free indexes)
    h: Tensor  # (R * g, M, dim) exit states by row and index
    count: Tensor  # (R,) nodes per row
    count_host: list[int] | None  # the same on the host, where passes are cut to it (None: static shapes)
    row_host: list[int]  # `row` on the host (read with the children)
    children: dict[tuple[int, int], int]  # (parent node, token) -> node
    path_host: list[int]  # `path` on the host, flattened (N * levels), read with the children
    verified: Tensor | None = None  # (N, dim) the verify pass's outputs by node, where the draft's call ran it
    # (N, V) the target's log-probs by node (`verify`), the ready roots' carried ones included, where that
    # call made them
    logprobs: Tensor | None = None


@dataclass
class _Advance:
    """What replay committed for one item."""

    steps: int
    parents: list[int] | None  # the node each new live beam extends; None: the item is done
    tokens: list[int] | None  # pending input of each new live beam
    verified: list[int | None] | None = None  # the node each new beam's pending input is, if verified (None: done)
    scores: list[float] | None = None  # each new live beam's score (None: done)


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
    first: dict[int, dict[int, tuple[list[int], float]]] = field(default_factory=dict)  # item -> length -> result

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

    def result(self, item: int) -> tuple[list[int], float]:
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
    # by reference where the backend reads slot tables: a new beam that takes another row shares its
    # root's prefix instead of copying it (`commit`)
    cache = dec.new_cache(enc.rows, cache_positions(max_length, gamma, width), by_reference=dec.backend.by_reference)
    together = _Together(batch, max_length) if semantics == "upstream" else None
    states = [BeamState.initial(1, k, length_penalty, dec.eos_id, device, semantics, stop_together=False)
              for _ in range(batch)]
    live = _Live(list(range(batch)), states, torch.zeros(batch * k, dtype=torch.long, device=device), [0] * batch,
                 list(range(batch * k)), torch.cat([s.scores for s in states]).flatten(), dec.start(enc.rows), enc)
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
        live = commit(dec, live, tree, advances, cache, guided, logprobs)
        stats.steps += 1
        stats.target_passes += 1
        stats.draft_passes += levels
    clock.into(stats)
    if together is not None:
        tokens, scores = on_device([together.result(i) for i in range(batch)], device)
        return tokens, scores, together.stop
    tokens, scores = on_device([done[i].best(0) for i in range(batch)], device)
    return tokens, scores, max(done[i].length for i in range(batch))


def draft(
    dec: Decoder, live: _Live, cache: KVCache, levels: int, width: int, cond_scale: float, temperature: float = 1.0
) -> _Tree:
    """Beam search with the exit head for `levels` levels of width W per item; every node is kept.

    Each level's nodes are laid out per row, (R, c) with padding where a row got fewer: c is the most any
    row got (the row counts read back once per level), or on a backend of static shapes the draft width
    (nothing read back). A node's index in its row is the row's node count before the level plus its rank
    among the level's nodes of that row, so the layout is the same slot range t + first.. for real and
    padding positions alike. A backend may draft the same tree in one call (`Backend.beam_draft`: the
    kernels, unguided)."""
    guided = cond_scale > 1
    g = 2 if guided else 1
    a_n, k = len(live.states), live.states[0].beam_size
    r_n, device, vocab, eos = a_n * k, live.t.device, dec.vocab_size, dec.eos_id
    m_max, dim = 1 + levels * width, live.x.shape[-1]
    static = dec.backend.static_shapes
    t = live.t  # (R,) slot of each root
    t_host = [n for n in live.lengths for _ in range(k)]
    same_t = _same(live.lengths)
    score = live.score  # (R,) target scores of the live beams, by root row
    blocked = eos if eos is not None and live.states[0].semantics == "standard" else None
    whole = None if guided or static else dec.backend.beam_draft(
        live.x, t, score, a_n, levels, width, temperature, blocked, live.enc, cache, live.lengths, live.ready,
        live.carried, live.ready_count)
    if whole is not None:  # the backend drafted the whole tree, and passed over it, in one call
        hs, anc, depth, count, row, index, parent, token, path, verified, logprobs, host = whole
        row_l, children, path_l, count_l = _read_tree(r_n, row.numel(), levels, host.tolist(), counted=True)
        return _Tree(row, index, path, anc, depth, hs, count, count_l, row_l, children, path_l, verified, logprobs)
    anc = torch.eye(m_max, dtype=torch.bool, device=device).repeat(r_n, 1, 1)
    depth = torch.zeros(r_n, m_max, dtype=torch.long, device=device)
    hs = live.x.new_zeros(r_n * g, m_max, dim)
    roots = torch.arange(r_n, device=device)
    zeros = torch.zeros_like(roots)
    # the current level's nodes (item-major): rows, indexes in their rows, ranks among the row's new nodes
    lrow, lidx, col = roots, zeros, zeros
    count = torch.ones_like(roots)  # nodes per row, this level's included
    first, per_row = zeros, count  # per row: index of the level's first node, the level's node count
    first_host, count_host = [0] * r_n, [1] * r_n
    nodes = [(roots, zeros, torch.full_like(roots, -1), zeros, roots.new_zeros(r_n, levels))]  # per level
    n_nodes, x, trunk = 0, live.x, range(dec.exit_layer)
    for d in range(levels + 1):
        if d == 0:  # the roots, one per row at slot t (with equal t, causal by slot is the tree mask)
            c = 1
            if same_t is not None and not static:
                h = dec.run(x, same_t, trunk, live.enc, cache)
            else:
                h = dec.run(x, dec.per_row(t, guided), trunk, live.enc, cache,
                            **_tree_pass(dec, anc, zeros[:, None], t, same_t, count, guided, cache, 0, static,
                                         None if static else max(t_host) + 1))
        else:
            c = width if static else max(per_row_host)
            span = torch.arange(c, device=device)
            xs = x.new_zeros(r_n * g, c, dim)
            xs.view(r_n, g, c, -1)[lrow, :, col] = x.view(-1, g, dim)
            keys = None if static else max(a + f for a, f in zip(t_host, first_host)) + c
            h = dec.run(xs, dec.per_row(t + first, guided), trunk, live.enc, cache,
                        **_tree_pass(dec, anc, first[:, None] + span, t, same_t, per_row, guided, cache, d, static,
                                     keys))
        h_new = h.view(r_n, g, c, -1)[lrow, :, col]  # (n, g, dim) the level's real nodes
        hs.view(r_n, g, m_max, -1)[lrow, :, lidx] = h_new
        if d == levels:
            break
        # expand: candidates of every node of this level, top W per item by draft score
        lp = step_logprobs(dec.draft_logits(h_new.flatten(0, 1)), cond_scale, temperature)
        if d == 0 and live.ready is not None:
            # a ready root's children are ranked by the target's own log-probs, which the last cycle
            # carried, not by the draft's guess of them: its first level then holds the new beams the
            # replay's first step takes from it (width 512: 6% fewer cycles, the same results)
            lp = torch.where(live.ready[:, None], live.carried.to(lp.dtype), lp)
        if blocked is not None:
            lp[:, blocked] = -math.inf  # EOS ends a hypothesis: it is never a node to expand
        per = lrow.numel() // a_n
        cand = (score.to(lp.dtype)[:, None] + lp).view(a_n, per * vocab)
        top, flat = cand.topk(min(width, per * vocab), dim=1)
        # the parent's place in this level (item-major), its row and index; the child's rank among the new
        # nodes of its row (creation order) and so its index in the row
        loc = (torch.arange(a_n, device=device)[:, None] * per + torch.div(flat, vocab, rounding_mode="floor")).flatten()
        prow, pidx = lrow[loc], lidx[loc]
        n = prow.numel()
        col = ((prow[:, None] == prow[None, :]) & _earlier(n, device)).sum(dim=1)
        per_row = torch.zeros_like(count).index_add_(0, prow, torch.ones_like(prow))
        first, count = count, count + per_row
        nidx = first[prow] + col
        anc[prow, nidx] = anc[prow, pidx]
        anc[prow, nidx, nidx] = True
        depth[prow, nidx] = d + 1
        path = nodes[-1][4][loc].clone()
        path[:, d] = nidx
        tokens = (flat % vocab).flatten()
        nodes.append((prow, nidx, loc + n_nodes, tokens, path))
        n_nodes += lrow.numel()
        lrow, lidx, score = prow, nidx, top.flatten()
        x = dec.embed(tokens[:, None], guided)
        if not static:  # one read per level: how many nodes each row got (the next pass's size)
            per_row_host = per_row.tolist()
            first_host, count_host = count_host, [a + b for a, b in zip(count_host, per_row_host)]
    row, index, parent, token, path = (torch.cat(f) for f in zip(*nodes))
    row_l, children, path_l, _ = _read_tree(r_n, row.numel(), levels, torch.cat((row, parent, token, path.flatten())).tolist())
    return _Tree(row, index, path, anc, depth, hs, count, None if static else count_host, row_l, children, path_l)


def _read_tree(
    roots: int, n: int, levels: int, host: list[int], counted: bool = False
) -> tuple[list[int], dict[tuple[int, int], int], list[int], list[int] | None]:
    """A tree's host side from its one read-back `host` (the n nodes' rows, parents, tokens, paths
    flattened, then where `counted` the rows' node counts): every node's row, the children of (parent
    node, token), every node's path flattened, and the counts (or None)."""
    parent_l, token_l = host[n : 2 * n], host[2 * n : 3 * n]
    children = {(p, tk): i for i, (p, tk) in enumerate(zip(parent_l, token_l)) if i >= roots}
    end = 3 * n + n * levels
    return host[:n], children, host[3 * n : end], host[end:] if counted else None


def _tree_pass(
    dec: Decoder, anc: Tensor, idx: Tensor, t: Tensor, same_t: int | None, per_row: Tensor,
    guided: bool, cache: KVCache, depth: Tensor | int, static: bool, keys: int | None,
) -> dict:
    """`Decoder.run`'s mask, positions and real flags for tree queries at indexes idx (R, c) of their rows
    (`depth`: their depth, or each index's); `keys`: how many cache slots the pass reads (None: the
    capacity, static shapes)."""
    c = idx.shape[1]
    real = torch.arange(c, device=idx.device) < per_row[:, None]
    pos = t[:, None] + (depth if isinstance(depth, Tensor) else torch.full_like(idx, depth))
    mask = _tree_mask(anc, idx, t, same_t, cache.capacity if keys is None else keys, guided,
                      None if static else dec.dtype)
    return dict(attn_mask=mask, positions=dec.per_row(pos, guided), real=dec.per_row(real, guided))


def verify(
    dec: Decoder, live: _Live, tree: _Tree, cache: KVCache, cond_scale: float, temperature: float = 1.0
) -> Tensor:
    """One target pass (layers E+1..L) over every node of every root row; log-probs per node (N, V). A
    ready root's are the last cycle's (`_Live.ready`: the backend's one call skipped it; passed level by
    level it is recomputed, to the same bits)."""
    guided = cond_scale > 1
    if tree.logprobs is not None:  # the draft's call ran the pass and the head, and carried the ready roots'
        return tree.logprobs
    if tree.verified is not None:  # the draft's call ran the pass
        return _carry(live, step_logprobs(dec.target_logits(tree.verified), cond_scale, temperature))
    t = live.t
    static = dec.backend.static_shapes  # the whole tree's size instead of the largest row's
    m = tree.anc.shape[1] if static else max(tree.count_host)
    same_t = _same(live.lengths)
    idx = torch.arange(m, device=t.device).expand(t.numel(), m)
    upper = range(dec.exit_layer, dec.depth)
    start = same_t if same_t is not None and not static else dec.per_row(t, guided)
    h = dec.run(tree.h[:, :m], start, upper, live.enc, cache,
                **_tree_pass(dec, tree.anc, idx, t, same_t, tree.count, guided, cache, tree.depth[:, :m], static,
                             None if static else max(live.lengths) + m))
    g = 2 if guided else 1
    nodes = h.view(t.numel(), g, m, -1)[tree.row, :, tree.index]  # (N, g, dim): the head skips padding
    return _carry(live, step_logprobs(dec.target_logits(nodes.flatten(0, 1)), cond_scale, temperature))


def _carry(live: _Live, logprobs: Tensor) -> Tensor:
    """The ready roots' log-probs (node id = row) taken from the last cycle."""
    if live.ready is None:
        return logprobs
    r_n = live.ready.numel()
    logprobs[:r_n] = torch.where(live.ready[:, None], live.carried, logprobs[:r_n])
    return logprobs


def replay(
    live: _Live, tree: _Tree, logprobs: Tensor, max_length: int, together: _Together | None = None
) -> list[_Advance]:
    """Exact beam steps on target log-probs, per item, while every live beam is a verified node."""
    advances = []
    for a, state in enumerate(live.states):
        k = state.beam_size
        nodes = live.rows[a * k : (a + 1) * k]  # the roots (node id = row): this item's live beams
        steps = 0
        if together is not None and state.length >= together.stop:  # T became known after it passed T
            advances.append(_Advance(0, None, None))
            continue
        while True:
            try:
                out = beam_step(state, logprobs, last=state.length + 1 == max_length, rows=nodes)
            except NonFiniteLogits as e:  # the state holds one item: name its row in the batch
                raise NonFiniteLogits(live.items[a], e.step, e.head) from None
            steps += 1
            if together is not None and together.record(live.items[a], state) or state.active == 0:
                advances.append(_Advance(steps, None, None))
                break
            rows, tokens, scores = out.host
            parents = [nodes[j] for j in rows]
            found = [tree.children.get(pt) for pt in zip(parents, tokens)]
            # a -inf beam (fewer than K candidates) never expands again: any verified node serves it
            dead = [s == -math.inf for s in scores]
            nxt = [p if n is None and dd else n for n, p, dd in zip(found, parents, dead)]
            if None in nxt:  # a new beam left the tree: this step is committed, the cycle ends
                advances.append(_Advance(steps, parents, tokens,
                                         [None if dd else n for n, dd in zip(found, dead)], scores))
                break
            nodes = nxt
    return advances


def commit(
    dec: Decoder, live: _Live, tree: _Tree, advances: list[_Advance], cache: KVCache, guided: bool, logprobs: Tensor,
) -> _Live:
    """New beam j takes a row of its item: its root's row if it is the first new beam from that root, else a
    row no new beam descends from (the root's K/V copied there, or by reference its slot table: one reorder
    per cycle, of those rows only);
    then its accepted path's K/V move to slots t+1.., t+steps-1, and to t+steps its pending input's where
    that is a verified node (the row is then ready, with that node's `logprobs`). A backend may do it all
    in one call (`Backend.commit_beams`: the kernels, unguided, while no item finishes)."""
    kept = [a for a, adv in enumerate(advances) if adv.parents is not None]
    device, k = live.t.device, live.states[0].beam_size
    if not kept:
        return _Live([], [], live.t[:0], [], [], live.score[:0], live.x[:0], live.enc)
    # everything is worked out on the host from what replay and the draft's read-back hold (a few
    # numbers per beam), then sent in one copy (or one kernel call): the same work as tensor ops cost ~30
    # small kernels a cycle, ~0.5 ms at width 512 on a Zen 3
    levels = tree.path.shape[1]
    lengths = [live.lengths[a] + advances[a].steps for a in kept]
    source, rows = [], []  # per new row (kept items' blocks in order): the old row it copies; per new beam: its row
    tokens, node = [0] * (len(kept) * k), [-1] * (len(kept) * k)  # by new row: pending input, its verified node
    paths = []  # per new beam: (t, the slots its accepted path occupies in the tree), moved to t+1..
    for i, a in enumerate(kept):
        adv, t = advances[a], live.lengths[a]
        roots = [tree.row_host[p] for p in adv.parents]
        firsts = {r: j for j, r in reversed(list(enumerate(roots)))}  # root -> its first new beam
        free = iter(r for r in range(a * k, (a + 1) * k) if r not in firsts)
        own = [r if firsts[r] == j else next(free) for j, r in enumerate(roots)]
        block = [0] * k
        for j, (r, new) in enumerate(zip(roots, own)):
            block[new - a * k] = r
            row = i * k + new - a * k
            rows.append(row)
            tokens[row] = adv.tokens[j]
            # its path ends at its pending input where that is verified (then it is ready, and the node's
            # depth is the steps committed), else at its parent; the root stays at t
            n = adv.verified[j]
            end, moves = (adv.parents[j], adv.steps - 1) if n is None else (n, adv.steps)
            if n is not None:
                node[row] = n
            paths.append((t, tree.path_host[end * levels : end * levels + moves]))
        source += block
    s_max = max(len(p) for _, p in paths)
    # columns past a path's end copy a slot onto itself
    src = [t + (p[c] if c < len(p) else c + 1) for t, p in paths for c in range(s_max)]
    dst = [t + c + 1 for t, _ in paths for c in range(s_max)]
    scores = [v for a in kept for v in advances[a].scores]  # by new beam, as rows
    ready_count = sum(n >= 0 for n in node)
    items, states = [live.items[a] for a in kept], [live.states[a] for a in kept]
    fast = None if guided or len(kept) < len(advances) else dec.backend.commit_beams(
        cache, source, rows, src, dst, lengths, tokens, node, scores, logprobs)
    if fast is not None:
        t_rows, x, score, ready, carried = fast
        return _Live(items, states, t_rows, lengths, rows, score, x, live.enc, ready, carried, ready_count)
    crop = [n for n in lengths for _ in range(k)]
    sent = torch.tensor(rows + source + tokens + node + crop + src + dst, device=device)
    n_rows = len(rows)
    rows_t, source_t, tokens_t, node_t, crop_t, src_t, dst_t = sent.split([n_rows] * 5 + [n_rows * s_max] * 2)
    if source != list(range(len(live.rows))):
        cache.reorder(dec.rows(source_t, guided))
    if s_max > 0:
        cache.move_slots(dec.rows(rows_t, guided), dec.per_row(src_t.view(n_rows, s_max), guided),
                         dec.per_row(dst_t.view(n_rows, s_max), guided))
    cache.crop(dec.per_row(crop_t, guided))
    ready = carried = None
    if ready_count:  # by row, as the tokens
        ready, carried = node_t >= 0, logprobs[node_t.clamp(min=0)]
    score = torch.cat([state.scores for state in states]).flatten()  # by new beam: by row where rows differ
    if rows != list(range(n_rows)):
        score = torch.empty_like(score).index_copy_(0, rows_t, score)
    # the source side only changes when an item finished: every beam of an item shares it, so the rows the
    # new rows copy name it (no send of the kept items)
    enc = live.enc if len(kept) == len(advances) else live.enc.select(dec.rows(source_t, guided))
    return _Live(items, states, crop_t, lengths, rows, score, dec.embed(tokens_t[:, None], guided), enc, ready,
                 carried, ready_count)


def _same(lengths: list[int]) -> int | None:
    """The common length of the active items, or None when they differ."""
    return lengths[0] if all(n == lengths[0] for n in lengths) else None


@functools.lru_cache(maxsize=16)
def _earlier(n: int, device: torch.device) -> Tensor:
    """(n, n) bool: [i, j] is j < i (the ranks of equal entries in creation order, as one comparison)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_(-1)


def _tree_mask(
    anc: Tensor, idx: Tensor, t: Tensor, same_t: int | None, keys: int, guided: bool, dtype: torch.dtype | None
) -> Tensor:
    """(R*g, 1, c, keys) over cache slots 0..keys-1 for the queries at indexes idx (R, c) of their rows: a
    query sees slots < t (the committed prefix) and the slots of its ancestors and itself (a padding query:
    the prefix and itself; its output is never read). Bool, or additive in `dtype` (the mask is never all
    True: no read-back to test it)."""
    r_n, m = anc.shape[0], anc.shape[1]
    c = idx.shape[1]
    own = anc[torch.arange(r_n, device=t.device)[:, None], idx]  # (R, c, M)
    if same_t is not None:  # every row's tree starts at slot t: prefix, then the ancestors by index
        parts = [own.new_ones(1, 1, 1).expand(r_n, c, same_t), own[..., : keys - same_t]]
        if keys - same_t > m:
            parts.append(own.new_zeros(1, 1, 1).expand(r_n, c, keys - same_t - m))
        mask = torch.cat(parts, dim=-1)
    else:
        rel = torch.arange(keys, device=t.device) - t[:, None]  # (R, keys) tree index of each key slot
        tree = own.gather(2, rel.clamp(0, m - 1)[:, None, :].expand(-1, c, -1)) & (rel < m)[:, None, :]
        mask = (rel < 0)[:, None, :] | tree
    if dtype is not None:
        mask = additive(mask, dtype, test_all=False)
    return Decoder.per_row(mask, guided)[:, None]
