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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13])
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
