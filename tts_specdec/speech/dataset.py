"""Paired (text ids, unit ids) data from an LJSpeech-layout corpus, and length-bucketed batches."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .audio import read_wav
from .corpus import read_metadata, wav_path
from .features import LogMel
from .tokenizer import CharTokenizer
from .units import UnitExtractor


@dataclass
class PairedData:
    texts: list[str]
    text_ids: list[torch.Tensor]  # each (n_text,)
    units: list[torch.Tensor]     # each (frames,)

    def __len__(self) -> int:
        return len(self.texts)


def corpus_frames(root: str | Path, max_utterances: int, seed: int = 0) -> np.ndarray:
    """Log-mel frames (n, n_mels) of a random subset of the corpus, for fitting k-means."""
    utterances = read_metadata(root)
    random.Random(seed).shuffle(utterances)
    log_mel = LogMel()
    frames = [log_mel(read_wav(wav_path(root, u.id))) for u in tqdm(utterances[:max_utterances], desc="log-mel")]
    return torch.cat(frames).numpy()


def save_pairs(data: PairedData, path: str | Path) -> Path:
    """PairedData as one safetensors file (ids and units end to end, lengths, texts in its metadata)."""
    import json

    from safetensors.torch import save

    from .atomic import atomic_file

    tensors = {"text_ids": torch.cat(data.text_ids).long() if data.text_ids else torch.zeros(0, dtype=torch.long),
               "text_lengths": torch.tensor([len(t) for t in data.text_ids], dtype=torch.long),
               "units": torch.cat(data.units).long() if data.units else torch.zeros(0, dtype=torch.long),
               "unit_lengths": torch.tensor([len(u) for u in data.units], dtype=torch.long)}
    path = Path(path)
    with atomic_file(path) as file:
        file.write(save(tensors, metadata={"texts": json.dumps(data.texts)}))
    return path


def load_pairs(path: str | Path) -> PairedData:
    """PairedData written by `save_pairs` (safetensors and JSON: no code runs)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        texts = json.loads(file.metadata()["texts"])
        t = {name: file.get_tensor(name) for name in file.keys()}
    return PairedData(texts, list(t["text_ids"].split(t["text_lengths"].tolist())),
                      list(t["units"].split(t["unit_lengths"].tolist())))


def extract_pairs(root: str | Path, tokenizer: CharTokenizer, extractor: UnitExtractor) -> PairedData:
    texts, text_ids, units = [], [], []
    for u in tqdm(read_metadata(root), desc=f"units {root}"):
        texts.append(u.text)
        text_ids.append(torch.tensor(tokenizer.encode_one(u.text)))
        units.append(extractor(read_wav(wav_path(root, u.id))[None])[0].long())
    return PairedData(texts, text_ids, units)


def pad_stack(rows: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def length_batches(lengths: list[int], max_frames: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar-length items, each padded size at most `max_frames` frames."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_frames:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches
