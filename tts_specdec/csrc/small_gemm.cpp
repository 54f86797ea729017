// y = x @ W (+ bias) (+ residual) for the many-row products of decoding (float32, CPU).
//
// W (in, out) is packed once as out/16 panels of (in, 16) floats (or bfloat16s: half the bytes to stream,
// each widened exactly to float32 as it is loaded, then summed as floats are), in groups of kGroup panels
// stored slab by slab (kernels.h, `kernels.Packed`). A call walks a thread's groups; within a group, slab after slab of
// kBlock terms: the slab's weights (kGroup x kBlock x 16 floats, 8 KB, one run of memory) come from
// memory once and stay in L1 while every tile of rows passes over them, so the weights stream once per
// call for any number of rows, and the arithmetic of the row tiles overlaps the stream (prefetched
// kAheadBytes ahead). Each tile keeps its partial sums in registers: AVX-512
// (32 registers) holds up to 14 rows x 2 panels, AVX2 (16) 6 rows x 1 panel; with AVX-512, more than 7
// rows of float32 panels take strips of up to 8 rows x 1 panel over chunks of 4 slabs, which keep the
// running sums in registers as well (gemm_tiles.inc's `strip`). The instruction set is
// chosen at run time (`set_isa`). Panels are split over torch's own intra-op threads (at::parallel_for),
// so MKL's single-threaded skinny products are avoided and the thread pool is shared with torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace tts {
namespace {

// A thread hand-off (OpenMP fork and join) costs some microseconds: a thread takes a share only when it
// holds at least kMinTaskWork multiply-adds, a weight read counting as kWeightCost of them (streaming
// a weight costs about that many FMAs' time), so the products of a small cache-resident model stay on
// one thread while a large model's single-row products still split its memory stream.
constexpr int64_t kMinTaskWork = 1 << 21;
constexpr int64_t kWeightCost = 8;

// the distance at which the slab tiles ask memory into L2 ahead of what they read: 4 slabs of a group
// (many times a DRAM latency at the rate the tiles read, well inside the 1-2 MB L2 of the CPUs we run on)
constexpr int64_t kAheadBytes = 4 * kGroup * kBlock * kPanel * int64_t(sizeof(float));

// One call's operands; prefetches stay below stream_end (the end of this thread's panels).
struct Job {
  const float* x;
  const void* w;  // float or bfloat16 (uint16_t) panels
  const float *scale, *bias, *res;
  float* y;
  int64_t ldx, in, ldy, ldr, rows, panels;
  const char* stream_end;
  const int64_t* index;  // the i-th row of the call is row index[i] of x, y and res (null: row i)
  int64_t row(int64_t i) const { return index ? index[i] : i; }
};

}  // namespace

