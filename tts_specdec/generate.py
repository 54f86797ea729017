"""Drop-in `TextToSemantic.generate`: same arguments, same return conventions, our decoding loops.

    import tts_specdec
    tts_specdec.patch(model)                  # model.generate(...) now runs here
    out = model.generate(texts, source_type="text", target_type="speech",
                         beam_search_decode=True, spec_decode=True, beam_size=4)
    tts_specdec.unpatch(model)                # spear-tts's own method again

Mapping of spear-tts's arguments (docs/dropin.md has the table):
- sampling (default): temperature 0 is greedy; `filter_logits_fn` = spear-tts `top_k` (its default:
  keep ceil(thres * V) logits, thres 0.1, or `k`) or `top_p` (`thres`, default 0.9) becomes our filter;
  spec_decode=True uses exact speculative sampling with `spec_decode_gamma` drafts (at most, with the
  added keywords `draft_confidence` and `draft_cond_scale`; "auto" lets `SpeculativeDecoder.sample`
  choose). Without spec_decode, greedy decoding (temperature 0) runs with gamma="auto": it speculates
  only where that is predicted to be faster, and its tokens are greedy's either way. A filter with no
  exact equivalent here (any other function, or top_p at a temperature other than 0 or 1, which
  spear-tts applies before the temperature) runs spear-tts's own sampling loop, at every temperature.
- beam_search_decode=True: spear-tts's beam search, token for token (`beam_semantics="upstream"`, the
  default; "standard" is `SpeculativeDecoder.beam_search`'s length-normalised search with the added
  keyword `length_penalty`); with spec_decode=True too, speculative beam search at `spec_decode_gamma`,
  which returns the same; without, gamma="auto" (speculative only where predicted faster).
- directions without an early-exit head (speech -> text) ignore spec_decode and run the plain loops.
- inputs as spear-tts takes them: empty strings, rows of padding, left padding, int32 ids (spear-tts
  derives no mask from ids that are not int64: every position is attended), `source_mask` over the
  source with its EOS set (n + 1 columns when the model sets a source EOS).
- output: LongTensor (batch, n) padded with the target pad id; a row that ended keeps its EOS, then
  padding (spear-tts's `mask_after_eos`, applied here to every row: spear-tts skips it when some row
  runs to max_length); `return_source` / `return_target_mask` as spear-tts.
- `spec_decode_lenience` other than 1 (spear-tts's lossy acceptance) is refused: decoding here is exact.
- compile (added keyword, or given to `patch` / `patched`): True or a torch.compile backend name decodes on
  `SpeculativeDecoder(model, compile=...)`'s static compiled steps (CUDA graphs on a GPU), the same tokens
  as the default path; the filters without an equivalent still run spear-tts's own loop.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ._upstream import TextToSemantic, _spear, quiet_progress
from .api import SpeculativeDecoder
from .beam import BeamSemantics
from .inputs import check_compile, check_cond_scale, check_float, check_gamma, prepare_source

_CACHE = "_tts_specdec_decoders"  # the model's own attribute: per direction and compile, its SpeculativeDecoder
_COMPILE = "_tts_specdec_compile"  # the model's own attribute: the compile `patch` was given


def generate(
    model: TextToSemantic,
    source: Tensor | Sequence[str],
    *,
    source_type: str = "text",
    target_type: str = "speech",
    temperature: float = 1.0,
    filter_logits_fn: Callable | None = None,
    filter_fn_kwargs: dict | None = None,
    source_mask: Tensor | None = None,
    max_length: int = 2048,
    beam_search_decode: bool = False,
    spec_decode: bool = False,
    spec_decode_gamma: int | str = 5,
    spec_decode_lenience: float = 1.0,
    beam_size: int = 4,
    return_source: bool = False,
    return_target_mask: bool = False,
    cond_scale: float = 1.0,
    beam_semantics: BeamSemantics = "upstream",
    length_penalty: float = 1.0,
    draft_width: int | None = None,
    draft_confidence: float | None = None,
    draft_cond_scale: float | None = None,
    generator: torch.Generator | None = None,
    progress: bool = True,
    compile: bool | str | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """`TextToSemantic.generate` with the same arguments and returns; see the module docstring.

    progress: a tqdm bar over max_length where spear-tts draws one (its plain sampling and beam loops,
    not spec_decode); False: none.
    compile: decode on static compiled steps (`SpeculativeDecoder`'s compile: True for inductor, or a
    torch.compile backend name); None: what `patch` was given for this model, else False. The compiled
    decoder is built on the first call and kept with the model: later calls of the same shapes compile
    nothing; moving the model to another device or dtype builds a new one."""
    model = _unwrap(model)
    compile = check_compile(model.__dict__.get(_COMPILE, False) if compile is None else compile)
    temperature = check_float("temperature", temperature)
    if temperature < 0:  # spear-tts divides by max(temperature, 1e-10): greedy
        temperature = 0.0
    if spec_decode and spec_decode_lenience != 1.0:  # spear-tts reads it only when decoding speculatively
        raise ValueError(
            f"spec_decode_lenience must be 1.0, got {spec_decode_lenience}: speculative decoding here is exact "
            "(spear-tts's lenience accepts more drafts and changes the output distribution)"
        )
    check_cond_scale("cond_scale", cond_scale)  # before any path, spear-tts's own loop included
    filter_fn = _spear.top_k if filter_logits_fn is None else filter_logits_fn
    kwargs = dict(filter_fn_kwargs or {})
    dec = _decoder(model, source_type, target_type, compile)
    given = source
    ids, mask = _source(model, source, source_type, source_mask)
    # spec_decode: the caller's gamma; else "auto" where gamma cannot change the output (greedy and beam
    # search: `SpeculativeDecoder`'s defaults), plain sampling otherwise
    has_draft = dec.decoder.exit_layer is not None
    if spec_decode:
        # checked on every path: spear-tts's own sampling loop (filters without an equivalent) ignores it
        gamma: int | str | None = check_gamma(spec_decode_gamma, dec.decoder.exit_layer) if has_draft else 0
    else:
        gamma = "auto" if beam_search_decode else None

    eos = dec.decoder.eos_id
    target_pad = model.pad_id[target_type]
    bar = _Bar(max_length) if progress and not spec_decode else None
    if beam_search_decode:  # spear-tts's beam search never filters
        with bar or contextlib.nullcontext():
            out = dec.beam_search(
                ids, beam_size=beam_size, length_penalty=length_penalty, max_length=max_length,
                cond_scale=cond_scale, gamma=gamma, draft_width=draft_width, beam_semantics=beam_semantics,
                temperature=temperature, source_mask=mask, progress=bar,
            )
        if beam_semantics == "upstream":  # every row is as long as the search: it stops for all at once
            target = _pad(out.tokens, eos, target_pad, out.stats.beam_steps, out.stats.beam_steps)
        else:
            target = _pad(out.tokens, eos, target_pad, max_length)
    else:
        mapped = _filter(filter_fn, kwargs, dec.decoder.vocab_size, temperature)
        if mapped is None:  # spear-tts's own plain sampling loop, then every row masked after its EOS
            with contextlib.nullcontext() if progress else quiet_progress():  # its own bar
                returned = TextToSemantic.generate(
                    model, given, source_type=source_type, target_type=target_type, temperature=temperature,
                    filter_logits_fn=filter_fn, filter_fn_kwargs=kwargs, source_mask=source_mask,
                    max_length=max_length, return_source=True, cond_scale=cond_scale,
                )
            return _returns(returned[0], _masked(returned[1], eos, target_pad), return_source,
                            return_target_mask, target_pad)
        top_k, top_p = mapped
        with bar or contextlib.nullcontext():
            out = dec.sample(
                ids, temperature=temperature, top_k=top_k, top_p=top_p, cond_scale=cond_scale,
                max_length=max_length, generator=generator, gamma=gamma,
                draft_confidence=draft_confidence if spec_decode and gamma else None,
                draft_cond_scale=draft_cond_scale if spec_decode and gamma and cond_scale > 1 else None,
                source_mask=mask, progress=bar,
            )
        target = _pad(out.tokens, eos, target_pad, max_length)
    source_ids = ids
    if model.autoset_eos_id[source_type]:
        source_ids = _spear.set_eos_id(ids, model.eos_id[source_type], pad_id=model.pad_id[source_type])
    return _returns(source_ids.to(_dtype(given)), target, return_source, return_target_mask, target_pad)


def _returns(
    source: Tensor, target: Tensor, return_source: bool, return_target_mask: bool, pad: int
) -> Tensor | tuple[Tensor, ...]:
    """spear-tts's four return shapes: target, (source, target), (target, mask), (source, target, mask)."""
    returned = [target]
    if return_source:
        returned.insert(0, source)
    if return_target_mask:
        returned.append(target != pad)
    return returned[0] if len(returned) == 1 else tuple(returned)


