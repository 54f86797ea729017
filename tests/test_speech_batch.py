"""Batch synthesis as a job: input lines, manifest, resume, isolation of bad lines, atomic files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tts_specdec.speech import batch
from tts_specdec.speech.atomic import atomic_file, remove_partials, write_json, write_text
from tts_specdec.speech.audio import wav_samples, write_wav
from tts_specdec.speech.batch import Line, Settings, read_lines
from tts_specdec.speech.manifest import (BLANK, ERROR, OK, Entry, append_entries, is_done, latest_entries,
                                         read_entries, write_manifest)
from tts_specdec.speech.pipeline import SpeechModel, synthesize
from test_speech_checkpoint import tiny_checkpoint

SETTINGS = Settings(mode="plain", checkpoint="tiny")


@pytest.fixture(scope="module")
def speech() -> SpeechModel:
    return SpeechModel.from_checkpoint(tiny_checkpoint(seed=1))


def short(speech, texts, mode, **kwargs):
    """synthesize with few units per piece: the tiny random model never says EOS."""
    return synthesize(speech, texts, mode, max_length=10, **kwargs)


def stamp(path):
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_read_lines_bom_crlf_blank_and_bad_bytes(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfHello there.\r\n\r\n  Two  \rthree\n\xff\xfeoops\nlast\n")
    lines = read_lines(path)
    assert [(l.number, l.text) for l in lines] == [(1, "Hello there."), (2, ""), (3, "Two"), (4, "three"),
                                                   (5, "\ufffd\ufffdoops"), (6, "last")]
    assert [l.error for l in lines] == [None, None, None, None, "not UTF-8 (byte 0)", None]
    assert lines[0].id == "00001.wav"
    path.write_bytes(b"no newline at the end")
    assert [l.text for l in read_lines(path)] == ["no newline at the end"]


def test_manifest_ignores_a_torn_line_and_keeps_the_newest_entry(tmp_path):
    old = Entry(1, "00001.wav", "a", ERROR, error="line 1: x", finished=1.0)
    new = Entry(1, "00001.wav", "a", OK, samples=5, finished=2.0)
    other = Entry(2, "00002.wav", "b", OK, samples=5, finished=1.5)
    write_manifest(tmp_path, [old])
    append_entries(tmp_path / "manifest.part1.jsonl", [new, other])
    with open(tmp_path / "manifest.part1.jsonl", "a") as file:
        file.write(Entry(2, "00002.wav", "b", ERROR, finished=9.0).to_json()[:40])  # killed mid-line
    assert len(read_entries(tmp_path / "manifest.part1.jsonl")) == 2
    latest = latest_entries(tmp_path)
    assert latest[1] == new and latest[2] == other
    write_manifest(tmp_path, list(latest.values()))
    assert not list(tmp_path.glob("manifest.part*"))  # merged parts are removed
    assert [json.loads(l)["line"] for l in (tmp_path / "manifest.jsonl").read_text().splitlines()] == [1, 2]


def test_is_done_needs_same_text_settings_and_a_wav_of_the_recorded_length(tmp_path):
    write_wav(tmp_path / "00001.wav", torch.zeros(1600))
    meta = SETTINGS.to_dict()
    entry = Entry(1, "00001.wav", "hello", OK, meta, samples=1600)
    assert is_done(entry, "hello", meta, tmp_path)
    assert not is_done(entry, "hello!", meta, tmp_path)                              # the line changed
    assert not is_done(entry, "hello", Settings(mode="beam").to_dict(), tmp_path)    # other settings
    assert not is_done(Entry(1, "00001.wav", "hello", ERROR, meta, samples=1600), "hello", meta, tmp_path)
    assert not is_done(None, "hello", meta, tmp_path)
    wav = (tmp_path / "00001.wav").read_bytes()
    (tmp_path / "00001.wav").write_bytes(wav[: len(wav) // 2])                        # truncated
    assert not is_done(entry, "hello", meta, tmp_path)
    (tmp_path / "00001.wav").unlink()
    assert not is_done(entry, "hello", meta, tmp_path)


def test_atomic_file_leaves_the_old_file_on_error(tmp_path):
    target = tmp_path / "x.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target, "w") as file:
            file.write("new, half written")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]
    (tmp_path / ".x.txt.abc.partial").write_text("left by a kill")
    assert remove_partials(tmp_path) == 1 and target.read_text() == "old"
    assert wav_samples(target) is None  # not a wav


def test_write_text_replaces_the_file_whole(tmp_path):
    """What the tools and recipes write their JSON and reports with: the new text in one replace, no
    temporary file left beside it."""
    target = tmp_path / "figures.json"
    target.write_text("old")
    write_text(target, "{\"é\": 1}\n")
    assert target.read_text(encoding="utf-8") == "{\"é\": 1}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]
    write_json(target, {"tokens/s": [1.5]})
    assert target.read_text(encoding="utf-8") == '{\n "tokens/s": [\n  1.5\n ]\n}\n'


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_run_isolates_bad_lines_records_blanks_and_resumes(tmp_path, speech, monkeypatch):
    monkeypatch.setattr(batch, "synthesize", short)
    texts = write_lines(tmp_path / "in.txt", ["Is the cat red?", "", "Price: 5 €", "Open the door.", "Hi!"])
    out = tmp_path / "out"
    report = batch.run(speech, texts, out, SETTINGS, batch_size=2, progress=False)
    status = {e.line: e.status for e in report.entries}
    assert status == {1: OK, 2: BLANK, 3: ERROR, 4: OK, 5: OK}
    assert report.failed[0].error.startswith("line 3: ") and "€" in report.failed[0].error
    assert sorted(p.name for p in out.iterdir()) == ["00001.wav", "00004.wav", "00005.wav", "manifest.jsonl"]
    for entry in report.entries:
        if entry.status == OK:
            assert wav_samples(out / entry.id) == entry.samples > 0 and entry.settings == SETTINGS.to_dict()
    merged = read_entries(out / "manifest.jsonl")
    assert [e.line for e in merged] == [1, 2, 3, 4, 5] and [e.status for e in merged] == list(status.values())
    before = {n: stamp(out / f"0000{n}.wav") for n in (1, 4, 5)}

    # rerun: nothing ok is redone; the failed line is tried again; a changed line is redone alone
    write_lines(texts, ["Is the cat red?", "", "Price: five euros", "Open the door now.", "Hi!"])
    report = batch.run(speech, texts, out, SETTINGS, batch_size=2, progress=False)
    assert report.reused == 2 and report.made == 2 and not report.failed
    assert stamp(out / "00001.wav") == before[1] and stamp(out / "00005.wav") == before[5]
    assert stamp(out / "00004.wav") != before[4] and (out / "00003.wav").exists()

    # other settings: every line is made again
    report = batch.run(speech, texts, out, Settings(mode="beam", checkpoint="tiny"), batch_size=2, progress=False)
    assert report.reused == 0 and report.made == 4


def test_a_line_that_fails_or_becomes_blank_loses_its_old_wav(tmp_path, speech, monkeypatch):
    monkeypatch.setattr(batch, "synthesize", short)
    texts = write_lines(tmp_path / "in.txt", ["Is the cat red?", "Open the door.", "Hi!", "Look!"])
    out = tmp_path / "out"
    batch.run(speech, texts, out, SETTINGS, batch_size=2, progress=False)
    assert sorted(p.name for p in out.glob("*.wav")) == ["00001.wav", "00002.wav", "00003.wav", "00004.wav"]
    elsewhere = tmp_path / "elsewhere.wav"  # a link in the folder goes; what it points to stays
    elsewhere.write_bytes((out / "00004.wav").read_bytes())
    (out / "00004.wav").unlink()
    (out / "00004.wav").symlink_to(elsewhere)

    # line 2 now fails, line 3 is blank, line 4 fails: their wavs of the first run go, line 1's stays
    before = stamp(out / "00001.wav")
    write_lines(texts, ["Is the cat red?", "Price: 5 €", "", "5 € too"])
    report = batch.run(speech, texts, out, SETTINGS, batch_size=2, progress=False)
    assert {e.line: e.status for e in report.entries} == {1: OK, 2: ERROR, 3: BLANK, 4: ERROR}
    assert sorted(p.name for p in out.iterdir()) == ["00001.wav", "manifest.jsonl"]
    assert stamp(out / "00001.wav") == before and elsewhere.exists()
    assert [e.status for e in read_entries(out / "manifest.jsonl")] == [OK, ERROR, BLANK, ERROR]

    # a folder where a wav would be is not the job's to remove
    (out / "00003.wav").mkdir()
    batch.run(speech, texts, out, SETTINGS, batch_size=2, progress=False)
    assert (out / "00003.wav").is_dir()


def test_a_batch_that_fails_is_retried_line_by_line(tmp_path, speech):
    def synth(speech, texts, mode, **kwargs):
        if any("boom" in t for t in texts):
            raise RuntimeError("decoder exploded")
        return short(speech, texts, mode, **kwargs)

    lines = [Line(1, "one boom"), Line(2, "two"), Line(3, "three")]
    entries = batch.synthesize_batch(speech, lines, SETTINGS, tmp_path, synth=synth)
    assert [e.status for e in entries] == [ERROR, OK, OK]
    assert entries[0].error == "line 1: RuntimeError: decoder exploded"


def test_long_text_is_decoded_as_a_batch_of_sentences_and_joined(speech):
    whole = short(speech, ["Open the door. Is the cat red?  Hi, anna!"], "plain")
    parts = short(speech, ["open the door.", "is the cat red?", "hi, anna!"], "plain")
    assert whole.pieces == [3] and parts.pieces == [1, 1, 1]
    assert torch.equal(whole.units[0], torch.cat(parts.units))
    pause = torch.zeros(round(0.25 * 16_000))
    assert torch.equal(whole.wavs[0], torch.cat([parts.wavs[0], pause, parts.wavs[1], pause, parts.wavs[2]]))
    # a sentence longer than max_chars is cut too: more text, more audio
    long = short(speech, ["the red cat and the blue dog " * 8], "plain", max_chars=40)
    assert long.pieces[0] >= 6 and long.wavs[0].numel() > whole.wavs[0].numel()