namespace avx2 {
#define kLanes 8
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
// One panel's weights of one term (kPanel = 16 of them) into two vectors. bfloat16 is float32's upper
// half, so a 32-bit word of two bfloat16s widens exactly into the even column (shifted up) and the odd
// one (masked): one load and two simple operations per 16 weights, where zero-extending each half
// (vpmovzxwd, a lane-crossing shuffle) and shifting took two loads and four. On a Zen 3 (width 512,
// 2 threads, old and new builds alternated) bfloat16 greedy decoding with gamma="auto" and beam search
// ran 2-5% faster; plain decoding, bound by the stream, did not change. The vectors hold the even and
// the odd columns of the panel, and `unpair` restores the columns' order in the epilogue: each element
// is still summed term by term in the same order, so the bits are those of float32 panels holding the
// same values.
inline void wpanel(const float* p, V* out) { out[0] = vload(p); out[1] = vload(p + kLanes); }
inline void wpanel(const uint16_t* p, V* out) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  out[1] = _mm256_and_ps(_mm256_castsi256_ps(pairs), _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u))));
}
// a panel's sums, [c0 c2 .. c14 | c1 c3 .. c15] as the bfloat16 tiles leave them, back to [c0 .. c15]
constexpr bool kPairedColumns = true;
inline void unpair(float* a) {
  const V even = vload(a), odd = vload(a + kLanes);
  const V lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // c0-3 | c8-11, c4-7 | c12-15
  vstore(a, _mm256_permute2f128_ps(lo, hi, 0x20));
  vstore(a + kLanes, _mm256_permute2f128_ps(lo, hi, 0x31));
}
// 16 registers: one row takes 4 panels (8 chains), two rows 2 panels, 3-6 rows one panel (12 chains)
constexpr int64_t kTileRows = 6, kFewRows = 2, kManyRows = 6;
constexpr int kWidePanels = 1, kManyPanels = 1;
// On an AMD EPYC Zen 3 (weights streamed, one thread, a replica of these tiles), rolled loops left a
// 4-row product at 1.22x of one row and 5 rows at 0.97x; four terms per iteration: 1.01x (the 1- and
// 2-row tiles stay rolled: unrolled, plain greedy decoding at width 512 ran 4% slower). Tiles that
// take turns asking for the memory ahead: 8 rows (4 + 4) 1.16-1.20x instead of 1.25-1.27x, 6 x 2 rows
// 1.17x instead of 1.43x. Both only for streamed weights (`kStreamBytes`): on the shipped model (its
// matrices in the caches) unrolled tiles made batch-4 greedy decoding 17% slower
constexpr int kTermUnroll = 4, kUnrollFromRows = 3;
#define TTS_FEW_CASES TTS_FEW(1, 4) TTS_FEW(2, 2)
#define TTS_WIDE_CASES TTS_WIDE(1) TTS_WIDE(2) TTS_WIDE(3) TTS_WIDE(4) TTS_WIDE(5) TTS_WIDE(6)
#define TTS_MANY_CASES TTS_MANY(1) TTS_MANY(2) TTS_MANY(3) TTS_MANY(4) TTS_MANY(5) TTS_MANY(6)
// no strips (gemm_tiles.inc): a panel is two vectors here, so a strip with its running sums would hold
// 3 rows
constexpr int64_t kStripRows = 0, kStripsAbove = 0, kChunkSlabs = 1;
#define TTS_STRIP_CASES
using tts::Job;
#include "gemm_tiles.inc"
#undef TTS_FEW_CASES
#undef TTS_WIDE_CASES
#undef TTS_MANY_CASES
#undef TTS_STRIP_CASES
#undef kLanes
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#define kLanes 16
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
// a panel is one vector: its 16 bfloat16s zero-extended and shifted up (exact), columns in order
inline void wpanel(const float* p, V* out) { out[0] = vload(p); }
inline void wpanel(const uint16_t* p, V* out) {
  out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
constexpr bool kPairedColumns = false;
inline void unpair(float*) {}
// 32 registers: up to 6 rows take 4 panels at once (24 chains), 7-14 rows one tile of 2 panels (28
// accumulators + 2 weight vectors + a broadcast), more rows tiles of up to 7 rows x 4 panels: each row's
// term is broadcast once per slab, not once per pair of panels (11 loads per 28 FMAs, not 16). Measured
// on the EPYC, weights streamed, 2 threads, minimum of 11 interleaved passes: 20 rows 6.9-7.2 ms against
// 7.7 ms with 10-row x 2-panel tiles, 32 rows 10.7-10.9 against 12.1; at 8-14 rows the single 2-panel
// tile stays ahead (12 rows 4.85 ms, against 5.07 as two 6 x 4 tiles)
constexpr int64_t kTileRows = 14, kFewRows = 6, kManyRows = 7;
constexpr int kWidePanels = 2, kManyPanels = 4;
// Streamed weights, tiles of 4 rows and more: two terms per iteration. On an Intel Xeon VM (2 threads,
// tools/gemm_rows.py, variants alternated, 4 rounds each, x one row) 8 rows went from 1.17-1.24x to
// 1.03-1.07x, 12 rows from 1.24-1.31x to 1.13-1.21x, 16 rows from 1.34-1.38x to 1.30-1.33x; four terms
// were no better, and asking memory 8 or 16 slabs ahead instead of 4 moved nothing. Not measured on a Zen 4
constexpr int kTermUnroll = 2, kUnrollFromRows = 4;
#define TTS_FEW_CASES TTS_FEW(1, 4) TTS_FEW(2, 4) TTS_FEW(3, 4) TTS_FEW(4, 4) TTS_FEW(5, 4) TTS_FEW(6, 4)
#define TTS_WIDE_CASES TTS_WIDE(7) TTS_WIDE(8) TTS_WIDE(9) TTS_WIDE(10) TTS_WIDE(11) TTS_WIDE(12) TTS_WIDE(13) TTS_WIDE(14)
#define TTS_MANY_CASES TTS_MANY(4) TTS_MANY(5) TTS_MANY(6) TTS_MANY(7)
// More than 7 rows of float32 panels: strips of up to 8 rows x 1 panel over chunks of 4 slabs (32 KB, of
// which a strip reads its panel's 8 KB), their running sums in registers (8 running and 8 per slab, 18
// registers with the weights and the broadcast), not the tiles above, whose partial sums go through
// memory every slab. Measured on the AMD EPYC (Zen 4), 2 threads, the two alternated in one process
// (medians of 7 passes, x one row over ~130 MB streamed): (512, 512) matrices 16 rows 1.29x against
// 1.49x; (2048, 512) 12 rows 1.41x against 1.88x; (512, 1536) 16 rows 1.42x against 1.47x, 32 rows 2.55x
// against 2.66x (16 rows in three pairs of fresh processes: within noise); in the caches 3-8% more GFLOPS
// at 12-32 rows. They start at 8 rows: at 7 and 8 rows they were within 1-3% of the tiles either way.
// Chunks of 8 slabs (64 KB, beyond L1) ran 15-30% slower, of 2 as fast as 4. bfloat16 panels keep the
// tiles: strips over a whole group's terms gained them 2-5% in one run, chunked ones were not timed
constexpr int64_t kStripRows = 8, kStripsAbove = 7, kChunkSlabs = 4;
#define TTS_STRIP_CASES TTS_STRIP(4) TTS_STRIP(5) TTS_STRIP(6) TTS_STRIP(7) TTS_STRIP(8)
using tts::Job;
#include "gemm_tiles.inc"
#undef TTS_FEW_CASES
#undef TTS_WIDE_CASES
#undef TTS_MANY_CASES
#undef TTS_STRIP_CASES
#undef kLanes
}  // namespace avx512
#pragma GCC pop_options