def _masked(target: Tensor, eos: int | None, pad: int) -> Tensor:
    """Every row padded after its first EOS (spear-tts's loop leaves that undone when a row runs to
    max_length)."""
    return target if eos is None else _spear.mask_after_eos(target, eos, pad)


def patch(model: TextToSemantic, compile: bool | str = False) -> TextToSemantic:
    """Install `generate` on this model instance: existing `model.generate(...)` calls run here.

    compile: True (inductor) or a torch.compile backend name: those calls decode on static compiled steps
    (see `generate`); a call's own `compile=` overrides it.
    spear-tts's own method stays reachable as `TextToSemantic.generate(model, ...)`; `unpatch` restores it.
    A torch.compile'd model is patched through the module it wraps. Returns the model given.
    """
    inner = _unwrap(model)
    compile = check_compile(compile)
    if type(inner).generate is not TextToSemantic.generate:
        raise TypeError(
            f"{type(inner).__name__} overrides generate(): patching would bypass it. Call "
            "tts_specdec.generate(model, ...) where you want this decoding, or patch a plain TextToSemantic"
        )
    inner.generate = types.MethodType(generate, inner)
    inner.__dict__[_COMPILE] = compile
    return model


def unpatch(model: TextToSemantic) -> TextToSemantic:
    """Undo `patch`: `model.generate` is spear-tts's again and the cached decoders (compiled ones
    included) are dropped."""
    inner = _unwrap(model)
    bound = inner.__dict__.get("generate")
    if isinstance(bound, types.MethodType) and bound.__func__ is generate:
        del inner.__dict__["generate"]
    inner.__dict__.pop(_CACHE, None)
    inner.__dict__.pop(_COMPILE, None)
    return model


