"""Quality figures against espeak-ng references: content-ID accuracy by DTW, and duration ratios.

Content-ID: an utterance counts as correct when, among all references, the one with the smallest
length-normalised DTW distance on log-mel frames is its own sentence. Frames are mean-normalised per
utterance and mel band first, so a level difference between vocoder and espeak does not dominate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .features import LogMel

DURATION_RANGE = (0.8, 1.25)


def _pad(frames: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(f) for f in frames)
    padded = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, longest - len(f))) for f in frames])
    return padded, torch.tensor([len(f) for f in frames])


def dtw_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Length-normalised DTW distances between every a[i] (n_i, d) and every b[j] (m_j, d).

    Returns (len(a), len(b)): the cumulative Euclidean frame cost along the best monotone path,
    divided by n_i + m_j. All pairs run at once, padded; padding lies after every real cell, so it
    never feeds a cell that is read.
    """
    if not a or not b:
        raise ValueError("a and b must be non-empty lists of (frames, dim) tensors")
    a_pad, a_len = _pad(a)
    b_pad, b_len = _pad(b)
    cost = torch.cdist(a_pad[:, None], b_pad[None])  # (A, B, n, m)
    n, m = cost.shape[-2:]
    inf = torch.tensor(float("inf"))
    # D[r, c] = cost[r, c] + min(D[r-1, c], D[r-1, c-1], D[r, c-1]); column 0 of each row is the
    # boundary (inf, except D[-1, -1] = 0)
    prev = torch.full((len(a), len(b), m + 1), float("inf"))
    prev[..., 0] = 0.0
    end = torch.empty(len(a), len(b))
    for r in range(n):
        above = torch.minimum(prev[..., 1:], prev[..., :-1])
        row = [inf.expand(len(a), len(b))]
        for c in range(m):
            row.append(cost[:, :, r, c] + torch.minimum(above[..., c], row[-1]))
        prev = torch.stack(row, dim=-1)
        done = a_len - 1 == r  # the a-utterances whose last frame is row r
        end[done] = prev[done][:, torch.arange(len(b)), b_len]
    return end / (a_len[:, None] + b_len[None, :])


@dataclass
class QualityReport:
    n: int
    content_id_accuracy: float
    duration_ratios: list[float]
    correct: list[bool]

    @property
    def duration_pass_rate(self) -> float:
        lo, hi = DURATION_RANGE
        return sum(lo <= r <= hi for r in self.duration_ratios) / max(1, self.n)

    @property
    def median_duration_ratio(self) -> float:
        return float(torch.tensor(self.duration_ratios).median()) if self.duration_ratios else float("nan")


def normalised_log_mel(wav: torch.Tensor, log_mel: LogMel) -> torch.Tensor:
    mel = log_mel(wav)
    return mel - mel.mean(dim=0, keepdim=True)


def evaluate_wavs(generated: list[torch.Tensor], references: list[torch.Tensor]) -> QualityReport:
    """generated[i] and references[i] are waveforms (16 kHz) of the same sentence."""
    if len(generated) != len(references) or not generated:
        raise ValueError(f"generated and references must be equally long and non-empty, got "
                         f"{len(generated)} and {len(references)}")
    log_mel = LogMel()
    gen = [normalised_log_mel(w, log_mel) for w in generated]
    ref = [normalised_log_mel(w, log_mel) for w in references]
    distances = dtw_distance(gen, ref)
    correct = (distances.argmin(dim=1) == torch.arange(len(gen))).tolist()
    ratios = [g.numel() / max(1, r.numel()) for g, r in zip(generated, references)]
    return QualityReport(len(gen), sum(correct) / len(gen), ratios, correct)
