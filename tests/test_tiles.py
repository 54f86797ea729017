"""torch's path runs every product in calls of ROWS tokens and attention in calls of ROWS queries over keys
padded to KEYS (`tiles`), so a token's result does not depend on how many tokens share the call, and every
speculative mode returns its plain mode's result to the bit there: in float32 (torch's own float32
products and attention break the invariance on the AMD EPYC Zen 4 these tests were written on) and in half
precision computed in its own dtype (a GPU's case; on the CPU only when the compute dtype is forced)."""

import pytest
import torch
import torch.nn.functional as F

from tts_specdec import SpeculativeDecoder, tiles
from tts_specdec.backends import static_compiled
from tts_specdec.masks import additive

from conftest import make_model, make_source

BF16 = torch.bfloat16


def tokens(out):
    return [t.tolist() for t in out.tokens]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """torch's products split rows over threads by their count: each count checked."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def native(monkeypatch):
    """Decoding computes in the model's own dtype on the CPU too (`TTS_SPECDEC_HALF=native`), on torch's
    ops (the kernels run float32 only)."""
    import tts_specdec.weights as weights

    monkeypatch.setattr(weights, "NATIVE_HALF", True)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rows_runs_fixed_tiles(dtype):
    w = torch.randn(8, 24)
    x = torch.randn(37, 8).to(dtype)
    calls = []

    def f(t):
        calls.append(t.shape[0])
        return t @ w.to(t.dtype)

    y = tiles.rows(f, x)
    assert calls == [tiles.ROWS] * 3 and y.shape == (37, 24)
    calls.clear()
    assert torch.equal(y, torch.cat([tiles.rows(f, t) for t in x.split(1)]))  # row by row: the same bits
    assert calls == [tiles.ROWS] * 37
    torch.testing.assert_close(y.float(), x.float() @ w, atol=0.05 if dtype == BF16 else 1e-5, rtol=0.02)
    assert tiles.rows(f, x[:0]).shape == (0, 24)
    # the tokens on another dim of f's output, and two inputs split alike
    xb = x.to(BF16)
    z = tiles.rows(lambda a, b: torch.stack((a, b)), xb, xb + 1, dim=1)
    assert torch.equal(z, torch.stack((xb, xb + 1)))


# widths around the narrow ones (5-7 and 9-11 columns lost the invariance even in tiles: `weights._NARROW`)
@pytest.mark.parametrize("width", [5, 8, 11, 12, 16, 40, 130])
def test_a_products_rows_keep_their_bits_whatever_shares_the_call(width, threads):
    """torch's float32 product of a row, alone and among 2-40 rows at either end: the same bits, for
    `weights._normed_mm` (heads and projections) and `_residual` as torch's path runs them. Untiled, a row
    took other bits in calls of 4 rows or more than alone on the CPU this was written on (at 2 threads at
    other counts too); a model's feed-forward split into blocks: tests/test_spec_beam.py's split layout."""
    from tts_specdec.weights import _normed_mm, _residual

    g = torch.Generator().manual_seed(width)
    w, w_res = torch.randn(24, width, generator=g), torch.randn(24, width, generator=g)
    x, a = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    res = torch.randn(40, width, generator=g)
    products = {
        "normed": lambda i, j: _normed_mm(x[i:j], w),
        "residual": lambda i, j: _residual(res[i:j], a[i:j], w_res),
    }
    for name, f in products.items():
        alone = torch.cat([f(i, i + 1) for i in range(40)])
        for rows in (2, 3, 4, 5, 16, 17, 40):
            for start in (0, 40 - rows):
                assert torch.equal(f(start, start + rows), alone[start : start + rows]), (name, rows, start)


@pytest.mark.parametrize("n, m, masked", [(1, 10, False), (5, 70, True), (17, 129, True), (40, 64, False)])
def test_attention_tiles_compute_attention(n, m, masked):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 3, s, 16, generator=g) for s in (n, m, m))
    mask = None
    if masked:  # causal over the last n keys, as a verify pass
        mask = additive(torch.arange(m) <= m - n + torch.arange(n)[:, None], torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(tiles.attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    got = tiles.attention(q.to(BF16), k.to(BF16), v.to(BF16), None if mask is None else mask.to(BF16))
    assert got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, atol=0.03, rtol=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_query_attends_alike_whatever_shares_the_call(dtype, threads):
    """The verify pass's case: queries at positions s..s+n-1 over keys 0..s+n-1 (causal), against the
    one-query step at each position over its keys 0..p; bit for bit (torch's own op, untiled, gave other
    bits at some positions on the CPU this was written on, in bf16 and in float32)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 600, 64, generator=g).to(dtype) for _ in range(3))
    for n in (3, 5, 11):  # every position up to 200, and verify passes whose keys run past 512
        for s in [*range(0, 200 - n, n), *range(500, 515)]:
            end = s + n
            mask = additive(torch.arange(end) <= s + torch.arange(n)[:, None], dtype)
            verify = tiles.attention(q[:, :, s:end], k[:, :, :end], v[:, :, :end], mask)
            for j in range(n):
                p = s + j
                step = tiles.attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1])
                assert torch.equal(step[:, :, 0], verify[:, :, j]), (n, p)


