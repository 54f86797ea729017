"""Result and statistics dataclasses shared by every decoding mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class DecodeStats:
    """Counters of one decode call. A 'target pass' runs the layers above the exit (or all layers)."""

    mode: str = ""
    steps: int = 0  # plain: decoding steps; speculative: cycles
    beam_steps: int = 0  # beam search: steps of the search's longest item (plain or speculative)
    target_passes: int = 0
    draft_passes: int = 0
    generated_tokens: int = 0
    wall_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    gamma: int = 0  # gamma="auto": the speculative gamma most cycles used (0: it decoded plainly)
    auto: bool = False  # gamma was chosen by gamma="auto" (tts_specdec.auto)
    gamma_hist: list[int] = field(default_factory=list)  # [g] = cycles at gamma g (plain: [0] = steps)
    draft_confidence: float | None = None  # speculative sampling: drafting stops below this q(x)
    exit_layer: int | None = None
    layer_evals: list[int] = field(default_factory=list)  # token-layer evaluations per decoder layer
    # speculative sampling, counted per row and cycle
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # row-cycles that stopped at a rejected draft
    accepted_hist: list[int] = field(default_factory=list)  # [k] = row-cycles that kept k drafts
    # speculative beam search: beam steps committed per target pass
    committed_hist: list[int] = field(default_factory=list)  # [k] = cycles that committed k steps

    @classmethod
    def total(cls, parts: list["DecodeStats"]) -> "DecodeStats":
        """The counters of several decode calls with the same settings, summed (histograms too)."""
        if not parts:
            raise ValueError("parts must hold at least one DecodeStats")
        out = cls(mode=parts[0].mode, gamma=parts[0].gamma, auto=parts[0].auto,
                  draft_confidence=parts[0].draft_confidence, exit_layer=parts[0].exit_layer)
        for name in ("steps", "target_passes", "draft_passes", "generated_tokens", "wall_time", "draft_time",
                     "verify_time", "drafted", "accepted", "rejections"):
            setattr(out, name, sum(getattr(p, name) for p in parts))
        for name in ("layer_evals", "accepted_hist", "committed_hist", "gamma_hist"):
            lists = [getattr(p, name) for p in parts if getattr(p, name)]
            width = max((len(x) for x in lists), default=0)
            setattr(out, name, [sum(x[i] for x in lists if i < len(x)) for i in range(width)])
        if out.auto:  # calls may have picked different gammas: describe the sum
            out.gamma = most_used_gamma(out.gamma_hist)
            out.exit_layer = next((p.exit_layer for p in parts if p.exit_layer is not None), None)
            out.draft_confidence = next((p.draft_confidence for p in parts if p.draft_confidence is not None), None)
        return out

    @property
    def cycles(self) -> int:
        return self.steps

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Sampling: mean tokens a row emits per target pass (accepted drafts + 1)."""
        row_cycles = sum(self.accepted_hist)
        if row_cycles:
            return (self.accepted + row_cycles) / row_cycles
        if self.committed_hist:
            return self.steps_per_target_pass
        return 1.0

    @property
    def accepted_per_pass(self) -> float:
        """Mean drafts accepted per row and target pass (excludes the correction/bonus token)."""
        row_cycles = sum(self.accepted_hist)
        return self.accepted / row_cycles if row_cycles else 0.0

    @property
    def steps_per_target_pass(self) -> float:
        """Beam search: mean beam steps committed per target pass."""
        if not self.committed_hist:
            return 1.0
        total = sum(k * n for k, n in enumerate(self.committed_hist))
        return total / sum(self.committed_hist)

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance rate: accepted drafts over drafts that were judged.

        A cycle judges drafts until its first rejection, so the judged count is accepted + rejections
        (the maximum-likelihood estimate under the i.i.d. acceptance model of Leviathan et al.).
        """
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else 0.0

    @property
    def trunk_evals(self) -> int:
        """Token-layer evaluations of layers 1..E (shared by draft and target)."""
        return sum(self.layer_evals[: self.exit_layer or 0])

    @property
    def upper_evals(self) -> int:
        """Token-layer evaluations of layers E+1..L."""
        return sum(self.layer_evals[self.exit_layer or 0 :])


def most_used_gamma(gamma_hist: list[int]) -> int:
    """The speculative gamma (> 0) of the most cycles in a gamma histogram; 0 when none drafted."""
    used = [(n, g) for g, n in enumerate(gamma_hist) if g and n]
    return max(used)[1] if used else 0


@dataclass
class Decoded:
    """Output of a decode: one token sequence per source row, EOS and padding stripped."""

    tokens: list[Tensor]
    scores: list[float] | None
    stats: DecodeStats
