"""`SpeculativeDecoder`: the public entry point wrapping a user's `TextToSemantic`."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._upstream import TextToSemantic
from . import beam, speculative
from .auto import AUTO, MAX_GAMMA, CostModel, SamplingPolicy
from .beam import SEMANTICS, BeamSemantics, beam_search_loop
from .decoder import Decoder
from .inputs import (
    check_beam_size, check_common, check_compile, check_draft_cond_scale, check_draft_width, check_float, check_gamma,
    check_int, check_length_penalty, check_memory, default_draft_width, eval_mode, prepare_source, useful_gamma, walk,
)
from .measure import BEAM_GAMMAS, Costs
from .results import Decoded, DecodeStats, most_used_gamma
from .sampling import SamplingConfig
from .speculative import sample_loop


class SpeculativeDecoder:
    """Fast exact decoding for a `TextToSemantic`: target = full decoder, draft = its early-exit head."""

    def __init__(
        self, model: TextToSemantic, *, source_type: str = "text", target_type: str = "speech",
        compile: bool | str = False,
    ) -> None:
        """compile: decode on static-shape steps compiled with `torch.compile(fullgraph=True)` (CUDA graphs
        on a GPU: mode "reduce-overhead"); True uses inductor, a string names another torch.compile
        backend ("aot_eager", ...). Same tokens as the default path for greedy decoding; sampling keeps its
        law. For GPUs: on a CPU the C++ kernels of the default path are faster."""
        for name, value in (("source_type", source_type), ("target_type", target_type)):
            if value not in ("text", "speech"):
                raise ValueError(f"{name} must be 'text' or 'speech', got {value!r}")
        self.decoder = Decoder(model, source_type, target_type, check_compile(compile))
        self.costs = Costs()  # gamma="auto": this decoder's measured costs, kept across calls

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
        gamma: int | str | None = None,
        draft_confidence: float | None = None,
        draft_cond_scale: float | None = None,
        source_mask: Tensor | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Decoded:
        """Sample (temperature 0: greedy), exactly from the target's distribution whatever the gamma.

        gamma: tokens the early-exit head drafts per cycle for the target to verify in one pass (0: plain
        decoding), or "auto": each cycle's gamma (0 included) and draft stops are chosen from a cost model
        of this machine (draft steps and verify passes timed once per parameters, dtype, device and thread
        count, kept by this object; `cost_model`) and the acceptance observed while decoding, and corrected
        by timing its own runs: plain steps, speculative cycles and (on the CPU) cycles with draft stops,
        per number of running rows (classes 1, 2, 3-4, 5-8, ...), kept by this object across calls, the
        fastest decoding almost all the time. Speculation pays where verifying gamma + 1 tokens costs about one plain step.
        Default (None): "auto" for greedy decoding (temperature 0), whose tokens are the same at every
        gamma; 0 when sampling (temperature > 0), where the tokens follow the same law at every gamma but
        a seeded run's tokens depend on the gammas used: pass gamma="auto" to opt in (its choices follow
        the clock, so a fixed generator does not reproduce a run). A model without an early-exit head
        decodes plainly under "auto"; an int gamma > 0 needs one. An int gamma is at most 256
        (`inputs.MAX_FIXED_GAMMA`); greedy decoding lowers one past max_length - 1 to that (the same tokens:
        stats.gamma is the gamma used). Sizes past what the device's memory holds are refused before
        anything is allocated (docs/arguments.md).

        draft_confidence: with gamma > 0, a row stops drafting early, after a drafted token the
        draft gave less than this probability (gamma is then the most drafts per cycle); with "auto", the
        threshold of the draft stops auto always uses when it drafts (default: auto decides).
        draft_cond_scale: with gamma > 0 or "auto" and cond_scale > 1, the guidance scale of the draft's
        logits (default: cond_scale). Any draft keeps sampling exact; a weak draft often agrees better
        with the guided target when mixed more gently.
        source_mask: spear-tts's source mask over the source with its EOS set (default: source != pad).
        Given, it says which tokens are real: then empty texts, rows of padding and left padding are
        taken as spear-tts takes them (without it they are refused as likely mistakes).
        progress: called with the longest row's length as decoding advances (e.g. to draw a bar).
        stats: `gamma_hist` counts the cycles at each gamma; under "auto" `gamma` is the speculative gamma
        of most cycles (0: decoded plainly) and `draft_confidence` the draft stops it used, if any.
        """
        max_length, cond_scale = check_common(self.model, max_length=max_length, cond_scale=cond_scale, progress=progress)
        temperature = check_float("temperature", temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if gamma is None:  # auto where it cannot change the tokens (see above)
            gamma = AUTO if temperature == 0 else 0
        gamma = check_gamma(gamma, self.decoder.exit_layer)
        auto = gamma == AUTO
        if auto and self.decoder.exit_layer is None:  # nothing to draft with: plain decoding
            gamma = 0
        elif not auto and temperature == 0:  # greedy: the same tokens at every gamma
            gamma = useful_gamma(gamma, max_length)
        if draft_confidence is not None:
            draft_confidence = check_float("draft_confidence", draft_confidence)
            if not 0 < draft_confidence <= 1:
                raise ValueError(f"draft_confidence must be in (0, 1], got {draft_confidence}")
            if not gamma:
                raise ValueError("draft_confidence needs gamma > 0 or 'auto' and an early-exit head (it ends drafts)")
        draft_cond_scale = check_draft_cond_scale(draft_cond_scale, cond_scale, None if gamma == AUTO else gamma)
        if top_k is not None:
            top_k = check_int("top_k", top_k, 1)
        if top_p is not None:
            top_p = check_float("top_p", top_p)
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        cfg = SamplingConfig(temperature, top_k, top_p)
        stats, modules = self._begin()
        with eval_mode(self.model, modules):
            source = prepare_source(self.model, source, self.decoder.source_type, strict=source_mask is None)
            drafts = MAX_GAMMA if gamma == AUTO else gamma  # auto drafts at most MAX_GAMMA a cycle
            rows = source.shape[0] * (2 if cond_scale > 1 else 1)
            check_memory(self.decoder, {"KV cache": self.decoder.cache_bytes(
                rows, speculative.cache_positions(max_length, drafts))},
                _sizes(source, cond_scale, gamma=gamma, max_length=max_length))
            policy = None
            if gamma == AUTO:
                arms = self.costs.arms(self.decoder, temperature > 0, cond_scale > 1)
                policy = SamplingPolicy(self.costs.sampling(self.decoder), arms, draft_confidence)
                if not policy.pays:  # speculation cannot win here: plain decoding, no per-cycle choices
                    policy, gamma = None, 0
            start = time.perf_counter()
            tokens = sample_loop(
                self.decoder, source, cfg, gamma=policy.max_gamma if policy else gamma, cond_scale=cond_scale,
                max_length=max_length, generator=generator, stats=stats,
                draft_confidence=None if auto else draft_confidence, draft_cond_scale=draft_cond_scale, auto=policy,
                source_mask=source_mask, progress=progress,
            )
            stats.wall_time = time.perf_counter() - start
        if auto:
            self._label(stats, "auto", most_used_gamma(stats.gamma_hist), policy.used_confidence if policy else None)
        else:
            self._label(stats, "speculative" if gamma else "plain", gamma, draft_confidence)
        stats.auto = auto
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
        gamma: int | str = AUTO,
        draft_width: int | None = None,
        beam_semantics: BeamSemantics = "standard",
        temperature: float = 1.0,
        source_mask: Tensor | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Decoded:
        """Exact beam search over target log-probs.

        beam_semantics: "standard" (module `beam`: K finished hypotheses, length_penalty) or "upstream",
        spear-tts's own search (summed log-probs, no length normalisation, beams expand past EOS, all
        items stop together when every beam holds an EOS); `length_penalty` does not apply to it.
        temperature: the log-probs are log_softmax(logits / temperature) (0: divided by 1e-10, as spear-tts).
        source_mask: spear-tts's source mask over the source with its EOS set, as in `sample`.
        progress: called with the beams' length as the search advances, as in `sample`.

        gamma: draft levels per cycle (0: plain beam search): gamma > 0 drafts steps with the early-exit
        head (draft_width W >= beam_size candidates per level, default beam_size + ceil(beam_size / 4):
        `inputs.default_draft_width`) and verifies them in
        tree passes, with the same result; "auto" (the default, since the result is the same at every
        gamma) chooses per call between plain and speculative beam search (W: draft_width, the same
        default) by timing its own calls, per batch size class, kept by this object; short plain and
        speculative beam searches timed once per parameters, dtype, device, thread count, beam size and
        width seed the choice. A model without an early-exit head runs plain beam search under "auto".

        Sizes (docs/arguments.md): beam_size in [1, 1024] (upstream semantics: at most the vocabulary too);
        an int gamma in [0, 256], lowered to max_length - 1 past it; draft_width >= beam_size, lowered to
        beam_size x vocabulary past it (both: the same search). A call whose KV cache and draft tree would
        not fit in the device's memory is refused before anything is allocated.
        """
        max_length, cond_scale = check_common(self.model, max_length=max_length, cond_scale=cond_scale, progress=progress)
        if beam_semantics not in SEMANTICS:
            raise ValueError(f"beam_semantics must be one of {SEMANTICS}, got {beam_semantics!r}")
        vocab = self.decoder.vocab_size
        beam_size = check_beam_size(beam_size, vocab, beam_semantics == "upstream")
        length_penalty = check_length_penalty(length_penalty)
        temperature = check_float("temperature", temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        gamma = check_gamma(gamma, self.decoder.exit_layer)
        auto = gamma == AUTO
        has_draft = self.decoder.exit_layer is not None
        if not auto:  # no level is drafted past max_length: the same search
            gamma = useful_gamma(gamma, max_length)
        width = check_draft_width(default_draft_width(beam_size) if draft_width is None else draft_width, beam_size,
                                  vocab)
        stats, modules = self._begin()
        with eval_mode(self.model, modules):
            source = prepare_source(self.model, source, self.decoder.source_type, strict=source_mask is None)
            most = gamma  # the most levels a cycle drafts: auto's (its timed probes too) are BEAM_GAMMAS
            if auto:
                most = useful_gamma(max(BEAM_GAMMAS), max_length) if has_draft else 0
            check_memory(self.decoder, self._beam_plan(source.shape[0], beam_size, cond_scale > 1, most, width,
                                                       max_length),
                         _sizes(source, cond_scale, beam_size=beam_size, gamma=gamma,
                                draft_width=width if most else None, max_length=max_length))
            policy = None
            if auto and has_draft:
                policy = self.costs.beam_policy(self.decoder, source.shape[0], beam_size, width, cond_scale > 1)
                gamma = policy.gamma()
            elif auto:
                gamma = 0
            start = time.perf_counter()
            same = dict(semantics=beam_semantics, temperature=temperature, source_mask=source_mask, progress=progress)
            if gamma:
                from .spec_beam import spec_beam_search_loop

                tokens, scores, stats.beam_steps = spec_beam_search_loop(
                    self.decoder, source, beam_size=beam_size, length_penalty=length_penalty,
                    max_length=max_length, cond_scale=cond_scale, gamma=gamma, draft_width=width, stats=stats,
                    **same,
                )
            else:
                tokens, scores, steps = beam_search_loop(
                    self.decoder, source, beam_size=beam_size, length_penalty=length_penalty,
                    max_length=max_length, cond_scale=cond_scale, **same,
                )
                stats.steps = stats.target_passes = stats.beam_steps = steps
            stats.wall_time = time.perf_counter() - start
        if policy is not None:  # what this call took and committed informs the next auto call
            policy.done(stats.beam_steps)
            if gamma:
                self.costs.observe_beam(gamma, stats.committed_hist)
        mode = "auto-beam" if auto else "speculative-beam" if gamma else "beam"
        self._label(stats, mode, gamma, None)
        stats.auto = auto
        stats.gamma_hist = [0] * gamma + [stats.steps]
        eos = self.decoder.eos_id
        tokens = [t[:-1] if eos is not None and t.numel() and int(t[-1]) == eos else t for t in tokens]
        stats.generated_tokens = sum(t.numel() for t in tokens)
        stats.layer_evals = list(self.decoder.layer_evals)
        return Decoded(tokens, scores, stats)

    def _beam_plan(self, batch: int, beam_size: int, guided: bool, gamma: int, width: int,
                   max_length: int) -> dict[str, int]:
        """What a beam search allocates up front (bytes by name): its KV cache and, speculative, the draft tree."""
        roots = batch * beam_size
        rows = roots * (2 if guided else 1)
        if not gamma:
            return {"KV cache": self.decoder.cache_bytes(rows, beam.cache_positions(max_length))}
        from .spec_beam import cache_positions, tree_bytes

        positions = cache_positions(max_length, gamma, width)
        return {"KV cache": self.decoder.cache_bytes(rows, positions),
                "draft tree": tree_bytes(self.decoder, roots, guided, gamma, width, positions)}

    def cost_model(self) -> CostModel | None:
        """The cost model gamma="auto" decides speculative sampling with, for the model's parameters,
        dtype, device and the thread count as they are now (measured on the first call for them, then
        kept); None for a model without an early-exit head."""
        if self.decoder.exit_layer is None:
            return None
        modules, params = walk(self.model)
        self.decoder.begin(params)
        with eval_mode(self.model, modules):
            return self.costs.sampling(self.decoder)

    def _begin(self) -> tuple[DecodeStats, list[torch.nn.Module]]:
        """Start a decode call: the decoder's weights checked against the model's (one walk of the model
        gives its parameters for that and its modules for `eval_mode`), fresh stats."""
        modules, params = walk(self.model)
        self.decoder.begin(params)
        self.decoder.layer_evals = [0] * self.decoder.depth
        return DecodeStats(), modules

    def _label(self, stats: DecodeStats, mode: str, gamma: int, draft_confidence: float | None) -> None:
        stats.mode, stats.gamma, stats.draft_confidence = mode, gamma, draft_confidence
        stats.exit_layer = self.decoder.exit_layer if gamma else None


def _sizes(source: Tensor, cond_scale: float, **named: object) -> str:
    """The arguments a call's memory grows with, for `check_memory`'s message."""
    guided = " (2 rows each: cond_scale > 1)" if cond_scale > 1 else ""
    given = ", ".join(f"{name}={value!r}" for name, value in named.items() if value is not None)
    return f"a batch of {source.shape[0]}{guided}, {given}"
