"""Wav I/O with soundfile (torchaudio 2.11's load/save need torchcodec, which we do not ship)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

SAMPLE_RATE = 16_000


def read_wav(path: str | Path, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Mono float32 waveform (samples,) resampled to `sample_rate`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no such wav file: {path}")
    data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    wav = torch.from_numpy(data.mean(axis=1))
    if sr != sample_rate:
        wav = AF.resample(wav, sr, sample_rate)
    return wav


def write_wav(path: str | Path, wav: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> Path:
    """Write a mono waveform as 16-bit PCM; peak-normalised only if it would clip."""
    if wav.dim() != 1:
        raise ValueError(f"wav must be 1-D (samples,), got shape {tuple(wav.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = wav.detach().float().cpu().numpy()
    peak = float(np.abs(data).max()) if data.size else 0.0
    if peak > 0.99:
        data = data * (0.99 / peak)
    sf.write(str(path), data, sample_rate, subtype="PCM_16")
    return path
