"""Function-preserving widening of a speech checkpoint: the same model at a realistic size.

The shipped model (dim 128) fits in a CPU's L3 cache, so its decoding steps are bound by arithmetic;
real Spear-TTS models are 10-100x larger and every step streams their weights from memory, which is
where speculation pays. `widen` builds a model of width `dim` with `heads` heads (and optionally more
target layers) that computes exactly the same function, so every speed measured on it is a real
model's memory traffic with the trained model's outputs and acceptance:

- every weight is placed in the leading block of the larger one and the rest is zero: the residual
  stream stays zero in the new channels, new heads see zero queries and keys and add zero output,
  new feed-forward units see zero pre-activations (GELU(0) * 0 = 0);
- layouts that stack several blocks on one axis (`to_kv`: keys then values; the GEGLU input: values
  then gates) are padded block by block;
- RMSNorm is F.normalize(x) * sqrt(dim) * gamma: the norm of a zero-padded vector is unchanged, so
  gamma is scaled by sqrt(dim_old / dim_new) to cancel the larger sqrt(dim);
- extra target layers (`depth`) are appended after the last one with zero output projections, so each
  adds exactly nothing to the residual stream (the early-exit layer keeps its place).

The outputs agree with the original's up to float rounding (products are summed over more terms).

    python -m tts_specdec.widen OUT_DIR --dim 512 --heads 8 [--checkpoint DIR] [--depth 24]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from ._upstream import _spear
from .speech.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .speech.model import build_model



def widen(ckpt: Checkpoint, dim: int, heads: int, depth: int | None = None) -> Checkpoint:
    """A checkpoint of width `dim`, `heads` heads of the same size and `depth` target layers (default:
    the same) whose model computes `ckpt.model`'s function. Tokenizer, units and mel settings are kept."""
    old = ckpt.config
    depth = old.target_depth if depth is None else depth
    for name, value, least in (("dim", dim, old.dim), ("heads", heads, old.heads), ("depth", depth, old.target_depth)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= the checkpoint's {least}, got {value!r}")
    if old.target_kv_heads is not None:
        raise ValueError("widen: checkpoints with target_kv_heads (grouped kv heads) are not supported")
    config = replace(old, dim=dim, heads=heads, target_depth=depth)
    model = build_model(config, tokenizer_encode=ckpt.tokenizer).eval()
    source = ckpt.model.state_dict()
    stacked = _two_block_parameters(model)
    state = {}
    for name, blank in model.state_dict().items():
        if "rotary_emb" in name:  # one module shared by every layer (the same frequencies under each name)
            state[name] = next(w for n, w in source.items() if "rotary_emb" in n and n.split(".")[0] == name.split(".")[0]).clone()
        elif name not in source:
            state[name] = _identity(name, blank)
        else:
            state[name] = _widened(source[name], blank, old.dim, dim, name.endswith("gamma"), name in stacked)
    model.load_state_dict(state)
    meta = {"widened_from": {"dim": old.dim, "heads": old.heads, "target_depth": old.target_depth},
            "init_meta": ckpt.meta}
    return Checkpoint(model=model, config=config, tokenizer=ckpt.tokenizer, centroids=ckpt.centroids,
                      mel_config=ckpt.mel_config, meta=meta)


def _two_block_parameters(model: torch.nn.Module) -> set[str]:
    """Parameters whose first axis stacks two equal blocks, each padded on its own: attention's to_kv
    (keys, then values) and the Linear in front of a GEGLU (values, then gates)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, _spear.Attention):
            names.add(f"{prefix}.to_kv.0.weight")
        if isinstance(module, torch.nn.Sequential):
            for i in range(1, len(module)):
                if isinstance(module[i], _spear.GEGLU) and isinstance(module[i - 1], torch.nn.Linear):
                    names.update(f"{prefix}.{i - 1}.{p}" for p, _ in module[i - 1].named_parameters())
    return names


def _widened(w: Tensor, blank: Tensor, old_dim: int, new_dim: int, norm_gain: bool, two_blocks: bool) -> Tensor:
    if norm_gain:  # RMSNorm: cancel the larger sqrt(dim)
        w = w * math.sqrt(old_dim / new_dim)
    elif w.shape == blank.shape:
        return w.clone()  # rotary frequencies and anything not widened
    if two_blocks:
        return torch.cat([_corner(half, big) for half, big in zip(w.chunk(2), blank.chunk(2))])
    return _corner(w, blank)


def _corner(w: Tensor, blank: Tensor) -> Tensor:
    """w in the leading block of a zero tensor shaped like `blank`."""
    out = torch.zeros_like(blank)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def _identity(name: str, blank: Tensor) -> Tensor:
    """An appended target layer's parameter: zero (its outputs add nothing), norm gains one."""
    return torch.ones_like(blank) if name.endswith("gamma") else torch.zeros_like(blank)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description="Widen a speech checkpoint function-preservingly (benchmarks at realistic sizes).")
    p.add_argument("out", type=Path, help="directory to write the widened checkpoint to")
    p.add_argument("--checkpoint", type=Path, help="speech checkpoint directory (default: the shipped one)")
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--depth", type=int, help="target layers (default: the checkpoint's); extra ones are identities")
    args = p.parse_args(argv)
    from .speech.pipeline import ASSETS

    ckpt = load_checkpoint(args.checkpoint or ASSETS)
    try:
        wide = widen(ckpt, args.dim, args.heads, args.depth)
    except ValueError as e:
        p.error(str(e))
    path = save_checkpoint(args.out, wide)
    params = sum(t.numel() for t in wide.model.parameters())
    print(f"wrote {path}: dim {args.dim}, {args.heads} heads, {wide.config.target_depth} target layers, {params / 1e6:.1f}M parameters")
    return path


if __name__ == "__main__":
    main()
