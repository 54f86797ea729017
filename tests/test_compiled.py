"""compile=True: static-shape steps under torch.compile(fullgraph=True) decode what the default path decodes.

On the CPU the graphs are compiled with the "aot_eager" backend (the same tracing, functionalization
and graph capture as inductor, without generating code: seconds instead of minutes on two cores); one
test runs inductor itself. The decoders are shared by the module's tests: each graph is compiled once. GPU-only tests carry the `cuda` marker and skip without CUDA.
"""

import copy
import functools

import pytest
import torch
from torch._dynamo.utils import counters

from tts_specdec import SpeculativeDecoder, speculative
from tts_specdec.backends import StaticCompiled, TorchEager, static_compiled
from tts_specdec.sampling import SamplingConfig, probabilities

from conftest import make_model, make_source, uncompiled_graph

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 20
BACKEND = "aot_eager"


def assert_same_tokens(a, b):
    assert [t.tolist() for t in a] == [t.tolist() for t in b]


@pytest.fixture(scope="module")
def models():
    """float64 models (the default path's arithmetic and the compiled one agree to ~1e-15: no token can
    flip), an EOS reachable within MAX_LEN for some rows; one trained with guidance, with grouped kv heads."""
    return {"plain": make_model(0, dtype=torch.float64),
            "cfg": make_model(5, heads=4, kv_heads=1, cond_drop_prob=0.5, dtype=torch.float64)}


@pytest.fixture(scope="module")
def compiled(models):
    """One compiled decoder per model for the whole module (graphs are compiled once per decoder)."""
    return {name: SpeculativeDecoder(m, compile=BACKEND) for name, m in models.items()}


@pytest.fixture(scope="module")
def source():
    return make_source(5, 7, seed=2, lengths=[7, 5, 7, 2, 6])  # ragged; rows end at EOS and at MAX_LEN


@pytest.mark.parametrize("gamma,confidence", [(0, None), (3, None), (4, 0.6)], ids=["plain", "spec", "stops"])
@pytest.mark.parametrize("name,cond_scale", [("plain", 1.0), ("cfg", 3.0)])
def test_greedy_equals_default_path(models, compiled, source, name, cond_scale, gamma, confidence, monkeypatch):
    kwargs = dict(temperature=0.0, gamma=gamma, cond_scale=cond_scale, max_length=MAX_LEN, draft_confidence=confidence)
    ref = SpeculativeDecoder(models[name]).sample(source, **kwargs)
    eager = _count_torch_passes(monkeypatch)
    out = compiled[name].sample(source, **kwargs)
    assert not eager  # every layer pass ran as a graph
    assert compiled[name].decoder.backend.name == "compiled"
    lengths = [t.numel() for t in ref.tokens]
    if name == "plain":
        assert min(lengths) < MAX_LEN and max(lengths) == MAX_LEN, lengths  # EOS and max_length both met
    assert_same_tokens(out.tokens, ref.tokens)
    if gamma:
        assert (out.stats.accepted, out.stats.drafted) == (ref.stats.accepted, ref.stats.drafted)
    if confidence:  # rows stopped drafting early, at counts the device found as the host rule does
        assert ref.stats.drafted < gamma * sum(ref.stats.accepted_hist)


def test_bf16_model_speculates_exactly_on_the_compiled_path(source):
    """A bf16 model (`model.to(torch.bfloat16)`) on the compiled path on the CPU computes in float32
    (`weights.compute_dtype`): speculative greedy decoding == greedy decoding and speculative beam search ==
    beam search, as for float32. On a GPU it computes in bf16, where no row-count invariance is built yet:
    `recipes/device_check.py --dtype bfloat16` (in `make gpu-check`) reports it there."""
    dec = SpeculativeDecoder(make_model(0).to(torch.bfloat16), compile=BACKEND)
    kw = dict(temperature=0.0, max_length=MAX_LEN)
    plain = dec.sample(source, gamma=0, **kw)
    assert dec.decoder.dtype == torch.float32 and dec.decoder.backend.name == "compiled"
    assert_same_tokens(dec.sample(source, gamma=3, **kw).tokens, plain.tokens)
    beam = dec.beam_search(source, beam_size=3, gamma=0, max_length=MAX_LEN)
    spec = dec.beam_search(source, beam_size=3, gamma=1, draft_width=6, max_length=MAX_LEN)
    assert_same_tokens(spec.tokens, beam.tokens)


def test_plain_sampling_draws_as_step_by_step(models, compiled, source, monkeypatch):
    """With the termination check after every step, the compiled steps take exactly the step-by-step
    loop's random numbers: the same tokens from the same seed (top-k, guidance)."""
    monkeypatch.setattr(speculative, "PLAIN_STEPS", 1)
    kwargs = dict(temperature=0.8, top_k=5, gamma=0, cond_scale=2.0, max_length=MAX_LEN)
    ref = SpeculativeDecoder(models["cfg"]).sample(source, generator=torch.Generator().manual_seed(3), **kwargs)
    out = compiled["cfg"].sample(source, generator=torch.Generator().manual_seed(3), **kwargs)
    assert_same_tokens(out.tokens, ref.tokens)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0, gamma=0), dict(temperature=0.8, top_k=5, gamma=0),
                                    dict(temperature=0.8, gamma=3), dict(temperature=0.0, gamma=4, draft_confidence=0.6),
                                    dict(temperature=0.8, gamma=4, draft_confidence=0.6)],
                         ids=["greedy", "sample", "spec-sample", "spec-greedy-stops", "spec-sample-stops"])
def test_recorded_runs_decode_as_graph_per_step(models, compiled, source, kwargs, monkeypatch):
    """Runs recorded as one CUDA graph (plain runs, whole speculative cycles) keep their own input buffers,
    refilled each call, and random numbers drawn in the step-by-step order: off CUDA the same buffers and
    code run unrecorded, and give the tokens of one graph per step from the same seed (guidance on, ragged
    rows); a second decode reuses the first one's runs. Their bodies run with "meta" as the default device:
    a tensor made there without naming its device (on a GPU: a host tensor, whose copy a capture cannot
    hold) fails the run."""
    real_body = static_compiled._Run._body

    def body_without_a_default_device(self, run):
        with torch.device("meta"):
            return real_body(self, run)

    monkeypatch.setattr(static_compiled._Run, "_body", body_without_a_default_device)
    # the steps as plain Python, outside the meta default (a torch function mode)
    monkeypatch.setattr(StaticCompiled, "_graph", uncompiled_graph)
    # a cycle per run (the default): the batch's rows end at different cycles (runs of cycles: the next test)
    monkeypatch.setattr(speculative, "CYCLES_PER_RUN", 1)
    kwargs = dict(kwargs, cond_scale=2.0, max_length=MAX_LEN)
    dec = SpeculativeDecoder(models["cfg"], compile=BACKEND)
    dec.sample(source[:1], **dict(kwargs, max_length=2))  # the backend is chosen on the first call
    backend = dec.decoder.backend
    backend.record_runs = True
    ref = compiled["cfg"].sample(source, generator=torch.Generator().manual_seed(4), **kwargs)
    out = dec.sample(source, generator=torch.Generator().manual_seed(4), **kwargs)
    assert_same_tokens(out.tokens, ref.tokens)
    assert out.stats.layer_evals == ref.stats.layer_evals
    runs = dict(backend._runs)
    kinds = {k[0] for k in runs}
    assert kinds == ({"cycle"} if kwargs["gamma"] else {"plain"}), kinds  # a cycle's draft phase is in it
    again = dec.sample(source, generator=torch.Generator().manual_seed(4), **kwargs)
    assert_same_tokens(again.tokens, ref.tokens)
    assert again.stats.layer_evals == ref.stats.layer_evals
    # the same runs replayed, none recorded anew: the next decode's cache got the pooled K/V storage (a run
    # that kept the last decode's cache alive would hold it back, and every decode would record again)
    assert list(backend._runs) == list(runs) and all(backend._runs[k] is r for k, r in runs.items())


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0, gamma=3), dict(temperature=0.0, gamma=4, draft_confidence=0.6),
                                    dict(temperature=0.8, gamma=3), dict(temperature=0.8, top_k=5, gamma=4, draft_confidence=0.6)],
                         ids=["greedy", "greedy-stops", "sample", "sample-stops"])
