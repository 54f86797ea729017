// Decode-time attention for a few query rows (float32, AVX2/FMA, CPU).
//
// A decoding step attends 1-16 queries per sequence over a few hundred keys. At that size torch's
// scaled_dot_product_attention is mostly per-call set-up, and the rotary embedding, the K/V cache
// writes and the layout copies around it are about ten more small kernels per layer.
// `self_attention` does all of it in one call: rotate q and k, write k and v into the cache at each
// token's slot, attend causally by slot (or under an additive mask), and return (tokens, heads * d).
// `cross_attention` attends queries over precomputed source K/V. Each query is computed on its own
// with a fixed summation order, so a sequence's result does not depend on what else is in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace tts {
namespace {

constexpr int64_t kMinTaskFlops = 1 << 19;  // below this a thread hand-off (OpenMP fork/join) costs more than it saves

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (scores minus their maximum), Cephes' range reduction and polynomial (~1 ulp);
// below -87 (weights under 1e-38 of the largest) the result is 0, so -inf (masked) gives 0. NaN stays
// NaN, as in torch's softmax (a NaN key or query must not pass for a masked one).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 nan = _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), x);  // x where x is NaN, else 0 bits
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_or_ps(_mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep), nan);
}

}  // namespace

// out = h * gelu(gate), exact GELU gate / 2 (1 + erf(gate / sqrt 2)), for n floats. erfc(|x|) by
// Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, the method of torch's own vectorised erf), taken
// directly for negative gates, where 1 + erf(x) = erfc(|x|) would otherwise cancel.
void geglu_row(const float* h, const float* gate, float* out, int64_t n) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f), rsqrt2 = _mm256_set1_ps(float(M_SQRT1_2));
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 g = _mm256_loadu_ps(gate + k);
    const __m256 x = _mm256_mul_ps(g, rsqrt2);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), ax, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    const __m256 erfc = _mm256_mul_ps(_mm256_mul_ps(p, t), exp_nonpositive(_mm256_xor_ps(sign, _mm256_mul_ps(x, x))));
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 one_plus_erf = _mm256_blendv_ps(_mm256_sub_ps(two, erfc), erfc, negative);
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, g), one_plus_erf), _mm256_loadu_ps(h + k)));
  }
  for (; k < n; ++k) out[k] = gate[k] * 0.5f * (1.0f + std::erf(gate[k] * float(M_SQRT1_2))) * h[k];
}

