// The raw-pointer cores of the decoding kernels, shared by the tensor entry points (each file's
// bottom half, argument checks included) and by `Stack` (layers.cpp), which checks a whole range of
// layers once per call and then runs them without building a tensor per product.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

namespace at {
class Tensor;
}  // namespace at

namespace tts {

constexpr int64_t kPanel = 16;  // output columns per packed weight panel
// panels per group: a group is stored slab after slab of kBlock terms (the last one shorter where the
// input width is not a multiple), so a slab is one run of memory (`kernels.Packed`, which packs them,
// says GROUP and BLOCK)
constexpr int64_t kGroup = 4;
// blocked summation: each block of kBlock terms is summed on its own, then added to the total, so
// rounding grows with kBlock + in / kBlock rather than with in (no worse than MKL's blocked sums)
constexpr int64_t kBlock = 32;
// Within a slab, float32 panels are stored panel by panel (each panel's terms in order: a tile's pass over
// one panel reads one run of memory), bfloat16 panels term by term (term k of each panel side by side).
// On a Zen 3 (2 threads, in one process, the same weights both ways) float32 panel by panel ran products
// of 4-8 rows 5-9% faster over streamed weights and 4-12 rows 3-9% faster in the caches, 1 row as fast
// streamed and 0-3% slower in the caches; bfloat16 panel by panel ran 1 row 5-7% slower (streamed),
// 4-20 rows 1-3% faster. The AVX-512 tiles and strips read the same layouts; the two layouts have not been
// compared with them: the bits do not depend on it, only the speed.
template <typename WT>
constexpr bool kPanelMajor = std::is_same<WT, float>::value;

// y = (x / ||x|| per row if normalize) @ W + bias + res for x (rows, in) with row stride ldx, W packed
// as (panels, in, 16), float32 or bfloat16 (each weight widened to float32 exactly, then the same sums);
// the caller has checked its shape. res may be y itself (an in-place residual add); x must not overlap
// y. index (or null): the call's i-th row is row index[i] of x, y and res (the real tokens among padded
// ones); the other rows of y are not written.
void gemm(const float* x, int64_t ldx, int64_t rows, int64_t in, const at::Tensor& packed, const float* bias,
          const float* res, int64_t ldr, bool normalize, float* y, int64_t ldy, const int64_t* index = nullptr);

// The tiles of the products: "avx512" or "avx2" switch (the first an error where the CPU lacks
// AVX-512), "auto" takes the widest the CPU has, "" keeps them; returns the setting now in use. Both give
// the same bits.
std::string set_isa(const std::string& name);

// out = h * gelu(gate) for n floats (exact GELU); out may be h itself.
void geglu_row(const float* h, const float* gate, float* out, int64_t n);

// One layer's K/V cache: slot s of kv head j of row r at k + r * k_row + j * k_head + s * d. With a
// slot table, row r READS slot s from row table[r * table_row + s] (beams that share a prefix share its
// K/V, so a beam reorder moves table entries, not K/V); writes always go to the row's own storage.
struct CacheView {
  float *k, *v;
  int64_t k_row, k_head, v_row, v_head;
  const int64_t* table = nullptr;
  int64_t table_row = 0;
};

// An additive mask (R, n, keys), R 1 (shared by every row) or rows; p null: causal by slot.
struct MaskView {
  const float* p = nullptr;
  int64_t rows = 0, row_stride = 0, query_stride = 0;
};

// heads (rows * n, (h + 2 kvh) d); pos, slots (rows * n) per token; q_rot, out (rows * n, h d).
// live (rows * n) or null (all): the queries whose outputs matter; the others (padding of tree rows)
// still write their k and v, but attend to nothing and leave out untouched.
void self_attention(const float* heads, const float* cos, const float* sin, const int64_t* pos,
                    const int64_t* slots, int64_t rows, int64_t n, int64_t h, int64_t kvh, int64_t d,
                    const CacheView& cache, const MaskView& mask, int64_t keys, float* q_rot, float* out,
                    const uint8_t* live = nullptr);

// Precomputed source K/V of one layer, (sources, h, len, d) with these strides; row r reads source
// row_of[r] (beams of one item share it), or source r without row_of; mask (rows, len) or null.
struct SourceView {
  const float *k, *v;
  int64_t k_row, k_head, v_row, v_head, len;
  const float* mask;
  int64_t mask_row;
  const int64_t* row_of = nullptr;
};

// q, out (rows * n, h d); live as for self_attention
void cross_attention(const float* q, int64_t rows, int64_t n, int64_t h, int64_t d, const SourceView& src, float* out,
                     const uint8_t* live = nullptr);

// A beam step's ranking (csrc/beam.cpp, as `beam_top`): per item i the n best of float(scores[i * k + j]) +
// lp[(i * k + j) * ld + v], NaN first, then by value, ties to the lower flat index j * V + v; values and
// index (a, n).
void beam_rank(const double* scores, const float* lp, int64_t ld, int64_t a, int64_t k, int64_t V, int64_t n, double* values,
               int64_t* index);

}  // namespace tts
