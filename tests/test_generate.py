"""Drop-in generate(): spear-tts's arguments and return conventions, our loops underneath."""

import copy
import gc
import weakref

import pytest
import torch

import tts_specdec
from tts_specdec import SpeculativeDecoder, generate, patch, unpatch
from tts_specdec._upstream import TextToSemantic, _spear, quiet_progress
from tts_specdec.generate import _filter

from conftest import TEXT_VOCAB, forward_logits, make_model, make_source

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LENGTH = 16
TTS = dict(source_type="text", target_type="speech")


def upstream(model, source, **kwargs):
    """spear-tts's own method, even on a patched model."""
    with quiet_progress():
        return TextToSemantic.generate(model, source, **kwargs)


def spear_format(rows, eos, pad, max_length):
    """Expected padded output: rows (EOS stripped) + EOS when they ended before max_length, then pad."""
    rows = [r.tolist() + ([eos] if len(r) < max_length else []) for r in rows]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


@pytest.fixture(scope="module")
def patched():
    model = patch(make_model(0, cond_drop_prob=0.2))
    return model


@pytest.fixture(scope="module")
def source():
    return make_source(3, 6, seed=0, lengths=[6, 4, 2])


@pytest.mark.parametrize("spec_decode, confidence", [(False, None), (True, None), (True, 0.8)])
@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_greedy_equals_upstream_greedy(patched, source, spec_decode, confidence, cond_scale):
    kw = dict(TTS, temperature=0.0, max_length=MAX_LENGTH, cond_scale=cond_scale)
    ref = upstream(patched, source, **kw)
    out = patched.generate(source, **kw, spec_decode=spec_decode, spec_decode_gamma=3, draft_confidence=confidence)
    assert out.dtype == torch.long and torch.equal(out, ref)


def test_return_source_and_mask_like_upstream(patched, source):
    kw = dict(TTS, temperature=0.0, max_length=MAX_LENGTH, return_source=True, return_target_mask=True)
    ref = upstream(patched, source, **kw)
    out = patched.generate(source, **kw)
    assert len(out) == len(ref) == 3
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec_decode", [False, True])
def test_upstream_beam_is_the_default_and_equals_spear_tts(patched, source, spec_decode):
    kw = dict(TTS, beam_search_decode=True, beam_size=3, max_length=MAX_LENGTH, temperature=0.8)
    out = patched.generate(source, **kw, spec_decode=spec_decode, spec_decode_gamma=3)
    assert torch.equal(out, upstream(patched, source, **kw))


@pytest.mark.parametrize("spec_decode", [False, True])
def test_standard_beam_search_in_spear_format(patched, source, spec_decode):
    ref = SpeculativeDecoder(patched).beam_search(source, gamma=0, beam_size=3, max_length=MAX_LENGTH)
    out = patched.generate(
        source, **TTS, beam_search_decode=True, spec_decode=spec_decode, beam_size=3,
        spec_decode_gamma=4, max_length=MAX_LENGTH, beam_semantics="standard",
    )
    expected = spear_format(ref.tokens, patched.eos_id["speech"], patched.semantic_pad_id, MAX_LENGTH)
    assert torch.equal(out, expected)
    # EOS kept then padding: what spear-tts's mask_after_eos leaves
    eos = patched.eos_id["speech"]
    assert torch.equal(_spear.mask_after_eos(out, eos, patched.semantic_pad_id), out)


def test_functional_form_and_cfg_beam(patched, source):
    kw = dict(TTS, beam_search_decode=True, beam_size=2, max_length=MAX_LENGTH, cond_scale=2.0,
              beam_semantics="standard")
    ref = SpeculativeDecoder(patched).beam_search(source, gamma=0, beam_size=2, max_length=MAX_LENGTH, cond_scale=2.0)
    expected = spear_format(ref.tokens, patched.eos_id["speech"], patched.semantic_pad_id, MAX_LENGTH)
    assert torch.equal(generate(patched, source, **kw, spec_decode=True), expected)
    assert tts_specdec.generate is generate


def test_upstream_default_filter_mapping():
    vocab = 13  # 12 semantic ids + EOS: spear-tts's top_k keeps ceil(0.1 * 13) = 2
    assert _filter(_spear.top_k, {}, vocab, 1.0) == (2, None)
    assert _filter(_spear.top_k, {"thres": 0.5}, vocab, 0.7) == (7, None)
    assert _filter(_spear.top_k, {"k": 4}, vocab, 1.0) == (4, None)
    assert _filter(_spear.top_p, {}, vocab, 1.0) == (None, 0.9)
    assert _filter(_spear.top_p, {"thres": 0.5}, vocab, 0.8) is None  # order matters: not mapped
    assert _filter(_spear.top_p, {}, vocab, 0.0) == (None, None)  # greedy: top-k and top-p keep the argmax
    assert _filter(lambda x: x, {}, vocab, 0.0) is None  # another function may not