def test_runs_of_cycles_decode_as_a_cycle_per_run(models, source, kwargs, monkeypatch):
    """Where cycles are recorded, a run holds up to CYCLES_PER_RUN cycles (one launch, one read-back) and
    every row takes every cycle of it; what a row took after its end is dropped. Greedy: the same tokens as
    one graph per step for a ragged batch (rows end at EOS and at max_length in the middle of runs), with
    guidance. Sampling: each row alone gives the same tokens from the same seed (the run draws the step-by-step
    order); in a batch a row that ended still draws until its run ends, so a seeded batch differs, as
    plain runs do (`test_sampling_keeps_its_law`)."""
    monkeypatch.setattr(StaticCompiled, "_graph", uncompiled_graph)
    monkeypatch.setattr(speculative, "CYCLES_PER_RUN", 4)  # the default is 1 (docs/gpu.md); the mechanism stays
    kwargs = dict(kwargs, cond_scale=2.0, max_length=MAX_LEN)
    # a cycle per run (not recorded: on the CPU the default), and runs of cycles; decoders of their own (the
    # module's keep their buffer pools to the shapes other tests ask for)
    per_cycle, dec = (SpeculativeDecoder(models["cfg"], compile=BACKEND) for _ in range(2))
    dec.sample(source[:1], **dict(kwargs, max_length=2))  # the backend is chosen on the first call
    backend = dec.decoder.backend
    backend.record_runs = True
    calls = []
    run_cycle = backend.run_cycle
    monkeypatch.setattr(backend, "run_cycle", lambda *a, **k: calls.append(a[1][2]) or run_cycle(*a, **k))
    seeded = lambda: dict(generator=torch.Generator().manual_seed(4)) if kwargs["temperature"] else {}  # noqa: E731
    batches = [source] if kwargs["temperature"] == 0 else [source[i : i + 1] for i in range(source.shape[0])]
    for batch in batches:
        ref = per_cycle.sample(batch, **seeded(), **kwargs)
        calls.clear()
        out = dec.sample(batch, **seeded(), **kwargs)
        assert_same_tokens(out.tokens, ref.tokens)
        if max(t.numel() for t in ref.tokens) > 8:
            assert max(calls) == speculative.CYCLES_PER_RUN, calls  # runs of several cycles happened
        cycles = sum(calls)
        assert out.stats.steps == cycles and len(calls) < cycles  # fewer read-backs than cycles
        if kwargs["temperature"] == 0:
            assert (out.stats.accepted, out.stats.drafted) == (ref.stats.accepted, ref.stats.drafted)


def test_seeded_sampling_repeats(compiled, source):
    runs = [compiled["cfg"].sample(source, temperature=0.8, top_k=5, gamma=0, cond_scale=2.0, max_length=MAX_LEN,
                                   generator=torch.Generator().manual_seed(9)).tokens for _ in range(2)]
    assert_same_tokens(*runs)


def test_sampling_keeps_its_law(models, compiled):
    """Runs of N steps draw for every row at every step (rows past EOS too), so a seeded run's tokens
    differ from the default path's; each token is still one exponential race on fresh noise over the
    target's distribution. Checked on the first token's law (p known in closed form: one plain step) and
    on speculative sampling's output, whose first token must follow the same law."""
    model, dec = models["plain"], compiled["plain"]
    source = make_source(1, 7, seed=0).expand(2000, -1)  # max_length 1: every row runs the one step
    d = SpeculativeDecoder(model).decoder
    d.begin()
    with torch.no_grad():
        enc = d.encode(source[:1])
        cache = d.new_cache(1, 4)
        logits = d.target_logits(d.run(d.start(1), 0, range(d.depth), enc, cache))[0, 0]
    law = probabilities(logits, SamplingConfig(1.0))
    for gamma, confidence in ((0, None), (2, None), (3, 0.6)):
        out = dec.sample(source, temperature=1.0, gamma=gamma, max_length=1, draft_confidence=confidence,
                         generator=torch.Generator().manual_seed(0))
        first = torch.stack([t[0] if t.numel() else torch.tensor(d.eos_id) for t in out.tokens])
        freq = torch.bincount(first, minlength=law.numel()).double() / first.numel()
        tv = 0.5 * float((freq[: law.numel()] - law).abs().sum())
        assert tv < 0.06, (gamma, tv)  # 2000 draws over 13 tokens: the expected TV is ~0.03


