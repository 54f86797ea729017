"""Batch synthesis as a job runner: a text file in, one wav and one manifest entry per line out.

A run (1) reads the lines (UTF-8 with or without a byte-order mark, any line ending), (2) plans: a
line is skipped when the manifest already holds an ok entry for the same text and settings whose wav
opens with the recorded length, (3) cuts the other lines into batches of consecutive lines and
decodes its share of them, (4) writes each wav atomically and appends its entry, and (5) merges every
entry into DIR/manifest.jsonl. A line that fails becomes an error entry; the run goes on. A line whose
entry is not ok (it failed, or is blank now) has no wav: one left by an earlier run is removed.

Under torchrun every process runs the same plan and takes a contiguous share of the batches
(accelerate's `PartialState.split_between_processes`): a batch holds the same lines whatever the
number of processes, so N processes write the files one process writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

from tqdm import tqdm

from .atomic import discard, remove_partials
from .audio import write_wav
from .longtext import MAX_PIECE_CHARS
from .manifest import BLANK, ERROR, OK, Entry, append_entries, is_done, latest_entries, write_manifest
from .pipeline import MODES, SpeechModel, synthesize


@dataclass(frozen=True)
class Settings:
    """What a wav depends on besides its text: a manifest entry made with other settings is redone."""
    mode: str = "spec-beam"
    cond_scale: float = 1.0
    seed: int = 0
    max_chars: int = MAX_PIECE_CHARS
    checkpoint: str = "shipped"
    dtype: str = "float32"  # the text-to-semantic model's (`synthesize.py --dtype`)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    def to_dict(self) -> dict:
        out = {"mode": self.mode, "cond_scale": self.cond_scale, "seed": self.seed,
               "max_chars": self.max_chars, "checkpoint": self.checkpoint}
        if self.dtype != "float32":  # named only when not the default: manifests written before it stay valid
            out["dtype"] = self.dtype
        return out


@dataclass(frozen=True)
class Line:
    number: int                  # 1-based
    text: str                    # stripped; "" for a blank line
    error: Optional[str] = None  # set when the line could not even be read (not UTF-8)

    @property
    def id(self) -> str:
        return f"{self.number:05d}.wav"


def read_lines(path: Path) -> list[Line]:
    """Every line of a text file: a UTF-8 byte-order mark and \\r\\n or \\r endings are handled; a line
    that is not UTF-8 is kept with its error, so that it alone fails."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    lines = []
    for number, chunk in enumerate(raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"), 1):
        try:
            lines.append(Line(number, chunk.decode("utf-8").strip()))
        except UnicodeDecodeError as error:
            lines.append(Line(number, chunk.decode("utf-8", errors="replace").strip(),
                              f"not UTF-8 (byte {error.start})"))
    if lines and not lines[-1].text and lines[-1].error is None:
        lines.pop()  # the newline that ends the file starts no line
    return lines


class Processes(Protocol):
    """The part of accelerate's PartialState a run uses (one process: `SingleProcess`)."""
    process_index: int
    num_processes: int
    is_main_process: bool

    def wait_for_everyone(self) -> None: ...

    def split_between_processes(self, inputs: list, apply_padding: bool = False): ...


class SingleProcess:
    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass

    def split_between_processes(self, inputs: list, apply_padding: bool = False):
        import contextlib

        return contextlib.nullcontext(inputs)


@dataclass
class Report:
    """What one run did, over all processes (the merged manifest)."""
    manifest: Path
    entries: list[Entry]
    reused: int                  # ok lines kept from an earlier run
    made: int                    # lines this run tried (all processes), failed ones included
    seconds: float               # wall time of this process

    @property
    def ok(self) -> int:
        return sum(e.status == OK for e in self.entries)

    @property
    def failed(self) -> list[Entry]:
        return [e for e in self.entries if e.status == ERROR]

    @property
    def blank(self) -> int:
        return sum(e.status == BLANK for e in self.entries)


def _error(line: Line, settings: dict, reason: str) -> Entry:
    return Entry(line.number, line.id, line.text, ERROR, settings, error=f"line {line.number}: {reason}")


def synthesize_batch(speech: SpeechModel, batch: list[Line], settings: Settings, out_dir: Path,
                     synth: Callable = synthesize) -> list[Entry]:
    """Decode one batch in one call; lines the tokenizer rejects, and every line of a batch whose
    decoding raised, are tried alone so that only the guilty line fails."""
    meta = settings.to_dict()
    entries, good = [], []
    for line in batch:
        if line.error is not None:
            entries.append(_error(line, meta, line.error))
            continue
        try:
            speech.tokenizer.encode_one(line.text)
            good.append(line)
        except ValueError as error:
            entries.append(_error(line, meta, str(error)))
    groups = [good] if good else []
    while groups:
        group = groups.pop(0)
        try:
            # seeded by the batch's first line, not by the process that decodes it
            result = synth(speech, [line.text for line in group], settings.mode, seed=settings.seed + group[0].number,
                           cond_scale=settings.cond_scale, max_chars=settings.max_chars)
        except Exception as error:  # noqa: BLE001 - isolation: one bad line must not end the run
            if len(group) > 1:
                groups = [[line] for line in group] + groups
            else:
                entries.append(_error(group[0], meta, f"{type(error).__name__}: {error}"))
            continue
        total_units = max(1, sum(u.numel() for u in result.units))
        for line, wav, units, pieces in zip(group, result.wavs, result.units, result.pieces):
            write_wav(out_dir / line.id, wav)
            entries.append(Entry(line.number, line.id, line.text, OK, meta, samples=wav.numel(),
                                 seconds=round(wav.numel() / speech.mel_config.sample_rate, 4), pieces=pieces,
                                 decode_seconds=round(result.decode_seconds * units.numel() / total_units, 4)))
    return sorted(entries, key=lambda e: e.line)


def run(speech: SpeechModel, texts_file: Path, out_dir: Path, settings: Settings, *, batch_size: int = 8,
        processes: Optional[Processes] = None, progress: bool = True) -> Report:
    """Synthesise every line of `texts_file` into `out_dir` (see the module docstring)."""
    started = time.perf_counter()
    state = processes or SingleProcess()
    meta = settings.to_dict()
    lines = read_lines(texts_file)
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_partials(out_dir)
    state.wait_for_everyone()  # no process reads the manifest while the main one tidies
    previous = latest_entries(out_dir)
    kept = {line.number: previous[line.number] for line in lines
            if line.text and line.error is None and is_done(previous.get(line.number), line.text, meta, out_dir)}
    todo = [line for line in lines if (line.text or line.error) and line.number not in kept]
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    state.wait_for_everyone()  # every process has planned before any writes a part file
    part = out_dir / f"manifest.part{state.process_index}.jsonl"
    with state.split_between_processes(batches) as mine:
        bar = tqdm(total=sum(map(len, mine)), unit="line", desc=f"{settings.mode} -> {out_dir}",
                   disable=not (progress and state.is_main_process))
        for batch in mine:
            append_entries(part, synthesize_batch(speech, batch, settings, out_dir))
            bar.update(len(batch))
        bar.close()
    state.wait_for_everyone()
    entries = latest_entries(out_dir)
    for line in lines:
        if not line.text and line.error is None:
            entries[line.number] = Entry(line.number, line.id, "", BLANK, meta)
    merged = [entries[line.number] for line in lines if line.number in entries]
    if len(merged) != len(lines):  # every process appended before the barrier: a bug, not a user error
        raise RuntimeError(f"manifest: {len(lines) - len(merged)} lines have no entry after the run")
    state.wait_for_everyone()  # every process has read the parts before the main one removes them
    if state.is_main_process:
        # a line that failed or became blank keeps no wav of an earlier run beside its entry (removed
        # first: a kill before the manifest is written leaves an entry whose wav is gone, which resume
        # redoes, never a wav the manifest calls an error)
        for line in lines:
            if entries[line.number].status != OK:
                discard(out_dir / line.id)
        write_manifest(out_dir, merged)
    state.wait_for_everyone()
    return Report(out_dir / "manifest.jsonl", merged, len(kept), len(todo), time.perf_counter() - started)
