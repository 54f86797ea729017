// y = x @ W (+ bias) (+ residual) for the few-row products of decoding (float32, AVX2/FMA, CPU).
//
// W (in, out) is packed once as out/16 panels of (in, 16) floats, so each panel streams through
// memory once per call while up to 6 rows of x accumulate against it in registers (6 rows x 2 vectors;
// fewer rows take several panels at once).
// MKL runs such skinny products on one thread at a fraction of the bandwidth; here panels are split
// over torch's own intra-op threads (at::parallel_for), so the thread pool is shared with torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace tts {
namespace {

constexpr int64_t kBlock = 32;  // terms per partial sum
constexpr int64_t kAhead = 256;  // weight rows prefetched ahead, over all panels in flight
constexpr int64_t kMinTaskMacs = 1 << 17;  // below this a thread hand-off costs more than it saves

// R rows of x against P consecutive panels (R * P <= 6: at most 12 accumulator chains). One row alone
// would leave the FMA unit waiting on its 2 chains (4-cycle latency per term); taking 4 panels at once
// gives it 8 independent chains. Every output element is summed in the same order whatever R and P,
// so a row's result never depends on how many rows share the call.
template <int R, int P>
inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t in, float* y, int64_t ldy,
                       const float* scale, const float* bias, const float* res, int64_t ldr) {
  // blocked summation: each block of kBlock terms is summed on its own, then added to the total, so
  // rounding grows with kBlock + in / kBlock rather than with in (no worse than MKL's blocked sums)
  constexpr int V = 2 * P;  // vectors per row
  const int64_t stride = in * kPanel;  // from one panel to the next
  __m256 acc[R][V], blk[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += kBlock) {
    const int64_t k1 = std::min(in, k0 + kBlock);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) blk[r][v] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m256 wv[V];
      for (int p = 0; p < P; ++p) {
        const float* wk = w + p * stride + k * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kPanel), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kPanel), _MM_HINT_T1);
        wv[2 * p] = _mm256_loadu_ps(wk);
        wv[2 * p + 1] = _mm256_loadu_ps(wk + 8);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        for (int v = 0; v < V; ++v) blk[r][v] = _mm256_fmadd_ps(xb, wv[v], blk[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_add_ps(acc[r][v], blk[r][v]);
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const int64_t c = (v / 2) * kPanel + (v % 2) * 8;  // output column of this vector
      __m256 a = acc[r][v];
      if (scale) a = _mm256_mul_ps(a, _mm256_set1_ps(scale[r]));
      if (bias) a = _mm256_add_ps(a, _mm256_loadu_ps(bias + c));
      if (res) a = _mm256_add_ps(a, _mm256_loadu_ps(res + r * ldr + c));
      _mm256_storeu_ps(y + r * ldy + c, a);
    }
  }
}

// Where one call's rows and panels are.
struct Product {
  const float *x, *w, *scale, *bias, *res;
  float* y;
  int64_t ldx, in, ldy, ldr;

  // R rows from row m against panels [p, p + count), P at a time while whole groups remain
  template <int R, int P>
  void rows_from(int64_t m, int64_t p, int64_t count) const {
    int64_t q = p;
    for (; q + P <= p + count; q += P) at<R, P>(m, q);
    for (; q < p + count; ++q) at<R, 1>(m, q);
  }

  template <int R, int P>
  void at(int64_t m, int64_t p) const {
    const int64_t c = p * kPanel;
    panel_rows<R, P>(x + m * ldx, ldx, w + p * in * kPanel, in, y + m * ldy + c, ldy, scale ? scale + m : nullptr,
                     bias ? bias + c : nullptr, res ? res + m * ldr + c : nullptr, ldr);
  }
};

}  // namespace

void gemm(const float* x, int64_t ldx, int64_t rows, int64_t in, const float* panels, int64_t n_panels,
          const float* bias, const float* res, int64_t ldr, bool normalize, float* y, int64_t ldy) {
  constexpr int64_t kStackRows = 64;
  float stack_norms[kStackRows];
  std::vector<float> heap_norms(normalize && rows > kStackRows ? rows : 0);
  float* inv_norm = rows > kStackRows ? heap_norms.data() : stack_norms;
  for (int64_t m = 0; m < (normalize ? rows : 0); ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < in; ++k) ss += double(x[m * ldx + k]) * x[m * ldx + k];
    inv_norm[m] = float(1.0 / std::max(std::sqrt(ss), 1e-12));
  }
  const Product prod{x, panels, normalize ? inv_norm : nullptr, bias, res, y, ldx, in, ldy, ldr};
  const int64_t grain = std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, rows * in * kPanel));
  at::parallel_for(0, n_panels, grain, [&](int64_t p0, int64_t p1) {
    // 4 panels at a time: every block of rows, while those panels are in L1/L2. Blocks of up to 6 rows
    // (12 accumulators), as even as possible (9 rows: 5 + 4, not 4 + 4 + 1): each block re-reads the
    // panels, and a block of many rows does more arithmetic per weight load
    for (int64_t p = p0; p < p1; p += 4) {
      const int64_t count = std::min<int64_t>(4, p1 - p);
      for (int64_t m = 0; m < rows;) {
        const int64_t left = rows - m, blocks = (left + 5) / 6, r = (left + blocks - 1) / blocks;
        switch (r) {
          case 6: prod.rows_from<6, 1>(m, p, count); break;
          case 5: prod.rows_from<5, 1>(m, p, count); break;
          case 4: prod.rows_from<4, 1>(m, p, count); break;
          case 3: prod.rows_from<3, 1>(m, p, count); break;
          case 2: prod.rows_from<2, 2>(m, p, count); break;
          default: prod.rows_from<1, 4>(m, p, count); break;
        }
        m += r;
      }
    }
  });
}

}  // namespace tts

// x (rows, in) with unit column stride; packed (out / 16, in, 16); bias (out,); residual (rows, out).
// normalize: each row of x is divided by max(||x||, 1e-12) first (F.normalize), applied to the sums.
// geglu: x is (rows, 2 in) = [h | gate] and the product takes h * gelu(gate) (exact, erf) instead.
torch::Tensor small_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool normalize, bool geglu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.stride(1) == 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x: float32 CPU (rows, in), unit column stride");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == tts::kPanel && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
              packed.size(1) * (geglu ? 2 : 1) == x_in.size(1), "packed: contiguous float32 (out / 16, in, 16) matching x");
  TORCH_CHECK(!(geglu && normalize), "geglu and normalize do not combine");
  torch::Tensor x = x_in;
  if (geglu) {
    const int64_t half = packed.size(1);
    x = torch::empty({x_in.size(0), half}, x_in.options());
    const float* src = x_in.data_ptr<float>();
    float* dst = x.data_ptr<float>();
    for (int64_t m = 0; m < x_in.size(0); ++m) {
      const float* hv = src + m * x_in.stride(0);
      tts::geglu_row(hv, hv + half, dst + m * half, half);
    }
  }
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0), out = panels * tts::kPanel;
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out, "bias: contiguous float32 (out,)");
  if (residual) TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == out &&
                            residual->stride(1) == 1 && residual->scalar_type() == at::kFloat, "residual: float32 (rows, out), unit column stride");
  auto y = torch::empty({rows, out}, x.options());
  tts::gemm(x.data_ptr<float>(), x.stride(0), rows, in, packed.data_ptr<float>(), panels, bias ? bias->data_ptr<float>() : nullptr,
            residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0, normalize, y.data_ptr<float>(), out);
  return y;
}
