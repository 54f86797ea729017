"""Bad input fails early with an error that names the argument; training mode is restored."""

import pytest
import torch

from tts_specdec import SpeculativeDecoder

from conftest import TEXT_VOCAB, make_model, make_source

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder(make_model(0))


@pytest.fixture(scope="module")
def src():
    return make_source(2, 5)


def test_model_must_be_a_text_to_semantic():
    with pytest.raises(TypeError, match="model must be a spear_tts_pytorch.TextToSemantic"):
        SpeculativeDecoder(torch.nn.Linear(2, 2))


def test_strings_need_a_tokenizer(dec):
    with pytest.raises(ValueError, match="source is a list of strings but the model has no tokenizer"):
        dec.sample(["hello"], max_length=2)
    with pytest.raises(TypeError, match="source must be a list of strings or a LongTensor"):
        dec.sample("hello", max_length=2)


def test_strings_go_through_the_tokenizer():
    def encode(texts):
        rows = [[1 + ord(c) % (TEXT_VOCAB - 1) for c in t] for t in texts]
        width = max(map(len, rows))
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])

    model = make_model(0, tokenizer_encode=encode)
    dec = SpeculativeDecoder(model)
    texts = ["hi there", "ok"]
    by_text = dec.sample(texts, temperature=0.0, max_length=6).tokens
    by_ids = dec.sample(encode(texts), temperature=0.0, max_length=6).tokens
    assert [t.tolist() for t in by_text] == [t.tolist() for t in by_ids]
    with pytest.raises(ValueError, match=r"source\[1\] is empty"):
        dec.sample(["hi", "  "], max_length=2)


@pytest.mark.parametrize("bad", [TEXT_VOCAB, -3])
def test_ids_outside_the_text_vocabulary(dec, src, bad):
    source = src.clone()
    source[1, 2] = bad
    with pytest.raises(ValueError, match=rf"source\[1, 2\] = {bad} is outside the text vocabulary"):
        dec.sample(source, max_length=2)
    with pytest.raises(ValueError, match="outside the text vocabulary"):
        dec.beam_search(source, max_length=2)


def test_empty_rows(dec, src):
    source = src.clone()
    source[1] = 0
    with pytest.raises(ValueError, match="source row 1 is empty"):
        dec.sample(source, max_length=2)
    with pytest.raises(ValueError, match="source must have shape"):
        dec.sample(src[:, :0], max_length=2)
    with pytest.raises(ValueError, match="source must have shape"):
        dec.sample(src[:0], max_length=2)


def test_source_must_be_right_padded_integer_ids(dec, src):
    source = src.clone()
    source[0, 1] = 0  # a pad followed by real tokens
    with pytest.raises(ValueError, match="source rows must be right-padded"):
        dec.sample(source, max_length=2)
    with pytest.raises(TypeError, match="source must hold integer token ids"):
        dec.sample(src.float(), max_length=2)
    with pytest.raises(ValueError, match="source_type must be 'text' or 'speech'"):
        SpeculativeDecoder(dec.model, source_type="audio")


