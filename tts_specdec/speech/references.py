"""Held-out sentences and their espeak-ng reference recordings (for the quality figures)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch

from .audio import read_wav
from .corpus import ESPEAK_RATE, espeak, espeak_available
from .sentences import generate_sentences

DEFAULT_CACHE = Path("data/references")


def heldout_sentences(n: int = 50, seed: int = 0) -> list[str]:
    """The corpus's held-out sentences: the first `n` the generator yields (never in training)."""
    return generate_sentences(n, seed=seed)


def reference_wavs(texts: list[str], cache: str | Path = DEFAULT_CACHE,
                   rate: int = ESPEAK_RATE) -> Optional[list[torch.Tensor]]:
    """espeak-ng recordings of `texts` (cached by text), or None when espeak-ng is not installed."""
    if not espeak_available():
        return None
    cache = Path(cache)
    wavs = []
    for text in texts:
        key = hashlib.sha1(f"{rate}|{text}".encode()).hexdigest()[:16]
        path = cache / f"{key}.wav"
        if not path.exists():
            espeak(text, path, rate=rate)
        wavs.append(read_wav(path))
    return wavs