def test_top_k_one_is_greedy(models, compiled, source):
    greedy = SpeculativeDecoder(models["plain"]).sample(source, temperature=0.0, gamma=0, max_length=MAX_LEN)
    out = compiled["plain"].sample(source, temperature=1.0, top_k=1, gamma=3, max_length=MAX_LEN,
                                   generator=torch.Generator().manual_seed(1))  # drafts, q and p all one-hot
    assert_same_tokens(out.tokens, greedy.tokens)


@pytest.mark.parametrize("semantics", ["standard", "upstream"])
@pytest.mark.parametrize("name,cond_scale", [("plain", 1.0), ("cfg", 2.0)])
def test_beam_search_equals_default_path(models, compiled, source, name, cond_scale, semantics, monkeypatch):
    """Plain beam search's layer step is a compiled verify pass over a cache by value (beams reorder K/V);
    speculative beam search's draft levels and verify pass are compiled tree passes, padded to static
    sizes: the same hypotheses as the default path either way (ragged rows, items ending at EOS and at
    max_length, guidance)."""
    for gamma, width in ((0, None), (2, None), (2, 3), (3, 5)):  # None: the default width (4 for 3 beams)
        kwargs = dict(beam_size=3, gamma=gamma, max_length=12, cond_scale=cond_scale, beam_semantics=semantics)
        if width:
            kwargs["draft_width"] = width
        ref = SpeculativeDecoder(models[name]).beam_search(source, **kwargs)
        lengths = [t.numel() for t in ref.tokens]
        assert min(lengths) < 12 and max(lengths) == 12, lengths
        counters.clear()
        eager = _count_torch_passes(monkeypatch)
        out = compiled[name].beam_search(source, **kwargs)
        assert_same_tokens(out.tokens, ref.tokens)
        assert out.scores == pytest.approx(ref.scores, rel=1e-12)
        assert not counters["graph_break"]
        assert not eager  # every layer pass ran as a graph: none on torch's ops


def test_no_graph_breaks_and_graphs_do_not_grow_with_length(models):
    """fullgraph=True raises on any graph break; the graphs compiled for a short decode serve a decode
    three times as long (capacity buckets, positions as tensors): none is added."""
    dec = SpeculativeDecoder(models["plain"], compile=BACKEND)
    source = make_source(1, 7, seed=5)
    model_eos = dec.decoder.eos_id
    dec.decoder.eos_id = None  # no EOS: every decode runs to max_length, batch 1 throughout
    try:
        counters.clear()
        for gamma in (0, 3):
            dec.sample(source, temperature=0.0, gamma=gamma, max_length=16)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and not counters["graph_break"]
        for gamma in (0, 3):
            out = dec.sample(source, temperature=0.0, gamma=gamma, max_length=48)
            assert out.tokens[0].numel() == 48
        assert counters["stats"]["unique_graphs"] == graphs
        assert not counters["graph_break"]
    finally:
        dec.decoder.eos_id = model_eos


