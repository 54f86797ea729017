"""Distil a model's early-exit head toward its own final head, trunk frozen.

Speculative acceptance is 1 - TV(p, q) per token, so the draft should imitate the target's
distribution on the sequences the target itself produces: we sample those sequences with our own
sampler, run the frozen decoder once per batch to get the exit hidden states and the target's
distribution, and minimise KL(p || q) over the exit head's parameters only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._upstream import TextToSemantic
from .api import SpeculativeDecoder


def distill_exit_head(
    model: TextToSemantic,
    sources: Tensor | None = None,
    *,
    source_len: int = 32,
    pool: int = 32,
    steps: int = 300,
    seq_len: int = 200,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train `model.to_early_exit_semantic_logits` in place; returns the loss per step.

    sources: padded text ids to sample training sequences from; random ids when None.
    """
    if not model.target_has_early_exit:
        raise ValueError("model has no early-exit head to distil (target_early_exit_layer is None)")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = model.device
    if sources is None:
        sources = torch.randint(1, model.num_text_token_ids, (pool, source_len), generator=gen)
    sources = sources.to(device)
    dec = SpeculativeDecoder(model)
    sampled = dec.sample(sources, temperature=1.0, max_length=seq_len, generator=_device_gen(device, seed))
    lengths = torch.tensor([len(t) for t in sampled.tokens])
    targets = torch.zeros(len(sampled.tokens), int(lengths.max().clamp(min=1)), dtype=torch.long, device=device)
    for i, t in enumerate(sampled.tokens):
        targets[i, : len(t)] = t

    head = model.to_early_exit_semantic_logits
    params = list(head.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    inner, exit_layer = dec.decoder, model.early_exit_layer
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(targets), (min(batch, len(targets)),), generator=gen)
        src, tgt, n = sources[idx], targets[idx], lengths[idx]
        with torch.no_grad():
            inner.begin()
            enc = inner.encode(src)
            cache = inner.new_cache(len(idx), tgt.shape[1] + 1)
            x = torch.cat((inner.start(len(idx)), inner.embed(tgt)), dim=1)
            h_exit = inner.run(x, 0, range(exit_layer), enc, cache)
            p = inner.target_logits(inner.run(h_exit, 0, range(exit_layer, inner.depth), enc, cache)).log_softmax(-1)
        mask = torch.arange(tgt.shape[1] + 1, device=device) <= n.to(device)[:, None]  # start + tokens
        log_q = head(h_exit).log_softmax(-1)
        kl = (p.exp() * (p - log_q)).sum(-1)
        loss = (kl * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.train(was_training)
    for prm in params:
        prm.grad = None
    return losses


def _device_gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
