"""Long text: split into sentence-sized pieces, and the pieces' audio joined with short pauses.

The shipped model learned sentences of 2 to 12 words; given a paragraph it stops after a few
seconds. Decoding each sentence as its own row (all rows of a text in one batch) and joining the
audio makes the duration grow with the text.
"""

from __future__ import annotations

import re

import torch

from .text import normalize_text

# about 2.5 units (0.05 s each) per character: 160 characters is ~8 s of speech, a long training sentence
MAX_PIECE_CHARS = 160
PAUSE_SECONDS = 0.25

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def _cut(piece: str, max_chars: int) -> list[str]:
    """A piece longer than max_chars, cut at the last comma, else the last space, else hard."""
    out = []
    while len(piece) > max_chars:
        head = piece[: max_chars + 1]
        at = head.rfind(", ")
        at = at + 1 if at > 0 else head.rfind(" ")
        if at <= 0:
            at = max_chars
        out.append(piece[:at].strip())
        piece = piece[at:].strip()
    return out + [piece] if piece else out


def split_text(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """Normalised text (`text.normalize_text`) cut after each sentence's . ? or !, and pieces still
    longer than `max_chars` cut at commas or spaces. Empty when there is nothing to say."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces = []
    for sentence in _SENTENCE_END.split(normalize_text(text)):
        pieces += _cut(sentence.strip(), max_chars)
    pieces = [p for p in pieces if p]
    spoken = [p for p in pieces if p.strip(" .,?!-'")]  # a lone "." between sentences says nothing
    return spoken or pieces


def join_audio(wavs: list[torch.Tensor], sample_rate: int, pause_seconds: float = PAUSE_SECONDS) -> torch.Tensor:
    """Pieces' waveforms (samples,) end to end with `pause_seconds` of silence between them."""
    if not wavs:
        raise ValueError("wavs must not be empty")
    pause = torch.zeros(round(pause_seconds * sample_rate), dtype=wavs[0].dtype)
    parts = [wavs[0]]
    for wav in wavs[1:]:
        parts += [pause, wav]
    return torch.cat(parts)