@pytest.mark.parametrize(
    "method, kwargs, error, match",
    [
        ("sample", dict(max_length=0), ValueError, "max_length must be >= 1"),
        ("beam_search", dict(max_length=0), ValueError, "max_length must be >= 1"),
        ("sample", dict(max_length=2.5), TypeError, "max_length must be an int"),
        ("beam_search", dict(beam_size=0), ValueError, "beam_size must be >= 1"),
        ("sample", dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        ("sample", dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        ("sample", dict(top_k=0), ValueError, "top_k must be >= 1"),
        ("sample", dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        ("sample", dict(temperature=float("nan")), ValueError, "temperature must be finite"),
        ("sample", dict(temperature=float("inf")), ValueError, "temperature must be finite"),
        ("sample", dict(top_p=float("nan")), ValueError, "top_p must be finite"),
        ("sample", dict(gamma=2, draft_confidence=float("nan")), ValueError, "draft_confidence must be finite"),
        ("beam_search", dict(length_penalty=float("nan")), ValueError, "length_penalty must be finite"),
        ("sample", dict(cond_scale=3.0), ValueError, "cond_scale > 1 needs a model trained with cond_drop_prob"),
        ("beam_search", dict(cond_scale=3.0), ValueError, "cond_scale > 1 needs a model trained with cond_drop_prob"),
        ("sample", dict(cond_scale=0.5), ValueError, r"cond_scale must be in \[1, 100\]"),
        ("sample", dict(cond_scale=1e38), ValueError, r"cond_scale must be in \[1, 100\]"),
        ("beam_search", dict(cond_scale=1e38), ValueError, r"cond_scale must be in \[1, 100\]"),
        ("beam_search", dict(length_penalty=1e300), ValueError, r"length_penalty must be in \[-10, 10\]"),
        ("beam_search", dict(length_penalty=-10.5), ValueError, r"length_penalty must be in \[-10, 10\]"),
        ("sample", dict(gamma=-1), ValueError, "gamma must be >= 0"),
        ("sample", dict(gamma=2, draft_confidence=0.0), ValueError, r"draft_confidence must be in \(0, 1\]"),
        ("sample", dict(gamma=2, draft_confidence=1.5), ValueError, r"draft_confidence must be in \(0, 1\]"),
        ("sample", dict(gamma=2, draft_confidence="high"), TypeError, "draft_confidence must be"),
        ("sample", dict(draft_confidence=0.5), ValueError, "draft_confidence needs gamma > 0"),
        ("sample", dict(gamma=2, draft_cond_scale=0.5), ValueError, r"draft_cond_scale must be in \[1, 100\]"),
        ("sample", dict(gamma=2, draft_cond_scale=1e6), ValueError, r"draft_cond_scale must be in \[1, 100\]"),
        ("sample", dict(gamma=2, draft_cond_scale="low"), TypeError, "draft_cond_scale must be"),
        ("sample", dict(gamma=2, draft_cond_scale=2.0), ValueError, "draft_cond_scale needs gamma > 0 and cond_scale > 1"),
        ("sample", dict(generator=0), TypeError, "generator must be a torch.Generator"),
        ("sample", dict(progress=1), TypeError, "progress must be None or a callable"),
        ("beam_search", dict(progress="bar"), TypeError, "progress must be None or a callable"),
    ],
)
def test_bad_arguments_name_the_argument(dec, src, method, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(dec, method)(src, **{"max_length": 2, **kwargs})


def test_gamma_needs_an_early_exit_layer(src):
    dec = SpeculativeDecoder(make_model(0, exit_layer=None))
    with pytest.raises(ValueError, match="gamma > 0 needs a draft"):
        dec.sample(src, max_length=2, gamma=2)
    assert dec.sample(src, max_length=2, gamma=0).tokens[0].numel() <= 2  # plain still works


def test_training_model_is_decoded_in_eval_mode_and_put_back():
    kwargs = dict(attn_dropout=0.5, ff_dropout=0.5)
    model = make_model(0, **kwargs)
    src = make_source(2, 5)
    ref_sample = SpeculativeDecoder(model).sample(src, temperature=0.0, max_length=8).tokens
    ref_beam = SpeculativeDecoder(model).beam_search(src, beam_size=2, max_length=8).tokens
    model.train()
    dec = SpeculativeDecoder(model)
    sample = dec.sample(src, temperature=0.0, max_length=8).tokens
    assert model.training and all(m.training for m in model.modules())
    beam = dec.beam_search(src, beam_size=2, max_length=8).tokens
    assert model.training and all(m.training for m in model.modules())
    assert [t.tolist() for t in sample] == [t.tolist() for t in ref_sample]
    assert [t.tolist() for t in beam] == [t.tolist() for t in ref_beam]
    model.eval()
    SpeculativeDecoder(model).sample(src, max_length=2)
    assert not model.training
    # mixed modes: only the source transformer trains; it decodes in eval mode and keeps its flags
    model.source_transformer.train()
    flags = [m.training for m in model.modules()]
    assert any(flags) and not all(flags)
    assert [t.tolist() for t in dec.sample(src, temperature=0.0, max_length=8).tokens] == [t.tolist() for t in ref_sample]
    assert [m.training for m in model.modules()] == flags


def test_walk_gives_torchs_modules_and_parameters():
    """One walk for eval mode and Decoder.begin: the same objects in the same order as torch's two
    walks, shared modules and tied parameters once each (spear-tts ties the text logits to the
    text embedding)."""
    from tts_specdec.inputs import walk

    model = make_model(0)
    model.extra = torch.nn.ModuleList([model.source_transformer.layers[0][2], torch.nn.Linear(2, 2)])  # shared + new
    model.extra[1].bias = None
    modules, params = walk(model)
    assert len(modules) == len(list(model.modules())) and all(a is b for a, b in zip(modules, model.modules()))
    assert len(params) == len(list(model.parameters())) and all(a is b for a, b in zip(params, model.parameters()))


# ---- sizes: refused or lowered before anything is allocated ---------------------------------------


@pytest.fixture
def no_allocation(monkeypatch):
    """Encoding the source and making a KV cache fail the test: what a decode allocates first."""
    from tts_specdec.cache import KVCache
    from tts_specdec.decoder import Decoder

    def allocated(*args, **kwargs):
        raise AssertionError("the decoder allocated before the sizes were checked")

    monkeypatch.setattr(KVCache, "__init__", allocated)
    monkeypatch.setattr(Decoder, "encode", allocated)


@pytest.fixture(scope="module")
def shipped():
    from tts_specdec.speech import load_default

    return load_default()


TEXTS = ["The hard mountain is cold."]
# the calls: (what runs, the message, which must name the argument, its value and the range)
ABSURD = [
    (dict(method="beam_search", beam_size=10**6), r"^beam_size must be in \[1, 1024\], got 1000000$"),
    (dict(method="sample", gamma=10**6), r"^gamma must be in \[0, 256\], got 1000000$"),
    (dict(method="beam_search", beam_size=4, gamma=10**9), r"^gamma must be in \[0, 256\], got 1000000000$"),
]


def _refused_fast(call, match):
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as error:
        call()
    assert time.perf_counter() - start < 1.0 and "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs, match", ABSURD)
def test_absurd_sizes_are_refused_before_allocating(shipped, no_allocation, kwargs, match):
    kwargs = dict(kwargs)
    method = kwargs.pop("method")
    _refused_fast(lambda: getattr(SpeculativeDecoder(shipped.model), method)(TEXTS, **kwargs), match)


@pytest.mark.parametrize("kwargs, match", ABSURD)
def test_absurd_sizes_through_generate_and_synthesize(shipped, no_allocation, kwargs, match):
    from tts_specdec import generate
    from tts_specdec.speech import Mode, synthesize

    kwargs = dict(kwargs)
    method = kwargs.pop("method")
    dropin = dict(beam_search_decode=method == "beam_search", progress=False)
    if "beam_size" in kwargs:
        dropin["beam_size"] = kwargs["beam_size"]
    if "gamma" in kwargs:
        dropin.update(spec_decode=True, spec_decode_gamma=kwargs["gamma"])
    _refused_fast(lambda: generate(shipped.model, TEXTS, **dropin), match)
    _refused_fast(lambda: synthesize(shipped, TEXTS, Mode("absurd", method, **kwargs)), match)


def test_size_ceilings():
    from tts_specdec.inputs import MAX_BEAM_SIZE, MAX_FIXED_GAMMA, check_beam_size, check_draft_width, check_gamma

    assert check_beam_size(MAX_BEAM_SIZE, 12, upstream=False) == MAX_BEAM_SIZE  # past the vocabulary: standard
    with pytest.raises(ValueError, match=r"beam_size must be in \[1, 1024\], got 1025"):
        check_beam_size(MAX_BEAM_SIZE + 1, 10**6, upstream=False)
    with pytest.raises(ValueError, match=r"beam_size must be <= the vocabulary \(12\)"):
        check_beam_size(13, 12, upstream=True)
    assert check_gamma(MAX_FIXED_GAMMA, 2) == MAX_FIXED_GAMMA and check_gamma("auto", 2) == "auto"
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 256\], got 257"):
        check_gamma(MAX_FIXED_GAMMA + 1, 2)
    assert check_draft_width(10**9, 4, 13) == 4 * 13 and check_draft_width(None, 4, 13) is None
    with pytest.raises(ValueError, match="draft_width must be >= 4, got 3"):
        check_draft_width(3, 4, 13)


def test_gamma_past_max_length_is_lowered_where_the_result_cannot_change(src):
    """Greedy decoding and beam search: the tokens of gamma 0 (float64: beam scores to rounding), with
    max_length - 1 drafts. Sampling keeps its gamma: a seeded run's draws depend on it."""
    dec = SpeculativeDecoder(make_model(0, dtype=torch.float64))
    plain = dec.sample(src, temperature=0.0, gamma=0, max_length=5)
    greedy = dec.sample(src, temperature=0.0, gamma=200, max_length=5)
    assert [t.tolist() for t in greedy.tokens] == [t.tolist() for t in plain.tokens] and greedy.stats.gamma == 4
    sampled = dec.sample(src, temperature=1.0, gamma=200, max_length=5, generator=torch.Generator().manual_seed(0))
    assert sampled.stats.gamma == 200
    beams = dec.beam_search(src, beam_size=2, gamma=0, max_length=5)
    spec = dec.beam_search(src, beam_size=2, gamma=200, draft_width=10**9, max_length=5)
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in beams.tokens]
    assert spec.scores == pytest.approx(beams.scores, abs=1e-9)
    assert spec.stats.gamma == 4


def _caches(monkeypatch):
    """Bytes of K/V of every cache made from now on."""
    from tts_specdec.cache import KVCache

    made, init = [], KVCache.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self.k.nbytes + self.v.nbytes)

    monkeypatch.setattr(KVCache, "__init__", record)
    return made