def test_a_third_source_length_compiles_nothing(models):
    """Source length is a shape: the first length compiles the graphs, a second compiles them once more with
    the length dynamic (torch.compile's automatic dynamic shapes; none when torch's on-disk profile of an
    earlier run already marked it dynamic), and later lengths reuse those graphs. A fixed gamma: under
    greedy decoding's default "auto" the arms a call tries follow the clock, and an arm first tried on the
    third length compiles its own graphs (seen once in CI: [10, 2, 1, 0])."""
    dec = SpeculativeDecoder(models["plain"], compile=BACKEND)
    compiled = []
    for n in (7, 4, 9, 5):
        counters.clear()
        kw = dict(temperature=0.0, max_length=12, gamma=3)
        ref = SpeculativeDecoder(models["plain"]).sample(make_source(1, n, seed=n), **kw)
        out = dec.sample(make_source(1, n, seed=n), **kw)
        assert_same_tokens(out.tokens, ref.tokens)
        compiled.append(counters["stats"]["unique_graphs"])
    assert compiled[0] > 0 and compiled[2:] == [0, 0], compiled


def test_speculative_beam_graphs_do_not_grow_with_length(models):
    """Speculative beam search's tree passes: no graph breaks, and a decode three times as long adds no
    graph (levels of the draft width, the whole tree for verify, capacity buckets)."""
    dec = SpeculativeDecoder(models["plain"], compile=BACKEND)
    source = make_source(2, 7, seed=5)
    model_eos = dec.decoder.eos_id
    dec.decoder.eos_id = None  # no EOS: both items run to max_length together
    try:
        counters.clear()
        kwargs = dict(beam_size=3, gamma=3, draft_width=4)
        # every cycle shape: full trees, and the shorter ones near max_length; both decodes' caches are in
        # the same capacity bucket (max_length + 2 + gamma * width <= 64)
        short = dec.beam_search(source, max_length=16, **kwargs)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0 and not counters["graph_break"]
        long = dec.beam_search(source, max_length=48, **kwargs)
        assert [t.numel() for t in short.tokens + long.tokens] == [16, 16, 48, 48]
        assert long.stats.steps > 2 * short.stats.steps  # cycles
        assert counters["stats"]["unique_graphs"] == graphs
        assert not counters["graph_break"]
    finally:
        dec.decoder.eos_id = model_eos


def _count_torch_passes(monkeypatch) -> list:
    """A list that gets an entry for every layer pass run on torch's ops from now on."""
    calls, run = [], TorchEager.run_layers

    def counted(self, *args, **kwargs):
        calls.append(args[2])
        return run(self, *args, **kwargs)

    monkeypatch.setattr(TorchEager, "run_layers", counted)
    return calls


def test_cache_buffers_are_reused_once_free(compiled):
    """The static backend's caches take K/V storage from a `cache.BufferPool`: the storage of the last
    cache of the same shape once that cache is gone or moved to other storage (CUDA graphs read the
    cache in place: a fixed address spares a re-recording per decode), zeroed, and never storage a live
    cache still holds."""
    dec = compiled["plain"].decoder
    with torch.inference_mode():  # as the decoding calls run
        _pool_hands_on_free_storage(dec)


def _pool_hands_on_free_storage(dec):
    first = dec.new_cache(2, 64)
    address = first.k.data_ptr()
    first.k.fill_(float("nan"))
    del first
    second = dec.new_cache(2, 64)
    assert second.k.data_ptr() == address and not second.k.any() and not second.v.any()
    third = dec.new_cache(2, 64)  # second is alive: fresh storage
    address = third.k.data_ptr()
    assert address != second.k.data_ptr()
    del third
    fourth = dec.new_cache(2, 64)
    assert fourth.k.data_ptr() == address
    fourth.k[:, 1].fill_(3.0)
    fourth.high = 64
    fourth.reorder(torch.tensor([1]))  # a row dropped: gathered into the first row of the same storage
    assert fourth.k.shape[1] == 1 and fourth.k.data_ptr() == address and bool((fourth.k == 3.0).all())
    fifth = dec.new_cache(2, 64)
    assert fifth.k.data_ptr() != address  # fourth still holds that storage, as a view
    fourth.grow(200)  # doubling to a power of two (64 -> 256), on new storage
    assert fourth.capacity == 256 and fourth.k.data_ptr() != address


