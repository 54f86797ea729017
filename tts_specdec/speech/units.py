"""Discrete speech units: nearest k-means centroid of each log-mel frame.

`UnitExtractor` is the interface the pipeline needs; `MelKMeans` is ours, and
`audiolm_pytorch.HubertWithKmeans` satisfies it as well (it has `codebook_size` and maps a
(batch, samples) waveform to (batch, frames) unit ids), so users with HuBERT + k-means checkpoints
can plug it in. Our own centroids are stored as safetensors (`save_centroids` / `load_centroids`):
reading them runs no code. A joblib file is pickle, which runs code when read: `MelKMeans.from_joblib`
reads one (audiolm's format, `joblib.load(path).cluster_centers_`) only when a user passes it, and
`save_kmeans` writes one only for export to audiolm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .atomic import atomic_file
from .features import LogMel, MelConfig


@runtime_checkable
class UnitExtractor(Protocol):
    codebook_size: int

    def __call__(self, wav: torch.Tensor) -> torch.Tensor:  # (batch, samples) -> (batch, frames)
        ...


class MelKMeans(torch.nn.Module):
    """waveform (batch, samples) or (samples,) -> unit ids (batch, frames) or (frames,)."""

    def __init__(self, centroids: torch.Tensor, mel_config: MelConfig = MelConfig()):
        super().__init__()
        if centroids.dim() != 2 or centroids.shape[1] != mel_config.n_mels:
            raise ValueError(f"centroids must be (codebook_size, {mel_config.n_mels}), got {tuple(centroids.shape)}")
        self.register_buffer("centroids", centroids.float())
        self.log_mel = LogMel(mel_config)

    @property
    def codebook_size(self) -> int:
        return self.centroids.shape[0]

    @classmethod
    def from_joblib(cls, path: str | Path, mel_config: MelConfig = MelConfig()) -> "MelKMeans":
        """Load an audiolm-format k-means file (pickle: only from a trusted source)."""
        import joblib

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"path: no such k-means file: {path}")
        centers = np.asarray(joblib.load(path).cluster_centers_, dtype=np.float32)
        return cls(torch.from_numpy(centers), mel_config)

    def quantize(self, mel: torch.Tensor) -> torch.Tensor:
        """log-mel frames (..., frames, n_mels) -> nearest centroid ids (..., frames)."""
        # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; ||x||^2 is constant per frame
        scores = mel @ self.centroids.T - 0.5 * self.centroids.pow(2).sum(-1)
        return scores.argmax(-1)

    @torch.no_grad()
    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.quantize(self.log_mel(wav))


def fit_kmeans(frames: np.ndarray, n_clusters: int, *, seed: int = 0, batch_size: int = 4096):
    """Fit scikit-learn MiniBatchKMeans on log-mel frames (n, n_mels); returns the fitted estimator."""
    from sklearn.cluster import MiniBatchKMeans

    if frames.ndim != 2 or len(frames) < n_clusters:
        raise ValueError(f"frames must be (n >= n_clusters, n_mels), got {frames.shape}")
    kmeans = MiniBatchKMeans(n_clusters=n_clusters, batch_size=batch_size, random_state=seed,
                             n_init=3, max_iter=100, compute_labels=False)
    return kmeans.fit(frames)


def save_centroids(centroids: torch.Tensor, path: str | Path) -> Path:
    """(codebook_size, n_mels) centroids as safetensors, written atomically."""
    from safetensors.torch import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as file:
        file.write(save({"centroids": centroids.float().contiguous()}))
    return path


def load_centroids(path: str | Path) -> torch.Tensor:
    """Centroids written by `save_centroids` (safetensors: no code runs); names the file in errors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no such centroids file: {path}")
    try:
        centroids = load_file(str(path)).get("centroids")
    except SafetensorError as error:
        raise ValueError(f"{path}: not a safetensors file ({error})") from None
    if centroids is None or centroids.dim() != 2 or not centroids.is_floating_point():
        raise ValueError(f"{path}: needs a float tensor 'centroids' of shape (codebook_size, n_mels)")
    return centroids.float()


def save_kmeans(kmeans, path: str | Path) -> Path:
    """Save in the format audiolm's HubertWithKmeans loads (joblib of the sklearn estimator)."""
    import joblib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    joblib.dump(kmeans, path)
    return path
