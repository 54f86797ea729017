"""The manifest of a batch synthesis: one JSON line per input line, and what resume trusts of it.

    DIR/manifest.jsonl          the merged manifest, one entry per input line, rewritten atomically
    DIR/manifest.part<R>.jsonl  entries appended by process R while it works (fsync'd per batch)

A run killed mid-way leaves part files (possibly with a torn last line); the next run reads the
manifest and every part file, skips lines that do not parse, keeps the newest entry of each input
line, and merges them into manifest.jsonl when it ends.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable, Optional

from .atomic import atomic_file
from .audio import wav_samples

MANIFEST = "manifest.jsonl"
PART_GLOB = "manifest.part*.jsonl"

OK, ERROR, BLANK = "ok", "error", "blank"


@dataclass
class Entry:
    line: int                      # 1-based line of the input file
    id: str                        # the wav's name in DIR (also for lines that failed: where it would be)
    text: str
    status: str                    # "ok", "error" or "blank" (an empty line: nothing to say)
    settings: dict = field(default_factory=dict)  # mode and decoding settings the wav was made with
    error: Optional[str] = None    # why the line failed ("line 7: ...")
    samples: int = 0               # samples in the wav
    seconds: float = 0.0           # seconds of audio
    pieces: int = 0                # sentence pieces decoded (longtext.split_text)
    decode_seconds: float = 0.0    # this line's share of its batch's decoding time (by units)
    finished: float = field(default_factory=time.time)  # unix time; the newest entry of a line wins

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Entry":
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not {"line", "id", "text", "status"} <= set(data):
            raise ValueError("not a manifest entry")
        entry = cls(**{k: v for k, v in data.items() if k in names})
        if not isinstance(entry.line, int) or not isinstance(entry.id, str) or not isinstance(entry.settings, dict):
            raise ValueError("not a manifest entry")
        return entry


def read_entries(path: Path) -> list[Entry]:
    """Entries of one manifest file in file order; lines that do not parse (a torn last line of a
    killed run, anything edited by hand) are ignored, so their input lines are redone."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    entries = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            entries.append(Entry.from_dict(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return entries


def latest_entries(out_dir: Path) -> dict[int, Entry]:
    """The newest entry of each input line over the manifest and every part file in `out_dir`."""
    latest: dict[int, Entry] = {}
    for path in [out_dir / MANIFEST, *sorted(out_dir.glob(PART_GLOB))]:
        for entry in read_entries(path):
            if entry.line not in latest or entry.finished >= latest[entry.line].finished:
                latest[entry.line] = entry
    return latest


def is_done(entry: Optional[Entry], text: str, settings: dict, out_dir: Path) -> bool:
    """Resume may skip a line only when its entry is ok for this text and these settings and its wav
    opens with the recorded length (a wav of another run, or a damaged one, is made again)."""
    return (entry is not None and entry.status == OK and entry.text == text and entry.settings == settings
            and entry.samples > 0 and wav_samples(out_dir / entry.id) == entry.samples)


def append_entries(path: Path, entries: Iterable[Entry]) -> None:
    """Append and fsync: a kill loses at most the batch being written (a torn line is ignored on read)."""
    text = "".join(entry.to_json() + "\n" for entry in entries)
    with open(path, "a", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def write_manifest(out_dir: Path, entries: list[Entry]) -> Path:
    """Write DIR/manifest.jsonl atomically (temporary file + rename), then remove the part files it
    replaces; a kill in between leaves parts whose entries are already in the manifest, harmlessly."""
    path = out_dir / MANIFEST
    with atomic_file(path, "w", encoding="utf-8") as file:
        file.write("".join(e.to_json() + "\n" for e in sorted(entries, key=lambda e: e.line)))
    for part in out_dir.glob(PART_GLOB):
        part.unlink(missing_ok=True)
    return path
