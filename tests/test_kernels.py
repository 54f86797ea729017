"""The small-product kernel against torch's products: every row remainder, bias, residual, strides."""

import os

import pytest
import torch

from tts_specdec import kernels
from tts_specdec.kernels import Packed


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", True)


def test_builds_here():
    """CI machines have a compiler: a build failure here would silently slow every decode down."""
    if os.environ.get("TTS_SPECDEC_KERNELS") == "0":
        pytest.skip("disabled by TTS_SPECDEC_KERNELS=0")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the kernel is for AVX2 CPUs; torch's products run here")
    assert kernels.unavailable_reason() is None
    assert kernels.available("cpu", torch.float32)


def test_build_lock_removes_what_a_killed_build_left(tmp_path):
    """torch waits forever on a `lock` file left by a build that was killed: holding our flock proves
    no live build of the folder owns it, so it is removed instead of waited on."""
    (tmp_path / "lock").write_text("")
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_first_use_does_not_hang_on_a_stale_lock(tmp_path):
    """The whole path of a first use in a new process, as CI meets it: the built extension's folder
    holds the `lock` file of a killed build. The kernels load (no rebuild: the build is complete) within
    the timeout instead of waiting forever."""
    import shutil
    import subprocess
    import sys

    if os.environ.get("TTS_SPECDEC_KERNELS") == "0" or not kernels.available():
        pytest.skip("the kernels do not run here")
    built = kernels._build_dir
    root = tmp_path / "ext"
    shutil.copytree(built, root / "py310_cpu" / built.name)  # the folder name is the source digest
    (root / "py310_cpu" / built.name / "lock").write_text("")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root / "py310_cpu"))
    code = "from tts_specdec import kernels; print(kernels.unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
    assert not (root / "py310_cpu" / built.name / "lock").exists()


