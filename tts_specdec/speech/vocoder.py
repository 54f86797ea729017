"""Units -> waveform without a neural vocoder: centroid log-mel -> InverseMelScale -> Griffin-Lim."""

from __future__ import annotations

import torch
import torchaudio.transforms as T

from .features import MelConfig


class CentroidVocoder(torch.nn.Module):
    """unit ids (frames,) or (batch, frames) -> waveform (samples,) or (batch, samples).

    Output length is (frames - 1) * hop_length, the inverse of the centred STFT in `LogMel`.
    """

    def __init__(self, centroids: torch.Tensor, mel_config: MelConfig = MelConfig(), n_iter: int = 32):
        super().__init__()
        if centroids.dim() != 2 or centroids.shape[1] != mel_config.n_mels:
            raise ValueError(f"centroids must be (codebook_size, {mel_config.n_mels}), got {tuple(centroids.shape)}")
        self.config = mel_config
        self.register_buffer("centroids", centroids.float())
        n_stft = mel_config.n_fft // 2 + 1
        self.inverse_mel = T.InverseMelScale(n_stft=n_stft, n_mels=mel_config.n_mels,
                                             sample_rate=mel_config.sample_rate,
                                             f_min=mel_config.f_min, f_max=mel_config.f_max)
        self.griffin_lim = T.GriffinLim(n_fft=mel_config.n_fft, hop_length=mel_config.hop_length,
                                        power=2.0, n_iter=n_iter)

    @property
    def codebook_size(self) -> int:
        return self.centroids.shape[0]

    def units_to_mel(self, units: torch.Tensor) -> torch.Tensor:
        """(…, frames) unit ids -> (…, frames, n_mels) centroid log-mel."""
        if units.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"units must be an integer tensor, got {units.dtype}")
        if units.numel() and (units.min() < 0 or units.max() >= self.codebook_size):
            raise ValueError(f"units must lie in [0, {self.codebook_size}), got range "
                             f"[{int(units.min())}, {int(units.max())}]")
        return self.centroids[units]

    @torch.no_grad()
    def mel_to_wav(self, log_mel: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(…, frames, n_mels) log-mel -> (…, samples) waveform."""
        if log_mel.shape[-2] < 2:
            raise ValueError(f"need at least 2 frames to vocode, got {log_mel.shape[-2]}")
        mel_power = log_mel.exp().transpose(-1, -2)
        spec = self.inverse_mel(mel_power).clamp(min=0)
        # Griffin-Lim starts from random phase; a fixed seed makes every render reproducible
        with torch.random.fork_rng():
            torch.manual_seed(0 if generator is None else int(generator.initial_seed()))
            return self.griffin_lim(spec)

    def forward(self, units: torch.Tensor) -> torch.Tensor:
        return self.mel_to_wav(self.units_to_mel(units))
