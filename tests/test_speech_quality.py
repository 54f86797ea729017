"""DTW distance and the content-ID / duration figures."""

import numpy as np
import pytest
import torch

from tts_specdec.speech.quality import dtw_distance, evaluate_wavs


def naive_dtw(x: torch.Tensor, y: torch.Tensor) -> float:
    cost = torch.cdist(x, y).double().numpy()
    n, m = cost.shape
    table = np.full((n + 1, m + 1), np.inf)
    table[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i, j] = cost[i - 1, j - 1] + min(table[i - 1, j], table[i - 1, j - 1], table[i, j - 1])
    return table[n, m] / (n + m)


def test_dtw_matches_the_textbook_recursion():
    torch.manual_seed(0)
    a = [torch.randn(n, 5) for n in (1, 4, 7)]
    b = [torch.randn(m, 5) for m in (3, 1, 6, 2)]
    expected = torch.tensor([[naive_dtw(x, y) for y in b] for x in a], dtype=torch.float32)
    assert torch.allclose(dtw_distance(a, b), expected, atol=1e-5)


def test_dtw_is_zero_for_a_time_stretched_copy():
    x = torch.randn(5, 3)
    assert dtw_distance([x], [x.repeat_interleave(2, dim=0)])[0, 0] == 0


def test_evaluate_identifies_sentences_and_durations():
    torch.manual_seed(0)
    sr = 16_000
    refs = [torch.sin(2 * torch.pi * f * torch.arange(sr // 2) / sr) * 0.3 for f in (200, 700, 2500)]
    generated = [refs[0], refs[1][: sr // 4], refs[2]]
    report = evaluate_wavs(generated, refs)
    assert report.content_id_accuracy == 1.0 and report.correct == [True, True, True]
    assert report.duration_ratios == [1.0, 0.5, 1.0]
    assert report.duration_pass_rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="generated"):
        evaluate_wavs(generated, refs[:2])
