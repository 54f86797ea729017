"""recipes/synthesize.py --texts as a user runs it: killed and resumed, under torchrun, and bad commands."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tts_specdec.speech.audio import wav_samples
from tts_specdec.speech.checkpoint import save_checkpoint
from tts_specdec.speech.manifest import OK
from test_speech_checkpoint import tiny_checkpoint
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "synthesize.py"
SENTENCES = ["Is the cat red?", "Open the door.", "Hi, anna!", "The old boat is near the bridge.",
             "Ben found a green apple.", "Where is the train?", "It is cold at night.", "Look at the clock!"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"), tiny_checkpoint(seed=1))


def command(checkpoint: Path, texts: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(RECIPE), "--texts", str(texts), "--out", str(out), "--checkpoint", str(checkpoint),
            "--mode", "plain", "--threads", "1", *extra]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_killed_run_resumes_without_redoing_finished_lines(tmp_path, checkpoint):
    texts = tmp_path / "in.txt"
    texts.write_text("\n".join(SENTENCES * 6) + "\n")
    out = tmp_path / "out"
    run = subprocess.Popen(command(checkpoint, texts, out, "--batch-size", "1"), env=env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = out / "manifest.part0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and run.poll() is None:
        if part.exists() and part.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    assert run.poll() is None, "the run ended before it could be killed"
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert not (out / "manifest.jsonl").exists()
    for wav in out.glob("*.wav"):  # whatever the kill left under a wav's name is a complete wav
        assert wav_samples(wav), wav
    finished = {e["id"]: e for e in map(json.loads, part.read_text().splitlines()[:3])}
    stamps = {name: os.stat(out / name).st_mtime_ns for name in finished}
    assert len(finished) == 3 and len(list(out.glob("*.wav"))) < len(SENTENCES) * 6

    rerun = subprocess.run(command(checkpoint, texts, out, "--batch-size", "4"), env=env(), capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    entries = manifest(out)
    assert [e["line"] for e in entries] == list(range(1, len(SENTENCES) * 6 + 1))
    assert all(e["status"] == OK and wav_samples(out / e["id"]) == e["samples"] for e in entries)
    for name, entry in finished.items():  # not redone: same file, same manifest entry
        assert os.stat(out / name).st_mtime_ns == stamps[name]
        assert entries[entry["line"] - 1] == entry
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".wav")) == ["manifest.jsonl"]


def test_bfloat16_run_is_recorded_and_redone_in_float32(tmp_path, checkpoint):
    """--dtype bfloat16 decodes the model converted to bfloat16; its entries say so, so a float32 run over
    the same folder redoes them (and float32 entries name no dtype: manifests from before the option
    stay valid)."""
    texts, out = tmp_path / "texts.txt", tmp_path / "out"
    texts.write_text("\n".join(SENTENCES[:2]) + "\n")
    half = subprocess.run(command(checkpoint, texts, out, "--dtype", "bfloat16"), env=env(), capture_output=True,
                          text=True, timeout=300)
    assert half.returncode == 0, half.stderr
    first = manifest(out)
    assert [e["status"] for e in first] == [OK, OK] and all(e["settings"]["dtype"] == "bfloat16" for e in first)
    full = subprocess.run(command(checkpoint, texts, out), env=env(), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr
    second = manifest(out)
    assert [e["status"] for e in second] == [OK, OK] and all("dtype" not in e["settings"] for e in second)
    assert all(a["finished"] < b["finished"] for a, b in zip(first, second))  # redone


def test_torchrun_two_processes_write_what_one_process_writes(tmp_path, checkpoint):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    texts = tmp_path / "in.txt"
    texts.write_text("\n".join(SENTENCES[:5] + ["", "Price: 5 €"]) + "\n")
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run(command(checkpoint, texts, one, "--batch-size", "2"), env=env(), capture_output=True,
                            text=True, timeout=300)
    launch = [torchrun, "--standalone", "--nproc_per_node", "2", *command(checkpoint, texts, two, "--batch-size", "2")[1:]]
    double = subprocess.run(launch, env=env(), capture_output=True, text=True, timeout=300)
    assert single.returncode == 1, single.stderr  # line 7 cannot be spelled
    assert double.returncode != 0 and "line 7:" in double.stderr + double.stdout
    assert "2 processes" in double.stdout
    wavs = sorted(p.name for p in one.glob("*.wav"))
    assert wavs == sorted(p.name for p in two.glob("*.wav")) and len(wavs) == 5
    for name in wavs:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    timing = {"finished", "decode_seconds"}
    strip = [[{k: v for k, v in e.items() if k not in timing} for e in manifest(out)] for out in (one, two)]
    assert strip[0] == strip[1] and len(strip[0]) == 7
    assert sorted(p.name for p in two.iterdir() if not p.name.endswith(".wav")) == ["manifest.jsonl"]


def recipe_module():
    return load_script("recipes/synthesize.py", "synthesize_recipe")


@pytest.mark.parametrize("args, message", [
    (["--texts", "{tmp}/missing.txt"], "--texts: no such file"),
    (["--texts", "{tmp}/in.txt", "--threads", "0"], "--threads: must be an integer >= 1, got 0"),
    (["--texts", "{tmp}/in.txt", "--cond-scale", "inf"], "--cond-scale: must be a finite number in [1, 100]"),
    (["--texts", "{tmp}/in.txt", "--batch-size", "x"], "--batch-size: must be an integer >= 1, got 'x'"),
    (["--texts", "{tmp}/in.txt", "--out", "{tmp}/in.txt"], "is not a folder"),
    (["--texts", "{tmp}/in.txt", "--out", "{tmp}/o", "--checkpoint", "{tmp}"], "lacks"),
    (["Price: 5 \N{EURO SIGN}", "--out", "{tmp}/o.wav", "--checkpoint", "{ckpt}"], "outside the tokenizer vocabulary"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, checkpoint, args, message, monkeypatch, capsys):
    threads = torch.get_num_threads()  # main() sets the process's threads: give them back
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    (tmp_path / "in.txt").write_text("Hi!\n")
    argv = [a.format(tmp=tmp_path, ckpt=checkpoint) for a in args]
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    with pytest.raises(SystemExit) as exit:
        recipe_module().main()
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert torch.get_num_threads() == threads


def test_user_error_from_the_shell_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(RECIPE), "--texts", str(tmp_path / "missing.txt")], env=env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == f"synthesize.py: error: --texts: no such file: {tmp_path}/missing.txt\n"