def test_build_lock_waits_for_a_live_build_then_gives_up(tmp_path, monkeypatch):
    """A build in another live process keeps its lock file; past the wait the caller gets an error
    (and `_load` falls back to torch's products), never a hang."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
         " fcntl.flock(fd, fcntl.LOCK_EX); (open(sys.argv[2], 'w').close()); print('held', flush=True);"
         " time.sleep(60)", str(tmp_path / "tts_specdec.flock"), str(tmp_path / "lock")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(kernels, "BUILD_WAIT_SECONDS", 0.5)
        with pytest.raises(TimeoutError, match="another process"):
            with kernels._build_lock(tmp_path):
                pass
        assert (tmp_path / "lock").exists()  # a live build's lock is left alone
    finally:
        holder.kill()
        holder.wait()
    with kernels._build_lock(tmp_path):  # its holder died: the flock is free and the lock file stale
        assert not (tmp_path / "lock").exists()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 29, 40])
@pytest.mark.parametrize("shape", [(37, 16), (256, 768), (682, 256)])
def test_equals_torch(rows, shape, threads):
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows)
        w = torch.randn(shape, generator=g)
        x = torch.randn(rows, shape[0], generator=g)
        bias = torch.randn(shape[1], generator=g)
        res = torch.randn(rows, shape[1], generator=g)
        p = Packed(w)
        k = shape[0]

        def close(got, x_, extra=0.0):
            # the worst-case bound of float32 summation: |error| <= (k + 2) u (|x| @ |w| + |extra|)
            ref = x_.double() @ w.double() + extra
            bound = (k + 2) * 2.0**-24 * (x_.double().abs() @ w.double().abs() + torch.as_tensor(extra).double().abs())
            return bool(((got.double() - ref).abs() <= bound).all())

        assert close(p(x), x)
        assert close(p(x, bias, res), x, bias.double() + res.double())
        # views with row strides wider than their width (slices of larger tensors)
        xs = torch.randn(rows, k + 5, generator=g)[:, 3 : 3 + k]
        rs = torch.randn(rows, 2 * shape[1], generator=g)[:, : shape[1]]
        assert close(p(xs, residual=rs), xs, rs.double())
        # normalised rows (F.normalize), and a zero row (the norm's floor, no division by zero)
        xz = x.clone()
        xz[0] = 0
        unit = xz.double() / xz.double().norm(dim=-1, keepdim=True).clamp_min(1e-12)
        assert close(p(xz, bias, normalize=True), unit.float(), bias.double())
        # a non-unit column stride is copied, not misread
        xt = torch.randn(k, rows, generator=g).t()
        assert close(p(xt), xt)
    finally:
        torch.set_num_threads(before)


def _isas() -> list[str]:
    """The instruction sets the products can run on here (AVX-512 only where the CPU has it)."""
    if not kernels.available():
        return []
    return ["avx2", "avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


@pytest.fixture
def isa_restored():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    before = kernels.isa()
    yield
    kernels.isa(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_row_result_independent_of_batch(threads, isa_restored):
    """A row's product is the same to the bit whatever rows share the call, on every instruction set:
    few rows take several panels per tile, more rows one tile of up to 6 (AVX2) or 14 (AVX-512) rows, many
    rows several tiles (AVX-512: of up to 7 rows x 4 panels; float32 beyond 7 rows strips of up to 8 rows x 1
    panel over chunks of 4 slabs), all in the same summation order (speculative == plain relies on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(7)
        # 1, 7, 5, 4 and 9 panels: whole groups of 4 and partial ones
        for shape in [(37, 16), (128, 112), (300, 80), (64, 64), (96, 144)]:
            p = Packed(torch.randn(shape, generator=g))
            x = torch.randn(33, shape[0], generator=g)
            bias = torch.randn(shape[1], generator=g)
            for isa in _isas():
                kernels.isa(isa)
                alone = torch.cat([p(x[i : i + 1], bias, normalize=True) for i in range(33)])
                for rows in [*range(1, 17), 20, 28, 29, 33]:
                    for first in (0, 33 - rows):
                        got = p(x[first : first + rows], bias, normalize=True)
                        assert torch.equal(got, alone[first : first + rows]), (isa, shape, rows, first)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_weights_sum_as_cache_resident_ones(threads, isa_restored):
    """A matrix beyond 1 MB streams from memory and takes other tiles (unrolled term loops, tiles that
    share the asks ahead: `small_gemm.cpp`'s kStreamBytes; float32 strips over chunks that end within a
    group's terms, 21 slabs in chunks of 4): every row count gives each row's bits alone,
    and the bits of the same columns multiplied as cache-resident slices (the same sums in the same
    order), a last slab of an odd number of terms and a partial group of panels included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        # 1.2 MB: 21 slabs of terms, the last 11 (odd: the unrolled term loops end on a single term); 29 panels
        w = torch.randn(651, 464, generator=g)
        big, parts = Packed(w), [Packed(w[:, c : c + 128]) for c in range(0, 464, 128)]  # <= 333 KB each
        assert big.panels.numel() * 4 > 1 << 20 and all(q.panels.numel() * 4 < 1 << 20 for q in parts)
        x, bias = torch.randn(33, 651, generator=g), torch.randn(464, generator=g)
        for isa in _isas():
            kernels.isa(isa)
            alone = torch.cat([big(x[i : i + 1], bias, normalize=True) for i in range(33)])
            sliced = torch.cat([q(x, bias[c : c + 128], normalize=True) for q, c in zip(parts, range(0, 464, 128))], 1)
            assert torch.equal(alone, sliced), isa
            for rows in [*range(1, 17), 20, 28, 29, 33]:
                for first in (0, 33 - rows):
                    got = big(x[first : first + rows], bias, normalize=True)
                    assert torch.equal(got, alone[first : first + rows]), (isa, rows, first)
    finally:
        torch.set_num_threads(before)


def test_instruction_sets_give_the_same_bits(isa_restored):
    """AVX2 and AVX-512 sum every element in the same order: the same bits (so a result does not
    depend on the machine's vector width either), for products, residuals and normalised rows."""
    if len(_isas()) < 2:
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(3)
    for rows in (1, 3, 6, 9, 14, 21, 40):
        w = torch.randn(200, 208, generator=g)  # 13 panels: 3 groups and one panel
        x, res = torch.randn(rows, 200, generator=g), torch.randn(rows, 208, generator=g)
        bias = torch.randn(208, generator=g)
        p = Packed(w)
        out = {}
        for isa in ("avx2", "avx512"):
            kernels.isa(isa)
            out[isa] = (p(x, bias, res), p(x, normalize=True))
        assert all(torch.equal(a, b) for a, b in zip(out["avx2"], out["avx512"])), rows


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_panels_sum_as_float32_panels_of_the_rounded_weights(threads, isa_restored):
    """bfloat16 panels hold each weight rounded to bfloat16 once and widen it exactly in the product: the
    bits of float32 panels holding the rounded values, on every instruction set and at every row count
    (so a row's result still does not depend on what shares the call), residuals and row norms included;
    also beyond 1 MB, where the weights stream and the tiles unroll (on AVX2 they widen a panel's 16
    weights from one load into its even and odd columns and put the columns back in order at the end)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(11)
        # the last: 1.2 MB of bfloat16 (streamed), 41 slabs of terms, the last 20; 29 panels
        for shape in [(200, 208), (512, 64), (96, 144), (1300, 464)]:
            w = torch.randn(shape, generator=g)
            half, wide = Packed(w, store=torch.bfloat16), Packed(w.to(torch.bfloat16).float())
            assert half.panels.dtype == torch.bfloat16 and half.panels.shape == wide.panels.shape
            assert (half.panels.numel() * 2 > 1 << 20) == (shape == (1300, 464))  # only the last streams
            x, res = torch.randn(33, shape[0], generator=g), torch.randn(33, shape[1], generator=g)
            bias = torch.randn(shape[1], generator=g)
            for isa in _isas():
                kernels.isa(isa)
                alone = torch.cat([half(x[i : i + 1], bias, res[i : i + 1]) for i in range(33)])
                for rows in [*range(1, 17), 20, 28, 29, 33]:
                    got = half(x[:rows], bias, res[:rows])
                    assert torch.equal(got, wide(x[:rows], bias, res[:rows])), (isa, shape, rows)
                    assert torch.equal(got, alone[:rows]), (isa, shape, rows)
                    assert torch.equal(half(x[:rows], normalize=True), wide(x[:rows], normalize=True)), (isa, rows)
    finally:
        torch.set_num_threads(before)


def test_panels_are_float32_or_bfloat16(isa_restored):
    with pytest.raises(ValueError, match="store"):
        Packed(torch.randn(16, 16), store=torch.float16)


def test_auto_isa_gives_the_same_bits_at_every_row_count(isa_restored):
    """"auto" takes tiles of several panels for a few rows and of up to 14 rows for more: a row's
    product must not change with the row count."""
    if len(_isas()) < 2:
        pytest.skip("this CPU has no AVX-512")
    kernels.isa("auto")
    g = torch.Generator().manual_seed(5)
    p = Packed(torch.randn(160, 144, generator=g))
    x = torch.randn(20, 160, generator=g)
    alone = torch.cat([p(x[i : i + 1]) for i in range(20)])
    for rows in (2, 6, 7, 20):
        assert torch.equal(p(x[:rows]), alone[:rows]), rows


def test_isa_rejects_unknown_names(isa_restored):
    with pytest.raises(RuntimeError, match="isa"):
        kernels.isa("sse2")


def test_rejects_partial_panel():
    with pytest.raises(ValueError, match="w_t"):
        Packed(torch.zeros(8, 20))


def test_not_for_other_dtypes_or_when_disabled(monkeypatch):
    assert not kernels.available("cpu", torch.float64)
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not kernels.available("cpu", torch.float32)
    assert not Packed.fits(torch.zeros(8, 16))


@pytest.mark.parametrize("shape", [(256, 768), (682, 256)])
def test_rounding_no_worse_than_torch(shape):
    """Per product, the kernel's float32 error (blocked sums, the norm applied to the sums) is at most
    torch's (normalise, then MKL), both against float64, on average over random draws."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    err_kernel = err_torch = 0.0
    for _ in range(50):
        x = 3 * torch.randn(4, shape[0], generator=g)
        w = torch.randn(shape, generator=g) / shape[0] ** 0.5
        truth = torch.nn.functional.normalize(x.double(), dim=-1) @ w.double()
        err = lambda y: float((y.double() - truth).norm() / truth.norm())  # noqa: E731
        err_kernel += err(Packed(w)(x, normalize=True))
        err_torch += err(torch.nn.functional.normalize(x, dim=-1) @ w)
    assert err_kernel <= err_torch


def _needs_kernel():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())


def test_geglu_and_padded_width():
    """geglu: the product of h * gelu(gate) for x = [h | gate]; width: a padded head's columns cut off."""
    _needs_kernel()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    for rows in (1, 3, 6):
        x = torch.randn(rows, 96, generator=g) * 3
        res = torch.randn(rows, 32, generator=g)
        h, gate = x.double().chunk(2, dim=-1)
        act = torch.nn.functional.gelu(gate) * h
        ref = act @ w.double() + res.double()
        bound = 52 * 2.0**-24 * (act.abs() @ w.double().abs() + res.double().abs()) + 1e-6 * (act.abs() @ w.double().abs())
        assert ((Packed(w)(x, residual=res, geglu=True).double() - ref).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="geglu and normalize"):
        Packed(w)(x, geglu=True, normalize=True)
    head = Packed(torch.nn.functional.pad(w[:, :30], (0, 2)), width=30)
    y = head(x[:, :48])
    assert y.shape == (6, 30)
    torch.testing.assert_close(y, x[:, :48] @ w[:, :30], rtol=1e-5, atol=1e-5)


def _attention_ref(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(d) + mask) v; q (n, d), k/v (keys, d), mask (n, keys) additive."""
    s = q.double() @ k.double().T / q.shape[-1] ** 0.5 + mask.double()
    return s.softmax(dim=-1) @ v.double()


def _rotate_ref(t, cos, sin):
    swapped = t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return t.double() * cos.double() + swapped.double() * sin.double()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h, kvh", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_self_attention_matches_reference(h, kvh, masked, threads):
    """Rotary on q and k (at `pos`), k and v written at `slots`, each query over its row's keys: causal by
    slot, or under an explicit additive mask; kv head j % kvh serves query head j; ragged rows."""
    _needs_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(h * 10 + kvh + masked)
        rows, n, d, cap = 3, 4, 16, 40
        heads = torch.randn(rows * n, (h + 2 * kvh) * d, generator=g)
        cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
        k_cache, v_cache = torch.randn(rows, kvh, cap, d, generator=g), torch.randn(rows, kvh, cap, d, generator=g)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        slots = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [0, 1, 2, 3]])  # rows at different lengths
        pos = slots + torch.tensor([[0], [20], [3]])  # positions need not be the slots (tree nodes)
        keys = int(slots.max()) + 1
        mask = None
        if masked:
            mask = torch.where(torch.rand(rows, n, keys, generator=g) < 0.3, float("-inf"), 0.0)
            mask[torch.arange(rows)[:, None], torch.arange(n), slots] = 0.0  # each query sees its own slot
        out = kernels.self_attention(heads, cos, sin, pos, slots, k_cache, v_cache, mask, keys, h, kvh)
        t = heads.view(rows, n, h + 2 * kvh, d)
        for r in range(rows):
            c, s = cos[pos[r]][:, None], sin[pos[r]][:, None]
            q = _rotate_ref(t[r, :, :h], c, s)
            k_new, v_new = _rotate_ref(t[r, :, h : h + kvh], c, s), t[r, :, h + kvh :].double()
            k_ref, v_ref = k_before[r].double().clone(), v_before[r].double().clone()
            k_ref[:, slots[r]] = k_new.transpose(0, 1)
            v_ref[:, slots[r]] = v_new.transpose(0, 1)
            torch.testing.assert_close(k_cache[r].double(), k_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(v_cache[r].double(), v_ref)
            causal = torch.where(torch.arange(keys) <= slots[r][:, None], 0.0, float("-inf"))
            m = causal if mask is None else mask[r]
            for j in range(h):
                ref = _attention_ref(q[:, j], k_ref[j % kvh, :keys], v_ref[j % kvh, :keys], m)
                got = out.view(rows, n, h, d)[r, :, j]
                torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)
        # slots beyond `keys` were not touched
        torch.testing.assert_close(k_cache[:, :, keys:], k_before[:, :, keys:], rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("seed", range(4))
def test_self_attention_masked_keys_give_the_bits_of_the_visible_ones(seed):
    """A query under a mask that hides keys between visible ones (a tree node: its prefix and ancestors)
    gets the bits of the same query over only the visible keys, laid out one after another with no mask
    (a beam step): hidden keys are left out of every sum, not added as zero weights."""
    _needs_kernel()
    g = torch.Generator().manual_seed(seed)
    h, kvh, d, cap, keys = 4, 2, 16, 64, 37
    visible = [j for j in range(keys - 1) if torch.rand(1, generator=g) < 0.6]  # then the query's own slot
    heads = torch.randn(1, (h + 2 * kvh) * d, generator=g)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    k_tree, v_tree = torch.randn(1, kvh, cap, d, generator=g), torch.randn(1, kvh, cap, d, generator=g)
    mask = torch.full((1, 1, keys), float("-inf"))
    mask[0, 0, visible + [keys - 1]] = 0.0
    pos = torch.tensor([[50]])
    tree = kernels.self_attention(heads, cos, sin, pos, torch.tensor([[keys - 1]]), k_tree, v_tree, mask, keys, h, kvh)
    n = len(visible)
    k_step, v_step = torch.zeros(1, kvh, cap, d), torch.zeros(1, kvh, cap, d)
    k_step[:, :, :n], v_step[:, :, :n] = k_tree[:, :, visible], v_tree[:, :, visible]
    step = kernels.self_attention(heads, cos, sin, pos, torch.tensor([[n]]), k_step, v_step, None, n + 1, h, kvh)
    assert torch.equal(tree, step)
    # every key hidden (a padding query): zeros, not NaN
    none = kernels.self_attention(heads, cos, sin, pos, torch.tensor([[keys - 1]]), k_tree, v_tree,
                                  torch.full((1, 1, keys), float("-inf")), keys, h, kvh)
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d, keys", [(16, 600), (64, 300), (128, 150), (24, 70)])
def test_attention_queries_together_give_the_bits_of_each_alone(d, keys, threads):
    """A verify pass's queries (several per row, causal by slot) and cross attention's each get the bits
    of a call holding that query alone (a plain step), over hundreds of keys, with rows at other lengths,
    a masked source and a source row that sees nothing: what any kernel that shares a key's K and V rows
    among a row's queries must keep."""
    _needs_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(d + keys)
        rows, n, h, kvh, cap = 2, 11, 2, 2, keys + 16
        heads = torch.randn(rows * n, (h + 2 * kvh) * d, generator=g)
        cos, sin = torch.randn(cap, d, generator=g), torch.randn(cap, d, generator=g)
        k_cache, v_cache = torch.randn(rows, kvh, cap, d, generator=g), torch.randn(rows, kvh, cap, d, generator=g)
        slots = torch.stack([torch.arange(keys - n, keys), torch.arange(keys // 3, keys // 3 + n)])
        together = kernels.self_attention(heads, cos, sin, slots, slots, k_cache, v_cache, None, keys, h, kvh)
        for r in range(rows):
            for i in range(n):
                tok = r * n + i
                one = kernels.self_attention(heads[tok : tok + 1], cos, sin, slots[r : r + 1, i : i + 1],
                                             slots[r : r + 1, i : i + 1], k_cache[r : r + 1].clone(),
                                             v_cache[r : r + 1].clone(), None, int(slots[r, i]) + 1, h, kvh)
                assert torch.equal(together[tok], one[0]), (r, i)
        S = keys // 4 + 3
        q = torch.randn(rows * n, h * d, generator=g)
        src_k, src_v = torch.randn(rows, h, S, d, generator=g), torch.randn(rows, h, S, d, generator=g)
        mask = torch.where(torch.rand(rows, S, generator=g) < 0.3, float("-inf"), 0.25)
        mask[1] = float("-inf")  # a row that sees nothing: zeros
        for m in (None, mask):
            both = kernels.cross_attention(q, src_k, src_v, m)
            for r in range(rows):
                for i in range(n):
                    tok = r * n + i
                    alone = kernels.cross_attention(q[tok : tok + 1], src_k[r : r + 1], src_v[r : r + 1],
                                                    None if m is None else m[r : r + 1])
                    assert torch.equal(both[tok], alone[0]), (r, i, m is None)
        assert torch.equal(both[n:], torch.zeros_like(both[n:]))
    finally:
        torch.set_num_threads(before)


def test_cross_attention_matches_reference():
    _needs_kernel()
    g = torch.Generator().manual_seed(1)
    rows, n, h, S, d = 3, 2, 2, 23, 24
    q = torch.randn(rows * n, h * d, generator=g)
    keys, values = torch.randn(rows, h, S, d, generator=g), torch.randn(rows, h, S, d, generator=g)
    mask = torch.where(torch.arange(S) < torch.tensor([[23], [10], [1]]), 0.0, float("-inf"))
    for m in (None, mask):
        out = kernels.cross_attention(q, keys, values, m).view(rows, n, h, d)
        for r in range(rows):
            for j in range(h):
                mr = torch.zeros(n, S) if m is None else m[r].expand(n, S)
                ref = _attention_ref(q.view(rows, n, h, d)[r, :, j], keys[r, j], values[r, j], mr)
                torch.testing.assert_close(out[r, :, j].double(), ref, rtol=2e-5, atol=2e-5)


def test_attention_propagates_nan():
    """A NaN key or query gives NaN, as float64 softmax does (none may pass for a masked key, whose
    weight would be 0); -inf alone is masked; rows without NaN are untouched."""
    _needs_kernel()
    g = torch.Generator().manual_seed(2)
    rows, n, h, S, d = 3, 2, 1, 9, 16
    q = torch.randn(rows * n, h * d, generator=g)
    keys, values = torch.randn(rows, h, S, d, generator=g), torch.randn(rows, h, S, d, generator=g)
    keys[0, 0, 4, 3] = float("nan")  # row 0: one key, every query of the row sees it
    q.view(rows, n, h, d)[1, 1, 0, 5] = float("nan")  # row 1: its second query
    mask = torch.zeros(rows, S)
    mask[2, 6:] = float("-inf")
    out = kernels.cross_attention(q, keys, values, mask).view(rows, n, h, d)
    assert out[0].isnan().all() and out[1, 1].isnan().all() and out[1, 0].isfinite().all()
    for r, i in ((1, 0), (2, 0), (2, 1)):
        ref = _attention_ref(q.view(rows, n, h, d)[r, i : i + 1, 0], keys[r, 0], values[r, 0], mask[r : r + 1])
        torch.testing.assert_close(out[r, i, 0].double(), ref[0], rtol=2e-5, atol=2e-5)


def test_filtered_probs_of_a_nan_row_are_nan():
    """Logits with NaN or inf give NaN probabilities (torch's softmax does too) without sorting NaN for
    top-p; the other rows are as before."""
    _needs_kernel()
    from tts_specdec.sampling import SamplingConfig, filter_logits

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    logits[1, 7], logits[2, 0] = float("nan"), float("inf")
    probs = kernels.filtered_probs(logits, 0.8, 10, 0.9)
    assert probs[1:3].isnan().all()
    ref = filter_logits(logits[[0, 3]], SamplingConfig(0.8, 10, 0.9)).softmax(-1)
    torch.testing.assert_close(probs[[0, 3]], ref, rtol=1e-5, atol=1e-6)


def test_verify_accept_greedy_reads_logits_as_torch_argmax():
    """The fused cycle tail (`kernels.verify_accept`, greedy) picks each position's token as torch's argmax
    does (the first of tied maxima, the first NaN where a logit is NaN) and keeps drafts as `greedy_accept`
    does (up to a row's limit, a draft of -1 never kept); its read-back, next input and advance follow."""
    _needs_kernel()
    import torch.nn.functional as F

    from tts_specdec.sampling import greedy_accept

    g = torch.Generator().manual_seed(5)
    dim, V, rows, gamma = 32, 40, 6, 3
    e = F.normalize(torch.randn(dim, generator=g), dim=0)
    w = 0.1 * torch.randn(dim, V, generator=g)
    w[:, 3] = w[:, 7] = 5 * e  # rows along e: columns 3 and 7 tie at the maximum
    head = kernels.Head([], Packed(F.pad(w, (0, -V % 16)), width=V))
    emb = torch.randn(V, 8, generator=g)
    h = torch.randn(rows * (gamma + 1), dim, generator=g)
    h[::3] = e * torch.rand(h[::3].shape[0], 1, generator=g).add(0.5)
    h[5, 0] = h[14, 2] = float("nan")  # two positions with every logit NaN
    logits = head(h)
    logits_nan_one = logits.clone()
    top = logits.argmax(-1).view(rows, gamma + 1)
    assert (top.view(-1)[::3] == 3).all() and (top.view(-1)[[5, 14]] == 0).all()
    drafts = top[:, :gamma].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # rejected at once
    drafts[2, 1] = -1  # a NONFINITE draft
    limit = torch.tensor([3, 3, 3, 1, 0, 2])
    for lim in (None, limit):
        read, x, advance = kernels.verify_accept(head, emb, h, drafts, None, lim, 0.0, None, None, None)
        ref = greedy_accept(top, drafts, lim)
        assert read[:, 0].long().tolist() == ref.accepted.tolist()
        assert read[:, 1].long().tolist() == ref.next_token.tolist()
        assert torch.equal(read[:, 2:6].isfinite(), logits_nan_one.sum(-1, dtype=torch.float64).view(rows, -1).isfinite())
        assert torch.equal(read[:, 6:9].long(), drafts)
        assert read.shape[1] == 9 + (lim is not None) and (lim is None or torch.equal(read[:, 9].long(), lim))
        assert torch.equal(x[:, 0], emb[ref.next_token]) and torch.equal(advance, ref.accepted + 1)
    assert ref.accepted.tolist() != [0] * rows and len(set(ref.accepted.tolist())) > 2  # the cases vary


def test_attention_rejects_bad_arguments():
    _needs_kernel()
    heads = torch.randn(2, 3 * 16)
    cos = sin = torch.randn(8, 16)
    cache = torch.zeros(1, 1, 8, 16)
    slots = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.self_attention(heads, cos, sin, slots, slots + 7, cache, cache.clone(), None, 8, 1, 1)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.cross_attention(torch.randn(1, 12), torch.randn(1, 1, 3, 12), torch.randn(1, 1, 3, 12), None)


def test_geglu_elementwise_accuracy():
    """Through an identity product the output is h * gelu(gate) itself: within a few float32 ulp of |g h|
    (erf to 1.5e-7, as torch's vectorised erf), over gates from -12 to 12 and the scalar tail."""
    _needs_kernel()
    g = torch.Generator().manual_seed(3)
    gate = torch.linspace(-12, 12, 4 * 48 - 5)
    gate = torch.cat((gate, torch.zeros(5))).view(4, 48)  # the zeros: gelu(0) = 0 exactly
    h = torch.randn(4, 48, generator=g)
    got = Packed(torch.eye(48))(torch.cat((h, gate), dim=1), geglu=True).double()
    ref = torch.nn.functional.gelu(gate.double()) * h.double()
    assert ((got - ref).abs() <= 4e-7 * (gate.double() * h.double()).abs()).all()
    # 12 units: one vector of 8, then 4 through the scalar tail
    tail = Packed(torch.eye(12, 16))(torch.cat((h[:, :12], gate[:, 30:42]), dim=1), geglu=True)[:, :12].double()
    ref = torch.nn.functional.gelu(gate[:, 30:42].double()) * h[:, :12].double()
    assert ((tail - ref).abs() <= 4e-7 * (gate[:, 30:42].double() * h[:, :12].double()).abs()).all()


def test_stack_rejects_bad_arguments():
    """The layer stack checks its weights once and every call's arguments before touching memory."""
    _needs_kernel()
    dim, h, d, inner = 32, 2, 16, 32
    g = torch.Generator().manual_seed(0)
    panels = lambda i, o: Packed(torch.randn(i, o, generator=g)).panels  # noqa: E731
    layer = [panels(dim, 3 * h * d), panels(h * d, dim), panels(dim, h * d), panels(h * d, dim),
             panels(dim, 2 * inner), torch.zeros(2 * inner), panels(inner, dim), torch.zeros(dim)]
    with pytest.raises(RuntimeError, match="qkv"):
        kernels.Stack([panels(dim, 2 * h * d)] + layer[1:], h, h, d)
    with pytest.raises(RuntimeError, match="tensors per layer"):
        kernels.Stack(layer[:7], h, h, d)
    stack = kernels.Stack(layer * 2, h, h, d)
    rows, n, cap, S = 1, 2, 8, 3
    cos = sin = torch.randn(cap, d)
    slots = torch.tensor([[0, 1]])
    k_all, v_all = torch.zeros(2, rows, h, cap, d), torch.zeros(2, rows, h, cap, d)
    enc = torch.randn(2, rows, h, S, d)
    x = torch.randn(rows * n, dim)
    args = lambda **kw: {**dict(x=x, layers=range(2), cos=cos, sin=sin, pos=slots, slots=slots, k_all=k_all,  # noqa: E731
                                v_all=v_all, table=None, mask=None, keys=2, enc_keys=enc, enc_values=enc,
                                cross_mask=None), **kw}
    assert stack.run(**args()).shape == (rows * n, dim)
    with pytest.raises(RuntimeError, match="outside"):
        stack.run(**args(layers=range(1, 3)))
    with pytest.raises(RuntimeError, match="x:"):
        stack.run(**args(x=torch.randn(rows * n + 1, dim)))
    with pytest.raises(RuntimeError, match="out of range"):
        stack.run(**args(slots=slots + 1))
    with pytest.raises(RuntimeError, match="capacity"):
        stack.run(**args(keys=cap + 1))
    with pytest.raises(RuntimeError, match="k_all"):
        stack.run(**args(k_all=torch.zeros(1, rows, h, cap, d)))
    with pytest.raises(RuntimeError, match="enc_keys"):
        stack.run(**args(enc_keys=enc[:, :, :1]))
    with pytest.raises(RuntimeError, match="mask"):
        stack.run(**args(mask=torch.zeros(1, n, 3)))
    # a slot table: (rows, capacity) naming cache rows that exist
    assert stack.run(**args(table=torch.zeros(rows, cap, dtype=torch.long))).shape == (rows * n, dim)
    with pytest.raises(RuntimeError, match="table"):
        stack.run(**args(table=torch.ones(rows, cap, dtype=torch.long)))
    with pytest.raises(RuntimeError, match="table"):
        stack.run(**args(table=torch.zeros(rows, cap - 1, dtype=torch.long)))


def test_fingerprint_sees_every_change():
    """`Decoder.begin`'s change check: equal bytes give equal sums; one changed word (a last bit, a
    word in the tail, a sign) or two swapped words (same lane, other lane) change them; a strided
    tensor reads as its contiguous copy; off the CPU there is no fingerprint."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in (1, 7, 8, 9, 100, 4099)] + [torch.randint(0, 9, (5,), dtype=torch.uint8)]
    ref = kernels.fingerprint(base)
    assert len(ref) == 2 * len(base)
    assert kernels.fingerprint([t.clone() for t in base]) == ref

    def changed(i: int, edit) -> list[int]:
        ts = [t.clone() for t in base]
        edit(ts[i])
        return kernels.fingerprint(ts)

    def flip_last_bit(t: torch.Tensor, k: int) -> None:
        t.view(torch.int32)[k] ^= 1

    def swap(t: torch.Tensor, a: int, b: int) -> None:
        t[[a, b]] = t[[b, a]]

    edits = [
        (5, lambda t: flip_last_bit(t, 0)), (5, lambda t: flip_last_bit(t, 4098)),  # first word, tail word
        (2, lambda t: t.neg_()), (0, lambda t: t.mul_(2)), (6, lambda t: t.__setitem__(4, t[4] ^ 1)),
        (5, lambda t: swap(t, 0, 8)), (5, lambda t: swap(t, 1, 2)), (4, lambda t: t.copy_(t.flip(0))),
    ]
    for i, edit in edits:
        assert changed(i, edit) != ref
    wide = torch.randn(6, 10, generator=g)
    assert kernels.fingerprint([wide[:, ::2]]) == kernels.fingerprint([wide[:, ::2].contiguous()])
    assert kernels.fingerprint([torch.empty(3, device="meta")]) is None


def test_fingerprint_is_the_same_on_any_thread_count():
    """Over 4 MB the tensors are dealt to torch's threads: every tensor's sums are the same as on one
    thread, and its first sum is the sum of its 32-bit words mod 2^64 (a strided one's as its copy)."""
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g) for n in (3, 1 << 20, 5, 300_001, 1 << 18, 77)]
    tensors.append(torch.randn(700, 900, generator=g)[:, ::3])  # strided
    assert sum(t.numel() * 4 for t in tensors) > 1 << 22
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.fingerprint(tensors)
        torch.set_num_threads(max(2, threads))
        many = kernels.fingerprint(tensors)
    finally:
        torch.set_num_threads(threads)
    assert many == one
    for i, t in enumerate(tensors):
        words = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert one[2 * i] % 2**64 == int(words.sum()) % 2**64
