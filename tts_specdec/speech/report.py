"""samples/README.md and the spectrogram comparison figure."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .evaluation import ModeResult
from .features import LogMel
from .quality import DURATION_RANGE, QualityReport


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _quality_cells(q: Optional[QualityReport]) -> list[str]:
    if q is None:
        return ["–", "–", "–"]
    return [_pct(q.content_id_accuracy), _pct(q.duration_pass_rate), f"{q.median_duration_ratio:.2f}"]


def markdown_table(results: list[ModeResult], ceiling: Optional[QualityReport],
                   identical: dict[str, bool]) -> str:
    lo, hi = DURATION_RANGE
    header = ("| mode | tokens/s | real-time factor | tokens per target pass | accepted drafts per pass "
              f"| content-ID accuracy | duration ratio in [{lo}, {hi}] | median duration ratio | same units as |\n"
              "|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in results:
        accepted = "–" if r.accepted_per_pass is None else f"{r.accepted_per_pass:.2f}"
        same = identical.get(r.mode, "")
        same = "" if same == "" else same
        rows.append("| " + " | ".join([f"`{r.mode}`", f"{r.tokens_per_second:.0f}", f"{r.real_time_factor:.3f}",
                                       f"{r.tokens_per_target_pass:.2f}", accepted, *_quality_cells(r.quality),
                                       str(same)]) + " |")
    if ceiling is not None:
        rows.append("| reference units through the vocoder (ceiling) | – | – | – | – | "
                    + " | ".join(_quality_cells(ceiling)) + " | |")
    return header + "\n".join(rows) + "\n"


def spectrogram_figure(path: str | Path, title: str, wavs: dict[str, torch.Tensor]) -> Path:
    """One log-mel panel per wav (same sentence), stacked, on a shared colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_mel = LogMel()
    mels = {name: log_mel(w).T.numpy() for name, w in wavs.items()}
    vmin = min(m.min() for m in mels.values())
    vmax = max(m.max() for m in mels.values())
    fig, axes = plt.subplots(len(mels), 1, figsize=(8, 1.6 * len(mels)), sharex=True, squeeze=False)
    for ax, (name, mel) in zip(axes[:, 0], mels.items()):
        ax.imshow(mel, origin="lower", aspect="auto", vmin=vmin, vmax=vmax, cmap="magma")
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("frame (20 ms)")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
