"""Log-mel features: 16 kHz audio, hop 320 -> 50 frames per second, 80 mel bands.

The same transform feeds k-means (units), the vocoder's inverse, and the DTW quality metric, so all
three live on one scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torchaudio.transforms as T

from .audio import SAMPLE_RATE


@dataclass(frozen=True)
class MelConfig:
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 1024
    hop_length: int = 320
    n_mels: int = 80
    f_min: float = 0.0
    f_max: float = 8000.0
    log_floor: float = 1e-5

    @property
    def frames_per_second(self) -> float:
        return self.sample_rate / self.hop_length

    def to_dict(self) -> dict:
        return asdict(self)


class LogMel(torch.nn.Module):
    """waveform (..., samples) -> log power mel (..., frames, n_mels)."""

    def __init__(self, config: MelConfig = MelConfig()):
        super().__init__()
        self.config = config
        self.mel = T.MelSpectrogram(sample_rate=config.sample_rate, n_fft=config.n_fft,
                                    hop_length=config.hop_length, n_mels=config.n_mels,
                                    f_min=config.f_min, f_max=config.f_max, power=2.0)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.dim() not in (1, 2):
            raise ValueError(f"wav must be (samples,) or (batch, samples), got {tuple(wav.shape)}")
        if wav.shape[-1] == 0:
            raise ValueError("wav must not be empty")
        mel = self.mel(wav.float())
        return mel.clamp(min=self.config.log_floor).log().transpose(-1, -2)