@contextlib.contextmanager
def patched(model: TextToSemantic, compile: bool | str = False) -> Iterator[TextToSemantic]:
    """`with tts_specdec.patched(model): model.generate(...)` runs here inside the block only (compile:
    as `patch`'s)."""
    patch(model, compile)
    try:
        yield model
    finally:
        unpatch(model)


class _Bar:
    """spear-tts's bar (tqdm over max_length steps), moved to the decoded length as decoding advances."""

    def __init__(self, total: int) -> None:
        self.total, self.bar = total, None  # drawn at the first step: arguments are checked by then

    def __call__(self, length: int) -> None:
        if self.bar is None:
            self.bar = _spear.tqdm(total=self.total)  # spear-tts's tqdm: `quiet_progress` silences both
        self.bar.update(length - self.bar.n)

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _unwrap(model: object) -> TextToSemantic:
    """The TextToSemantic itself: torch.compile's wrapper holds it as `_orig_mod`."""
    inner = getattr(model, "_orig_mod", model)  # OptimizedModule (torch.compile)
    if not isinstance(inner, TextToSemantic):
        raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic (or torch.compile of one), "
                        f"got {type(model).__name__}")
    return inner


class _Decoders(dict):
    """Per-direction decoders kept on the model itself, so they live exactly as long as it does (the
    decoder refers to the model: a registry outside it would keep it alive). Copies and pickles of the
    model get an empty one: decoders are rebuilt on demand."""

    def __deepcopy__(self, memo: dict) -> "_Decoders":
        return _Decoders()

    def __reduce__(self) -> tuple:
        return (_Decoders, ())