def test_decodes_repeat_on_reused_buffers(compiled, source):
    """A decode on storage a finished decode left (poisoned with NaN in between: the pool must zero it)
    returns what the first returned; rows that end keep the cache's storage."""
    dec = compiled["cfg"]
    pool = dec.decoder.backend._pool

    def poison():
        with torch.inference_mode():
            for k, v, _ in pool._held.values():
                k.fill_(float("nan"))
                v.fill_(float("nan"))

    kwargs = dict(temperature=0.0, gamma=3, cond_scale=3.0, max_length=MAX_LEN)
    first = dec.sample(source, **kwargs).tokens
    poison()
    assert_same_tokens(dec.sample(source, **kwargs).tokens, first)
    beam_first = dec.beam_search(source, beam_size=3, gamma=2, max_length=12).tokens
    poison()
    assert_same_tokens(dec.beam_search(source, beam_size=3, gamma=2, max_length=12).tokens, beam_first)
    # rows ended at different cycles: one storage per shape requested, not one per row count
    assert len(pool._held) <= 3, list(pool._held)


def test_capacity_buckets():
    assert [StaticCompiled.capacity(n) for n in (1, 64, 65, 200, 256, 257)] == [64, 64, 128, 256, 256, 512]
    assert TorchEager.capacity(65) == 65


def test_compile_argument_is_checked(models):
    with pytest.raises(TypeError, match="compile"):
        SpeculativeDecoder(models["plain"], compile=1)
    assert SpeculativeDecoder(models["plain"]).decoder.backend.name in ("kernels", "torch")


def test_shipped_model_speculative_greedy_equals_default_path():
    """The shipped checkpoint in float32 (the default path: the C++ kernels): the same tokens, two ragged
    rows, one ending at EOS."""
    from tts_specdec.speech import load_default

    model = load_default().model
    texts = ["hello there, how are you?", "a short one"]
    kwargs = dict(temperature=0.0, gamma=4, max_length=90)
    ref = SpeculativeDecoder(model).sample(texts, **kwargs)
    assert min(t.numel() for t in ref.tokens) < 90
    assert_same_tokens(SpeculativeDecoder(model, compile=BACKEND).sample(texts, **kwargs).tokens, ref.tokens)


def test_inductor_greedy_equals_default_path():
    """The one inductor test (code generation takes a while on a CPU): float32, one plain graph."""
    model = make_model(3, std=0.3)
    source = make_source(1, 6, seed=1)
    kwargs = dict(temperature=0.0, gamma=0, max_length=12)
    ref = SpeculativeDecoder(model).sample(source, **kwargs)
    assert_same_tokens(SpeculativeDecoder(model, compile=True).sample(source, **kwargs).tokens, ref.tokens)


def test_inductor_speculative_beam_equals_default_path():
    """inductor's code for the tree passes (draft levels, verify) and the beam step: float32, a ragged
    batch of 2."""
    model = make_model(3, std=0.3)
    source = make_source(2, 6, seed=1, lengths=[6, 4])
    kwargs = dict(beam_size=3, gamma=2, max_length=12)
    ref = SpeculativeDecoder(model).beam_search(source, **kwargs)
    out = SpeculativeDecoder(model, compile=True).beam_search(source, **kwargs)
    assert_same_tokens(out.tokens, ref.tokens)


