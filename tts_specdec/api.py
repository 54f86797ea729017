"""`SpeculativeDecoder`: the public entry point wrapping a user's `TextToSemantic`."""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor

from ._upstream import TextToSemantic
from .beam import beam_search_loop
from .decoder import Decoder
from .inputs import check_common, check_draft_cond_scale, check_float, check_gamma, check_int, eval_mode, prepare_source, walk
from .results import Decoded, DecodeStats
from .sampling import SamplingConfig
from .speculative import sample_loop


class SpeculativeDecoder:
    """Fast exact decoding for a `TextToSemantic`: target = full decoder, draft = its early-exit head."""

    def __init__(self, model: TextToSemantic, *, source_type: str = "text", target_type: str = "speech") -> None:
        for name, value in (("source_type", source_type), ("target_type", target_type)):
            if value not in ("text", "speech"):
                raise ValueError(f"{name} must be 'text' or 'speech', got {value!r}")
        self.decoder = Decoder(model, source_type, target_type)

    @property
    def model(self) -> TextToSemantic:
        return self.decoder.model

    def sample(
        self,
        source: Tensor | Sequence[str],
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        cond_scale: float = 1.0,
        max_length: int = 2048,
        generator: torch.Generator | None = None,
        gamma: int = 0,
        draft_confidence: float | None = None,
        draft_cond_scale: float | None = None,
    ) -> Decoded:
        """Sample (temperature 0: greedy). gamma > 0 drafts with the early-exit head, losslessly; it pays
        where verifying gamma + 1 tokens costs about one step (GPUs: 1.9-2.0x at gamma 4 on an H100,
        shipped model): on CPUs with this package's kernels plain sampling runs many steps per call and
        was as fast or faster (README).

        draft_confidence: with gamma > 0, a row stops drafting early, after a drafted token the
        draft gave less than this probability (gamma is then the most drafts per cycle).
        draft_cond_scale: with gamma > 0 and cond_scale > 1, the guidance scale of the draft's logits
        (default: cond_scale). Any draft keeps sampling exact; a weak draft often agrees better with
        the guided target when mixed more gently (README: shipped model, cond_scale 3).
        """
        max_length, cond_scale = check_common(self.model, max_length=max_length, cond_scale=cond_scale)
        gamma = check_gamma(gamma, self.decoder.exit_layer)
        if draft_confidence is not None:
            draft_confidence = check_float("draft_confidence", draft_confidence)
            if not 0 < draft_confidence <= 1:
                raise ValueError(f"draft_confidence must be in (0, 1], got {draft_confidence}")
            if not gamma:
                raise ValueError("draft_confidence needs gamma > 0 (it ends drafts early)")
        draft_cond_scale = check_draft_cond_scale(draft_cond_scale, cond_scale, gamma)
        temperature = check_float("temperature", temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None:
            top_k = check_int("top_k", top_k, 1)
        if top_p is not None:
            top_p = check_float("top_p", top_p)
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        cfg = SamplingConfig(temperature, top_k, top_p)
        stats, modules = self._begin("speculative" if gamma else "plain", gamma)
        stats.draft_confidence = draft_confidence
        with eval_mode(self.model, modules):
            source = prepare_source(self.model, source, self.decoder.source_type)
            start = time.perf_counter()
            tokens = sample_loop(
                self.decoder, source, cfg, gamma=gamma, cond_scale=cond_scale,
                max_length=max_length, generator=generator, stats=stats, draft_confidence=draft_confidence,
                draft_cond_scale=draft_cond_scale,
            )
            stats.wall_time = time.perf_counter() - start
        stats.layer_evals = list(self.decoder.layer_evals)
        return Decoded(tokens, None, stats)

    def beam_search(
        self,
        source: Tensor | Sequence[str],
        *,
        beam_size: int = 4,
        length_penalty: float = 1.0,
        max_length: int = 2048,
        cond_scale: float = 1.0,
        gamma: int = 0,
        draft_width: int | None = None,
    ) -> Decoded:
        """Exact beam search over target log-probs. gamma > 0 drafts steps with the early-exit head and
        verifies them in tree passes, with the same result. It was slower than gamma = 0 wherever
        measured: 0.2-0.5x on CPUs with this package's kernels, 0.75-0.82x on an H100, where its per-step
        bookkeeping in Python costs more than the passes it saves (README)."""
        max_length, cond_scale = check_common(self.model, max_length=max_length, cond_scale=cond_scale)
        beam_size = check_int("beam_size", beam_size, 1)
        length_penalty = check_float("length_penalty", length_penalty)
        gamma = check_gamma(gamma, self.decoder.exit_layer)
        if draft_width is not None:
            draft_width = check_int("draft_width", draft_width, beam_size)
        stats, modules = self._begin("speculative-beam" if gamma else "beam", gamma)
        with eval_mode(self.model, modules):
            source = prepare_source(self.model, source, self.decoder.source_type)
            start = time.perf_counter()
            if gamma:
                from .spec_beam import spec_beam_search_loop

                tokens, scores = spec_beam_search_loop(
                    self.decoder, source, beam_size=beam_size, length_penalty=length_penalty,
                    max_length=max_length, cond_scale=cond_scale, gamma=gamma,
                    draft_width=draft_width or beam_size, stats=stats,
                )
            else:
                tokens, scores, steps = beam_search_loop(
                    self.decoder, source, beam_size=beam_size, length_penalty=length_penalty,
                    max_length=max_length, cond_scale=cond_scale,
                )
                stats.steps = stats.target_passes = steps
            stats.wall_time = time.perf_counter() - start
        eos = self.decoder.eos_id
        tokens = [t[:-1] if eos is not None and t.numel() and int(t[-1]) == eos else t for t in tokens]
        stats.generated_tokens = sum(t.numel() for t in tokens)
        stats.layer_evals = list(self.decoder.layer_evals)
        return Decoded(tokens, scores, stats)

    def _begin(self, mode: str, gamma: int) -> tuple[DecodeStats, list[torch.nn.Module]]:
        """Start a decode call: the decoder's weights checked against the model's (one walk of the model
        gives its parameters for that and its modules for `eval_mode`), fresh stats."""
        modules, params = walk(self.model)
        self.decoder.begin(params)
        self.decoder.layer_evals = [0] * self.decoder.depth
        return DecodeStats(mode=mode, gamma=gamma, exit_layer=self.decoder.exit_layer if gamma else None), modules
