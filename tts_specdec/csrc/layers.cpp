// A range of decoder layers in one call: the per-layer sequence of `Decoder._run_fused` without the
// Python in between (at 1-7 rows a layer's kernels take ~40 us; Python dispatch around them took as long).
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
