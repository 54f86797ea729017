// y = x @ W (+ bias) (+ residual) for the few-row products of decoding (float32, AVX2/FMA, CPU).
//
// W (in, out) is packed once as out/16 panels of (in, 16) floats, so each panel streams through
// memory once per call while 4 rows of x accumulate against it in registers (4 rows x 2 vectors).
// MKL runs such skinny products on one thread at a fraction of the bandwidth; here panels are split
// over torch's own intra-op threads (at::parallel_for), so the thread pool is shared with torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

void geglu_row(const float* h, const float* gate, float* out, int64_t n);  // attention.cpp, beside its exp

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;  // terms per partial sum
constexpr int64_t kMinTaskMacs = 1 << 17;  // below this a thread hand-off costs more than it saves

template <int R>
inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t in, float* y, int64_t ldy,
                       const float* scale, const float* bias, const float* res, int64_t ldr) {
  // blocked summation: each block of kBlock terms is summed on its own, then added to the total, so
  // rounding grows with kBlock + in / kBlock rather than with in (no worse than MKL's blocked sums)
  __m256 acc[R][2], blk[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += kBlock) {
    const int64_t k1 = std::min(in, k0 + kBlock);
    for (int r = 0; r < R; ++r) blk[r][0] = blk[r][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * kPanel), _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        blk[r][0] = _mm256_fmadd_ps(xb, w0, blk[r][0]);
        blk[r][1] = _mm256_fmadd_ps(xb, w1, blk[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_add_ps(acc[r][0], blk[r][0]);
      acc[r][1] = _mm256_add_ps(acc[r][1], blk[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 a0 = acc[r][0], a1 = acc[r][1];
    if (scale) {
      const __m256 s = _mm256_set1_ps(scale[r]);
      a0 = _mm256_mul_ps(a0, s);
      a1 = _mm256_mul_ps(a1, s);
    }
    if (bias) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
    }
    if (res) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(res + r * ldr));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(res + r * ldr + 8));
    }
    _mm256_storeu_ps(y + r * ldy, a0);
    _mm256_storeu_ps(y + r * ldy + 8, a1);
  }
}

}  // namespace

// x (rows, in) with unit column stride; packed (out / 16, in, 16); bias (out,); residual (rows, out).
// normalize: each row of x is divided by max(||x||, 1e-12) first (F.normalize), applied to the sums.
// geglu: x is (rows, 2 in) = [h | gate] and the product takes h * gelu(gate) (exact, erf) instead.
torch::Tensor small_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool normalize, bool geglu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.stride(1) == 1 && x_in.scalar_type() == at::kFloat, "x: float32 (rows, in), unit column stride");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
              packed.size(1) * (geglu ? 2 : 1) == x_in.size(1), "packed: contiguous (out / 16, in, 16) matching x");
  TORCH_CHECK(!(geglu && normalize), "geglu and normalize do not combine");
  torch::Tensor x = x_in;
  if (geglu) {
    const int64_t half = packed.size(1);
    x = torch::empty({x_in.size(0), half}, x_in.options());
    const float* src = x_in.data_ptr<float>();
    float* dst = x.data_ptr<float>();
    for (int64_t m = 0; m < x_in.size(0); ++m) {
      const float* hv = src + m * x_in.stride(0);
      geglu_row(hv, hv + half, dst + m * half, half);
    }
  }
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0), out = panels * kPanel;
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == out, "bias: contiguous (out,)");
  if (residual) TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == out &&
                            residual->stride(1) == 1, "residual: (rows, out), unit column stride");
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldr = residual ? residual->stride(0) : 0;
  std::vector<float> inv_norm(normalize ? rows : 0);
  for (int64_t m = 0; m < (normalize ? rows : 0); ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < in; ++k) ss += double(xp[m * ldx + k]) * xp[m * ldx + k];
    inv_norm[m] = float(1.0 / std::max(std::sqrt(ss), 1e-12));
  }
  const float* sp = normalize ? inv_norm.data() : nullptr;
  const int64_t macs_per_panel = std::max<int64_t>(1, rows * in * kPanel);
  const int64_t grain = std::max<int64_t>(1, kMinTaskMacs / macs_per_panel);
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = wp + p * in * kPanel;
      const int64_t c = p * kPanel;
      const float* b = bp ? bp + c : nullptr;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4)
        panel_rows<4>(xp + m * ldx, ldx, w, in, yp + m * out + c, out, sp ? sp + m : nullptr, b, rp ? rp + m * ldr + c : nullptr, ldr);
      const float* r = rp ? rp + m * ldr + c : nullptr;
      switch (rows - m) {
        case 3: panel_rows<3>(xp + m * ldx, ldx, w, in, yp + m * out + c, out, sp ? sp + m : nullptr, b, r, ldr); break;
        case 2: panel_rows<2>(xp + m * ldx, ldx, w, in, yp + m * out + c, out, sp ? sp + m : nullptr, b, r, ldr); break;
        case 1: panel_rows<1>(xp + m * ldx, ldx, w, in, yp + m * out + c, out, sp ? sp + m : nullptr, b, r, ldr); break;
        default: break;
      }
    }
  });
  return y;
}
