"""Pure tensor functions: logit filtering, CFG mixing, and the speculative accept rules (chains and trees).

Paper names: p = target distribution, q = draft distribution, gamma = drafted tokens per cycle.
Temperature 0 is greedy and is represented by one-hot distributions, so the same accept rule
accepts a draft token iff it is the target argmax and otherwise emits the target argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels


# spear-tts divides logits by max(temperature, 1e-10), which is greedy in effect below it; dividing by
# less overflows float32 logits to inf (all-NaN probabilities, zeros emitted), so below it we are greedy
TEMPERATURE_FLOOR = 1e-10


@dataclass(frozen=True)
class SamplingConfig:
    """The filter applied identically to target and draft logits (temperature < TEMPERATURE_FLOOR: 0)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if 0 < self.temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def cfg_mix(logits: Tensor, scale: float) -> Tensor:
    """(2N, ..., V) logits in (cond, null) row pairs -> (N, ..., V), mixed as spear-tts mixes them."""
    pairs = logits.unflatten(0, (-1, 2))
    cond, null = pairs[:, 0], pairs[:, 1]
    return null + (cond - null) * scale


def filter_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) masking with -inf. Not used when greedy."""
    if cfg.temperature != 1:
        logits = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token once the mass before it already exceeds top_p (the first token always stays)
        drop_sorted = F.pad(cum > cfg.top_p, (1, -1), value=False)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """The distribution tokens are drawn from: filtered softmax, or one-hot argmax when greedy."""
    if cfg.greedy:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    if (cfg.top_k is not None or cfg.top_p is not None) and kernels.available(logits.device, logits.dtype):
        # filter and softmax in one call (~10 small torch ops for top-p otherwise); the same filter
        # as the fused draft phase; the torch ops below are its reference
        flat = logits.reshape(-1, logits.shape[-1])
        return kernels.filtered_probs(flat, cfg.temperature, cfg.top_k, cfg.top_p).view(logits.shape)
    return filter_logits(logits, cfg).softmax(dim=-1)


def draw(probs: Tensor, generator: torch.Generator | None = None, race: Tensor | None = None) -> Tensor:
    """One token per row of probs (..., V) -> (...), exactly distributed as probs.

    Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) iid is token i with probability p_i
    (the Gumbel-max trick without logarithms). Three small kernels, cheaper on CPU than
    torch.multinomial, whose per-call cost is a visible share of a decoding step.
    race: the E_i when drawn already (`Draws.exponential`; clamped in place), else drawn here from `generator`.
    """
    if race is None:
        race = torch.empty_like(probs).exponential_(generator=generator)
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # a zero draw would make 0/0 = NaN win argmax
    return (probs / race).argmax(dim=-1)


class Draws:
    """A decode's random numbers, drawn from `generator` in the order they are asked for, each as the
    torch call named draws it (`exponential`: Tensor.exponential_, `rand`: torch.rand). A recorded CUDA
    graph draws nothing itself: its runs ask a subclass that hands out buffers refilled before each
    replay, in the same order (`backends.static_compiled`)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def exponential(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return self.fill("exponential", like.new_empty(shape))

    def rand(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return self.fill("rand", like.new_empty(shape))

    def fill(self, kind: str, t: Tensor) -> Tensor:
        """t drawn anew in place, as `kind` ("exponential" or "rand") draws it."""
        if kind == "exponential":
            return t.exponential_(generator=self.generator)
        return t.uniform_(generator=self.generator)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p - q, 0)): where to sample after a rejection. Falls back to p if p <= q everywhere."""
    r = (p - q).clamp_min(0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


@dataclass
class Acceptance:
    accepted: Tensor  # (rows,) number of draft tokens kept, 0..gamma
    next_token: Tensor  # (rows,) the token emitted after them (correction or bonus)


def speculative_accept(
    p: Tensor, q: Tensor, drafts: Tensor, generator: torch.Generator | None = None, limit: Tensor | None = None,
    draws: Draws | None = None,
) -> Acceptance:
    """Leviathan et al. 2022, Algorithm 1, per row.

    p: (rows, gamma + 1, V) target distributions at each drafted position and one past them.
    q: (rows, gamma, V) draft distributions the drafts were sampled from. drafts: (rows, gamma).
    Accept drafts[d] with probability min(1, p_d(x) / q_d(x)); at the first rejection draw from
    norm(max(p_d - q_d, 0)); if all are accepted draw the bonus token from p_gamma.
    limit: (rows,) drafts each row actually proposes (<= gamma; default all). A row's drafts past
    its limit are ignored and its bonus token is drawn from p at its limit, so every row is
    Algorithm 1 with its own gamma. A negative draft (`finite.NONFINITE`: its q was not finite) is
    rejected. Random numbers: u (rows, gamma), then the race of `draw` (rows, V), from `draws` (default:
    drawn from `generator`).
    On float32 CPU tensors with the kernels the rule runs in one call (`kernels.speculative_accept`)
    on the same random numbers; these torch ops are its reference (and the path everywhere else).
    """
    rows, gamma = drafts.shape
    if p.shape[:2] != (rows, gamma + 1) or q.shape[:2] != (rows, gamma):
        raise ValueError(f"shapes disagree: p {tuple(p.shape)}, q {tuple(q.shape)}, drafts {tuple(drafts.shape)}")
    draws = Draws(generator) if draws is None else draws
    u = draws.rand((rows, gamma), p)
    race = draws.exponential((rows, p.shape[-1]), p)
    if kernels.available(p.device, p.dtype) and q.dtype == p.dtype:
        # the same rule in one call on the same random numbers
        return Acceptance(*kernels.speculative_accept(p, q, drafts, u, race, limit))
    tokens = drafts.clamp_min(0)[..., None]
    px = p[:, :gamma].gather(-1, tokens)[..., 0]
    qx = q.gather(-1, tokens)[..., 0]
    # u < p/q written without division; q(x) > 0 because x was drawn from q
    keep = (u * qx < px) & (drafts >= 0)
    if limit is not None:
        proposed = torch.arange(gamma, device=p.device) < limit[:, None]
        keep &= proposed
        q = q * proposed[..., None]  # zero past the limit: residual(p, 0) = p, the bonus law
    accepted = torch.cumprod(keep.long(), dim=1).sum(dim=1)
    q_pad = F.pad(q, (0, 0, 0, 1))  # q is zero past the drafts: the bonus position samples from p itself
    row = torch.arange(rows, device=p.device)  # on p's device: a host index would be copied over each call
    dist = residual(p[row, accepted], q_pad[row, accepted])
    return Acceptance(accepted, draw(dist, race=race))


def greedy_accept(target_tokens: Tensor, drafts: Tensor, limit: Tensor | None = None) -> Acceptance:
    """Temperature 0: keep drafts while they equal the target argmax, then emit the target argmax.

    target_tokens: (rows, gamma + 1) argmax of p at each position; drafts: (rows, gamma);
    limit: (rows,) drafts each row proposes, as in `speculative_accept`.
    """
    gamma = drafts.shape[1]
    match = drafts == target_tokens[:, :gamma]
    if limit is not None:
        match &= torch.arange(gamma, device=drafts.device) < limit[:, None]
    accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)
    return Acceptance(accepted, target_tokens.gather(1, accepted[:, None])[:, 0])


# ---- token trees: several drafts per position ------------------------------------------------------
# A tree's nodes are numbered per row, 0 the root (the position whose token is already known), each
# node after its parent, siblings in the order they were drafted. `parent` (rows, N) holds each node's
# parent (-1 for the root and for padding nodes), `tokens` (rows, N) its token. p[:, i] is the target
# distribution after node i (its prefix), q[:, i] the draft distribution node i's children were drawn
# from.


@dataclass
class TreeAcceptance:
    node: Tensor  # (rows,) the deepest accepted node (0: the root, no draft kept)
    next_token: Tensor  # (rows,) the token emitted after it (correction or bonus)


def _children(parent: Tensor, node: Tensor) -> Tensor:
    """(rows, N) bool: the children of each row's `node`."""
    return parent == node[:, None]


