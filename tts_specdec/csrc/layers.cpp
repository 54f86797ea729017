// A range of decoder layers in one call: the per-layer sequence of `Decoder._run_fused` without the
// Python in between (at 1-7 rows a layer's kernels take ~40 us; Python dispatch around them took as long).
// Also the cache's beam reordering, and the module's Python bindings for all three source files.
#include <torch/extension.h>

torch::Tensor small_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool normalize, bool geglu);
torch::Tensor self_attention(const torch::Tensor& heads, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& pos, const torch::Tensor& slots, torch::Tensor k_cache,
                             torch::Tensor v_cache, const c10::optional<torch::Tensor>& mask, int64_t keys,
                             int64_t h, int64_t kvh);
torch::Tensor cross_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const c10::optional<torch::Tensor>& mask);

constexpr int64_t kPerLayer = 8;

// weights: kPerLayer tensors per model layer: qkv, attn_out, cross_q, cross_out, ff_in, ff_in_bias, ff_out,
// ff_out_bias (products packed as small_gemm takes them; the norms folded in). k_all, v_all: the cache
// (layers, rows, kvh, capacity, d); enc_keys, enc_values: per layer (rows, h, S, d).
torch::Tensor run_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, int64_t first, int64_t last,
                         const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                         const torch::Tensor& slots, const torch::Tensor& k_all, const torch::Tensor& v_all,
                         const c10::optional<torch::Tensor>& mask, int64_t keys, int64_t h, int64_t kvh,
                         const std::vector<torch::Tensor>& enc_keys, const std::vector<torch::Tensor>& enc_values,
                         const c10::optional<torch::Tensor>& cross_mask) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && 0 <= first && first <= last && last <= layers &&
              k_all.size(0) == layers && v_all.size(0) == layers && static_cast<int64_t>(enc_keys.size()) == layers &&
              static_cast<int64_t>(enc_values.size()) == layers, "run_layers: weights, cache and source K/V disagree on the layers");
  const c10::optional<torch::Tensor> none;
  for (int64_t i = first; i < last; ++i) {
    const torch::Tensor* w = weights.data() + i * kPerLayer;
    const auto heads = small_gemm(x, w[0], none, none, true, false);
    const auto a = self_attention(heads, cos, sin, pos, slots, k_all.select(0, i), v_all.select(0, i), mask, keys, h, kvh);
    x = small_gemm(a, w[1], none, x, false, false);
    const auto q = small_gemm(x, w[2], none, none, true, false);
    x = small_gemm(cross_attention(q, enc_keys[i], enc_values[i], cross_mask), w[3], none, x, false, false);
    x = small_gemm(small_gemm(x, w[4], w[5], none, true, false), w[6], w[7], x, false, true);
  }
  return x;
}

// In place: rows r of t (layers, rows, heads, capacity, d) become rows index[r], slots below `high`
// only. Rows that keep their place are not touched; sources are read before any row is written.
void reorder_rows(torch::Tensor t, const torch::Tensor& index, int64_t high) {
  TORCH_CHECK(t.dim() == 5 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              "t: contiguous float32 CPU (layers, rows, heads, capacity, d)");
  const int64_t layers = t.size(0), rows = t.size(1), heads = t.size(2), cap = t.size(3), d = t.size(4);
  TORCH_CHECK(index.dim() == 1 && index.size(0) == rows && index.scalar_type() == at::kLong, "index: int64 (rows,)");
  TORCH_CHECK(0 <= high && high <= cap, "high out of range");
  const auto idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<int64_t> moved;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= ip[r] && ip[r] < rows, "index out of range");
    if (ip[r] != r) moved.push_back(r);
  }
  if (moved.empty() || high == 0) return;
  float* base = t.data_ptr<float>();
  const int64_t span = high * d, row_stride = heads * cap * d;
  at::parallel_for(0, layers, 1, [&](int64_t l0, int64_t l1) {
    std::vector<float> tmp(moved.size() * heads * span);
    for (int64_t l = l0; l < l1; ++l) {
      float* layer = base + l * rows * row_stride;
      for (size_t m = 0; m < moved.size(); ++m)
        for (int64_t h = 0; h < heads; ++h) {
          const float* src = layer + ip[moved[m]] * row_stride + h * cap * d;
          std::copy(src, src + span, tmp.data() + (m * heads + h) * span);
        }
      for (size_t m = 0; m < moved.size(); ++m)
        for (int64_t h = 0; h < heads; ++h) {
          const float* src = tmp.data() + (m * heads + h) * span;
          std::copy(src, src + span, layer + moved[m] * row_stride + h * cap * d);
        }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "x @ W (+ bias) (+ residual), W packed in 16-column panels, x optionally row-normalised");
  m.def("self_attention", &self_attention, "rotary + K/V cache write + attention for a few decoding queries");
  m.def("cross_attention", &cross_attention, "attention of a few decoding queries over source K/V");
  m.def("reorder_rows", &reorder_rows, "in place: cache rows r become rows index[r] (slots below high)");
  m.def("run_layers", &run_layers, "decoder layers [first, last) on a few tokens: products and attention in one call");
}
