"""Wav I/O with soundfile (torchaudio 2.11's load/save need torchcodec, which we do not ship)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

from .atomic import atomic_file

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
    """Write a mono waveform as 16-bit PCM; peak-normalised only if it would clip.

    Atomic: the file is written under a temporary name in the same folder and renamed, so `path` is
    either absent, the old file or the complete new one, even if the process is killed mid-write."""
    if wav.dim() != 1:
        raise ValueError(f"wav must be 1-D (samples,), got shape {tuple(wav.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = wav.detach().float().cpu().numpy()
    peak = float(np.abs(data).max()) if data.size else 0.0
    if peak > 0.99:
        data = data * (0.99 / peak)
    with atomic_file(path) as file:
        sf.write(file, data, sample_rate, subtype="PCM_16", format="WAV")
    return path


def wav_samples(path: str | Path, sample_rate: int = SAMPLE_RATE) -> int | None:
    """Samples in a complete mono wav at `sample_rate`, or None if it is missing or unreadable."""
    try:
        info = sf.info(str(path))
    except (OSError, RuntimeError, sf.LibsndfileError):
        return None
    if info.samplerate != sample_rate or info.channels != 1:
        return None
    return int(info.frames)