def greedy_tree_accept(target_tokens: Tensor, parent: Tensor, tokens: Tensor) -> TreeAcceptance:
    """Temperature 0 on a tree: from the root, step to the child whose token is the target argmax while
    there is one, then emit the target argmax. target_tokens: (rows, N) argmax of p after each node.
    Siblings with equal tokens: the first drafted is taken (their subtrees are not merged)."""
    rows, n = parent.shape
    at = torch.arange(rows, device=parent.device)
    node = torch.zeros(rows, dtype=torch.long, device=parent.device)
    for _ in range(n - 1):  # a path has at most N - 1 drafts; usually few steps: stop when no row moves
        match = _children(parent, node) & (tokens == target_tokens[at, node][:, None])
        moves = match.any(dim=1)
        if not bool(moves.any()):
            break
        node = torch.where(moves, match.long().argmax(dim=1), node)
    return TreeAcceptance(node, target_tokens[at, node])


def tree_accept(
    p: Tensor, q: Tensor, parent: Tensor, tokens: Tensor, generator: torch.Generator | None = None,
    replacement: bool = True,
) -> TreeAcceptance:
    """Lossless acceptance over a tree of sampled drafts: the emitted tokens are distributed as the
    target's, whatever q and the tree's shape.

    At the current node (the root first), its children are tried in drafted order: child x is accepted
    with probability min(1, p(x) / q(x)) and the walk moves to it; after a rejection p becomes
    norm(max(p - q, 0)) before the next child is tried; when every child is rejected (or there is none)
    a token is drawn from that p and the walk ends. With `replacement` the children were drawn i.i.d.
    from q (SpecInfer, Miao et al. 2023, multi-step speculative sampling); without it, drawn from q
    without replacement, and after each rejection q also drops the rejected token and is renormalised
    (the rule for that case in Sequoia, Chen et al. 2024). A child whose token is negative
    (`finite.NONFINITE`) is rejected."""
    rows, n = parent.shape
    at = torch.arange(rows, device=p.device)
    node = torch.zeros(rows, dtype=torch.long, device=p.device)
    done = torch.zeros(rows, dtype=torch.bool, device=p.device)
    out = torch.zeros(rows, dtype=torch.long, device=p.device)
    for _ in range(n):
        kids = _children(parent, node) & ~done[:, None]
        pc, qc = p[at, node], q[at, node]
        moved = torch.zeros(rows, dtype=torch.bool, device=p.device)
        order = kids.long().cumsum(dim=1) * kids  # 1, 2, ... for the children in drafted order
        for j in range(1, int(order.max()) + 1 if bool(kids.any()) else 1):
            is_j = order == j
            has = is_j.any(dim=1) & ~moved
            child = is_j.long().argmax(dim=1)
            x = tokens[at, child]
            xs = x.clamp_min(0)[:, None]
            px, qx = pc.gather(1, xs)[:, 0], qc.gather(1, xs)[:, 0]
            u = torch.rand(rows, generator=generator, device=p.device, dtype=p.dtype)
            take = has & (u * qx < px) & (x >= 0)  # u < p/q without a division; q(x) > 0: x was drawn from q
            node = torch.where(take, child, node)
            moved |= take
            reject = has & ~take
            pc = torch.where(reject[:, None], residual(pc, qc), pc)
            if not replacement:
                drop = qc.scatter(1, xs, 0.0)
                drop = drop / drop.sum(dim=1, keepdim=True).clamp_min(torch.finfo(qc.dtype).tiny)
                qc = torch.where(reject[:, None] & (x >= 0)[:, None], drop, qc)
        ends = ~done & ~moved
        out = torch.where(ends, draw(pc, generator), out)
        done |= ends
        if bool(done.all()):
            break
    return TreeAcceptance(node, out)