@pytest.mark.parametrize("products", ["linear", "all"])
def test_products_as_reductions_decode_as_the_default_path(models, source, products, monkeypatch):
    """The compiled steps with their products (and attention's: "all", CUDA's default) written as sums of
    products (`static_compiled.products`) give the default path's tokens: speculative greedy decoding with
    guidance and grouped kv heads, seeded sampling step by step, and speculative beam search."""
    assert static_compiled.products(torch.device("cuda")) == "all" or static_compiled.PRODUCTS
    assert static_compiled.products(torch.device("cpu")) == "blas" or static_compiled.PRODUCTS
    monkeypatch.setattr(static_compiled, "PRODUCTS", products)
    monkeypatch.setattr(speculative, "PLAIN_STEPS", 1)
    dec = SpeculativeDecoder(models["cfg"], compile=BACKEND)
    ref = SpeculativeDecoder(models["cfg"])
    for kwargs in (dict(temperature=0.0, gamma=3, cond_scale=3.0), dict(temperature=0.8, top_k=5, gamma=0, cond_scale=2.0)):
        want = ref.sample(source, generator=torch.Generator().manual_seed(3), max_length=MAX_LEN, **kwargs)
        got = dec.sample(source, generator=torch.Generator().manual_seed(3), max_length=MAX_LEN, **kwargs)
        assert_same_tokens(got.tokens, want.tokens)
    w = dec.decoder.backend.w
    assert w.layers[0].qkv.t().is_contiguous() and w.target.t().is_contiguous()  # (out, in) memory
    kwargs = dict(beam_size=3, gamma=2, draft_width=6, max_length=MAX_LEN)
    assert_same_tokens(dec.beam_search(source, **kwargs).tokens, ref.beam_search(source, **kwargs).tokens)


# ---- GPU (skipped without CUDA) ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("gamma", [0, 4], ids=["plain", "spec"])
def test_cuda_graphs_greedy_equal_default_path(gamma):
    """inductor with mode="reduce-overhead" (CUDA graphs) on the GPU: the tokens of the default (eager)
    path on the same GPU, the shipped model, batch 1 and a ragged batch of 3."""
    from tts_specdec.speech import load_default

    speech = load_default()
    model = speech.model.cuda()
    texts = ["the quick brown fox jumps over the lazy dog", "hello there", "a third, longer sentence to read aloud"]
    kwargs = dict(temperature=0.0, gamma=gamma, max_length=200)
    for batch in (texts[:1], texts):
        ref = SpeculativeDecoder(model).sample(batch, **kwargs)
        out = SpeculativeDecoder(model, compile=True).sample(batch, **kwargs)
        assert_same_tokens(out.tokens, ref.tokens)


@pytest.mark.cuda
def test_cuda_seeded_sampling_is_reproducible():
    from tts_specdec.speech import load_default

    model = load_default().model.cuda()
    dec = SpeculativeDecoder(model, compile=True)
    runs = [dec.sample(["hello there"], temperature=1.0, gamma=0, max_length=100,
                       generator=torch.Generator("cuda").manual_seed(7)).tokens for _ in range(2)]
    assert_same_tokens(*runs)


