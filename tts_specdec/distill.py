"""Distil a model's early-exit head toward its own final head, trunk frozen.

Speculative acceptance is 1 - TV(p, q) per token, so the draft should imitate the target's
distribution on the sequences the target itself produces. We sample those sequences once with our own
sampler, run the frozen decoder once over them to record each position's exit hidden state and target
distribution (both fixed, since only the head trains), then fit the exit head on random batches of
recorded positions. Sequences set aside before fitting measure the acceptance, and the best head seen
on them is kept: a head fitted to few sequences learns them rather than the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from ._upstream import TextToSemantic
from .api import SpeculativeDecoder
from .inputs import check_common, check_draft_cond_scale, check_float, check_int, prepare_source
from .sampling import cfg_mix

LOSSES = ("tv", "kl")


@dataclass
class DistillResult:
    """What `distill_exit_head` did. Acceptance = mean over positions of sum_x min(p(x), q(x)), at
    temperature 1 without filters: the expected share of drafts speculative sampling keeps there."""

    losses: list[float]  # training loss per step
    acceptance_before: float  # on the set-aside positions (the training positions when holdout=0)
    acceptance_after: float  # the same, with the head that was kept
    best_step: int  # the step whose head was kept (0: the original head was best)
    train_positions: int
    heldout_positions: int


def distill_exit_head(
    model: TextToSemantic,
    sources: Tensor | Sequence[str] | None = None,
    *,
    source_len: int = 32,
    pool: int = 32,
    seq_len: int = 200,
    steps: int = 300,
    batch: int = 1024,
    lr: float = 1e-3,
    loss: str = "tv",
    holdout: float = 0.1,
    eval_every: int = 50,
    chunk: int = 32,
    cond_scale: float = 1.0,
    draft_cond_scale: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> DistillResult:
    """Train `model.to_early_exit_semantic_logits` in place; every other parameter is left untouched.

    sources: texts (with the model's tokenizer) or padded text ids to sample the target on; `pool`
    random id sequences of `source_len` when None. Use texts like the ones the model will speak but
    not the ones it was trained on: there the target is surer than it will be on new text.
    seq_len: the most tokens sampled per source. steps x batch: positions drawn for the fit.
    loss: "tv" (total variation, 1 - acceptance itself) or "kl" (KL(p || q), smoother from a head far
    from the target, e.g. a random one). holdout: share of the sequences set aside to measure
    acceptance and keep the best head (checked every `eval_every` steps; 0: no set-aside, the last
    head is kept). chunk: sources sampled and recorded per call. cond_scale > 1: fit for guided
    decoding, the draft's guided mix at `draft_cond_scale` (default cond_scale) to the target's guided
    distribution on its guided samples (what `sample(cond_scale=, draft_cond_scale=)` then accepts; the
    same head also drafts unguided, where such a fit may accept less). progress: show progress bars.
    """
    if not isinstance(model, TextToSemantic):
        raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic, got {type(model).__name__}")
    if not model.target_has_early_exit:
        raise ValueError("model has no early-exit head to distil (target_early_exit_layer is None)")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    for name, value, minimum in (("source_len", source_len, 1), ("pool", pool, 1), ("seq_len", seq_len, 1),
                                 ("steps", steps, 0), ("batch", batch, 1), ("eval_every", eval_every, 1),
                                 ("chunk", chunk, 1)):
        check_int(name, value, minimum)
    lr, holdout = check_float("lr", lr), check_float("holdout", holdout)
    _, cond_scale = check_common(model, max_length=seq_len, cond_scale=cond_scale)
    draft_scale = check_draft_cond_scale(draft_cond_scale, cond_scale)
    draft_scale = cond_scale if draft_scale is None else draft_scale
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if sources is None:
        sources = torch.randint(1, model.num_text_token_ids, (pool, source_len), generator=gen)
    sources = prepare_source(model, sources)

    was_training = model.training
    model.eval()
    try:
        states, log_p, seq_of = _record(SpeculativeDecoder(model), sources, seq_len, chunk, cond_scale, seed,
                                        progress)
    finally:
        model.train(was_training)
    n_seq = len(sources)
    n_held = min(n_seq - 1, math.ceil(holdout * n_seq)) if holdout > 0 else 0
    held_seqs = torch.randperm(n_seq, generator=gen)[:n_held].to(seq_of.device)
    held = torch.isin(seq_of, held_seqs)
    train_idx, held_idx = (~held).nonzero()[:, 0], held.nonzero()[:, 0]
    if n_held == 0:
        held_idx = train_idx

    head = model.to_early_exit_semantic_logits
    params = list(head.parameters())
    guided = cond_scale > 1

    def draft_logits(h: Tensor) -> Tensor:  # guided: h (positions, 2, dim) in (cond, null) pairs
        logits = head(h)
        return cfg_mix(logits.flatten(0, 1), draft_scale) if guided else logits

    def acceptance() -> float:
        with torch.no_grad():
            total = 0.0
            for part in held_idx.split(65536):
                q = draft_logits(states[part]).softmax(-1)
                total += torch.minimum(log_p[part].exp(), q).sum(-1).sum().item()
        return total / len(held_idx)

    head_was_training = head.training
    head.eval()  # the head runs in eval mode when it drafts
    before = best = acceptance()
    best_state, best_step = [p.detach().clone() for p in params], 0
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    bar = tqdm(range(1, steps + 1), desc="fit exit head", disable=not progress, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:  # short warm-up, then cosine down to a tenth
            group["lr"] = lr * min(1.0, step / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        pick = train_idx[torch.randint(0, len(train_idx), (batch,), generator=gen).to(train_idx.device)]
        log_q = draft_logits(states[pick]).log_softmax(-1)
        lp = log_p[pick]
        if loss == "tv":
            value = 0.5 * (lp.exp() - log_q.exp()).abs().sum(-1).mean()
        else:
            value = (lp.exp() * (lp - log_q)).sum(-1).mean()
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(value.item())
        if n_held == 0:
            continue
        if step % eval_every == 0 or step == steps:
            now = acceptance()
            if now > best:
                best, best_step = now, step
                best_state = [p.detach().clone() for p in params]
            bar.set_postfix(acceptance=f"{now:.4f}", best=f"{best:.4f}")
    with torch.no_grad():
        if n_held:
            for p, kept in zip(params, best_state):
                p.copy_(kept)
        else:
            best_step = steps
        after = acceptance()
    for p in params:
        p.grad = None
    head.train(head_was_training)
    return DistillResult(losses, before, after, best_step, len(train_idx), len(held_idx) if n_held else 0)


@torch.no_grad()
def _record(dec: SpeculativeDecoder, sources: Tensor, seq_len: int, chunk: int, cond_scale: float, seed: int,
            progress: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Sample each source at temperature 1; return, for every input position of every sampled sequence
    (the start token and each sampled token), its exit hidden state, the target's log-probabilities
    there, and the index of its sequence. Guided (cond_scale > 1): the target's guided distribution, and
    the exit states of the (cond, null) row pair, (positions, 2, dim)."""
    inner, exit_layer = dec.decoder, dec.decoder.exit_layer
    device = inner.device
    sample_gen = torch.Generator(device=device).manual_seed(seed)
    guided = cond_scale > 1
    states, log_p, seq_of = [], [], []
    for first in tqdm(range(0, len(sources), chunk), desc="sample the target", disable=not progress,
                      dynamic_ncols=True):
        src = sources[first : first + chunk]
        sampled = dec.sample(src, temperature=1.0, cond_scale=cond_scale, max_length=seq_len,
                             generator=sample_gen)
        lengths = torch.tensor([len(t) for t in sampled.tokens], device=device)
        tokens = torch.zeros(len(src), int(lengths.max().clamp(min=1)), dtype=torch.long, device=device)
        for i, t in enumerate(sampled.tokens):
            tokens[i, : len(t)] = t
        inner.begin()
        enc = inner.encode(src, guided)
        cache = inner.new_cache(enc.rows, tokens.shape[1] + 1)
        x = torch.cat((inner.start(enc.rows), inner.embed(tokens, guided)), dim=1)
        h_exit = inner.run(x, 0, range(exit_layer), enc, cache)
        logits = inner.target_logits(inner.run(h_exit, 0, range(exit_layer, inner.depth), enc, cache))
        if guided:  # rows are (cond, null) pairs
            logits = cfg_mix(logits, cond_scale)
            h_exit = h_exit.unflatten(0, (-1, 2)).transpose(1, 2)  # (sequences, n, 2, dim)
        real = torch.arange(tokens.shape[1] + 1, device=device) <= lengths[:, None]  # start + tokens
        states.append(h_exit[real])
        log_p.append(logits[real].log_softmax(-1))
        seq_of.append((torch.arange(len(src), device=device) + first)[:, None].expand_as(real)[real])
    return torch.cat(states), torch.cat(log_p), torch.cat(seq_of)
