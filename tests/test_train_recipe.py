"""recipes/train.py keeps its own state as safetensors/JSON: nothing in --run is unpickled; a user's
mistake on its command line is one line and exit status 2."""

import argparse
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np
import torch

from tts_specdec.speech.checkpoint import save_checkpoint
from tts_specdec.speech.dataset import PairedData, load_pairs, save_pairs
from tts_specdec.speech.units import fit_kmeans, load_centroids, save_kmeans
from test_speech_checkpoint import tiny_checkpoint
from conftest import load_script

RECIPE = Path(__file__).resolve().parents[1] / "recipes/train.py"

train = load_script("recipes/train.py", "train_recipe")


class Planted:
    """A pickle that, when loaded, writes a marker file: what a planted kmeans.joblib could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def frames(n: int = 64) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, 80)).astype(np.float32)


def test_a_kmeans_joblib_in_the_run_folder_is_never_read(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    run = tmp_path / "run"
    run.mkdir()
    (run / "kmeans.joblib").write_bytes(pickle.dumps(Planted(marker)))
    monkeypatch.setattr(train, "corpus_frames", lambda *a, **k: frames())
    args = argparse.Namespace(kmeans=None, run=run, corpus=tmp_path, kmeans_utterances=4, n_units=8, seed=0)
    extractor = train.units_of_run(args)
    assert not marker.exists()
    assert extractor.codebook_size == 8 and torch.equal(load_centroids(run / "units.safetensors"), extractor.centroids)
    # the second run reads the safetensors centroids, still not the pickle
    monkeypatch.setattr(train, "corpus_frames", None)
    assert torch.equal(train.units_of_run(args).centroids, extractor.centroids) and not marker.exists()


def test_an_external_kmeans_is_read_only_when_named(tmp_path):
    kmeans = fit_kmeans(frames(), 8, seed=0)
    path = save_kmeans(kmeans, tmp_path / "external.joblib")
    args = argparse.Namespace(kmeans=path, run=tmp_path / "run", corpus=None, kmeans_utterances=0, n_units=8, seed=0)
    (tmp_path / "run").mkdir()
    extractor = train.units_of_run(args)
    assert torch.equal(extractor.centroids, torch.from_numpy(kmeans.cluster_centers_).float())
    assert torch.equal(load_centroids(tmp_path / "run" / "units.safetensors"), extractor.centroids)


def test_pairs_round_trip_through_safetensors(tmp_path):
    data = PairedData(["a b", "c"], [torch.tensor([1, 2, 3]), torch.tensor([4])],
                      [torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10])])
    loaded = load_pairs(save_pairs(data, tmp_path / "pairs.safetensors"))
    assert loaded.texts == data.texts
    assert all(torch.equal(a, b) for a, b in zip(loaded.text_ids + loaded.units, data.text_ids + data.units))


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads: must be an integer >= 1, got 0"),
    (["--steps", "-1"], "--steps: must be an integer >= 0, got -1"),
    (["--lr", "nan"], "--lr: must be a finite number >= 0, got 'nan'"),
    (["--early-exit-layer", "5", "--target-depth", "4"], "--early-exit-layer must be in 1..4 (--target-depth), got 5"),
    (["--corpus", "{tmp}/nonexistent"], "--corpus: no {tmp}/nonexistent/train/metadata.csv"),
    (["--kmeans", "{tmp}/missing.joblib"], "--kmeans: no such file: {tmp}/missing.joblib"),
    (["--kmeans", "{tmp}/not_kmeans.joblib"], "--kmeans: {tmp}/not_kmeans.joblib is not a k-means model"),
    (["--run", "{tmp}/file"], "--run: {tmp}/file exists and is not a folder"),
    (["--init-from", "{tmp}/nowhere"], "--init-from: directory: {tmp}/nowhere lacks"),
    (["--init-from", "{ckpt}", "--kmeans", "{tmp}/other.joblib"], "--init-from {ckpt} was trained on other k-means units"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main() would set this process's threads
    (tmp_path / "file").write_text("")
    (tmp_path / "not_kmeans.joblib").write_bytes(pickle.dumps({"cluster_centers": [1.0]}))
    save_kmeans(fit_kmeans(frames(), 8, seed=0), tmp_path / "other.joblib")
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny_checkpoint(seed=1)) if "{ckpt}" in " ".join(args) else None
    run = ["--run", str(tmp_path / "run")] if "--run" not in args else []
    argv = [a.format(tmp=tmp_path, ckpt=ckpt) for a in args] + run
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    monkeypatch.setattr(train, "extract_pairs", lambda *a: pytest.fail("the corpus was read"))
    with pytest.raises(SystemExit) as exit:
        train.main()
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("train.py: error: ") and message.format(tmp=tmp_path, ckpt=ckpt) in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_user_error_from_the_shell_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(RECIPE.parents[1]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(RECIPE), "--corpus", str(tmp_path / "nonexistent"), "--run",
                             str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (f"train.py: error: --corpus: no {tmp_path}/nonexistent/train/metadata.csv "
                             "(recipes/make_corpus.py makes a corpus)\n")