namespace {

// out[0 : 8W] = inv * sum_j w[j] V[j][0 : 8W], W vectors of accumulators (a compile-time count keeps them
// in registers; a runtime one spilled them to the stack on every key).
// Rows of K or V: key j at base + j * ld (contiguous slots), or read through a slot table (`CacheView`).
struct Strided {
  const float* base;
  int64_t ld;
  const float* operator()(int64_t j) const { return base + j * ld; }
  Strided offset(int64_t t) const { return {base + t, ld}; }
  void prefetch(int64_t, int64_t, int64_t) const {}  // consecutive slots: the hardware prefetcher follows
};
struct Tabled {
  const float* base;  // row 0, this head, slot 0
  int64_t ld, row;  // floats per slot, per cache row
  const int64_t* table;  // physical row of each slot
  const float* operator()(int64_t j) const { return base + table[j] * row + j * ld; }
  Tabled offset(int64_t t) const { return {base + t, ld, row, table}; }
  // slots of several rows: the hardware prefetcher cannot follow, so ask for key j's d floats ahead
  void prefetch(int64_t j, int64_t keys, int64_t d) const {
    if (j >= keys) return;
    const char* p = reinterpret_cast<const char*>((*this)(j));
    for (int64_t b = 0; b < d * int64_t(sizeof(float)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
};

template <int W, typename Rows>
inline void weighted_sum(const float* w, const Rows& V, int64_t keys, float inv, float* out) {
  __m256 a[W];
  for (int u = 0; u < W; ++u) a[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    V.prefetch(j + 8, keys, 8 * W);
    const __m256 p = _mm256_set1_ps(w[j]);
    const float* v = V(j);
    for (int u = 0; u < W; ++u) a[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * u), a[u]);
  }
  const __m256 s = _mm256_set1_ps(inv);
  for (int u = 0; u < W; ++u) _mm256_storeu_ps(out + 8 * u, _mm256_mul_ps(a[u], s));
}

// The keys a mask leaves visible, by rank: key c is row idx[c] of `rows` (see `attend`).
template <typename Rows>
struct Picked {
  Rows rows;
  const int64_t* idx;
  const float* operator()(int64_t c) const { return rows(idx[c]); }
  Picked offset(int64_t t) const { return {rows.offset(t), idx}; }
  void prefetch(int64_t c, int64_t n, int64_t d) const {
    if (c < n) rows.prefetch(idx[c], idx[c] + 1, d);
  }
};

// out[0:d] = softmax(q . K(j) * scale + mask[j], j < keys) @ V over keys that are all visible, K(j) and
// V(j) the rows of key j (`Strided`, `Tabled` or `Picked`: the same arithmetic in the same order).
// `buf` holds at least keys rounded up to 8 floats.
template <typename Rows>
void attend_visible(const float* q, const Rows& K, const Rows& V, int64_t keys, int64_t d,
                    const float* mask, float scale, float* out, float* buf) {
  int64_t j = 0;
  for (; j + 4 <= keys; j += 4) {  // four keys at once: four independent FMA chains
    for (int64_t u = 8; u < 12; ++u) K.prefetch(j + u, keys, d);
    const float *k0 = K(j), *k1 = K(j + 1), *k2 = K(j + 2), *k3 = K(j + 3);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < d; t += 8) {
      const __m256 qv = _mm256_loadu_ps(q + t);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + t), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + t), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + t), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + t), a3);
    }
    buf[j] = hsum(a0) * scale;
    buf[j + 1] = hsum(a1) * scale;
    buf[j + 2] = hsum(a2) * scale;
    buf[j + 3] = hsum(a3) * scale;
  }
  for (; j < keys; ++j) {
    __m256 a = _mm256_setzero_ps();
    const float* kj = K(j);
    for (int64_t t = 0; t < d; t += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + t), _mm256_loadu_ps(kj + t), a);
    buf[j] = hsum(a) * scale;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (j = 0; j < keys; ++j) {
    if (mask) buf[j] += mask[j];
    // the maximum, NaN once a score is NaN (std::max would skip it): then every weight is NaN, as in torch
    if (buf[j] > m || buf[j] != buf[j]) m = m != m ? m : buf[j];
  }
  const int64_t padded = (keys + 7) / 8 * 8;
  if (m == -std::numeric_limits<float>::infinity()) {  // every key masked: zeros, not NaN
    std::fill(out, out + d, 0.0f);
    return;
  }
  for (j = keys; j < padded; ++j) buf[j] = -std::numeric_limits<float>::infinity();
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (j = 0; j < padded; j += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(buf + j), mv));
    _mm256_storeu_ps(buf + j, p);
    total = _mm256_add_ps(total, p);
  }
  const float inv = 1.0f / hsum(total);
  for (int64_t t0 = 0; t0 < d; t0 += 64) {  // up to 64 output floats at a time, in registers
    const Rows v = V.offset(t0);
    float* o = out + t0;
    switch (std::min<int64_t>(64, d - t0) / 8) {
      case 8: weighted_sum<8>(buf, v, keys, inv, o); break;
      case 7: weighted_sum<7>(buf, v, keys, inv, o); break;
      case 6: weighted_sum<6>(buf, v, keys, inv, o); break;
      case 5: weighted_sum<5>(buf, v, keys, inv, o); break;
      case 4: weighted_sum<4>(buf, v, keys, inv, o); break;
      case 3: weighted_sum<3>(buf, v, keys, inv, o); break;
      case 2: weighted_sum<2>(buf, v, keys, inv, o); break;
      default: weighted_sum<1>(buf, v, keys, inv, o); break;
    }
  }
}