@pytest.mark.parametrize("prefix, m", [(60, 90), (100, 600)])  # keys padded alike; to 128 vs 640
@pytest.mark.parametrize("op", [tiles._sdpa, static_compiled._attend], ids=["sdpa", "compiled"])
def test_gathered_attention_meets_scattered_keys_as_a_step_does(op, prefix, m):
    """A tree node sees its prefix and ancestors with siblings' slots between them: the same bits as a
    step over those keys alone, in slot order; for torch's attention op and the compiled path's."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, s, 32, generator=g).to(BF16) for s in (4, m, m))
    seen = torch.zeros(2, 1, 4, m, dtype=torch.bool)
    seen[..., :prefix] = True
    hidden = torch.randperm(30, generator=g)[:12] + prefix  # each query also sees a few scattered slots
    for j in range(4):
        seen[:, 0, j, hidden[: 3 * j + 1]] = True
    got = tiles.gathered_attention(q, k, v, additive(seen, BF16), op)
    for r in range(2):
        for j in range(4):
            keys = seen[r, 0, j].nonzero()[:, 0]
            step = tiles.attention(q[r : r + 1, :, j : j + 1], k[r : r + 1, :, keys], v[r : r + 1, :, keys], None, op)
            assert torch.equal(got[r, :, j], step[0, :, 0])
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=additive(seen, torch.float32))
    torch.testing.assert_close(got.float(), ref, atol=0.03, rtol=0.03)
    assert torch.equal(tiles.gathered_attention(q, k, v, seen, op), got)  # a bool mask: the same
    assert torch.equal(tiles.gathered_attention(q, k, v, None, op), tiles.attention(q, k, v, None, op))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("masked", [False, True])
def test_a_prepared_mask_gives_the_bits_of_the_raw_one(dtype, masked):
    """torch's path pads a pass's mask once for all its layers (`prepare`) and the source's keys once for
    the decode (`Encoded.dense(multiple)`): attention with them gives what it gives with the raw mask and
    keys, for keys padded by the call or already padded; an untiled dtype gets the raw mask back."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, s, 16, generator=g).to(dtype) for s in (5, 70, 70))
    mask = additive(torch.arange(70) <= 65 + torch.arange(5)[:, None], dtype) if masked else None
    prepared = tiles.prepare(q, 5, 70, mask)
    assert isinstance(prepared, tiles.Mask)
    width = prepared.padded.shape[-1]
    assert width == -(-70 // tiles.key_multiple(q)) * tiles.key_multiple(q)
    ref = tiles.attention(q, k, v, mask)
    assert torch.equal(tiles.attention(q, k, v, prepared), ref)
    k_p, v_p = (F.pad(t, (0, 0, 0, width - 70)) for t in (k, v))
    assert torch.equal(tiles.attention(q, k_p, v_p, prepared), ref)
    if dtype == torch.float32:
        assert tiles.prepare(q.double().to("meta"), 5, 70, mask) is mask  # a GPU's float32 is untiled: here a meta tensor


def test_encoded_dense_pads_the_source_keys_once():
    dec = SpeculativeDecoder(make_model(seed=4)).decoder
    enc = dec.encode(make_source(3, 9, seed=5))
    keys, values = enc.dense()
    padded_keys, padded_values = enc.dense(64)
    length = keys.shape[-2]
    assert padded_keys.shape[-2] == -(-length // 64) * 64
    assert torch.equal(padded_keys[..., :length, :], keys) and not padded_keys[..., length:, :].any()
    assert torch.equal(padded_values[..., :length, :], values) and not padded_values[..., length:, :].any()
    assert enc.dense(64)[0] is padded_keys  # made once


def test_attention_takes_bool_masks():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, s, 16, generator=g).to(BF16) for s in (5, 70, 70))
    seen = torch.arange(70) <= 65 + torch.arange(5)[:, None]
    assert torch.equal(tiles.attention(q, k, v, seen), tiles.attention(q, k, v, additive(seen, BF16)))


@pytest.mark.parametrize("guided, compile", [(False, False), (True, False), (True, "aot_eager")],
                         ids=["plain", "cfg", "cfg-compiled"])
