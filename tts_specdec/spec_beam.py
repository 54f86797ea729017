"""Exact speculative beam search: the early-exit head drafts beam continuations, the target verifies.

Per cycle, every active item at its own length t:
  draft   beam search with the exit head for gamma levels from the K live beams (width W), keeping
          every node: parent, token, exit state, and its layer 1..E K/V in a cache row of its path
  verify  ONE pass of layers E+1..L over every root-to-end path of the draft tree (one cache row per
          path, gamma + 1 positions), giving the target log-probs after every node, roots included
  replay  `beam.beam_step` on those log-probs while every live beam is a verified node; the first step
          whose new beams leave the tree is still committed (its log-probs were exact)
  commit  new beam j's cache = the path row of its parent node (reorder), cropped to t + steps
Each cache row is one path of the draft tree: the root's cache, then its descendants at slots t + d.
A node that loses all its children keeps its row ("dead" row) so the verify pass still reaches it.
The result is token for token what `beam.beam_search_loop` returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .beam import BeamState, beam_step
from .cache import KVCache
from .decoder import Decoder, Encoded
from .results import DecodeStats
from .sampling import cfg_mix
from .speculative import _per_row, _start


@dataclass
class _Live:
    """Active items at the start of a cycle; beams live in the batch dimension (item-major)."""

    items: list[int]  # original index of each active item
    states: list[BeamState]  # one per active item: items advance by different numbers of steps
    pos: Tensor  # (A,) generated tokens = slot of every live beam's pending input
    x: Tensor  # (A * K * g, 1, dim) pending inputs (not yet through any layer)
    enc: Encoded  # one entry per item (A * g rows)


@dataclass
class _Tree:
    """The draft forest of one cycle; node ids are level-major, roots first (root a*K + j)."""

    parent: Tensor  # (N,) parent node, -1 for roots
    depth: Tensor  # (N,)
    path: Tensor  # (N, gamma + 1) ancestors by depth ending in the node itself, -1 past its depth
    h: Tensor  # (N, g, dim) exit states (g = 2 rows per node under CFG)
    children: dict[tuple[int, int], int]  # (parent node, token) -> node
    row_node: Tensor  # (P,) the node each cache row's path ends at
    row_item: Tensor  # (P,) active item of each cache row
    enc: Encoded  # source of each cache row


@dataclass
class _Advance:
    """What replay committed for one item."""

    steps: int
    parents: list[int] | None  # node whose path row each new live beam continues; None: item done
    tokens: Tensor | None  # (K,) pending input of each new live beam


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
) -> tuple[list[Tensor], list[float]]:
    """Returns (best tokens per item incl. final EOS if any, their scores), as plain beam search."""
    batch, k, device = source.shape[0], beam_size, source.device
    guided = cond_scale > 1
    width = min(draft_width, k * dec.vocab_size)
    enc = dec.encode(source, guided)
    cache = dec.new_cache(batch * k * (2 if guided else 1), min(max_length, 256) + gamma + 2)
    states = [BeamState.initial(1, k, length_penalty, dec.eos_id, device) for _ in range(batch)]
    live = _Live(list(range(batch)), states, torch.zeros(batch, dtype=torch.long, device=device),
                 dec.start(cache.rows), enc)
    done: dict[int, BeamState] = {}
    stats.committed_hist = [0] * (gamma + 2)
    while live.items:
        # no drafting past max_length: replay can commit at most max_length - t steps
        levels = min(gamma, max_length - 1 - int(live.pos.min()))
        cache.grow(int(live.pos.max()) + levels + 2)
        t0 = time.perf_counter()
        tree = draft(dec, live, cache, levels, width, cond_scale)
        t1 = time.perf_counter()
        logprobs, canon = verify(dec, live, tree, cache, levels, cond_scale)
        t2 = time.perf_counter()
        advances = replay(live, tree, logprobs, max_length)
        for a, adv in enumerate(advances):
            stats.committed_hist[adv.steps] += 1
            if adv.parents is None:
                done[live.items[a]] = live.states[a]
        live = commit(dec, live, advances, canon, cache, guided)
        stats.steps += 1
        stats.target_passes += 1
        stats.draft_passes += levels
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
    best = [done[i].best(0) for i in range(batch)]
    return [t for t, _ in best], [s for _, s in best]


def draft(dec: Decoder, live: _Live, cache: KVCache, gamma: int, width: int, cond_scale: float) -> _Tree:
    """Beam search with the exit head, gamma levels of width W per item; every node is kept.

    Cache rows are [dead paths..., frontier paths...]; each level reorders them so every frontier
    node's row holds its own ancestors, and appends frontier nodes that got no child as dead rows.
    """
    guided = cond_scale > 1
    g = 2 if guided else 1
    a_n, k = len(live.states), live.states[0].beam_size
    device, vocab, eos = live.pos.device, dec.vocab_size, dec.eos_id
    n_max = a_n * (k + gamma * width)
    path = torch.full((n_max, gamma + 1), -1, dtype=torch.long, device=device)
    depth = torch.zeros(n_max, dtype=torch.long, device=device)
    parent = torch.full((n_max,), -1, dtype=torch.long, device=device)
    tokens = torch.zeros(n_max, dtype=torch.long, device=device)
    front = torch.arange(a_n * k, device=device)  # frontier node ids, in row order after the dead rows
    path[front, 0] = front
    front_item = torch.arange(a_n, device=device).repeat_interleave(k)
    score = torch.cat([s.scores for s in live.states]).flatten()  # (A*K,) target scores of the roots
    row_node, row_item, dead = front.clone(), front_item.clone(), 0
    enc = live.enc.select(dec.rows(row_item, guided))
    x, hs, n_nodes = live.x, [], a_n * k
    trunk = range(dec.exit_layer)
    for d in range(gamma + 1):
        # dead rows run too (run() takes every cache row); their outputs and writes are never read
        h = dec.run(x, _start(live.pos[row_item] + d, guided), trunk, enc, cache)[:, -1]
        h = h.view(-1, g, h.shape[-1])[dead:]
        hs.append(h)
        if d == gamma:
            break
        lp = _logprobs(dec.draft_logits(h.flatten(0, 1)), cond_scale)
        if eos is not None:
            lp[:, eos] = -math.inf  # EOS ends a hypothesis: it is never a node to expand
        per = front.numel() // a_n
        cand = (score.to(lp.dtype)[:, None] + lp).view(a_n, per * vocab)
        top, index = cand.topk(width, dim=1)
        par = (torch.arange(a_n, device=device)[:, None] * per + index // vocab).flatten()  # frontier slot
        new = torch.arange(n_nodes, n_nodes + a_n * width, device=device)
        parent[new], tokens[new], depth[new] = front[par], (index % vocab).flatten(), d + 1
        path[new] = path[front[par]]
        path[new, d + 1] = new
        n_nodes += new.numel()
        # rows: keep dead rows, add frontier nodes without children, duplicate parents for the new level
        orphan = torch.ones(front.numel(), dtype=torch.bool, device=device)
        orphan[par] = False
        orphan = orphan.nonzero()[:, 0]
        index_rows = torch.cat((torch.arange(dead, device=device), dead + orphan, dead + par))
        cache_rows = dec.rows(index_rows, guided)
        cache.reorder(cache_rows)
        enc = enc.select(cache_rows)
        row_node = torch.cat((row_node[:dead], front[orphan], new))
        row_item = torch.cat((row_item[:dead], front_item[orphan], front_item[par]))
        dead += orphan.numel()
        front, front_item, score = new, front_item[par], top.flatten()
        pending = dec.embed(tokens[new][:, None], guided)
        x = torch.cat((pending.new_zeros(dead * g, 1, pending.shape[-1]), pending))
    children = {
        (p, t): n + a_n * k
        for n, (p, t) in enumerate(zip(parent[a_n * k : n_nodes].tolist(), tokens[a_n * k : n_nodes].tolist()))
    }
    return _Tree(parent[:n_nodes], depth[:n_nodes], path[:n_nodes], torch.cat(hs), children, row_node, row_item, enc)


def verify(
    dec: Decoder, live: _Live, tree: _Tree, cache: KVCache, gamma: int, cond_scale: float
) -> tuple[Tensor, Tensor]:
    """One target pass (layers E+1..L) over every path row; returns (log-probs after each node (N, V),
    the row each node's log-probs came from (N,))."""
    guided = cond_scale > 1
    paths = tree.path[tree.row_node]  # (P, gamma + 1)
    valid = paths >= 0
    # exit states along each path; positions past a dead path's end get any state, never read
    x = tree.h[paths.clamp(min=0)].transpose(1, 2).flatten(0, 1)  # (P * g, gamma + 1, dim)
    upper = range(dec.exit_layer, dec.depth)
    h = dec.run(x, _start(live.pos[tree.row_item], guided), upper, tree.enc, cache)
    lp = _logprobs(dec.target_logits(h), cond_scale)  # (P, gamma + 1, V)
    rows = torch.arange(paths.shape[0], device=paths.device)[:, None].expand_as(paths)
    n = tree.parent.numel()
    canon = torch.full((n,), paths.shape[0], dtype=torch.long, device=paths.device)
    canon = canon.scatter_reduce(0, paths[valid], rows[valid], reduce="amin")  # first row holding the node
    return lp[canon, tree.depth], canon


def replay(live: _Live, tree: _Tree, logprobs: Tensor, max_length: int) -> list[_Advance]:
    """Exact beam steps on target log-probs, per item, while every live beam is a verified node."""
    advances = []
    for a, state in enumerate(live.states):
        k = state.beam_size
        nodes = list(range(a * k, (a + 1) * k))  # the roots: this item's live beams
        steps = 0
        while True:
            out = beam_step(state, logprobs[nodes], last=state.length + 1 == max_length)
            steps += 1
            if state.active == 0:
                advances.append(_Advance(steps, None, None))
                break
            parents = [nodes[j] for j in out.parents.tolist()]
            nxt = [tree.children.get(pt) for pt in zip(parents, out.tokens.tolist())]
            # a -inf beam (fewer than K candidates) never expands again: any verified node serves it
            dead = [s == -math.inf for s in state.scores[0].tolist()]
            nxt = [p if n is None and dd else n for n, p, dd in zip(nxt, parents, dead)]
            if None in nxt:  # a new beam left the tree: this step is committed, the cycle ends
                advances.append(_Advance(steps, parents, out.tokens))
                break
            nodes = nxt
    return advances


def commit(
    dec: Decoder, live: _Live, advances: list[_Advance], canon: Tensor, cache: KVCache, guided: bool
) -> _Live:
    """Each new live beam continues its parent node's path row; finished items drop their rows."""
    kept = [a for a, adv in enumerate(advances) if adv.parents is not None]
    device = live.pos.device
    kept_t = torch.tensor(kept, dtype=torch.long, device=device)
    steps = torch.tensor([advances[a].steps for a in kept], dtype=torch.long, device=device)
    pos = live.pos[kept_t] + steps
    if not kept:
        return _Live([], [], pos, live.x[:0], live.enc)
    rows = canon[torch.tensor([p for a in kept for p in advances[a].parents], device=device)]
    cache.reorder(dec.rows(rows, guided))
    k = live.states[0].beam_size
    cache.crop(_per_row(pos.repeat_interleave(k), guided))
    tokens = torch.cat([advances[a].tokens for a in kept])
    return _Live(
        [live.items[a] for a in kept],
        [live.states[a] for a in kept],
        pos,
        dec.embed(tokens[:, None], guided),
        live.enc.select(dec.rows(kept_t, guided)),
    )


def _logprobs(logits: Tensor, cond_scale: float) -> Tensor:
    return (cfg_mix(logits, cond_scale) if cond_scale > 1 else logits).log_softmax(dim=-1)
