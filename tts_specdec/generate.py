"""Drop-in `TextToSemantic.generate`: same arguments, same return conventions, our decoding loops.

    import tts_specdec
    tts_specdec.patch(model)                  # model.generate(...) now runs here
    out = model.generate(texts, source_type="text", target_type="speech",
                         beam_search_decode=True, spec_decode=True, beam_size=4)

Mapping of spear-tts's arguments:
- sampling (default): temperature 0 is greedy; `filter_logits_fn` = spear-tts `top_k` (its default:
  keep ceil(thres * V) logits, thres 0.1, or `k`) or `top_p` (`thres`, default 0.9) becomes our filter;
  spec_decode=True uses exact speculative sampling with `spec_decode_gamma` drafts (at most, with the
  added keywords `draft_confidence` and `draft_cond_scale`; "auto" lets `SpeculativeDecoder.sample`
  choose). Without spec_decode, greedy decoding (temperature 0) runs with gamma="auto": it speculates
  only where that is predicted to be faster, and its tokens are greedy's either way.
- beam_search_decode=True: our exact batched beam search (`length_penalty`, default 1.0, is an added
  keyword); with spec_decode=True too, speculative beam search at `spec_decode_gamma`, which returns the
  same result; without, gamma="auto" (speculative only where predicted faster, the same result).
- directions without an early-exit head (speech -> text) ignore spec_decode and run the plain loops.
- output: LongTensor (batch, n) padded with the target pad id; a row that ended keeps its EOS, then
  padding (spear-tts's `mask_after_eos`); `return_source` / `return_target_mask` as spear-tts.
What cannot be mapped exactly (a custom filter function, top_p with a temperature other than 0 or 1,
whose order spear-tts applies the other way round) runs spear-tts's own plain sampling loop.
"""

from __future__ import annotations

import math
import types
import warnings
import weakref
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._upstream import TextToSemantic, _spear
from .api import SpeculativeDecoder
from .inputs import prepare_source

_decoders: "weakref.WeakKeyDictionary[TextToSemantic, dict[tuple[str, str], SpeculativeDecoder]]" = (
    weakref.WeakKeyDictionary()
)


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
    length_penalty: float = 1.0,
    draft_width: int | None = None,
    draft_confidence: float | None = None,
    draft_cond_scale: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """`TextToSemantic.generate` with the same arguments and returns; see the module docstring."""
    dec = _decoder(model, source_type, target_type)
    ids = prepare_source(model, source, source_type)
    pad = model.pad_id[source_type]
    if source_mask is not None and not torch.equal(source_mask.to(ids.device).bool(), ids != pad):
        raise ValueError("source_mask must equal source != pad id (masks that differ from the padding are not supported)")
    if spec_decode_lenience != 1.0:
        warnings.warn("spec_decode_lenience is ignored: speculative decoding here is exact", stacklevel=2)
    # spec_decode: the caller's gamma; else "auto" where gamma cannot change the output (greedy and beam
    # search: `SpeculativeDecoder`'s defaults), plain sampling otherwise
    has_draft = dec.decoder.exit_layer is not None
    if spec_decode:
        gamma: int | str | None = spec_decode_gamma if has_draft else 0
    else:
        gamma = "auto" if beam_search_decode else None
    filter_fn = _spear.top_k if filter_logits_fn is None else filter_logits_fn
    kwargs = dict(filter_fn_kwargs or {})

    if beam_search_decode:
        if temperature != 1.0:
            raise ValueError("beam search ranks by the model's log-probs: temperature must be 1")
        out = dec.beam_search(
            ids, beam_size=beam_size, length_penalty=length_penalty, max_length=max_length,
            cond_scale=cond_scale, gamma=gamma, draft_width=draft_width,
        )
    else:
        top_k, top_p = _filter(filter_fn, kwargs, dec.decoder.vocab_size, temperature)
        if top_k is None and top_p is None and temperature != 0:
            return type(model).generate(  # spear-tts's own plain sampling loop
                model, source, source_type=source_type, target_type=target_type, temperature=temperature,
                filter_logits_fn=filter_fn, filter_fn_kwargs=kwargs, source_mask=source_mask,
                max_length=max_length, return_source=return_source, return_target_mask=return_target_mask,
                cond_scale=cond_scale,
            )
        out = dec.sample(
            ids, temperature=temperature, top_k=top_k, top_p=top_p, cond_scale=cond_scale,
            max_length=max_length, generator=generator, gamma=gamma,
            draft_confidence=draft_confidence if spec_decode and gamma else None,
            draft_cond_scale=draft_cond_scale if spec_decode and gamma and cond_scale > 1 else None,
        )
    target = _pad(out.tokens, dec.decoder.eos_id, model.pad_id[target_type], max_length, ids.device)
    returned = [target]
    if return_source:
        if model.autoset_eos_id[source_type]:
            ids = _spear.set_eos_id(ids, model.eos_id[source_type], pad_id=pad)
        returned.insert(0, ids)
    if return_target_mask:
        returned.append(target != model.pad_id[target_type])
    return returned[0] if len(returned) == 1 else tuple(returned)


def patch(model: TextToSemantic) -> TextToSemantic:
    """Install `generate` on this model instance: existing `model.generate(...)` calls run here.

    spear-tts's own method stays reachable as `type(model).generate(model, ...)`. Returns the model.
    """
    if not isinstance(model, TextToSemantic):
        raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic, got {type(model).__name__}")
    model.generate = types.MethodType(generate, model)
    return model


def _decoder(model: TextToSemantic, source_type: str, target_type: str) -> SpeculativeDecoder:
    """One decoder per model and direction, reused across calls (it re-reads weights every call)."""
    if not isinstance(model, TextToSemantic):
        raise TypeError(f"model must be a spear_tts_pytorch.TextToSemantic, got {type(model).__name__}")
    per_model = _decoders.setdefault(model, {})
    key = (source_type, target_type)
    if key not in per_model:
        per_model[key] = SpeculativeDecoder(model, source_type=source_type, target_type=target_type)
    return per_model[key]


def _filter(fn: Callable, kwargs: dict, vocab: int, temperature: float) -> tuple[int | None, float | None]:
    """spear-tts's filter function + kwargs -> our (top_k, top_p); (None, None): no exact equivalent.

    Greedy ignores the filter (both keep the argmax). spear-tts filters before dividing by the
    temperature: top-k does not care, top-p does, so top-p maps only at temperature 1.
    """
    if temperature == 0:
        return None, None
    if fn is _spear.top_k:
        k = kwargs.get("k")
        return (int(k) if k is not None else math.ceil(kwargs.get("thres", 0.1) * vocab)), None
    if fn is _spear.top_p and temperature == 1.0:
        return None, float(kwargs.get("thres", 0.9))
    return None, None


def _pad(tokens: list[Tensor], eos_id: int | None, pad_id: int, max_length: int, device: torch.device) -> Tensor:
    """Rows (EOS stripped) -> (batch, n): a row shorter than max_length ended with EOS, which is kept."""
    rows = [t if eos_id is None or t.numel() >= max_length else torch.cat((t, t.new_tensor([eos_id]))) for t in tokens]
    out = torch.full((len(rows), max(r.numel() for r in rows)), pad_id, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out
