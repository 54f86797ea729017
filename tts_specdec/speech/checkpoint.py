"""Checkpoint directory: safetensors weights + JSON config + tokenizer vocab + k-means centroids.

    model.safetensors   TextToSemantic state dict (tied weights stored once), float32
    config.json         ModelConfig, MelConfig and training metadata
    tokenizer.json      character vocabulary
    units.safetensors   k-means centroids (codebook_size, n_mels)

No pickle anywhere, so loading a checkpoint never runs code from the file. Loading checks every file
before building anything: config.json's keys and their types, the tensors' names and shapes against
the model the config describes, the centroids against the mel settings; errors name file and key.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
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


def _typed(cls, data: object, where: str):
    """Build the config dataclass `cls` from JSON, naming `where` (file: section) and the key in errors:
    every field present, nothing unknown, each of its declared type (an int is no bool)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    missing = [name for name in names if name not in data]
    if unknown or missing:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])))
    for name in names:
        value, hint = data[name], hints[name]
        allowed = tuple(t for t in typing.get_args(hint) if t is not type(None)) or (hint,)
        if value is None and type(None) in typing.get_args(hint):
            continue
        ok = any(isinstance(value, t) and not isinstance(value, bool) for t in allowed) or (
            float in allowed and isinstance(value, int) and not isinstance(value, bool))
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            kind = " or ".join(t.__name__ for t in allowed)
            raise ValueError(f"{where}.{name}: must be a finite {kind}, got {value!r}")
    try:
        return cls(**data)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _check_mel(mel: MelConfig, where: str) -> None:
    """Mel settings the audio side can use (16 kHz wavs, a real filter bank), named by key."""
    from .audio import SAMPLE_RATE

    problems = [(mel.sample_rate == SAMPLE_RATE, "sample_rate", f"must be {SAMPLE_RATE}"),
                (mel.n_fft >= 2, "n_fft", "must be >= 2"), (0 < mel.hop_length <= mel.n_fft, "hop_length", "must be in 1..n_fft"),
                (mel.n_mels >= 1, "n_mels", "must be >= 1"), (mel.log_floor > 0, "log_floor", "must be > 0"),
                (0 <= mel.f_min < mel.f_max <= mel.sample_rate / 2, "f_min", "needs 0 <= f_min < f_max <= sample_rate / 2")]
    for ok, key, rule in problems:
        if not ok:
            raise ValueError(f"{where}.{key}: {rule}, got {getattr(mel, key)}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None


def load_checkpoint(directory: str | Path) -> Checkpoint:
    """Load a checkpoint directory; the model comes back in eval mode on CPU."""
    directory = Path(directory)
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"directory: {directory} lacks {missing}")
    config_path = directory / "config.json"
    try:
        config_data = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config_data, dict) or not {"model", "mel"} <= set(config_data):
        raise ValueError(f"{config_path}: needs the sections 'model' and 'mel'")
    config = _typed(ModelConfig, config_data["model"], f"{config_path}: model")
    mel_config = _typed(MelConfig, config_data["mel"], f"{config_path}: mel")
    _check_mel(mel_config, f"{config_path}: mel")
    meta = config_data.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{config_path}: meta must be an object")
    tokenizer = CharTokenizer.load(directory / "tokenizer.json")
    if tokenizer.num_text_token_ids != config.num_text_token_ids:
        raise ValueError(f"{directory / 'tokenizer.json'}: {len(tokenizer.vocab)} characters + padding, but "
                         f"{config_path}: model.num_text_token_ids is {config.num_text_token_ids}")
    centroids = _read_tensors(directory / "units.safetensors").get("centroids")
    if centroids is None or tuple(centroids.shape) != (config.n_units, mel_config.n_mels) or not bool(
            torch.isfinite(centroids).all()):
        shape = None if centroids is None else tuple(centroids.shape)
        raise ValueError(f"{directory / 'units.safetensors'}: centroids must be finite, of shape (model.n_units, mel.n_mels) = "
                         f"{(config.n_units, mel_config.n_mels)} from {config_path}, got {shape}")
    model = build_model(config, tokenizer_encode=tokenizer)
    weights_path = directory / "model.safetensors"
    state = _read_tensors(weights_path)
    expected = _unique_state(model)
    tied = set(model.state_dict()) - set(expected)
    for name, tensor in state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise ValueError(f"{weights_path}: {name} has shape {tuple(tensor.shape)}, but {config_path} "
                             f"describes {tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            # NaN weights make NaN logits, whose argmax decodes silently as unit 0 to max_length
            raise ValueError(f"{weights_path}: {name} holds NaN or infinite values")
    result = model.load_state_dict(state, strict=False)
    # names absent from the file must be aliases of tied tensors that were loaded under another name
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"{weights_path}: does not match {config_path} "
                         f"(missing {sorted(set(result.missing_keys) - tied)}, unexpected {result.unexpected_keys})")
    return Checkpoint(model=model.eval(), config=config, tokenizer=tokenizer, centroids=centroids.float(),
                      mel_config=mel_config, meta=meta)
