"""recipes/train.py keeps its own state as safetensors/JSON: nothing in --run is unpickled."""

import argparse
import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

from tts_specdec.speech.dataset import PairedData, load_pairs, save_pairs
from tts_specdec.speech.units import fit_kmeans, load_centroids, save_kmeans

_spec = importlib.util.spec_from_file_location("train_recipe", Path(__file__).resolve().parents[1] / "recipes/train.py")
train = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("train_recipe", train)
_spec.loader.exec_module(train)


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