def _decoder(model: TextToSemantic, source_type: str, target_type: str, compile: bool | str) -> SpeculativeDecoder:
    """One decoder per model, direction and compile, reused across calls: it checks the weights every call
    (`Decoder.begin`: storage, versions, values) and rebuilds what it prepared from them when they changed.

    A compiled decoder is also tied to the device and dtype it was built on: its graphs were traced for
    them (and on a GPU, captured as CUDA graphs reading its weights in place). A model moved since gets a
    new decoder in place of the old one, whose graphs are then freed with it, rather than graphs added
    to the old one's for every placement the model has had."""
    per_model = model.__dict__.get(_CACHE)
    if per_model is None:
        per_model = model.__dict__[_CACHE] = _Decoders()
    key = (source_type, target_type, compile)
    placed = None
    if compile:
        start = model.start_token[target_type]  # `Decoder.device` and `.dtype` read the same parameter
        placed = (start.device, start.dtype)
    kept = per_model.get(key)
    if kept is None or kept[0] != placed:
        kept = per_model[key] = (placed, SpeculativeDecoder(
            model, source_type=source_type, target_type=target_type, compile=compile))
    return kept[1]


def _source(
    model: TextToSemantic, source: Tensor | Sequence[str], source_type: str, source_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """spear-tts's input rules -> (ids, the mask `Decoder.encode` applies)."""
    ids = prepare_source(model, source, source_type, strict=False)
    width = ids.shape[1] + int(model.autoset_eos_id[source_type])  # the source as the model sees it
    if source_mask is not None:
        if not isinstance(source_mask, Tensor) or source_mask.shape != (ids.shape[0], width):
            shape = tuple(source_mask.shape) if isinstance(source_mask, Tensor) else type(source_mask).__name__
            raise ValueError(f"source_mask must have shape {(ids.shape[0], width)} (the source with its EOS), "
                             f"got {shape}")
        return ids, source_mask.to(ids.device).bool()
    if _dtype(source) != torch.long:  # spear-tts derives a mask from int64 ids only
        return ids, torch.ones(ids.shape[0], width, dtype=torch.bool, device=ids.device)
    pad = model.pad_id[source_type]
    seen = _spear.set_eos_id(ids, model.eos_id[source_type], pad_id=pad) if model.autoset_eos_id[source_type] else ids
    return ids, seen != pad  # given explicitly: the decoder then takes rows spear-tts takes (`prepare_source`)


def _dtype(source: Tensor | Sequence[str]) -> torch.dtype:
    """The dtype of the ids spear-tts works on: texts and waveforms become int64 ids (tokenizer, wav2vec)."""
    return source.dtype if isinstance(source, Tensor) and not source.is_floating_point() else torch.long


def _filter(fn: Callable, kwargs: dict, vocab: int, temperature: float) -> tuple[int | None, float | None] | None:
    """spear-tts's filter function + kwargs -> our (top_k, top_p); None: no exact equivalent.

    Greedy: top-k and top-p keep the argmax, so they change nothing; another function may. spear-tts
    filters before dividing by the temperature: top-k does not care, top-p does, so top-p maps only at
    temperature 1.
    """
    if temperature == 0:
        return (None, None) if fn in (_spear.top_k, _spear.top_p) else None
    if fn is _spear.top_k:
        k = kwargs.get("k")
        return (int(k) if k is not None else math.ceil(kwargs.get("thres", 0.1) * vocab)), None
    if fn is _spear.top_p and temperature == 1.0:
        return None, float(kwargs.get("thres", 0.9))
    return None


def _pad(tokens: list[Tensor], eos_id: int | None, pad_id: int, full: int, width: int | None = None) -> Tensor:
    """Rows (EOS stripped) -> (batch, width; default the longest row): a row shorter than `full` (the
    most tokens a row without EOS has) ended with EOS, which is kept."""
    rows = [t if eos_id is None or t.numel() >= full else torch.cat((t, t.new_tensor([eos_id]))) for t in tokens]
    width = max(r.numel() for r in rows) if width is None else width
    out = torch.full((len(rows), width), pad_id, dtype=torch.long, device=tokens[0].device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out