// out[0:d] = softmax(q . K(j) * scale + mask[j], j < keys) @ V. Keys the mask hides (-inf) are left out
// before any sum rather than added as zero weights: the softmax's sum runs in 8 lanes by key rank, so a
// hidden key between two visible ones would move the later ones to other lanes and round the sum
// otherwise. So a tree node that sees its prefix and its ancestors gets the bits a plain step over that
// prefix and those ancestors gives (row-count invariance across a tree pass and a beam step).
template <typename Rows>
void attend(const float* q, const Rows& K, const Rows& V, int64_t keys, int64_t d,
            const float* mask, float scale, float* out, float* buf) {
  if (!mask) return attend_visible(q, K, V, keys, d, nullptr, scale, out, buf);
  thread_local std::vector<int64_t> idx;
  thread_local std::vector<float> bias;
  if (idx.size() < size_t(keys)) idx.resize(keys), bias.resize(keys);
  int64_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (mask[j] != -std::numeric_limits<float>::infinity()) idx[n] = j, bias[n++] = mask[j];
  attend_visible(q, Picked<Rows>{K, idx.data()}, Picked<Rows>{V, idx.data()}, n, d, bias.data(), scale, out, buf);
}

// t * cos + rotate_half(t) * sin with rotate_half(x)[2i, 2i+1] = (-x[2i+1], x[2i]); the sign is
// folded into the sin table (Decoder._ensure_rope), as in Decoder._rotate.
inline void rotate(const float* t, const float* c, const float* s, int64_t d, float* out) {
  for (int64_t i = 0; i < d; i += 2) {
    out[i] = t[i] * c[i] + t[i + 1] * s[i];
    out[i + 1] = t[i + 1] * c[i + 1] + t[i] * s[i + 1];
  }
}

// fn(r, j, buf) for every row r and query head j, over torch's threads with at least kMinTaskFlops of
// work per thread; buf holds `keys` scores rounded up to 8 floats (what `attend` needs). Head-major:
// the rows of one head run one after another on one thread, so beams that share a prefix (a slot
// table) read its K/V from that core's cache after the first.
template <typename Fn>
void for_each_row_head(int64_t rows, int64_t h, int64_t flops_per_head, int64_t keys, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kMinTaskFlops / std::max<int64_t>(1, flops_per_head));
  at::parallel_for(0, rows * h, grain, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;  // kept between calls: no allocation per layer
    if (buf.size() < size_t((keys + 7) / 8 * 8)) buf.resize((keys + 7) / 8 * 8);
    for (int64_t t = t0; t < t1; ++t) fn(t % rows, t / rows, buf.data());
  });
}

}  // namespace