@pytest.mark.parametrize("gamma, cond_scale", [(0, 1.0), (3, 1.0), (3, 2.0)])
def test_planned_cache_is_the_cache_allocated(monkeypatch, gamma, cond_scale):
    """The sizes checked against the memory are the ones the loops allocate."""
    from tts_specdec import speculative

    model = make_model(0, cond_drop_prob=0.2 if cond_scale > 1 else 0.0)
    dec, src = SpeculativeDecoder(model), make_source(3, 5)
    rows = 3 * (2 if cond_scale > 1 else 1)
    made = _caches(monkeypatch)
    dec.sample(src, temperature=0.0, gamma=gamma, max_length=9, cond_scale=cond_scale)
    assert made == [dec.decoder.cache_bytes(rows, speculative.cache_positions(9, gamma))]
    made.clear()
    dec.beam_search(src, beam_size=2, gamma=gamma, draft_width=5, max_length=9, cond_scale=cond_scale)
    assert made == [dec._beam_plan(3, 2, cond_scale > 1, gamma, 5, 9)["KV cache"]]


def test_a_plan_past_the_device_memory_is_refused(dec, src, monkeypatch):
    from tts_specdec import inputs
    from tts_specdec.decoder import Decoder

    plain = dec._beam_plan(2, 3, False, 0, 3, 6)
    spec = dec._beam_plan(2, 3, False, 2, 5, 6)
    assert set(plain) == {"KV cache"} and spec["draft tree"] >= 2 * 3 * (1 + 2 * 5) ** 2  # the ancestor masks
    monkeypatch.setattr(inputs, "device_memory", lambda device: sum(plain.values()))  # fits exactly
    assert dec.beam_search(src, beam_size=3, gamma=0, max_length=6).tokens
    monkeypatch.setattr(inputs, "device_memory", lambda device: sum(plain.values()) - 1)
    monkeypatch.setattr(Decoder, "encode", lambda *a, **k: pytest.fail("encoded before the memory check"))
    kib = sum(plain.values()) / 1024
    with pytest.raises(ValueError, match=rf"^a batch of 2, beam_size=3, gamma=0, max_length=6: this call plans "
                                         rf"{kib:.1f} KiB \(KV cache {kib:.1f} KiB\), more than the {kib:.1f} KiB "
                                         r"of memory of this cpu device; lower one of them$"):
        dec.beam_search(src, beam_size=3, gamma=0, max_length=6)
    with pytest.raises(ValueError, match=r"gamma=2, draft_width=5, .*\(KV cache .* \+ draft tree .*\)"):
        dec.beam_search(src, beam_size=3, gamma=2, draft_width=5, max_length=6)
    monkeypatch.setattr(inputs, "device_memory", lambda device: 1)
    with pytest.raises(ValueError, match=r"^a batch of 2 \(2 rows each: cond_scale > 1\), gamma=4, max_length=6: "
                                         r"this call plans .* more than the 1 B of memory"):
        SpeculativeDecoder(make_model(0, cond_drop_prob=0.2)).sample(src, gamma=4, max_length=6, cond_scale=2.0)


def test_device_memory_is_the_hosts():
    from tts_specdec.inputs import device_memory

    memory = device_memory(torch.device("cpu"))
    assert memory is None or 2**28 < memory < 2**50