namespace {

using GroupFn = void (*)(const Job&, int64_t, float*);

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// Which tiles run: AVX-512's where the CPU has AVX-512F, else AVX2's (TTS_SPECDEC_ISA=avx2 or
// `set_isa("avx2")` forces AVX2's). On an AMD EPYC (Zen 4, whose 512-bit FMAs are two 256-bit halves)
// AVX-512's tiles beat AVX2's 6 x 1 at every row count once they stopped keeping their accumulators on
// the stack (`slab` inlined): weights streamed from memory, 2 threads, one process, interleaved, an n-row
// product over a 1-row one: 8 rows 0.95-0.98x against 1.32-1.35x, 16 rows 1.63-1.71x against
// 1.83-1.94x, 32 rows 3.2-3.3x against 3.4-3.6x (2026-11-26). Every tile sums every element in the same
// order, so both give the same bits (a test compares them) and the choice changes no result.
bool use_avx512 = cpu_has_avx512() && !(std::getenv("TTS_SPECDEC_ISA") && std::string(std::getenv("TTS_SPECDEC_ISA")) == "avx2");

// weights beyond this many bytes (a core's L2 on the CPUs we run on) stream from memory on every call
constexpr int64_t kStreamBytes = int64_t(1) << 20;

template <typename WT>
GroupFn group_fn(bool streamed) {
  if (streamed) return use_avx512 ? &avx512::run_group<WT, true> : &avx2::run_group<WT, true>;
  return use_avx512 ? &avx512::run_group<WT, false> : &avx2::run_group<WT, false>;
}

}  // namespace

