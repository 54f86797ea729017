"""Run a decoding mode over many sentences and gather speed and quality figures for the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm import tqdm

from .pipeline import MODES, Mode, SpeechModel, Synthesis, synthesize
from .quality import QualityReport, evaluate_wavs


@dataclass
class ModeResult:
    mode: str
    utterances: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    vocode_seconds: float = 0.0
    audio_seconds: float = 0.0
    target_passes: int = 0
    row_cycles: int = 0          # speculative sampling: (row, cycle) pairs that judged drafts
    accepted: int = 0            # speculative sampling: accepted drafts
    committed_steps: int = 0     # beam modes: beam steps committed
    quality: Optional[QualityReport] = None
    syntheses: list[Synthesis] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def real_time_factor(self) -> float:
        """(decode + vocode seconds) / audio seconds; below 1 is faster than real time."""
        return (self.decode_seconds + self.vocode_seconds) / self.audio_seconds if self.audio_seconds else float("nan")

    @property
    def accepted_per_pass(self) -> Optional[float]:
        """Speculative sampling: mean drafts accepted per target pass (excludes the bonus token)."""
        return self.accepted / self.row_cycles if self.row_cycles else None

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens (sampling) or beam steps (beam search) committed per target pass."""
        if self.row_cycles:
            return (self.accepted + self.row_cycles) / self.row_cycles
        return self.committed_steps / self.target_passes if self.target_passes else 1.0

    def add(self, synthesis: Synthesis) -> None:
        stats = synthesis.stats
        self.utterances += len(synthesis.texts)
        self.generated_tokens += stats.generated_tokens
        self.decode_seconds += synthesis.decode_seconds
        self.vocode_seconds += synthesis.vocode_seconds
        self.audio_seconds += synthesis.audio_seconds
        self.target_passes += stats.target_passes
        self.row_cycles += sum(stats.accepted_hist)
        self.accepted += stats.accepted
        self.committed_steps += sum(k * n for k, n in enumerate(stats.committed_hist)) or stats.steps
        self.syntheses.append(synthesis)

    @property
    def wavs(self) -> list[torch.Tensor]:
        return [w for s in self.syntheses for w in s.wavs]


def run_mode(speech: SpeechModel, texts: list[str], mode: Mode | str, *, batch_size: int = 1,
             references: Optional[list[torch.Tensor]] = None, seed: int = 0,
             cond_scale: float = 1.0) -> ModeResult:
    """Synthesise `texts` in batches with one mode; with references, also the quality figures."""
    mode = MODES[mode] if isinstance(mode, str) else mode
    result = ModeResult(mode.name)
    for start in tqdm(range(0, len(texts), batch_size), desc=mode.name, unit="batch", leave=False):
        result.add(synthesize(speech, texts[start:start + batch_size], mode, seed=seed + start,
                                   cond_scale=cond_scale))
    if references is not None:
        result.quality = evaluate_wavs(result.wavs, references)
    return result


def vocoder_ceiling(speech: SpeechModel, references: list[torch.Tensor]) -> QualityReport:
    """The same figures for reference units put through the vocoder: the best the pipeline can do."""
    resynth = [speech.vocoder(speech.units(w)) for w in references]
    return evaluate_wavs(resynth, references)
