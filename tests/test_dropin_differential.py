"""Differential suite: the patched generate() against spear-tts's own generate() on the same inputs.

50 random tiny models (shapes, exit layers, EOS or none, guidance) x 12 settings (greedy, beam with
spear-tts's semantics plain and speculative, temperatures, CFG, filters, ragged and edge inputs,
return_* flags): each case must return exactly what spear-tts returns. One correction is applied to
spear-tts's output before comparing, the one edge where it is wrong (docs/dropin.md): when some row
runs to max_length it skips `mask_after_eos`, so rows that ended keep the tokens drawn after their EOS;
we mask them (mask_after_eos on spear-tts's output is a no-op wherever it masked itself).

Not compared token for token: sampling at temperature > 0 through our loops (our sampler draws from a
torch.Generator, spear-tts from the global RNG with Gumbel noise: same law, different draws;
tests/test_speculative.py checks the law), and spear-tts's spec_decode=True path (it is wrong:
greedy speculative output differs from greedy, batch > 1 raises), which the drop-in replaces by
exact speculative decoding and compares with spear-tts's plain loops instead.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tts_specdec
from tts_specdec._upstream import TextToSemantic, _spear, quiet_progress

from conftest import TEXT_VOCAB, make_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = 50
MAX_LENGTH = 9
TTS = dict(source_type="text", target_type="speech")


def _ban_token_3(logits, thres=0.5):
    """A filter with no equivalent here: token 3 banned, then spear-tts's top-k."""
    return _spear.top_k(logits.index_fill(-1, torch.tensor([3], device=logits.device), float("-inf")), thres=thres)


# name -> (generate keywords, source edit); every case is run on every model
SETTINGS = {
    "greedy": (dict(temperature=0.0), None),
    "greedy-spec-cfg": (dict(temperature=0.0, spec_decode=True, spec_decode_gamma=3, cond_scale=2.0), None),
    "greedy-top_p-returns": (
        dict(temperature=0.0, filter_logits_fn=_spear.top_p, return_source=True, return_target_mask=True), None),
    "greedy-custom-filter": (dict(temperature=0.0, filter_logits_fn=_ban_token_3), None),
    "sample-custom-filter": (dict(temperature=0.8, filter_logits_fn=_ban_token_3, filter_fn_kwargs=dict(thres=0.6)), None),
    "beam-k2": (dict(beam_search_decode=True, beam_size=2), None),
    "beam-k3-temp-cfg-spec": (
        dict(beam_search_decode=True, beam_size=3, temperature=0.7, cond_scale=2.0, spec_decode=True,
             spec_decode_gamma=2), None),
    "beam-k4-greedy-spec": (dict(beam_search_decode=True, beam_size=4, temperature=0.0, spec_decode=True,
                                 spec_decode_gamma=3), None),
    "beam-k3-hot-returns": (dict(beam_search_decode=True, beam_size=3, temperature=1.3, return_source=True,
                                 return_target_mask=True), None),
    "int32-greedy": (dict(temperature=0.0), "int32"),
    "left-pad-empty-row-beam": (dict(beam_search_decode=True, beam_size=2), "left-pad"),
    "source-mask-beam-spec": (dict(beam_search_decode=True, beam_size=2, spec_decode=True, spec_decode_gamma=2),
                              "mask"),
}


@functools.lru_cache(maxsize=None)
def model_and_source(seed: int) -> tuple[TextToSemantic, torch.Tensor]:
    """A random tiny model (shape drawn from the seed) and a ragged batch of 3 sources."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    depth = pick(2, 3, 4)
    heads = pick(1, 2)
    model = make_model(
        seed, dim=16, heads=heads, dim_head=8, target_depth=depth, kv_heads=pick(None, 1) if heads == 2 else None,
        exit_layer=pick(None, *range(1, depth)), semantic_vocab=pick(4, 6, 9), eos=seed % 7 != 3,
        cond_drop_prob=0.2, std=pick(0.3, 0.5, 0.8),
    )
    lengths = [int(torch.randint(1, 8, (1,), generator=g)) for _ in range(3)]
    source = torch.randint(1, TEXT_VOCAB, (3, max(lengths)), generator=g)
    for row, n in enumerate(lengths):
        source[row, n:] = 0
    return model, source


def edited(model: TextToSemantic, source: torch.Tensor, edit: str | None, seed: int) -> tuple[torch.Tensor, dict]:
    if edit == "int32":  # spear-tts derives no mask from int32 ids: padding is attended
        return source.int(), {}
    if edit == "left-pad":  # row 1 left-padded, row 2 padding only
        left = torch.zeros(3, source.shape[1] + 2, dtype=torch.long)
        left[0, : source.shape[1]] = source[0]
        n = int((source[1] != 0).sum())
        left[1, left.shape[1] - n:] = source[1, :n]
        return left, {}
    if edit == "mask":  # a mask over the source with its EOS that differs from the padding
        g = torch.Generator().manual_seed(seed)
        mask = torch.rand(source.shape[0], source.shape[1] + 1, generator=g) > 0.3
        mask[:, 0] = True
        return source, dict(source_mask=mask)
    return source, {}


def run_case(seed: int, name: str) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(spear-tts's outputs with the one correction, ours) for one model and setting."""
    model, source = model_and_source(seed)
    kwargs, edit = SETTINGS[name]
    source, extra = edited(model, source, edit, seed)
    kw = dict(TTS, max_length=MAX_LENGTH, **kwargs, **extra)
    upstream_kw = {k: v for k, v in kw.items() if k not in ("spec_decode", "spec_decode_gamma")}
    with quiet_progress():
        torch.manual_seed(seed)  # the custom-filter cases run spear-tts's loop: same global RNG, same draws
        ref = TextToSemantic.generate(model, source, **upstream_kw)
        torch.manual_seed(seed)
        out = tts_specdec.generate(model, source, **kw)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    if not kw.get("beam_search_decode") and model.autoset_eos_id["speech"]:
        target = 1 if kw.get("return_source") else 0
        fixed = _spear.mask_after_eos(ref[target], model.eos_id["speech"], model.semantic_pad_id)
        ref = ref[:target] + (fixed,) + ((fixed != model.semantic_pad_id,) if kw.get("return_target_mask") else ())
    return ref, out


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("seed", range(MODELS))
def test_patched_generate_equals_spear_tts(seed, name):
    ref, out = run_case(seed, name)
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), f"ours\n{a}\nspear-tts\n{b}"


def test_the_corrected_edge_occurs_and_is_only_after_eos():
    """The correction is needed (some cases have tokens after EOS in spear-tts's output) and touches
    nothing before a row's first EOS."""
    seen = 0
    for seed in range(10):
        model, source = model_and_source(seed)
        if not model.autoset_eos_id["speech"]:
            continue
        with quiet_progress():
            ref = TextToSemantic.generate(model, source, **TTS, max_length=MAX_LENGTH, temperature=0.0)
        out = tts_specdec.generate(model, source, **TTS, max_length=MAX_LENGTH, temperature=0.0)
        eos, pad = model.eos_id["speech"], model.semantic_pad_id
        seen += int(not torch.equal(_spear.mask_after_eos(ref, eos, pad), ref))
        keep = out != pad
        assert torch.equal(out[keep], ref[keep])
    assert seen > 0