@pytest.mark.cuda
@pytest.mark.parametrize("gamma", [0, 2], ids=["beam", "spec-beam"])
def test_cuda_graphs_beam_search_equals_default_path(gamma):
    """Beam search (gamma 0) and speculative beam search (its tree passes as CUDA graphs) under compile on
    the GPU: the default path's hypotheses on the same GPU, a ragged batch of 2."""
    from tts_specdec.speech import load_default

    model = load_default().model.cuda()
    texts = ["the quick brown fox jumps over the lazy dog", "hello there"]
    kwargs = dict(beam_size=4, gamma=gamma, max_length=200)
    ref = SpeculativeDecoder(model).beam_search(texts, **kwargs)
    out = SpeculativeDecoder(model, compile=True).beam_search(texts, **kwargs)
    assert_same_tokens(out.tokens, ref.tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("gamma", [0, 4], ids=["plain", "spec"])
def test_cuda_recorded_runs_equal_a_graph_per_step(gamma):
    """Recorded runs on the GPU (a plain run or a whole speculative sampling cycle captured as one CUDA
    graph, TTS_SPECDEC_RECORD_RUNS): the tokens of one graph per step, greedy for a ragged batch of 3 and
    sampled from the same seed for one row (each configuration compiles its own graphs: on an H100's host
    batch 1 and 3 with both temperatures did not finish in 230 s); a capture that fails raises, so this also
    proves the capture holds. A second decode records nothing."""
    from tts_specdec.speech import load_default

    model = load_default().model.cuda()
    texts = ["the quick brown fox jumps over the lazy dog", "hello there", "a third, longer sentence to read aloud"]
    decoders = []
    for record in (False, True):
        dec = SpeculativeDecoder(model, compile=True)
        # the backend is chosen on the first call (the one-row sampling below: the same graphs unrecorded)
        dec.sample(texts[:1], temperature=1.0, gamma=gamma, max_length=2)
        dec.decoder.backend.record_runs = record
        decoders.append(dec)
    for batch, temperature in ((texts, 0.0), (texts[:1], 1.0)):
        step, recorded = (d.sample(batch, temperature=temperature, gamma=gamma, max_length=200,
                                   generator=torch.Generator("cuda").manual_seed(3)) for d in decoders)
        assert_same_tokens(recorded.tokens, step.tokens)
    runs = dict(decoders[1].decoder.backend._runs)
    assert runs, "nothing was recorded"
    again = decoders[1].sample(texts[:1], temperature=1.0, gamma=gamma, max_length=200,
                               generator=torch.Generator("cuda").manual_seed(3))
    assert_same_tokens(again.tokens, step.tokens)
    assert list(decoders[1].decoder.backend._runs) == list(runs)  # replayed, nothing recorded anew


@pytest.mark.cuda
def test_cuda_plain_steps_do_not_synchronise():
    """A run of compiled plain steps (greedy and sampling) makes no synchronising CUDA call: checked with
    torch.cuda.set_sync_debug_mode("error") on a call after the graphs were recorded (the loop's one
    read-back per run is the caller's, outside the call)."""
    from tts_specdec.speech import load_default

    model = load_default().model.cuda()
    for temperature in (0.0, 1.0):
        tokens = _plain_run(model, temperature, "cuda", check=_no_sync)
        assert tokens.shape == (1, 8)


def _plain_run(model, temperature: float, device: str, check) -> torch.Tensor:
    """A compiled decoder's `plain_steps` (8 steps from the start token of one sentence), called three
    times (warm-up, graph recording, first replay), then once more inside `check` (a context manager)."""
    from tts_specdec.inputs import prepare_source

    dec = SpeculativeDecoder(model, compile=True)
    d = dec.decoder
    d.begin()
    cfg, generator = SamplingConfig(temperature), torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        enc = d.encode(prepare_source(model, ["hello there"]))
        cache = d.new_cache(enc.rows, 256)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(3):
            d.backend.plain_steps(d.start(1), pos, 8, cfg, generator, enc, cache)
        with check():
            tokens, _ = d.backend.plain_steps(d.start(1), pos, 8, cfg, generator, enc, cache)
    return tokens


class _no_sync:
    """Within: any synchronising CUDA call raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("recorded", [False, True], ids=["graph-per-step", "recorded-run"])
def test_autotune_switch_compiles_with_max_autotune_on_cuda_only(models, monkeypatch, recorded):
    """TTS_SPECDEC_AUTOTUNE=1: on CUDA with inductor a step compiles with max-autotune (CUDA graphs of its
    own where it would have them, replayed as such; none inside a recorded run); anywhere else the mode is
    unchanged. torch.compile is replaced by a recorder: nothing compiles."""
    modes = []
    monkeypatch.setattr(static_compiled, "AUTOTUNE", True)
    monkeypatch.setattr(static_compiled.torch, "compile", lambda fn, **kw: modes.append(kw["mode"]) or fn)
    model = copy.deepcopy(models["cfg"])  # its tensors are marked static for CUDA: not the module's model
    backend = StaticCompiled(SpeculativeDecoder(model).decoder, "inductor")
    backend.record_runs = recorded
    step = backend._graph(static_compiled._plain_step, torch.device("cuda"), heads=2)
    assert modes == ["max-autotune-no-cudagraphs" if recorded else "max-autotune"]
    assert isinstance(step, functools.partial) != recorded  # graphs of its own are replayed (outputs cloned)
    backend._graph(static_compiled._plain_step, torch.device("cpu"), heads=2)
    assert modes[-1] is None
    StaticCompiled(SpeculativeDecoder(model).decoder, "aot_eager")._graph(
        static_compiled._plain_step, torch.device("cuda"), heads=2)
    assert modes[-1] is None