def test_default_filter_samples_only_top_k(patched, source):
    """Upstream's default filter keeps ceil(0.1 * V) = 2 tokens: every sampled token is a top-2 token."""
    torch.manual_seed(0)
    out = patched.generate(source, **TTS, max_length=MAX_LENGTH, spec_decode=True, spec_decode_gamma=2)
    dec = SpeculativeDecoder(patched).decoder
    for row, src in zip(out, source):
        row = row[row != patched.semantic_pad_id]
        logits = forward_logits(patched, src[None], row[None, :-1])
        top2 = logits[0].topk(2, dim=-1).indices
        assert (top2 == row[:, None]).any(dim=-1).all()
    assert dec.vocab_size == 13


def test_custom_filter_runs_upstream_loop(patched, source):
    fn = lambda logits: logits  # noqa: E731  (no exact equivalent: spear-tts's loop samples)
    kw = dict(TTS, max_length=MAX_LENGTH, filter_logits_fn=fn)
    torch.manual_seed(1)
    ref = upstream(patched, source, **kw)
    torch.manual_seed(1)
    with quiet_progress():
        out = patched.generate(source, **kw)
    # every row masked after its EOS (spear-tts leaves that undone when a row runs to max_length)
    assert torch.equal(out, _spear.mask_after_eos(ref, patched.eos_id["speech"], patched.semantic_pad_id))


def test_custom_filter_honoured_when_greedy(patched, source):
    """A filter banning the greedy choice: spear-tts applies it before the argmax, and so do we."""
    greedy = patched.generate(source, **TTS, temperature=0.0, max_length=MAX_LENGTH)
    banned = int(greedy[0, 0])
    fn = lambda logits: logits.index_fill(-1, torch.tensor([banned]), float("-inf"))  # noqa: E731
    kw = dict(TTS, temperature=0.0, max_length=MAX_LENGTH, filter_logits_fn=fn)
    out = patched.generate(source, **kw)
    assert not (out == banned).any()
    ref = upstream(patched, source, **kw)
    assert torch.equal(out, _spear.mask_after_eos(ref, patched.eos_id["speech"], patched.semantic_pad_id))