void self_attention(const float* heads, const float* cos, const float* sin, const int64_t* pos,
                    const int64_t* slots, int64_t rows, int64_t n, int64_t h, int64_t kvh, int64_t d,
                    const CacheView& cache, const MaskView& mask, int64_t keys, float* q_rot, float* out,
                    const uint8_t* live) {
  const int64_t width = (h + 2 * kvh) * d;
  // rotate q into q_rot, write rotated k and v into the cache (all before any query reads the cache)
  for (int64_t tok = 0; tok < rows * n; ++tok) {
    const int64_t r = tok / n, slot = slots[tok];
    const float* c = cos + pos[tok] * d;
    const float* s = sin + pos[tok] * d;
    const float* src = heads + tok * width;
    for (int64_t j = 0; j < h; ++j) rotate(src + j * d, c, s, d, q_rot + tok * h * d + j * d);
    if (slot < 0) continue;  // a padding token that leaves the cache alone (`token_slots`)
    for (int64_t j = 0; j < kvh; ++j) {
      rotate(src + (h + j) * d, c, s, d, cache.k + r * cache.k_row + j * cache.k_head + slot * d);
      std::copy(src + (h + kvh + j) * d, src + (h + kvh + j + 1) * d, cache.v + r * cache.v_row + j * cache.v_head + slot * d);
    }
  }
  const float scale = 1.0f / std::sqrt(float(d));
  for_each_row_head(rows, h, n * keys * d * 4, keys, [&](int64_t r, int64_t j, float* buf) {
    const float* k_head = cache.k + (j % kvh) * cache.k_head;
    const float* v_head = cache.v + (j % kvh) * cache.v_head;
    const Strided K{k_head + r * cache.k_row, d}, V{v_head + r * cache.v_row, d};
    const Tabled KT{k_head, d, cache.k_row, cache.table + r * cache.table_row};
    const Tabled VT{v_head, d, cache.v_row, KT.table};
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tok = r * n + i;
      if (live && !live[tok]) continue;
      const float* m = mask.p ? mask.p + (mask.rows == 1 ? 0 : r * mask.row_stride) + i * mask.query_stride : nullptr;
      const int64_t seen = mask.p ? keys : slots[tok] + 1;
      const float* qi = q_rot + tok * h * d + j * d;
      float* o = out + tok * h * d + j * d;
      if (cache.table)
        attend(qi, KT, VT, seen, d, m, scale, o, buf);
      else
        attend(qi, K, V, seen, d, m, scale, o, buf);
    }
  });
}

void cross_attention(const float* q, int64_t rows, int64_t n, int64_t h, int64_t d, const SourceView& src, float* out,
                     const uint8_t* live) {
  const float scale = 1.0f / std::sqrt(float(d));
  for_each_row_head(rows, h, n * src.len * d * 4, src.len, [&](int64_t r, int64_t j, float* buf) {
    const int64_t e = src.row_of ? src.row_of[r] : r;
    const Strided K{src.k + e * src.k_row + j * src.k_head, d}, V{src.v + e * src.v_row + j * src.v_head, d};
    const float* m = src.mask ? src.mask + r * src.mask_row : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tok = r * n + i;
      if (live && !live[tok]) continue;
      attend(q + tok * h * d + j * d, K, V, src.len, d, m, scale, out + tok * h * d + j * d, buf);
    }
  });
}

}  // namespace tts

namespace {

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(-1) == 1, name,
              ": float32 CPU tensor with unit last stride");
}

}  // namespace

// Each token's cache slot and rotary position (sp, pp, rows * n each) from pos, slots (rows, n) int64 of
// any strides (expanded rows are common); every slot below `keys`, every position below `positions`. A
// padding token (is_real given, is_real[token] == 0) may have slot -1: it writes nothing in the cache.
void token_slots(const torch::Tensor& pos, const torch::Tensor& slots, int64_t keys, int64_t positions,
                 std::vector<int64_t>& sp, std::vector<int64_t>& pp, const uint8_t* is_real) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && pos.dim() == 2 &&
              pos.sizes() == slots.sizes(), "pos, slots: int64 (rows, n)");
  const int64_t rows = slots.size(0), n = slots.size(1);
  sp.resize(rows * n);
  pp.resize(rows * n);
  const int64_t* sd = slots.data_ptr<int64_t>();
  const int64_t* pd = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      sp[r * n + i] = sd[r * slots.stride(0) + i * slots.stride(1)];
      pp[r * n + i] = pd[r * pos.stride(0) + i * pos.stride(1)];
      const bool unwritten = sp[r * n + i] == -1 && is_real && !is_real[r * n + i];  // a padding token may write nothing
      TORCH_CHECK((unwritten || (0 <= sp[r * n + i] && sp[r * n + i] < keys)) && 0 <= pp[r * n + i] && pp[r * n + i] < positions,
                  "slot or position out of range");
    }
}

// A self-attention mask (1 or rows, n, keys) additive float32, or none (causal by slot).
tts::MaskView mask_view(const c10::optional<torch::Tensor>& mask, int64_t rows, int64_t n, int64_t keys) {
  if (!mask) return {};
  check_float(*mask, "mask");
  TORCH_CHECK(mask->dim() == 3 && (mask->size(0) == 1 || mask->size(0) == rows) && mask->size(1) == n &&
              mask->size(2) == keys, "mask: (1 or rows, n, keys)");
  return {mask->data_ptr<float>(), mask->size(0), mask->size(0) == 1 ? 0 : mask->stride(0), mask->stride(1)};
}

