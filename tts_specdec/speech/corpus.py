"""Corpus on disk in the LJSpeech layout: `<root>/metadata.csv` (`id|text` per line) + `<root>/wavs/<id>.wav`.

espeak-ng (Debian package) speaks our generated sentences into that layout; an existing
LJSpeech-layout corpus (e.g. LJSpeech itself, `id|text|normalized text`) is read the same way.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tqdm import tqdm

from .audio import read_wav, write_wav

METADATA = "metadata.csv"
ESPEAK_RATE = 230  # words per minute: faster speech = shorter unit sequences to learn and decode


@dataclass(frozen=True)
class Utterance:
    id: str
    text: str


def parse_metadata(lines: Iterable[str]) -> list[Utterance]:
    """Parse LJSpeech metadata lines. With 3 fields the normalised text (last) is used."""
    utterances = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\n\r")
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) not in (2, 3) or not fields[0].strip() or not fields[-1].strip():
            raise ValueError(f"metadata line {number}: expected 'id|text' or 'id|text|normalized', got {line!r}")
        utterances.append(Utterance(id=fields[0].strip(), text=fields[-1].strip()))
    ids = [u.id for u in utterances]
    if len(set(ids)) != len(ids):
        raise ValueError("metadata: duplicate utterance ids")
    return utterances


def read_metadata(root: str | Path) -> list[Utterance]:
    path = Path(root) / METADATA
    if not path.is_file():
        raise FileNotFoundError(f"root: no {METADATA} in {root}")
    return parse_metadata(path.read_text(encoding="utf-8").splitlines())


def write_metadata(root: str | Path, utterances: Iterable[Utterance]) -> Path:
    path = Path(root) / METADATA
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for u in utterances:
        if "|" in u.text or "\n" in u.text:
            raise ValueError(f"utterance {u.id}: text may not contain '|' or newlines")
        lines.append(f"{u.id}|{u.text}\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def wav_path(root: str | Path, utterance_id: str) -> Path:
    return Path(root) / "wavs" / f"{utterance_id}.wav"


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak(text: str, out: str | Path, *, voice: str = "en-us", rate: int = ESPEAK_RATE) -> Path:
    """Speak `text` with espeak-ng into a 16 kHz mono wav at `out`."""
    if not text.strip():
        raise ValueError("text must not be empty")
    if not espeak_available():
        raise FileNotFoundError("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
        # '--' keeps sentences starting with '-' from being read as options
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-w", tmp.name, "--", text],
                       check=True, capture_output=True)
        wav = read_wav(tmp.name)
    return write_wav(out, wav)


def speak_corpus(root: str | Path, utterances: list[Utterance], *, voice: str = "en-us",
                 rate: int = ESPEAK_RATE) -> Path:
    """Write metadata and speak every utterance whose wav is missing (resumable)."""
    write_metadata(root, utterances)
    for u in tqdm(utterances, desc=f"espeak-ng -> {root}", unit="utt"):
        out = wav_path(root, u.id)
        if not out.exists():
            espeak(u.text, out, voice=voice, rate=rate)
    return Path(root)
