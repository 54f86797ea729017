"""Training loop: (1) both heads on the data, (2) exit-head distillation with the trunk frozen."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from spear_tts_pytorch import TextToSemantic
from tqdm import tqdm

from .dataset import PairedData, length_batches, pad_stack
from .losses import distill_kl, head_agreement, head_logits, token_ce


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2800
    distill_steps: int = 500
    max_frames: int = 2400          # padded unit frames per batch
    lr: float = 1e-3
    distill_lr: float = 1e-3
    warmup: int = 150
    weight_decay: float = 0.01
    early_exit_weight: float = 1.0
    cond_drop_prob: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    max_minutes: Optional[float] = None  # safety valve on a busy machine: end phase 1 early (logged)


@dataclass
class TrainResult:
    steps: int
    distill_steps: int
    seconds: float
    stopped_early: bool
    final_loss: float
    final_distill_kl: float
    diagnostics: dict


def _batches(data: PairedData, max_frames: int, seed: int, text_pad: int, unit_pad: int):
    """Endless stream of (text, units) batches; reshuffled each epoch, deterministic in `seed`."""
    rng = random.Random(seed)
    lengths = [len(u) + 1 for u in data.units]
    while True:
        for batch in length_batches(lengths, max_frames, rng):
            yield (pad_stack([data.text_ids[i] for i in batch], text_pad),
                   pad_stack([data.units[i] for i in batch], unit_pad))


def _lr_at(step: int, config: TrainConfig, total: int, base: float) -> float:
    if step < config.warmup:
        return base * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, total - config.warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def diagnostics(model: TextToSemantic, validation: Optional[PairedData]) -> dict:
    """Teacher-forced figures on held-out pairs: head accuracies, draft/target agreement, loss."""
    if validation is None:
        return {}
    pad = model.semantic_pad_id
    was_training = model.training
    model.eval()
    with torch.no_grad():
        text = pad_stack(validation.text_ids, model.text_pad_id)
        units = pad_stack(validation.units, pad)
        hl = head_logits(model, text, units)
        stats = head_agreement(hl, pad)
        stats["val_loss"] = token_ce(hl.final, hl.target, pad).item()
    model.train(was_training)
    return stats


def distill_exit_head(model: TextToSemantic, data: PairedData, config: TrainConfig, steps: int,
                      seed: int) -> float:
    """Trunk frozen; the exit head learns the target head's distribution (KL) on `data`, which is
    what the speculative acceptance rate (1 - total variation) rewards. Returns the last KL."""
    pad = model.semantic_pad_id
    batches = _batches(data, config.max_frames, seed, model.text_pad_id, pad)
    head = model.to_early_exit_semantic_logits
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.distill_lr, weight_decay=0.0)
    model.eval()  # no dropout in the teacher; the condition is always given
    kl_value = float("nan")
    bar = tqdm(range(steps), desc="distill exit head", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config, steps, config.distill_lr)
        text, units = next(batches)
        hl = head_logits(model, text, units, trunk_grad=False)
        kl = distill_kl(hl.early, hl.final, hl.target, pad)
        optimizer.zero_grad(set_to_none=True)
        kl.backward()
        optimizer.step()
        kl_value = kl.item()
        bar.set_postfix(kl=f"{kl_value:.3f}")
    for p in model.parameters():
        p.requires_grad_(True)
    return kl_value


def train(model: TextToSemantic, data: PairedData, config: TrainConfig,
          validation: Optional[PairedData] = None,
          on_checkpoint: Optional[Callable[[int, dict], None]] = None,
          checkpoint_every: int = 500) -> TrainResult:
    """Phase 1 (both heads on the data, per-row condition drop for CFG), then phase 2 (distillation)."""
    torch.manual_seed(config.seed)
    pad = model.semantic_pad_id
    batches = _batches(data, config.max_frames, config.seed, model.text_pad_id, pad)
    generator = torch.Generator().manual_seed(config.seed)
    start = time.time()

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.98))
    loss_value, steps_done = float("nan"), 0
    bar = tqdm(range(config.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config, config.steps, config.lr)
        text, units = next(batches)
        drop = torch.rand(len(text), generator=generator) < config.cond_drop_prob
        hl = head_logits(model, text, units, drop)
        main = token_ce(hl.final, hl.target, pad)
        early = token_ce(hl.early, hl.target, pad)
        loss = main + config.early_exit_weight * early
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        loss_value, steps_done = main.item(), step + 1
        bar.set_postfix(loss=f"{loss_value:.3f}", early=f"{early.item():.3f}")
        if on_checkpoint and (step + 1) % checkpoint_every == 0:
            stats = diagnostics(model, validation)
            tqdm.write(f"step {step + 1}: {stats}")
            on_checkpoint(step + 1, stats)
        if config.max_minutes is not None and time.time() - start > 60 * config.max_minutes:
            tqdm.write(f"phase 1 stopped at step {step + 1}: --max-minutes {config.max_minutes} reached")
            break

    kl_value = distill_exit_head(model, data, config, config.distill_steps, config.seed + 1)
    model.eval()
    stats = diagnostics(model, validation)
    tqdm.write(f"final: {stats}")
    return TrainResult(steps_done, config.distill_steps, time.time() - start, steps_done < config.steps,
                       loss_value, kl_value, stats)