def test_bf16_speculative_modes_equal_plain_modes_in_bf16(native, guided, compile, one_thread, monkeypatch):
    """Computing in bf16 (not widened), on torch's path and the compiled static path (traced as on a
    GPU, run by aot_eager): speculative greedy == greedy, speculative beam search == beam search (tokens
    and scores), a batch == each row alone. Untiled, torch's path fails this on these models; the
    compiled case passes untiled too (its keys are the whole static cache already): it checks that the
    compiled path traces and runs with the tiles (the shipped model's compiled case, which failed
    untiled, compiles for minutes)."""
    model = (make_model(5, heads=4, kv_heads=1, cond_drop_prob=0.5) if guided else make_model(0)).to(BF16)
    dec = SpeculativeDecoder(model, compile=compile)
    assert dec.decoder.dtype == BF16 and dec.decoder.backend.name == ("compiled" if compile else "torch")
    tiled, rows = [], tiles.rows
    if not compile:  # (a list appended to while dynamo traces makes it recompile every call)
        monkeypatch.setattr(tiles, "rows", lambda f, *xs, dim=0: tiled.append(len(xs[0])) or rows(f, *xs, dim=dim))
    source = make_source(3, 6, seed=1, lengths=[6, 4, 5])
    kw = dict(max_length=24, cond_scale=3.0 if guided else 1.0)
    greedy = tokens(dec.sample(source, temperature=0.0, gamma=0, **kw))
    for gamma in (3,) if compile else (1, 3, 5):  # each compiled shape traces for seconds: the fewest
        assert tokens(dec.sample(source, temperature=0.0, gamma=gamma, **kw)) == greedy
    for row in range(0 if compile else 3):
        assert tokens(dec.sample(source[row : row + 1], temperature=0.0, gamma=3, **kw)) == greedy[row : row + 1]
    beam = dec.beam_search(source, beam_size=3, gamma=0, **kw)
    for gamma, width in ((3, 6),) if compile else ((1, 4), (3, 6)):
        spec = dec.beam_search(source, beam_size=3, gamma=gamma, draft_width=width, **kw)
        assert tokens(spec) == tokens(beam)
        assert spec.scores == beam.scores
    assert compile or tiled  # the products ran in tiles


def test_shipped_model_speculates_exactly_in_bf16(native):
    """The shipped model in bf16 on sentences where torch's untiled ops made speculative greedy decoding
    and speculative beam search (gamma 3, W 12) differ from their plain modes (CPU, 2026-11-30)."""
    from tts_specdec.speech import load_speech_model
    from tts_specdec.speech.pipeline import default_max_length
    from tts_specdec.speech.references import heldout_sentences

    model = load_speech_model().model.eval().to(BF16)
    dec = SpeculativeDecoder(model)
    texts = heldout_sentences(12)
    for text, beams in ((texts[11], False), (texts[1], True)):
        source = model.tokenizer_encode([text])
        n = default_max_length(source)
        greedy = dec.sample(source, temperature=0.0, gamma=0, max_length=n).tokens
        assert dec.sample(source, temperature=0.0, gamma=4, max_length=n).tokens[0].tolist() == greedy[0].tolist()
        if beams:
            beam = dec.beam_search(source, beam_size=4, gamma=0, max_length=n)
            spec = dec.beam_search(source, beam_size=4, gamma=3, draft_width=12, max_length=n)
            assert spec.tokens[0].tolist() == beam.tokens[0].tolist() and spec.scores == beam.scores


def test_float32_on_torchs_path_a_row_decodes_alone_as_in_its_batch(one_thread, monkeypatch):
    """The case `TTS_SPECDEC_KERNELS=0 python tools/fuzz_equivalence.py --seed 82` found: a tiny model with
    weights of standard deviation 1 encoded a batch of two sources ~4e-4 apart from one alone in the first
    logits (its products ran 4 rows, not 2), where two tokens lay 1e-4 apart, and greedy decoding's first
    token differed. In tiles a row decodes alone as in its batch, plainly and speculatively."""
    import tts_specdec.kernels as kernels

    monkeypatch.setattr(kernels, "ENABLED", False)
    seed = 607606
    model = make_model(seed, dim=48, heads=4, dim_head=8, kv_heads=1, target_depth=5, exit_layer=4, eos=False,
                       semantic_vocab=12, std=1.0, source_depth=1, cond_drop_prob=0.1)
    dec = SpeculativeDecoder(model)
    source = make_source(2, 1, seed=seed, lengths=[1, 1])
    plain = tokens(dec.sample(source, temperature=0.0, gamma=0, max_length=33))
    assert dec.decoder.backend.name == "torch"
    assert tokens(dec.sample(source, temperature=0.0, gamma=8, max_length=33)) == plain
    for row in range(2):
        assert tokens(dec.sample(source[row : row + 1], temperature=0.0, gamma=8, max_length=33)) == plain[row : row + 1]
