"""Log-mel features, the k-means unit extractor and the centroid vocoder."""

import numpy as np
import pytest
import torch

from tts_specdec.speech.features import LogMel, MelConfig
from tts_specdec.speech.units import MelKMeans, UnitExtractor, fit_kmeans, save_kmeans
from tts_specdec.speech.vocoder import CentroidVocoder

SR = 16_000


def tones(freqs=(300, 900, 1800, 3500), seconds=0.3) -> torch.Tensor:
    """A stand-in for speech: steady segments with distinct spectra, so units are well defined."""
    t = torch.arange(int(SR * seconds)) / SR
    return torch.cat([0.3 * torch.sin(2 * torch.pi * f * t) for f in freqs])


@pytest.fixture(scope="module")
def kmeans():
    frames = LogMel()(tones()).numpy()
    return fit_kmeans(frames, n_clusters=4, seed=0)


def test_log_mel_is_50_frames_per_second():
    mel = LogMel()(torch.zeros(2, SR))
    assert mel.shape == (2, SR // 320 + 1, 80)
    assert MelConfig().frames_per_second == 50
    with pytest.raises(ValueError, match="wav"):
        LogMel()(torch.zeros(1, 1, 10))


def test_extractor_matches_sklearn_predict(kmeans):
    extractor = MelKMeans(torch.from_numpy(kmeans.cluster_centers_))
    frames = LogMel()(tones())
    assert torch.equal(extractor.quantize(frames), torch.from_numpy(kmeans.predict(frames.numpy())).long())
    units = extractor(torch.stack([tones(), tones()]))
    assert units.shape == (2, frames.shape[0]) and extractor.codebook_size == 4
    assert isinstance(extractor, UnitExtractor)  # the interface HubertWithKmeans also satisfies


def test_joblib_file_in_audiolm_format(kmeans, tmp_path):
    import joblib

    path = save_kmeans(kmeans, tmp_path / "kmeans.joblib")
    # audiolm's HubertWithKmeans does exactly this with the file
    assert np.array_equal(joblib.load(path).cluster_centers_, kmeans.cluster_centers_)
    extractor = MelKMeans.from_joblib(path)
    assert torch.allclose(extractor.centroids, torch.from_numpy(kmeans.cluster_centers_).float())
    with pytest.raises(FileNotFoundError, match="path"):
        MelKMeans.from_joblib(tmp_path / "missing.joblib")


def test_bad_centroids_shape():
    with pytest.raises(ValueError, match="centroids"):
        MelKMeans(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="centroids"):
        CentroidVocoder(torch.zeros(4))


def test_vocoder_shapes():
    vocoder = CentroidVocoder(torch.randn(16, 80), n_iter=4)
    assert vocoder(torch.randint(0, 16, (30,))).shape == (29 * 320,)
    assert vocoder(torch.randint(0, 16, (3, 30))).shape == (3, 29 * 320)


def test_vocoder_rejects_bad_units():
    vocoder = CentroidVocoder(torch.randn(16, 80), n_iter=4)
    with pytest.raises(ValueError, match="units"):
        vocoder(torch.tensor([0, 16]))
    with pytest.raises(TypeError, match="units"):
        vocoder(torch.zeros(5))
    with pytest.raises(ValueError, match="frames"):
        vocoder(torch.tensor([3]))


def test_vocoder_round_trip_keeps_units(kmeans):
    """units -> vocoder -> waveform -> extractor gives the same units back (away from segment edges)."""
    centroids = torch.from_numpy(kmeans.cluster_centers_).float()
    extractor, vocoder = MelKMeans(centroids), CentroidVocoder(centroids)
    units = extractor(tones())
    again = extractor(vocoder(units))
    assert len(again) == len(units)
    # frames within 2 of a unit change are smeared by the STFT window; judge the steady ones
    steady = torch.tensor([len(set(units[max(0, i - 2): i + 3].tolist())) == 1 for i in range(len(units))])
    agree = (units == again)[steady].float().mean().item()
    assert steady.sum() > len(units) // 2 and agree >= 0.95, agree