def test_speech_to_text_without_exit_head_uses_plain_paths():
    model = patch(make_model(4, exit_layer=None))
    speech = torch.randint(0, 12, (2, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(source_type="speech", target_type="text", max_length=MAX_LENGTH)
    out = model.generate(speech, **kw, beam_search_decode=True, spec_decode=True, beam_size=2)
    assert torch.equal(out, upstream(model, speech, **kw, beam_search_decode=True, beam_size=2))
    greedy = model.generate(speech, **kw, temperature=0.0, spec_decode=True)
    # spear-tts masks after EOS only when every row ended; we always do (EOS kept, then padding)
    ref = _spear.mask_after_eos(upstream(model, speech, **kw, temperature=0.0), model.eos_id["text"], 0)
    assert torch.equal(greedy, ref)


def test_rejects_what_it_cannot_honour(patched, source):
    with pytest.raises(ValueError, match="spec_decode_lenience"):  # raised: audiolm silences warnings.warn
        patched.generate(source, **TTS, spec_decode=True, spec_decode_lenience=1.5, max_length=4)
    with pytest.raises(ValueError, match="source_mask must have shape"):  # spear-tts: a RuntimeError deep inside
        patched.generate(source, **TTS, source_mask=torch.ones_like(source, dtype=torch.bool), max_length=4)
    with pytest.raises(ValueError, match="beam_semantics"):
        patched.generate(source, **TTS, beam_search_decode=True, beam_semantics="other", max_length=4)
    with pytest.raises(ValueError, match="beam_size"):  # spear-tts: torch.topk's "selected index k out of range"
        patched.generate(source, **TTS, beam_search_decode=True, beam_size=14, max_length=4)
    # spear-tts takes these and returns all-zero tokens (cond_scale overflows the mix) or overflows mid-search
    fn = lambda logits: logits  # noqa: E731  (its own loop: the check comes first there too)
    for kw in (dict(cond_scale=1e38), dict(cond_scale=1e38, filter_logits_fn=fn),
               dict(cond_scale=1e38, beam_search_decode=True)):
        with pytest.raises(ValueError, match=r"cond_scale must be in \[1, 100\]"):
            patched.generate(source, **TTS, max_length=4, **kw)
    with pytest.raises(ValueError, match=r"length_penalty must be in \[-10, 10\]"):
        patched.generate(source, **TTS, beam_search_decode=True, beam_semantics="standard", length_penalty=1e300,
                         max_length=4)


def test_inputs_spear_tts_takes(patched):
    """An empty text, a row of padding, left padding, int32 ids, a mask unlike the padding: spear-tts's output."""
    before = patched.tokenizer_encode
    patched.tokenizer_encode = lambda texts: torch.nn.utils.rnn.pad_sequence(
        [torch.tensor([1 + ord(c) % 19 for c in t] or [0], dtype=torch.long) for t in texts], batch_first=True)
    eos, pad = patched.eos_id["speech"], patched.semantic_pad_id
    kw = dict(TTS, temperature=0.0, max_length=MAX_LENGTH)
    try:
        texts = ["a cat", "", "on the mat"]
        assert torch.equal(patched.generate(texts, **kw), _spear.mask_after_eos(upstream(patched, texts, **kw), eos, pad))
    finally:
        patched.tokenizer_encode = before
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 0, 0, 0, 0], [3, 4, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    beam = dict(TTS, beam_search_decode=True, beam_size=2, max_length=MAX_LENGTH)
    for source, extra in [(ids, {}), (ids.int(), {}), (ids, dict(source_mask=mask))]:
        for args in (kw, beam):
            ref = upstream(patched, source, **args, **extra)
            assert torch.equal(patched.generate(source, **args, **extra), _spear.mask_after_eos(ref, eos, pad))


def test_arguments_spear_tts_takes_as_it_takes_them(patched, source):
    """A negative temperature (spear-tts: max(T, 1e-10), greedy), spec_decode_lenience without
    spec_decode (spear-tts reads it only when decoding speculatively), and the source EOS id inside a
    source (its embedding has a row for it): the same output as spear-tts, no error."""
    eos, pad = patched.eos_id["speech"], patched.semantic_pad_id
    kw = dict(TTS, max_length=MAX_LENGTH)
    greedy = _spear.mask_after_eos(upstream(patched, source, **kw, temperature=0.0), eos, pad)
    assert torch.equal(patched.generate(source, **kw, temperature=-1.0), greedy)
    assert torch.equal(patched.generate(source, **kw, temperature=0.0, spec_decode_lenience=2.0), greedy)
    with_eos = source.clone()
    with_eos[0, 2] = patched.eos_id["text"]
    assert patched.eos_id["text"] == TEXT_VOCAB  # the id is outside the vocabulary the tokenizer writes
    for extra in ({}, dict(beam_search_decode=True, beam_size=2)):
        ref = _spear.mask_after_eos(upstream(patched, with_eos, **kw, temperature=0.0, **extra), eos, pad)
        assert torch.equal(patched.generate(with_eos, **kw, temperature=0.0, **extra), ref)
        if not extra:  # speculative greedy returns greedy's tokens (spear-tts's own speculative path does not)
            assert torch.equal(patched.generate(with_eos, **kw, temperature=0.0, spec_decode=True), ref)


def test_progress_bar_where_spear_tts_draws_one(patched, source, monkeypatch):
    """spear-tts's tqdm bar over max_length for plain sampling and beam search; progress=False: none."""
    made = []

    class Bar:
        def __init__(self, total):
            self.total, self.n, self.closed = total, 0, False
            made.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    monkeypatch.setattr(_spear, "tqdm", Bar)
    kw = dict(TTS, max_length=MAX_LENGTH)
    for extra in (dict(temperature=1.0), dict(beam_search_decode=True, beam_size=2)):
        made.clear()
        patched.generate(source, **kw, **extra)
        assert len(made) == 1 and made[0].total == MAX_LENGTH and made[0].closed and 0 < made[0].n <= MAX_LENGTH
        made.clear()
        patched.generate(source, **kw, **extra, progress=False)
        assert not made


def test_patched_model_is_not_kept_alive():
    model = patch(make_model(5))
    model.generate(make_source(1, 4), **TTS, temperature=0.0, max_length=4)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_unpatch_and_context_manager_restore_spear_tts(source):
    model = make_model(6)
    original = model.generate
    with tts_specdec.patched(model):
        assert model.generate.__func__ is generate
    assert model.generate == original and "generate" not in model.__dict__
    patch(model)
    copy.deepcopy(model)  # the decoders kept on the model are not copied
    unpatch(model)
    assert model.generate == original and not hasattr(model, "_tts_specdec_decoders")


def test_subclass_override_refused_and_compiled_model_unwrapped(source):
    class Custom(TextToSemantic):
        def generate(self, *args, **kwargs):
            return "custom"

    model = make_model(7)
    model.__class__ = Custom
    with pytest.raises(TypeError, match="overrides generate"):
        patch(model)
    model.__class__ = TextToSemantic
    compiled = torch.compile(model)  # compiles nothing until called: patch unwraps it
    assert patch(compiled) is compiled
    kw = dict(TTS, temperature=0.0, max_length=MAX_LENGTH)
    assert torch.equal(compiled.generate(source, **kw), generate(model, source, **kw))
    with pytest.raises(TypeError, match="TextToSemantic"):
        patch(torch.nn.Linear(2, 2))


def test_absurd_gamma_is_refused_on_spear_tts_own_loop_too(patched, source, monkeypatch):
    """top_p at temperature 0.8 has no exact equivalent here: spear-tts's loop runs and ignores the gamma,
    which is refused all the same (before that loop runs)."""
    monkeypatch.setattr(TextToSemantic, "generate", lambda *a, **k: pytest.fail("spear-tts's loop ran"))
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 256\], got 1000000$"):
        generate(patched, source, **TTS, temperature=0.8, filter_logits_fn=_spear.top_p, max_length=MAX_LENGTH,
                 spec_decode=True, spec_decode_gamma=10**6)
