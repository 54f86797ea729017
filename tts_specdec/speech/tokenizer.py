"""Character tokenizer on normalised text (see `text.py` for the normalisation).

Ids: 0 is padding (TextToSemantic's default text_pad_id); characters are 1..len(vocab).
TextToSemantic appends its own text EOS id (= num_text_token_ids) to the source.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .text import ALPHABET, normalize_text

PAD_ID = 0


class CharTokenizer:
    def __init__(self, vocab: str = ALPHABET):
        if len(set(vocab)) != len(vocab) or not vocab:
            raise ValueError("vocab must be a non-empty string of distinct characters")
        self.vocab = vocab
        self.char_to_id = {c: i + 1 for i, c in enumerate(vocab)}

    @property
    def num_text_token_ids(self) -> int:
        return len(self.vocab) + 1  # + padding

    def encode_one(self, text: str) -> list[int]:
        """Normalise and map one sentence to ids; ValueError on empty text or unknown characters."""
        normalised = normalize_text(text)
        if not normalised:
            raise ValueError(f"text must contain something to say, got {text!r}")
        unknown = sorted(set(normalised) - set(self.char_to_id))
        if unknown:
            raise ValueError(f"text {text!r} has characters outside the tokenizer vocabulary: {unknown}")
        return [self.char_to_id[c] for c in normalised]

    def __call__(self, texts: list[str]) -> torch.LongTensor:
        """Batch encode, right-padded with PAD_ID: (batch, max_len). The `tokenizer_encode` of TextToSemantic."""
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise TypeError(f"texts must be a list of str, got {type(texts).__name__}")
        if not texts:
            raise ValueError("texts must not be empty")
        rows = [self.encode_one(t) for t in texts]
        out = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row)
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"type": "char", "vocab": self.vocab, "pad_id": PAD_ID}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"path: no such tokenizer file: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict) or data.get("type") != "char" or data.get("pad_id") != PAD_ID:
            raise ValueError(f"path: {path} is not a char tokenizer file")
        if not isinstance(data.get("vocab"), str):
            raise ValueError(f"{path}: vocab must be a string of characters")
        return cls(data["vocab"])