std::string set_isa(const std::string& name) {
  if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "isa: this CPU has no AVX-512");
    use_avx512 = true;
  } else if (name == "auto") {
    use_avx512 = cpu_has_avx512();
  } else if (name == "avx2") {
    use_avx512 = false;
  } else {
    TORCH_CHECK(name.empty(), "isa: 'auto', 'avx2', 'avx512' or '' (which one runs), not '", name, "'");
  }
  return use_avx512 ? "avx512" : "avx2";
}

template <typename WT>
void gemm_of(const float* x, int64_t ldx, int64_t rows, int64_t in, const WT* panels, int64_t n_panels,
             const float* bias, const float* res, int64_t ldr, bool normalize, float* y, int64_t ldy, const int64_t* index) {
  if (rows == 0 || n_panels == 0) return;
  constexpr int64_t kStackRows = 64;
  float stack_norms[kStackRows];
  std::vector<float> heap_norms(normalize && rows > kStackRows ? rows : 0);
  float* inv_norm = rows > kStackRows ? heap_norms.data() : stack_norms;
  for (int64_t m = 0; m < (normalize ? rows : 0); ++m) {
    const float* xm = x + (index ? index[m] : m) * ldx;
    double ss = 0.0;
    for (int64_t k = 0; k < in; ++k) ss += double(xm[k]) * xm[k];
    inv_norm[m] = float(1.0 / std::max(std::sqrt(ss), 1e-12));
  }
  const GroupFn run_group = group_fn<WT>(n_panels * in * kPanel * int64_t(sizeof(WT)) > kStreamBytes);
  const int64_t groups = (n_panels + kGroup - 1) / kGroup;
  // a bfloat16 weight counts as a float32 one: at half the cost, width 512's 512-column one-row products
  // stayed on one thread, reading at one core's bandwidth
  const int64_t grain = std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, (rows + kWeightCost) * in * kPanel * kGroup));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const char* end = reinterpret_cast<const char*>(panels + std::min(n_panels, g1 * kGroup) * in * kPanel);
    const Job job{x, panels, normalize ? inv_norm : nullptr, bias, res, y, ldx, in, ldy, ldr, rows, n_panels, end, index};
    constexpr int64_t kStackAcc = 64 * kGroup * kPanel;  // 64 rows: 16 KB
    alignas(64) float stack_acc[kStackAcc];
    std::vector<float> heap_acc(rows * kGroup * kPanel > kStackAcc ? rows * kGroup * kPanel : 0);
    float* acc = heap_acc.empty() ? stack_acc : heap_acc.data();
    for (int64_t g = g0; g < g1; ++g) run_group(job, g, acc);
  });
}

void gemm(const float* x, int64_t ldx, int64_t rows, int64_t in, const torch::Tensor& packed, const float* bias,
          const float* res, int64_t ldr, bool normalize, float* y, int64_t ldy, const int64_t* index) {
  if (packed.scalar_type() == at::kBFloat16)
    gemm_of(x, ldx, rows, in, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), packed.size(0), bias, res,
            ldr, normalize, y, ldy, index);
  else
    gemm_of(x, ldx, rows, in, packed.data_ptr<float>(), packed.size(0), bias, res, ldr, normalize, y, ldy, index);
}

}  // namespace tts

// x (rows, in) with unit column stride; packed (out / 16, in, 16); bias (out,); residual (rows, out).
// normalize: each row of x is divided by max(||x||, 1e-12) first (F.normalize), applied to the sums.
// geglu: x is (rows, 2 in) = [h | gate] and the product takes h * gelu(gate) (exact, erf) instead.
torch::Tensor small_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool normalize, bool geglu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.stride(1) == 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x: float32 CPU (rows, in), unit column stride");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == tts::kPanel && packed.is_contiguous() &&
              (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
              packed.size(1) * (geglu ? 2 : 1) == x_in.size(1), "packed: contiguous float32 or bfloat16 (out / 16, in, 16) matching x");
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
  tts::gemm(x.data_ptr<float>(), x.stride(0), rows, in, packed, bias ? bias->data_ptr<float>() : nullptr,
            residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0, normalize, y.data_ptr<float>(), out,
            nullptr);
  return y;
}