// heads (rows * n, (h + 2 * kvh) * d): q heads, then k heads, then v heads of every token.
// cos, sin (P, d) rotary tables; pos, slots (rows, n) int64: rotary position and cache slot of each token.
// k_cache, v_cache (rows, kvh, capacity, d): this layer's cache; every token's k, v land at its slot.
// mask (R, n, keys) additive, R 1 or rows, or none: each query sees the slots <= its own.
// Query head j reads kv head j % kvh (spear-tts repeats kv heads as '(g h)').
torch::Tensor self_attention(const torch::Tensor& heads, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& pos, const torch::Tensor& slots, torch::Tensor k_cache,
                             torch::Tensor v_cache, const c10::optional<torch::Tensor>& mask, int64_t keys,
                             int64_t h, int64_t kvh) {
  check_float(heads, "heads");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos, sin: contiguous float32 (P, d)");
  TORCH_CHECK(slots.dim() == 2, "pos, slots: int64 (rows, n)");
  const int64_t rows = slots.size(0), n = slots.size(1), d = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK(heads.dim() == 2 && heads.is_contiguous() && heads.size(0) == rows * n && heads.size(1) == (h + 2 * kvh) * d,
              "heads: contiguous (rows * n, (h + 2 kvh) d)");
  TORCH_CHECK(d % 8 == 0 && cos.size(1) == d, "dim_head must be a multiple of 8 and match the rotary tables");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == rows && k_cache.size(1) == kvh &&
              h % kvh == 0, "k_cache, v_cache: (rows, kvh, capacity, d)");
  TORCH_CHECK(k_cache.stride(2) == d && v_cache.stride(2) == d, "cache slots must be contiguous rows of d");
  TORCH_CHECK(keys <= cap, "keys exceed the cache capacity");
  std::vector<int64_t> sp, pp;
  token_slots(pos, slots, keys, cos.size(0), sp, pp, nullptr);
  const tts::MaskView mv = mask_view(mask, rows, n, keys);
  auto out = torch::empty({rows * n, h * d}, heads.options());
  auto q_rot = torch::empty({rows * n, h * d}, heads.options());
  const tts::CacheView cache{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1),
                             v_cache.stride(0), v_cache.stride(1)};
  tts::self_attention(heads.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), pp.data(), sp.data(), rows, n,
                      h, kvh, d, cache, mv, keys, q_rot.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// q (rows * n, h * d); keys, values (rows, h, S, d); mask (rows, S) additive or none -> (rows * n, h * d).
torch::Tensor cross_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const c10::optional<torch::Tensor>& mask) {
  check_float(q, "q");
  check_float(keys, "keys");
  check_float(values, "values");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes(), "keys, values: (rows, h, S, d)");
  const int64_t rows = keys.size(0), h = keys.size(1), S = keys.size(2), d = keys.size(3);
  TORCH_CHECK(d % 8 == 0, "dim_head must be a multiple of 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(1) == h * d && q.size(0) % rows == 0, "q: contiguous (rows * n, h * d)");
  TORCH_CHECK(keys.stride(2) == d && values.stride(2) == d, "keys, values: contiguous (S, d) per head");
  tts::SourceView src{keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), keys.stride(1), values.stride(0),
                      values.stride(1), S, nullptr, 0};
  if (mask) {
    check_float(*mask, "mask");
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == rows && mask->size(1) == S, "mask: (rows, S)");
    src.mask = mask->data_ptr<float>();
    src.mask_row = mask->stride(0);
  }
  auto out = torch::empty_like(q);
  tts::cross_attention(q.data_ptr<float>(), rows, q.size(0) / rows, h, d, src, out.data_ptr<float>());
  return out;
}
