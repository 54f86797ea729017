"""Checkpoint directory: safetensors weights + JSON config + tokenizer vocab + k-means centroids.

    model.safetensors   TextToSemantic state dict (tied weights stored once), float32
    config.json         ModelConfig, MelConfig and training metadata
    tokenizer.json      character vocabulary
    units.safetensors   k-means centroids (codebook_size, n_mels)

No pickle anywhere, so loading a checkpoint never runs code from the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from spear_tts_pytorch import TextToSemantic

from .features import MelConfig
from .model import ModelConfig, build_model
from .tokenizer import CharTokenizer

FILES = ("model.safetensors", "config.json", "tokenizer.json", "units.safetensors")


@dataclass
class Checkpoint:
    model: TextToSemantic
    config: ModelConfig
    tokenizer: CharTokenizer
    centroids: torch.Tensor
    mel_config: MelConfig = MelConfig()
    meta: dict = field(default_factory=dict)


def _unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with each shared (tied) tensor kept once, under its first name."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().float().contiguous().cpu()
    return state


def save_checkpoint(directory: str | Path, ckpt: Checkpoint) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_unique_state(ckpt.model), str(directory / "model.safetensors"))
    config = {"model": ckpt.config.to_dict(), "mel": ckpt.mel_config.to_dict(), "meta": ckpt.meta}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ckpt.tokenizer.save(directory / "tokenizer.json")
    save_file({"centroids": ckpt.centroids.float().contiguous()}, str(directory / "units.safetensors"))
    return directory


def load_checkpoint(directory: str | Path) -> Checkpoint:
    """Load a checkpoint directory; the model comes back in eval mode on CPU."""
    directory = Path(directory)
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"directory: {directory} lacks {missing}")
    config_data = json.loads((directory / "config.json").read_text())
    config = ModelConfig.from_dict(config_data["model"])
    tokenizer = CharTokenizer.load(directory / "tokenizer.json")
    model = build_model(config, tokenizer_encode=tokenizer)
    state = load_file(str(directory / "model.safetensors"))
    result = model.load_state_dict(state, strict=False)
    # names absent from the file must be aliases of tied tensors that were loaded under another name
    tied = set(model.state_dict()) - set(_unique_state(model))
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"directory: {directory} does not match its config "
                         f"(missing {sorted(set(result.missing_keys) - tied)}, unexpected {result.unexpected_keys})")
    centroids = load_file(str(directory / "units.safetensors"))["centroids"]
    return Checkpoint(model=model.eval(), config=config, tokenizer=tokenizer, centroids=centroids,
                      mel_config=MelConfig(**config_data["mel"]), meta=config_data.get("meta", {}))
