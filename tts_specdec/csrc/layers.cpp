// A range of decoder layers in one call (`Stack`): the per-layer sequence of `Decoder._run_fused`
// without Python in between, on weights checked once when the stack is built; each call checks its
// arguments once and runs every layer on raw pointers into one workspace (no tensor per product).
// Also the module's Python bindings for every source file.
#include <torch/extension.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

torch::Tensor small_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, bool normalize, bool geglu);
torch::Tensor self_attention(const torch::Tensor& heads, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& pos, const torch::Tensor& slots, torch::Tensor k_cache,
                             torch::Tensor v_cache, const c10::optional<torch::Tensor>& mask, int64_t keys,
                             int64_t h, int64_t kvh);
torch::Tensor cross_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const c10::optional<torch::Tensor>& mask);
void token_slots(const torch::Tensor& pos, const torch::Tensor& slots, int64_t keys, int64_t positions,
                 std::vector<int64_t>& sp, std::vector<int64_t>& pp, const uint8_t* is_real);  // attention.cpp
torch::Tensor fingerprint(const std::vector<torch::Tensor>& tensors);  // fingerprint.cpp
tts::MaskView mask_view(const c10::optional<torch::Tensor>& mask, int64_t rows, int64_t n, int64_t keys);
std::vector<torch::Tensor> speculative_accept(const torch::Tensor& p, const torch::Tensor& q, const torch::Tensor& drafts,
                                              const torch::Tensor& u, const torch::Tensor& race,
                                              const c10::optional<torch::Tensor>& limit);
std::tuple<std::vector<std::vector<double>>, std::vector<std::vector<int64_t>>, torch::Tensor, torch::Tensor, torch::Tensor>
beam_top(const torch::Tensor& scores, const torch::Tensor& logprobs, const std::vector<int64_t>& rows, int64_t n);  // beam.cpp
// cache_ops.cpp
void reorder_rows(torch::Tensor t, const torch::Tensor& index, int64_t high);
void move_slots(const std::vector<torch::Tensor>& bufs, const torch::Tensor& rows, const torch::Tensor& src,
                const torch::Tensor& dst, const c10::optional<torch::Tensor>& table);
std::vector<torch::Tensor> commit_beams(const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& table,
                                        int64_t high, const std::vector<int64_t>& source, const std::vector<int64_t>& rows,
                                        const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                                        const std::vector<int64_t>& lengths, const std::vector<int64_t>& tokens,
                                        const std::vector<int64_t>& node, const std::vector<double>& scores,
                                        const torch::Tensor& emb, const torch::Tensor& logprobs);

namespace {

constexpr int64_t kPerLayer = 8;

// The panels of a packed (out / 16, in, 16) weight: its input width must be `in`; returns out.
int64_t packed_out(const torch::Tensor& w, int64_t in, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.size(1) == in && w.size(2) == tts::kPanel && w.is_contiguous() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.device().is_cpu(), name,
              ": contiguous float32 or bfloat16 CPU (out / 16, ", in, ", 16)");
  return w.size(0) * tts::kPanel;
}

// rows: the rows decoded; a cache with a slot table may hold more (rows of finished items stay put)
void check_cache(const torch::Tensor& t, int64_t layers, int64_t rows, int64_t kvh, int64_t d, const char* name, bool table) {
  TORCH_CHECK(t.dim() == 5 && t.size(0) == layers && (table ? t.size(1) >= rows : t.size(1) == rows) && t.size(2) == kvh && t.size(4) == d &&
              t.stride(4) == 1 && t.stride(3) == d && t.scalar_type() == at::kFloat && t.device().is_cpu(),
              name, ": float32 CPU (layers, rows, kv heads, slots, d) with contiguous slots");
}

// x (tokens, dim) += W_out(GEGLU(normalize(x) @ W_in + b_in)) + b_out, in place; ff (tokens, 2 inner) scratch.
// index (or null): only these `tokens` rows of x and ff (`tts::gemm`).
void feed_forward(float* x, int64_t tokens, int64_t dim, const torch::Tensor* w, int64_t inner, float* ff,
                  const int64_t* index = nullptr) {
  tts::gemm(x, dim, tokens, dim, w[0], w[1].data_ptr<float>(), nullptr, 0, true, ff, 2 * inner, index);
  for (int64_t i = 0; i < tokens; ++i) {
    float* f = ff + (index ? index[i] : i) * 2 * inner;
    tts::geglu_row(f, f + inner, f, inner);
  }
  tts::gemm(ff, 2 * inner, tokens, inner, w[2], w[3].data_ptr<float>(), x, dim, false, x, dim, index);
}

// Checks a feed-forward's 4 tensors (w_in, b_in, w_out, b_out) for model width dim; returns inner.
int64_t check_feed_forward(const torch::Tensor* w, int64_t dim) {
  const int64_t ff = packed_out(w[0], dim, "ff_in");
  TORCH_CHECK(ff % 2 == 0 && packed_out(w[2], ff / 2, "ff_out") == dim, "feed-forward: dim -> 2 inner -> dim");
  TORCH_CHECK(w[1].is_contiguous() && w[1].numel() == ff && w[1].scalar_type() == at::kFloat &&
              w[3].is_contiguous() && w[3].numel() == dim && w[3].scalar_type() == at::kFloat, "feed-forward biases");
  return ff / 2;
}

}  // namespace

// Decoder layers packed for the kernels. weights: kPerLayer tensors per model layer: qkv, attn_out,
// cross_q, cross_out, ff_in, ff_in_bias, ff_out, ff_out_bias (products packed as small_gemm takes them,
// the norms folded in; ff_in's output is [value | gate], each half as wide as ff_out's input).
class Stack {
 public:
  Stack(std::vector<torch::Tensor> weights, int64_t h, int64_t kvh, int64_t d)
      : w_(std::move(weights)), h_(h), kvh_(kvh), d_(d) {
    TORCH_CHECK(!w_.empty() && w_.size() % kPerLayer == 0, "weights: ", kPerLayer, " tensors per layer");
    TORCH_CHECK(h > 0 && kvh > 0 && h % kvh == 0 && d > 0 && d % 8 == 0, "heads, kv heads, dim_head: h % kvh == 0, d % 8 == 0");
    layers_ = static_cast<int64_t>(w_.size()) / kPerLayer;
    dim_ = w_[0].dim() == 3 ? w_[0].size(1) : 0;
    const int64_t hd = h * d;
    for (int64_t i = 0; i < layers_; ++i) {
      const torch::Tensor* w = w_.data() + i * kPerLayer;
      TORCH_CHECK(packed_out(w[0], dim_, "qkv") == (h + 2 * kvh) * d, "qkv: (h + 2 kvh) d outputs");
      TORCH_CHECK(packed_out(w[1], hd, "attn_out") == dim_ && packed_out(w[2], dim_, "cross_q") == hd &&
                  packed_out(w[3], hd, "cross_out") == dim_, "attention products: dim -> h d -> dim");
      const int64_t inner = check_feed_forward(w + 4, dim_);
      if (i == 0) inner_ = inner;
      TORCH_CHECK(inner == inner_, "feed-forward: every layer as wide");
    }
  }

  // x (rows * n, dim) through layers [first, last). pos, slots (rows, n) int64; k_all, v_all the cache
  // (layers, rows, kvh, capacity, d); table (rows, capacity) int64 or none: the cache row each slot is
  // read from (`CacheView`; k_all, v_all may then hold more rows); mask (1 or rows, n, keys) additive or
  // none (causal by slot); enc_keys, enc_values (layers, sources, h, S, d): row r reads source enc_rows[r]
  // (int64 (rows,)), or source r without enc_rows; cross_mask (rows, S) additive or none. real (or none):
  // int64, the increasing indices of the tokens whose outputs matter when rows are padded to n; the
  // products skip the others (their q, k, v zero, so their K/V in the cache is zero as on torch's path;
  // their outputs zero), and the real tokens' results are those of a call without `real`. A padding
  // token's slot may be -1: it writes no K/V (what its slot holds stays, for the real tokens to read).
  torch::Tensor run(const torch::Tensor& x, int64_t first, int64_t last, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& pos, const torch::Tensor& slots, const torch::Tensor& k_all,
                    const torch::Tensor& v_all, const c10::optional<torch::Tensor>& table,
                    const c10::optional<torch::Tensor>& mask, int64_t keys,
                    const torch::Tensor& enc_keys, const torch::Tensor& enc_values,
                    const c10::optional<torch::Tensor>& cross_mask, const c10::optional<torch::Tensor>& enc_rows,
                    const c10::optional<torch::Tensor>& real) const {
    TORCH_CHECK(0 <= first && first <= last && last <= layers_, "layers [", first, ", ", last, ") outside 0..", layers_);
    TORCH_CHECK(slots.dim() == 2, "pos, slots: int64 (rows, n)");
    const int64_t rows = slots.size(0), n = slots.size(1), tokens = rows * n;
    TORCH_CHECK(x.dim() == 2 && x.size(0) == tokens && x.size(1) == dim_ && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "x: float32 CPU (rows * n, dim)");
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == d_ && cos.is_contiguous() && sin.is_contiguous() &&
                cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos, sin: contiguous float32 (P, d)");
    check_cache(k_all, layers_, rows, kvh_, d_, "k_all", table.has_value());
    check_cache(v_all, layers_, rows, kvh_, d_, "v_all", table.has_value());
    TORCH_CHECK(k_all.size(1) == v_all.size(1), "k_all, v_all: as many rows");
    const int64_t cap = k_all.size(3);
    TORCH_CHECK(v_all.size(3) == cap && 0 <= keys && keys <= cap, "keys exceed the cache capacity");
    const int64_t* tp = nullptr;
    if (table) {
      TORCH_CHECK(table->dim() == 2 && table->size(0) == rows && table->size(1) == cap && table->stride(1) == 1 &&
                  table->scalar_type() == at::kLong, "table: int64 (rows, capacity), contiguous slots");
      tp = table->data_ptr<int64_t>();
      for (int64_t r = 0; r < rows; ++r)  // every slot a query may read names a cache row
        for (int64_t s = 0; s < keys; ++s)
          TORCH_CHECK(0 <= tp[r * table->stride(0) + s] && tp[r * table->stride(0) + s] < k_all.size(1), "table: row out of range");
    }
    const tts::MaskView mv = mask_view(mask, rows, n, keys);
    TORCH_CHECK(enc_keys.dim() == 5 && enc_keys.sizes() == enc_values.sizes() && enc_keys.size(0) == layers_ &&
                (enc_rows || enc_keys.size(1) == rows) && enc_keys.size(2) == h_ && enc_keys.size(4) == d_ && enc_keys.stride(4) == 1 &&
                enc_keys.stride(3) == d_ && enc_values.stride(4) == 1 && enc_values.stride(3) == d_ &&
                enc_keys.scalar_type() == at::kFloat && enc_values.scalar_type() == at::kFloat,
                "enc_keys, enc_values: float32 (layers, rows, h, S, d) with contiguous (S, d)");
    const int64_t S = enc_keys.size(3);
    const int64_t* row_of = nullptr;
    if (enc_rows) {
      TORCH_CHECK(enc_rows->dim() == 1 && enc_rows->size(0) == rows && enc_rows->is_contiguous() &&
                  enc_rows->scalar_type() == at::kLong, "enc_rows: contiguous int64 (rows,)");
      row_of = enc_rows->data_ptr<int64_t>();
      for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK(0 <= row_of[r] && row_of[r] < enc_keys.size(1), "enc_rows: source out of range");
    }
    const float* cm = nullptr;
    int64_t cm_row = 0;
    if (cross_mask) {
      TORCH_CHECK(cross_mask->dim() == 2 && cross_mask->size(0) == rows && cross_mask->size(1) == S &&
                  cross_mask->stride(1) == 1 && cross_mask->scalar_type() == at::kFloat, "cross_mask: float32 (rows, S)");
      cm = cross_mask->data_ptr<float>();
      cm_row = cross_mask->stride(0);
    }

    const int64_t* index = nullptr;  // the real tokens, or null: all
    int64_t live = tokens;
    std::vector<uint8_t> is_real;  // per token, for attention (which runs on every token's slot)
    if (real) {
      TORCH_CHECK(real->dim() == 1 && real->is_contiguous() && real->scalar_type() == at::kLong, "real: contiguous int64 (tokens,)");
      index = real->data_ptr<int64_t>();
      live = real->size(0);
      for (int64_t i = 0; i < live; ++i)
        TORCH_CHECK((i ? index[i - 1] < index[i] : 0 <= index[i]) && index[i] < tokens, "real: increasing token indices below rows * n");
      is_real.assign(tokens, 0);
      for (int64_t i = 0; i < live; ++i) is_real[index[i]] = 1;
    }
    std::vector<int64_t> sp, pp;  // a padding token's slot may be -1: it leaves the cache alone
    token_slots(pos, slots, keys, cos.size(0), sp, pp, index ? is_real.data() : nullptr);
    // a padding token attends to nothing: its attention output stays zero (the workspace is zeroed and
    // never written there), as its products' outputs do
    const uint8_t* attending = index ? is_real.data() : nullptr;

    const int64_t hd = h_ * d_, width = (h_ + 2 * kvh_) * d_;
    // the residual stream, updated in place layer by layer (padding tokens: zero throughout)
    auto out = index ? torch::zeros({tokens, dim_}, x.options()).index_copy_(0, *real, x.index_select(0, *real))
                     : x.clone(at::MemoryFormat::Contiguous);
    // zeroed: a padding token's q, k and v stay zero
    std::vector<float> ws(tokens * (width + 2 * hd + 2 * inner_));
    float* heads = ws.data();  // (tokens, width): q, k, v of every token
    float* q = heads + tokens * width;  // (tokens, hd): rotated or cross-attention queries
    float* a = q + tokens * hd;  // (tokens, hd): attention outputs
    float* ff = a + tokens * hd;  // (tokens, 2 inner): [value | gate], then value * gelu(gate)
    float* xp = out.data_ptr<float>();
    for (int64_t i = first; i < last; ++i) {
      const torch::Tensor* w = w_.data() + i * kPerLayer;
      const float* none = nullptr;
      tts::gemm(xp, dim_, live, dim_, w[0], none, none, 0, true, heads, width, index);
      const tts::CacheView cache{k_all.data_ptr<float>() + i * k_all.stride(0), v_all.data_ptr<float>() + i * v_all.stride(0),
                                 k_all.stride(1), k_all.stride(2), v_all.stride(1), v_all.stride(2),
                                 tp, table ? table->stride(0) : 0};
      tts::self_attention(heads, cos.data_ptr<float>(), sin.data_ptr<float>(), pp.data(), sp.data(), rows, n, h_, kvh_, d_,
                          cache, mv, keys, q, a, attending);
      tts::gemm(a, hd, live, hd, w[1], none, xp, dim_, false, xp, dim_, index);
      tts::gemm(xp, dim_, live, dim_, w[2], none, none, 0, true, q, hd, index);
      const tts::SourceView src{enc_keys.data_ptr<float>() + i * enc_keys.stride(0), enc_values.data_ptr<float>() + i * enc_values.stride(0),
                                enc_keys.stride(1), enc_keys.stride(2), enc_values.stride(1), enc_values.stride(2), S, cm, cm_row,
                                row_of};
      tts::cross_attention(q, rows, n, h_, d_, src, a, attending);
      tts::gemm(a, hd, live, hd, w[3], none, xp, dim_, false, xp, dim_, index);
      feed_forward(xp, live, dim_, w + 4, inner_, ff, index);
    }
    return out;
  }

 private:
  std::vector<torch::Tensor> w_;
  int64_t h_, kvh_, d_, layers_ = 0, dim_ = 0, inner_ = 0;
};

// An output head: optionally x + FF(x) first (the early-exit head's Residual(FeedForward)), then
// normalize(x) @ W with the head's RMSNorm folded into W, padded to whole panels; `width` columns matter.
class Head {
 public:
  Head(std::vector<torch::Tensor> ff, torch::Tensor w_out, int64_t width) : ff_(std::move(ff)), w_(std::move(w_out)), width_(width) {
    TORCH_CHECK(ff_.empty() || ff_.size() == 4, "ff: none or w_in, b_in, w_out, b_out");
    TORCH_CHECK(w_.dim() == 3, "w_out: packed (out / 16, dim, 16)");
    dim_ = w_.size(1);
    TORCH_CHECK(0 < width && width <= packed_out(w_, dim_, "w_out"), "width: 1 .. the padded output width");
    if (!ff_.empty()) inner_ = check_feed_forward(ff_.data(), dim_);
  }

  // h (tokens, dim), unit column stride -> logits (tokens, width), a view of whole-panel rows
  torch::Tensor operator()(const torch::Tensor& h) const {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == dim_ && h.stride(1) == 1 && h.scalar_type() == at::kFloat && h.device().is_cpu(),
                "h: float32 CPU (tokens, dim), unit column stride");
    const int64_t tokens = h.size(0), out = w_.size(0) * tts::kPanel;
    auto logits = torch::empty({tokens, out}, h.options());
    const float* x = h.data_ptr<float>();
    int64_t ldx = h.stride(0);
    std::vector<float> ws;
    if (!ff_.empty()) {
      ws.resize(tokens * (dim_ + 2 * inner_));
      for (int64_t t = 0; t < tokens; ++t) std::copy(x + t * ldx, x + t * ldx + dim_, ws.data() + t * dim_);
      feed_forward(ws.data(), tokens, dim_, ff_.data(), inner_, ws.data() + tokens * dim_);
      x = ws.data();
      ldx = dim_;
    }
    tts::gemm(x, ldx, tokens, dim_, w_, nullptr, nullptr, 0, true, logits.data_ptr<float>(), out);
    return width_ == out ? logits : logits.narrow(1, 0, width_);
  }

 private:
  std::vector<torch::Tensor> ff_;
  torch::Tensor w_;
  int64_t width_, dim_ = 0, inner_ = 0;
};

// Whether l[0:V] are all finite: their sum in double is NaN or +-inf iff one is (float values cannot
// overflow a double sum), one pass of adds instead of a test per value.
bool finite_row(const float* l, int64_t V) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += l[i];
  return std::isfinite(total);
}

// q[0:V] = softmax of the logits l / t after `sampling.filter_logits`' filters: top_k > 0 masks the
// logits below the top_k-th largest (the same float threshold as torch.topk's; ties stay); 0 < top_p
// < 1 then masks every token whose better-ranked tokens already hold more than top_p of the mass (that
// mass summed in double: a token within ~1e-7 of the edge may fall the other way than in torch's
// float32 cumsum; q stays the distribution that is drawn from). Scratch vectors are reused by callers.
// Logits that are not all finite give q = NaN, as torch's softmax does (and the sort below never sees
// a NaN: std::sort needs a strict weak order).
void filtered_softmax(const float* l, int64_t V, float t, int64_t top_k, double top_p, float* q,
                      std::vector<float>& kth_buf, std::vector<int64_t>& order) {
  if (!finite_row(l, V)) {
    std::fill(q, q + V, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  for (int64_t i = 0; i < V; ++i) q[i] = t == 1.0f ? l[i] : l[i] / t;  // as filter_logits divides them
  if (top_k > 0 && top_k < V) {
    kth_buf.assign(q, q + V);
    std::nth_element(kth_buf.begin(), kth_buf.begin() + (top_k - 1), kth_buf.end(), std::greater<float>());
    const float kth = kth_buf[top_k - 1];
    for (int64_t i = 0; i < V; ++i)
      if (q[i] < kth) q[i] = -std::numeric_limits<float>::infinity();
  }
  if (top_p > 0.0 && top_p < 1.0) {
    order.resize(V);
    for (int64_t i = 0; i < V; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return q[a] > q[b]; });
    const float top = q[order[0]];
    double mass = 0.0;
    for (int64_t i = 0; i < V; ++i) mass += std::exp(double(q[i] - top));
    double before = 0.0;  // mass of the tokens ranked above
    for (int64_t i = 0; i < V; ++i) {
      const double pi = std::exp(double(q[order[i]] - top)) / mass;
      if (before > top_p) q[order[i]] = -std::numeric_limits<float>::infinity();
      before += pi;
    }
  }
  const float m = *std::max_element(q, q + V);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += (q[i] = std::exp(q[i] - m));
  const float inv = float(1.0 / total);
  for (int64_t i = 0; i < V; ++i) q[i] *= inv;
}

// probs (rows, V) = filtered_softmax of each row of logits (rows, V), float32, unit column stride.
torch::Tensor filtered_probs(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "logits: float32 CPU (rows, V), unit column stride");
  TORCH_CHECK(temperature > 0.0 && top_k >= 0 && top_p >= 0.0 && top_p <= 1.0,
              "temperature > 0, top_k >= 0 (0: none), top_p in [0, 1] (0: none)");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto probs = torch::empty({rows, V}, logits.options());
  std::vector<float> kth_buf;
  std::vector<int64_t> order;
  for (int64_t r = 0; r < rows; ++r)
    filtered_softmax(logits.data_ptr<float>() + r * logits.stride(0), V, float(temperature), top_k, top_p,
                     probs.data_ptr<float>() + r * V, kth_buf, order);
  return probs;
}

// `gamma` decoding steps for every row in one call, each row at its own slots: the draft phase of a
// speculative sampling cycle (layers [0, E), the exit head, `tail`) or a run of plain sampling (every
// layer, the target head, stopping at `eos`). x0 (rows, dim): each row's pending input, at slot start[r];
// step d runs layers [0, last) at slot start[r] + d, takes the head's logits, picks
//   greedy (temperature 0): argmax;  sampling: argmax_i q_i / E_i, q = softmax(logits / temperature)
// filtered by top_k / top_p first (`filtered_softmax`), E_i ~ Exp(1) drawn from `gen` as one (seqs, V)
// tensor per step, as `sampling.draw` draws them (so the tokens and the generator's state are those of
// the step-by-step loop), and embeds it (emb) as the next input. tail: the last token is run through
// the layers too (its exit state is the draft's last). confidence > 0: a row stops proposing after a
// token its head gave less than that probability (greedy: the softmax maximum), and the steps end once
// every row stopped (`speculative.sample_loop`'s early draft stops). eos >= 0: the steps end after one
// in which some row picked eos (the caller drops that row). guidance > 0: rows come in (cond, null)
// pairs of one sequence each, whose logits are mixed as `sampling.cfg_mix` mixes them,
// null + (cond - null) * guidance, before the pick; the sequence's token feeds both rows. Returns the
// layers' outputs (rows, steps + 1, dim) (empty without tail), q (seqs, steps, V) (empty when greedy),
// the tokens (seqs, steps), each sequence's proposed count (seqs,) (empty without confidence) and the
// next input (rows, dim), the embedding of the last token; steps <= gamma. With confidence, a sequence's
// rows run no pass past its last draft's (padding: zero outputs and K/V), its q and tokens there are 0.
// A sequence whose (mixed) logits are not all finite gets token -1 (`finite.NONFINITE`) and q = NaN at
// that step, and token 0's embedding as its next input; a run of plain steps ends after that step.
std::vector<torch::Tensor> decode_steps(const Stack& stack, const Head& head, const torch::Tensor& emb, const torch::Tensor& x0,
                                        int64_t last, const torch::Tensor& start, int64_t gamma, double temperature,
                                        int64_t top_k, double top_p, double guidance, double confidence, int64_t eos, bool tail,
                                        c10::optional<at::Generator> gen, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& k_all, const torch::Tensor& v_all, const torch::Tensor& enc_keys,
                                        const torch::Tensor& enc_values, const c10::optional<torch::Tensor>& cross_mask,
                                        const c10::optional<torch::Tensor>& enc_rows) {
  TORCH_CHECK(x0.dim() == 2 && x0.size(0) > 0 && x0.scalar_type() == at::kFloat, "x0: float32 (rows >= 1, dim)");
  TORCH_CHECK(start.dim() == 1 && start.size(0) == x0.size(0) && start.scalar_type() == at::kLong && start.is_contiguous(),
              "start: contiguous int64 (rows,)");
  TORCH_CHECK(emb.dim() == 2 && emb.size(1) == x0.size(1) && emb.is_contiguous() && emb.scalar_type() == at::kFloat,
              "emb: contiguous float32 (tokens, dim)");
  TORCH_CHECK(gamma >= 1 && temperature >= 0.0, "gamma >= 1, temperature >= 0");
  TORCH_CHECK(top_k >= 0 && top_p >= 0.0 && top_p <= 1.0, "top_k >= 0 (0: no top-k), top_p in [0, 1] (0: no top-p)");
  TORCH_CHECK(guidance >= 0.0 && (guidance == 0.0 || x0.size(0) % 2 == 0), "guidance >= 0; guided rows in (cond, null) pairs");
  const int64_t rows = x0.size(0), dim = x0.size(1), per = guidance > 0.0 ? 2 : 1, seqs = rows / per;
  const bool sampling = temperature > 0.0;
  const float scale = float(guidance);
  std::vector<float> mixed, kth_buf;  // scratch: one sequence's guided logits; `filtered_softmax`'s
  std::vector<int64_t> order;
  const int64_t* sp = start.data_ptr<int64_t>();
  const int64_t first = *std::max_element(sp, sp + rows);
  torch::Tensor exits = tail ? torch::empty({rows, gamma + 1, dim}, x0.options()) : torch::empty({0}, x0.options());
  auto tokens = torch::empty({seqs, gamma}, start.options());
  torch::Tensor q;
  auto x = x0.contiguous();
  auto slots = start.view({rows, 1}).clone();
  const c10::optional<torch::Tensor> none;
  auto limit = torch::full({seqs}, gamma, start.options());
  int64_t* limits = limit.data_ptr<int64_t>();
  int64_t steps = gamma, drafting = seqs;
  for (int64_t d = 0;; ++d) {
    if (d) slots.add_(1);
    // a sequence that stopped proposing (early draft stops) needs its pass at step limit (its last
    // draft's exit state), none after: its rows are padding there (the products skip them, they write
    // zero K/V past the slots its drafts reach, and their exit states are zero). With several rows the
    // steps run on for the sequences still drafting, and a stopped one's passes were a verify's padding
    // too (`CpuKernels.verify_accept`).
    c10::optional<torch::Tensor> real;
    if (drafting < seqs) {
      std::vector<int64_t> live;
      for (int64_t r = 0; r < rows; ++r)
        if (d <= limits[r / per]) live.push_back(r);
      if (int64_t(live.size()) < rows) real = torch::tensor(live, start.options());
    }
    auto h = stack.run(x, 0, last, cos, sin, slots, slots, k_all, v_all, none, none, first + d + 1, enc_keys, enc_values, cross_mask, enc_rows, real);
    if (tail) exits.select(1, d).copy_(h);
    if (d == steps) break;  // with tail: the last token's pass
    auto logits = head(h);  // (rows, V), a view of whole-panel rows
    const int64_t V = logits.size(1), ld = logits.stride(0);
    TORCH_CHECK(V <= emb.size(0), "head wider than the embedding table");
    // zero past a sequence's proposed drafts, which nothing reads (accept rules stop at the limit): finite
    if (d == 0 && sampling) q = confidence > 0 ? torch::zeros({seqs, gamma, V}, x0.options()) : torch::empty({seqs, gamma, V}, x0.options());
    torch::Tensor race;
    if (sampling) race = torch::empty({seqs, V}, x0.options()).exponential_(1.0, gen);
    const float* lp = logits.data_ptr<float>();
    x = drafting < seqs ? torch::zeros({rows, dim}, x0.options()) : torch::empty({rows, dim}, x0.options());
    bool ended = false;
    for (int64_t r = 0; r < seqs; ++r) {
      if (d >= limits[r]) {  // stopped: no draft d (token 0, q zero, its next input a padding one)
        tokens.data_ptr<int64_t>()[r * gamma + d] = 0;
        continue;
      }
      const float* l = lp + r * per * ld;
      if (per == 2) {  // float ops in cfg_mix's order (no contraction: -ffp-contract=off)
        const float *cond = l, *null = l + ld;
        mixed.resize(V);
        for (int64_t i = 0; i < V; ++i) mixed[i] = null[i] + (cond[i] - null[i]) * scale;
        l = mixed.data();
      }
      int64_t best = 0;
      float chosen = 1.0f;  // the head's probability of its token, for the early stop
      const bool finite = finite_row(l, V);
      if (!finite) {  // no pick: marked, and the row keeps drafting as torch's NaN comparisons let it
        if (sampling) std::fill_n(q.data_ptr<float>() + (r * gamma + d) * V, V, std::numeric_limits<float>::quiet_NaN());
        ended |= !tail;
      } else if (!sampling) {
        for (int64_t i = 1; i < V; ++i)
          if (l[i] > l[best]) best = i;
        if (confidence > 0) {  // softmax maximum = 1 / sum_i exp(l_i - max)
          double total = 0.0;
          for (int64_t i = 0; i < V; ++i) total += std::exp(l[i] - l[best]);
          chosen = float(1.0 / total);
        }
      } else {
        float* qr = q.data_ptr<float>() + (r * gamma + d) * V;
        filtered_softmax(l, V, float(temperature), top_k, top_p, qr, kth_buf, order);
        const float* e = race.data_ptr<float>() + r * V;
        float best_score = -1.0f;
        for (int64_t i = 0; i < V; ++i) {
          const float score = qr[i] / std::max(e[i], std::numeric_limits<float>::min());  // as draw's clamp
          if (score > best_score) best_score = score, best = i;
        }
        chosen = qr[best];
      }
      if (confidence > 0 && limits[r] == gamma && d < gamma && chosen < confidence) {
        limits[r] = d + 1;  // this row proposes tokens 0..d
        --drafting;
      }
      ended |= finite && best == eos;
      tokens.data_ptr<int64_t>()[r * gamma + d] = finite ? best : -1;
      for (int64_t k = r * per; k < (r + 1) * per; ++k)
        std::copy(emb.data_ptr<float>() + best * dim, emb.data_ptr<float>() + (best + 1) * dim, x.data_ptr<float>() + k * dim);
    }
    if (drafting == 0 || ended) steps = d + 1;
    if (!tail && d + 1 == steps) break;
  }
  return {tail ? exits.narrow(1, 0, steps + 1) : exits, q.defined() ? q.narrow(1, 0, steps) : torch::empty({0}, x0.options()),
          tokens.narrow(1, 0, steps), confidence > 0 ? limit : torch::empty({0}, start.options()), x};
}

// The rest of a speculative sampling cycle after its verify pass, in one call (`speculative._cycles`,
// unguided, on the kernels): some ten small torch operations and their Python otherwise, ~0.2 ms of a
// ~1.4 ms cycle on the shipped model. h (rows * n, dim): the verify pass's outputs, n = g + 1 positions
// per row; drafts (rows, g) int64; q (rows, g, V) the draft's distributions (sampling); limit (rows,)
// int64 drafts each row proposed, or none. Every number is the one `_cycles` computes with torch ops on the
// kernels: the logits of `head` (`Decoder.target_logits`' product), greedy: `greedy_accept` on torch's
// argmax; sampling: p as `sampling.probabilities` makes it (`filtered_softmax` where top_k or top_p was
// given, torch's softmax of logits / temperature otherwise), u (rows, g) then race (rows, V) drawn from gen
// as `sampling.Draws` draws them, and `speculative_accept`. So tokens and the generator's state are those of
// the step-by-step path. Returns the read-back (rows, 2 + n + g [+ 1]) float64 (accepted, next token, each
// position's logit sum in double, the drafts [, limit]; the sums are read for finiteness only, and are
// summed in order here, not in torch's order), the next input emb[next] (rows, 1, dim) and each row's
// advance, accepted + 1 (rows,).
std::vector<torch::Tensor> verify_accept(const Head& head, const torch::Tensor& emb, const torch::Tensor& h,
                                         const torch::Tensor& drafts, const c10::optional<torch::Tensor>& q,
                                         const c10::optional<torch::Tensor>& limit, double temperature, bool filtered,
                                         int64_t top_k, double top_p, c10::optional<at::Generator> gen) {
  TORCH_CHECK(drafts.dim() == 2 && drafts.scalar_type() == at::kLong && drafts.is_contiguous() && drafts.size(1) > 0,
              "drafts: contiguous int64 (rows, gamma), gamma > 0");
  const int64_t rows = drafts.size(0), g = drafts.size(1), n = g + 1;
  TORCH_CHECK(h.dim() == 2 && h.size(0) == rows * n, "h: (rows * (gamma + 1), dim)");
  TORCH_CHECK(emb.dim() == 2 && emb.scalar_type() == at::kFloat && emb.is_contiguous(), "emb: contiguous float32 (vocab, dim)");
  const int64_t* lp = nullptr;
  if (limit) {
    TORCH_CHECK(limit->scalar_type() == at::kLong && limit->is_contiguous() && limit->dim() == 1 && limit->size(0) == rows,
                "limit: contiguous int64 (rows,)");
    lp = limit->data_ptr<int64_t>();
  }
  const torch::Tensor logits = head(h);  // (rows * n, V), unit column stride
  const int64_t V = logits.size(1), ld = logits.stride(0);
  const float* lg = logits.data_ptr<float>();
  // plain loops rather than torch operations here: right after the layer pass a cycle's first operations
  // find their code and data out of the caches, and each torch operation cost ~10 us more there
  std::vector<double> sums(rows * n);  // read only for finiteness (`finite_row`)
  for (int64_t t = 0; t < rows * n; ++t) {
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) total += lg[t * ld + i];
    sums[t] = total;
  }
  auto accepted = torch::empty({rows}, drafts.options());
  auto next = torch::empty({rows}, drafts.options());
  if (temperature == 0.0) {
    // torch's argmax: the first maximum, and the first NaN where there is one (as `greedy_accept` reads it)
    std::vector<int64_t> top(rows * n);
    for (int64_t t = 0; t < rows * n; ++t) {
      const float* l = lg + t * ld;
      int64_t best = 0;
      float value = l[0];
      for (int64_t i = 1; i < V && !std::isnan(value); ++i)
        if (std::isnan(l[i]) || l[i] > value) value = l[i], best = i;
      top[t] = best;
    }
    const int64_t* tp = top.data();
    const int64_t* dp = drafts.data_ptr<int64_t>();
    int64_t* ap = accepted.data_ptr<int64_t>();
    int64_t* np = next.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t proposed = lp ? lp[r] : g;
      TORCH_CHECK(0 <= proposed && proposed <= g, "limit out of range");
      int64_t a = 0;
      while (a < proposed && dp[r * g + a] == tp[r * n + a]) ++a;
      ap[r] = a;
      np[r] = tp[r * n + a];
    }
  } else {
    TORCH_CHECK(q && q->dim() == 3 && q->size(0) == rows && q->size(1) == g && q->size(2) == V, "q: (rows, gamma, V) when sampling");
    const torch::Tensor p = filtered ? filtered_probs(logits, temperature, top_k, top_p)
                                     : (temperature == 1.0 ? logits : logits.div(temperature)).softmax(-1);
    auto u = torch::empty({rows, g}, logits.options()).uniform_(0.0, 1.0, gen);
    auto race = torch::empty({rows, V}, logits.options()).exponential_(1.0, gen);
    auto out = speculative_accept(p.view({rows, n, V}).contiguous(), q->contiguous(), drafts, u, race, limit);
    accepted = out[0];
    next = out[1];
  }
  auto read = torch::empty({rows, 2 + n + g + (lp ? 1 : 0)}, logits.options().dtype(at::kDouble));
  double* rp = read.data_ptr<double>();
  const int64_t width = read.size(1);
  const double* sp = sums.data();
  const int64_t* dp = drafts.data_ptr<int64_t>();
  const int64_t* ap = accepted.data_ptr<int64_t>();
  const int64_t* np = next.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    double* row = rp + r * width;
    row[0] = double(ap[r]);
    row[1] = double(np[r]);
    for (int64_t j = 0; j < n; ++j) row[2 + j] = sp[r * n + j];
    for (int64_t j = 0; j < g; ++j) row[2 + n + j] = double(dp[r * g + j]);
    if (lp) row[2 + n + g] = double(lp[r]);
  }
  const int64_t dim = emb.size(1);
  auto x = torch::empty({rows, 1, dim}, emb.options());
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= np[r] && np[r] < emb.size(0), "next token out of the embedding's range");
    std::copy(emb.data_ptr<float>() + np[r] * dim, emb.data_ptr<float>() + (np[r] + 1) * dim, x.data_ptr<float>() + r * dim);
  }
  auto advance = torch::empty({rows}, drafts.options());
  int64_t* vp = advance.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) vp[r] = ap[r] + 1;
  return {read, x, advance};
}

// One speculative beam cycle's draft (`spec_beam.draft`, unguided, on the kernels) in one call: beam search
// with the exit head for `levels` levels of `width` nodes per item from the R = items * K live beams (rows
// item-major), every node kept. Node ids: roots 0..R-1, then level by level, each level item-major and
// within an item in the order of its candidates' draft scores (ties: the lower parent, then the lower
// token). A node lives in its root's cache row at slot t[r] + index (its index: the row's node count
// before its level plus its rank among the level's nodes of that row) with rotary position t[r] + depth,
// and sees the committed prefix (slots < t[r]) and its ancestors (the tree mask); a level's pass runs
// layers [0, last) over the real nodes only (rows padded to the level's widest). A candidate's score is
// its parent's plus the head's log_softmax(logits / temperature) (`beam.step_logprobs`); eos >= 0 is never
// a candidate (an EOS ends a hypothesis: not a node to expand). x0 (R, dim): the roots' pending inputs at
// slots t (R,); score (R,): the live beams' scores by row; emb (tokens, dim): the inputs of drafted tokens.
// Returns the exit states hs (R, M, dim) by row and index (M = 1 + levels * width; zero where no node),
// anc (R, M, M) bool (anc[r, i, j]: index j of row r is an ancestor of index i, or i itself, for every i),
// depth (R, M), count (R,) nodes per row, and per node: row, index, parent (-1: a root), token (0: a
// root), path (N, levels) (index of its ancestor at depth 1..levels, itself at its depth, 0 below).
// Then the verify pass (`spec_beam.verify`): layers [last, upper) over every node of every row (rows
// padded to the most nodes any row holds, padding skipped), each node at its slot and position under the
// same tree mask; returns their outputs (N, dim) in node order as a last tensor (upper == last: the exit
// states themselves). ready (R,) bool or none: roots whose token the last cycle's verify pass already
// took through every layer (their K/V moved to slot t[r], `spec_beam.commit`): the verify pass skips
// them and leaves their slot alone (their outputs: zero; the caller holds their log-probs). carried (R, V)
// or none: the ready roots' target log-probs (`beam.step_logprobs`, from the last cycle); where given, a
// ready root skips the trunk pass too (its exit state: zero) and its children are ranked by them, not by
// the head (`spec_beam.draft`). table (R,
// capacity) int64 or none: a cache by reference (`Stack::run`), every tree slot t[r].. already row r's own.
std::vector<torch::Tensor> beam_draft(const Stack& stack, const Head& head, const torch::Tensor& emb, const torch::Tensor& x0,
                                      const torch::Tensor& t, const torch::Tensor& score, int64_t items, int64_t levels,
                                      int64_t width, int64_t last, int64_t upper, double temperature, int64_t eos, const torch::Tensor& cos,
                                      const torch::Tensor& sin, const torch::Tensor& k_all, const torch::Tensor& v_all,
                                      const torch::Tensor& enc_keys, const torch::Tensor& enc_values,
                                      const c10::optional<torch::Tensor>& cross_mask, const c10::optional<torch::Tensor>& enc_rows,
                                      const c10::optional<torch::Tensor>& ready, const c10::optional<torch::Tensor>& table,
                                      const Head* target, const c10::optional<torch::Tensor>& carried) {
  TORCH_CHECK(x0.dim() == 2 && x0.size(0) > 0 && x0.scalar_type() == at::kFloat && x0.is_contiguous(), "x0: contiguous float32 (R, dim)");
  const int64_t R = x0.size(0), dim = x0.size(1);
  TORCH_CHECK(items > 0 && R % items == 0, "items: a divisor of the rows");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == R && t.scalar_type() == at::kLong && t.is_contiguous(), "t: contiguous int64 (R,)");
  TORCH_CHECK(score.dim() == 1 && score.size(0) == R && score.scalar_type() == at::kFloat && score.is_contiguous(),
              "score: contiguous float32 (R,)");
  TORCH_CHECK(emb.dim() == 2 && emb.size(1) == dim && emb.is_contiguous() && emb.scalar_type() == at::kFloat,
              "emb: contiguous float32 (tokens, dim)");
  TORCH_CHECK(levels >= 1 && width >= 1 && temperature >= 0.0, "levels >= 1, width >= 1, temperature >= 0");
  TORCH_CHECK(upper >= last, "upper: at or above last");
  TORCH_CHECK(!ready || (ready->dim() == 1 && ready->size(0) == R && ready->scalar_type() == at::kBool && ready->is_contiguous()),
              "ready: contiguous bool (R,)");
  const bool* done = ready ? ready->data_ptr<bool>() : nullptr;
  const int64_t M = 1 + levels * width;
  TORCH_CHECK(!carried || (ready && carried->dim() == 2 && carried->size(0) == R && carried->is_contiguous() &&
                           carried->scalar_type() == at::kFloat), "carried: contiguous float32 (R, V) with ready");
  const float inv_t = temperature == 1.0 ? 1.0f : float(1.0 / std::max(temperature, 1e-10));
  const auto lopt = t.options();
  auto hs = torch::zeros({R, M, dim}, x0.options());
  auto anc_t = torch::zeros({R, M, M}, lopt.dtype(at::kBool));
  auto depth_t = torch::zeros({R, M}, lopt);
  bool* anc = anc_t.data_ptr<bool>();
  int64_t* depth = depth_t.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < M; ++i) anc[(r * M + i) * M + i] = true;
  const int64_t* tp = t.data_ptr<int64_t>();
  if (table) {  // by reference: each row's tree slots t.. are its own from now on (`KVCache.claim`)
    TORCH_CHECK(table->dim() == 2 && table->size(0) == R && table->is_contiguous() && table->scalar_type() == at::kLong,
                "table: contiguous int64 (R, capacity)");
    int64_t* tab = table->data_ptr<int64_t>();
    const int64_t cap = table->size(1);
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(0 <= tp[r] && tp[r] + M <= cap, "t: the tree's slots beyond the table");
      std::fill(tab + r * cap + tp[r], tab + r * cap + tp[r] + M, r);
    }
  }
  std::vector<int64_t> count(R, 1), row(R), index(R, 0), parent(R, -1), token(R, 0), path(R * levels, 0);
  for (int64_t r = 0; r < R; ++r) row[r] = r;
  std::vector<float> lscore(score.data_ptr<float>(), score.data_ptr<float>() + R);  // the level's nodes' scores
  const c10::optional<torch::Tensor> none;
  // the roots: one per row at slot t (causal by slot is their tree mask). A ready root with carried
  // log-probs skips the pass: its K/V are at slot t already, and the target's own log-probs rank its
  // children below (an exit state would only give the draft's guess of them)
  auto slots0 = t.view({R, 1});  // a skipped root's slot: -1, its K/V left alone
  c10::optional<torch::Tensor> roots_real;
  if (carried) {
    std::vector<int64_t> real_v;
    for (int64_t r = 0; r < R; ++r)
      if (!done[r]) real_v.push_back(r);
    if (int64_t(real_v.size()) < R) {
      roots_real = torch::tensor(real_v, lopt);
      slots0 = torch::where(*ready, -1, t).view({R, 1});
    }
  }
  auto h = roots_real && roots_real->numel() == 0
               ? torch::zeros({R, dim}, x0.options())
               : stack.run(x0, 0, last, cos, sin, t.view({R, 1}), slots0, k_all, v_all, table, none,
                           *std::max_element(tp, tp + R) + 1, enc_keys, enc_values, cross_mask, enc_rows, roots_real);
  for (int64_t r = 0; r < R; ++r) std::copy(h.data_ptr<float>() + r * dim, h.data_ptr<float>() + (r + 1) * dim, hs.data_ptr<float>() + r * M * dim);
  // the tree mask (R, c, keys) of queries at indexes first[r] + j of each row r: slots < t[r] and t[r] + i
  // for the query's ancestors i (a padding query: the prefix and its own slot)
  auto tree_mask = [&](const std::vector<int64_t>& first, int64_t c, int64_t keys) {
    auto mask = torch::empty({R, c, keys}, x0.options());
    float* mp = mask.data_ptr<float>();
    const float hidden = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < c; ++j) {
        const bool* own = anc + (r * M + first[r] + j) * M;
        float* out = mp + (r * c + j) * keys;
        for (int64_t s = 0; s < keys; ++s) {
          const int64_t rel = s - tp[r];
          out[s] = rel < 0 || (rel < M && own[rel]) ? 0.0f : hidden;
        }
      }
    return mask;
  };
  int64_t level_start = 0, n = R;  // the current level's first node id and node count
  std::vector<float> lp, cand;
  std::vector<int64_t> order;
  for (int64_t d = 0; d < levels; ++d) {
    // expand: the head on the level's exit states (h: one row per node, in node order)
    auto logits = head(h);
    const int64_t V = logits.size(1), ld = logits.stride(0);
    TORCH_CHECK(V <= emb.size(0), "head wider than the embedding table");
    const int64_t per = n / items, take = std::min(width, per * V);
    lp.resize(n * V);
    const bool roots_carried = d == 0 && carried;  // level 0's nodes are the roots, node i = row i
    TORCH_CHECK(!roots_carried || carried->size(1) == V, "carried: one row of log-probs per root");
    for (int64_t i = 0; i < n; ++i) {  // log_softmax(logits / temperature), as step_logprobs
      const float* l = logits.data_ptr<float>() + i * ld;
      float* o = lp.data() + i * V;
      if (roots_carried && done[i]) {  // a ready root: the target's own log-probs, not the head's guess
        std::copy(carried->data_ptr<float>() + i * V, carried->data_ptr<float>() + (i + 1) * V, o);
      } else if (!finite_row(l, V)) {  // NaN, as step_logprobs gives (such candidates rank last)
        std::fill(o, o + V, std::numeric_limits<float>::quiet_NaN());
        continue;
      } else {
        float m = -std::numeric_limits<float>::infinity();
        double total = 0.0;
        for (int64_t v = 0; v < V; ++v) m = std::max(m, o[v] = inv_t == 1.0f ? l[v] : l[v] * inv_t);
        for (int64_t v = 0; v < V; ++v) total += std::exp(double(o[v] - m));
        const float lse = m + float(std::log(total));
        for (int64_t v = 0; v < V; ++v) o[v] -= lse;
      }
      if (eos >= 0 && eos < V) o[eos] = -std::numeric_limits<float>::infinity();
    }
    // every item's `take` best candidates (parent score + log-prob), best first
    std::vector<int64_t> ptok, ploc;
    std::vector<float> pscore;
    cand.resize(per * V);
    order.resize(per * V);
    for (int64_t a = 0; a < items; ++a) {
      for (int64_t p = 0; p < per; ++p)
        for (int64_t v = 0; v < V; ++v) cand[p * V + v] = lscore[a * per + p] + lp[(a * per + p) * V + v];
      for (int64_t i = 0; i < per * V; ++i) order[i] = i;
      auto better = [&](int64_t x, int64_t y) {  // NaN last, then by score, ties to the lower index
        const bool nx = std::isnan(cand[x]), ny = std::isnan(cand[y]);
        if (nx != ny) return ny;
        if (!nx && cand[x] != cand[y]) return cand[x] > cand[y];
        return x < y;
      };
      std::partial_sort(order.begin(), order.begin() + take, order.end(), better);
      for (int64_t i = 0; i < take; ++i) {
        const int64_t loc = a * per + order[i] / V;
        ploc.push_back(loc);
        ptok.push_back(order[i] % V);
        pscore.push_back(cand[order[i]]);
      }
    }
    // the new level's nodes: row, index (the row's count before the level + rank in the row), tree tables
    const int64_t nn = int64_t(ploc.size());
    std::vector<int64_t> first(count), per_row(R, 0), col(nn);
    for (int64_t q = 0; q < nn; ++q) {
      const int64_t pid = level_start + ploc[q], r = row[pid];
      col[q] = per_row[r]++;
      const int64_t ni = first[r] + col[q];
      bool* dst = anc + (r * M + ni) * M;
      std::copy(anc + (r * M + index[pid]) * M, anc + (r * M + index[pid] + 1) * M, dst);
      dst[ni] = true;
      depth[r * M + ni] = d + 1;
      row.push_back(r);
      index.push_back(ni);
      parent.push_back(pid);
      token.push_back(ptok[q]);
      for (int64_t j = 0; j < levels; ++j) path.push_back(j == d ? ni : path[pid * levels + j]);
    }
    for (int64_t r = 0; r < R; ++r) count[r] += per_row[r];
    // the level's pass: rows padded to the widest, padding skipped by the products
    const int64_t c = *std::max_element(per_row.begin(), per_row.end());
    auto x = torch::zeros({R * c, dim}, x0.options());
    auto pos = torch::empty({R, c}, lopt), slots = torch::empty({R, c}, lopt);
    int64_t keys = 0;
    for (int64_t r = 0; r < R; ++r) {
      keys = std::max(keys, tp[r] + first[r] + c);
      for (int64_t j = 0; j < c; ++j) {
        pos.data_ptr<int64_t>()[r * c + j] = tp[r] + d + 1;
        slots.data_ptr<int64_t>()[r * c + j] = tp[r] + first[r] + j;
      }
    }
    std::vector<int64_t> real_v;
    for (int64_t q = 0; q < nn; ++q) {
      const int64_t r = row[level_start + n + q], tok = r * c + col[q];
      real_v.push_back(tok);
      std::copy(emb.data_ptr<float>() + ptok[q] * dim, emb.data_ptr<float>() + (ptok[q] + 1) * dim, x.data_ptr<float>() + tok * dim);
    }
    std::sort(real_v.begin(), real_v.end());
    auto real = torch::tensor(real_v, lopt);
    h = stack.run(x, 0, last, cos, sin, pos, slots, k_all, v_all, table, tree_mask(first, c, keys), keys, enc_keys, enc_values,
                  cross_mask, enc_rows, real);
    // the next level's exit states in node order, and each node's in hs
    auto hn = torch::empty({nn, dim}, x0.options());
    for (int64_t q = 0; q < nn; ++q) {
      const int64_t id = level_start + n + q, r = row[id];
      const float* src = h.data_ptr<float>() + (r * c + col[q]) * dim;
      std::copy(src, src + dim, hn.data_ptr<float>() + q * dim);
      std::copy(src, src + dim, hs.data_ptr<float>() + (r * M + index[id]) * dim);
    }
    h = hn;
    lscore = pscore;
    level_start += n;
    n = nn;
  }
  const int64_t N = int64_t(row.size());
  auto pack = [&](const std::vector<int64_t>& v) { return torch::tensor(v, lopt); };
  std::vector<torch::Tensor> out{hs, anc_t, depth_t, pack(count), pack(row), pack(index), pack(parent), pack(token),
                                 pack(path).view({N, levels})};
  // the verify pass's outputs by row and index, `stride` indexes a row (no layer above the exit: the exit
  // states are the target's)
  torch::Tensor by_row = hs;
  int64_t stride = M;
  if (upper > last) {  // the verify pass over every node, rows padded to the fullest
    const int64_t m = *std::max_element(count.begin(), count.end());
    auto x = hs.narrow(1, 0, m).reshape({R * m, dim}).contiguous();
    auto pos = torch::empty({R, m}, lopt), slots = torch::empty({R, m}, lopt);
    std::vector<int64_t> real_v;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < m; ++j) {
        const bool skipped = j == 0 && done && done[r];  // a ready root: padding that writes nothing
        pos.data_ptr<int64_t>()[r * m + j] = tp[r] + depth[r * M + j];
        slots.data_ptr<int64_t>()[r * m + j] = skipped ? -1 : tp[r] + j;
        if (j < count[r] && !skipped) real_v.push_back(r * m + j);
      }
    const int64_t keys = *std::max_element(tp, tp + R) + m;
    by_row = stack.run(x, last, upper, cos, sin, pos, slots, k_all, v_all, table, tree_mask(std::vector<int64_t>(R, 0), m, keys),
                       keys, enc_keys, enc_values, cross_mask, enc_rows, torch::tensor(real_v, lopt));
    stride = m;
  }
  auto nodes = torch::empty({N, dim}, x0.options());
  for (int64_t id = 0; id < N; ++id) {
    const float* src = by_row.data_ptr<float>() + (row[id] * stride + index[id]) * dim;
    std::copy(src, src + dim, nodes.data_ptr<float>() + id * dim);
  }
  out.push_back(nodes);
  if (target) {
    // the target head and `beam.step_logprobs` (unguided) by node, in the same ATen ops as a plain beam
    // step runs them from Python, so the same bits: a tenth of a millisecond of Python-side operations a
    // cycle otherwise, each slow right after a call that streamed every weight
    auto logits = (*target)(nodes);
    if (temperature != 1.0) logits = logits / std::max(temperature, 1e-10);
    auto logprobs = at::log_softmax(logits, -1).add_(logits.sum({-1}, true).mul_(0));
    if (carried) {  // a ready root (node id = row) keeps the log-probs the last cycle gave it
      TORCH_CHECK(carried->size(1) == logprobs.size(1), "carried: one row of log-probs per root");
      const int64_t V = logprobs.size(1);
      for (int64_t r = 0; r < R; ++r)
        if (done[r]) std::copy(carried->data_ptr<float>() + r * V, carried->data_ptr<float>() + (r + 1) * V, logprobs.data_ptr<float>() + r * V);
    }
    out.push_back(logprobs);
  }
  // what the caller reads on the host, in one tensor: row, parent, token (N each), path (N x levels), count (R)
  std::vector<int64_t> host(row);
  host.insert(host.end(), parent.begin(), parent.end());
  host.insert(host.end(), token.begin(), token.end());
  host.insert(host.end(), path.begin(), path.end());
  host.insert(host.end(), count.begin(), count.end());
  out.push_back(pack(host));
  return out;
}

namespace {

// One step of `beam.beam_step` (standard semantics) on log-probs (R, V), R = a x K, where it needs no
// decision: the K best candidates of every item (`beam_top`'s ranking) finite and none EOS, and no item
// possibly done (its best live beam over `norm` no better than worst[i], its worst finished hypothesis;
// with a margin, so that a rounding of the power never keeps a done item here). Then applies it: the K
// best are the new beams, scores (a, K) float64 updated, each one's parent row and token appended to
// host (R each). Else leaves everything as it was and returns false.
bool standard_step(const torch::Tensor& logprobs, torch::Tensor& scores, const double* worst, int64_t a, int64_t K, double norm,
                   int64_t eos, std::vector<int64_t>& host) {
  const int64_t V = logprobs.size(1), n = std::min(2 * K, K * V), R = a * K;
  std::vector<double> values(a * n);
  std::vector<int64_t> index(a * n);
  tts::beam_rank(scores.data_ptr<double>(), logprobs.data_ptr<float>(), logprobs.stride(0), a, K, V, n, values.data(), index.data());
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t j = 0; j < K; ++j)
      if (!std::isfinite(values[i * n + j]) || index[i * n + j] % V == eos) return false;
    if (std::isfinite(worst[i]) && values[i * n] / norm <= worst[i] + 1e-9 * (1.0 + std::fabs(worst[i]))) return false;
  }
  const size_t at = host.size();
  host.resize(at + 2 * R);
  int64_t *parent = host.data() + at, *token = parent + R;
  double* sp = scores.data_ptr<double>();
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t f = index[i * n + j], r = i * K + j;
      parent[r] = i * K + f / V, token[r] = f % V, sp[r] = values[i * n + j];
    }
  return true;
}

// One step of spear-tts's beam search (`beam._upstream_step`) on log-probs (R, V), R = a x K, in its ATen
// ops: each beam's K best tokens (topk; only the first beam at the first step), the candidates' float
// sums ranked by sort, the first K the new beams. Where no live beam's log-probs hold NaN and not every
// new beam holds an EOS, applies it: scores (a, K) float64 and ended (R,) updated, each new beam's parent
// row and token appended to host (R each); else leaves everything as it was and returns false.
bool upstream_step(const torch::Tensor& logprobs, torch::Tensor& scores, const torch::Tensor& ended, int64_t a, int64_t K, bool first,
                   int64_t eos, std::vector<int64_t>& host) {
  const int64_t R = a * K;
  auto ranked = logprobs.topk(K, -1);
  const int64_t beams = first ? 1 : K;
  auto top = std::get<0>(ranked).view({a, K, K}).narrow(1, 0, beams);
  auto top_tokens = std::get<1>(ranked).view({a, K, K}).narrow(1, 0, beams);
  if (top.select(2, 0).isnan().any().item<bool>()) return false;
  auto cand = (scores.narrow(1, 0, beams).to(at::kFloat).unsqueeze(2) + top).flatten(1);
  auto order = std::get<1>(cand.sort(1, true)).narrow(1, 0, K).contiguous();
  auto tokens = top_tokens.flatten(1).gather(1, order).contiguous();
  auto best = cand.gather(1, order).to(at::kDouble).contiguous();
  const int64_t* op = order.data_ptr<int64_t>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const bool* was = ended.data_ptr<bool>();
  std::vector<int64_t> parent(R);
  std::vector<char> now(R);
  bool all = true;
  for (int64_t r = 0; r < R; ++r) {
    parent[r] = (r / K) * K + op[r] / K;
    now[r] = was[parent[r]] || (eos >= 0 && tp[r] == eos);
    all = all && now[r];
  }
  if (all) return false;
  host.insert(host.end(), parent.begin(), parent.end());
  host.insert(host.end(), tp, tp + R);
  scores.copy_(best);
  std::copy(now.begin(), now.end(), ended.data_ptr<bool>());
  return true;
}

}  // namespace

// Plain beam search's steps (`beam.beam_search_loop`: unguided, a cache by reference) in one call, for as
// long as each step is one that `beam.beam_step` takes without a decision (`standard_step`,
// `upstream_step`), so the call takes it itself: the step's layers, the target head and
// `beam.step_logprobs` in the same ATen ops as the Python loop (the same bits), the ranking, then the
// slot tables' rows reordered and the next inputs embedded. At width 512 on a Zen 3 those were
// some 2 ms of small operations a step beside the 14 ms layer pass, each slow right after the weights
// streamed through the caches.
// From x0 (R, dim), R = items x K rows (item-major), the inputs at slot t0 of every row; scores (a, K)
// float64 the live beams' scores; worst (a,) float64: the worst finished score of an item with K
// finished hypotheses, else -inf; length: the beams' length before the first step; limit: the step index
// (0 = the step at t0) that is never taken here (`max_length`'s last step: the caller finalises it).
// A step the caller must decide, or the step at limit, stops the call with that step's log-probs
// (its K/V already written, as `Backend.verify` leaves them); the end of the cache's capacity stops it
// before the step. Returns the steps taken as int64 (taken, 2, R) (each new beam's parent row and
// token), the scores after them (a, K) float64, the next inputs (R, 1, dim), and the stopping step's
// log-probs (R, V) or none.
// ended (R,) bool, given: spear-tts's semantics (`beam._upstream_step`, items stopping together): each
// row's beam holds an EOS, updated in place; a step is taken here unless some live beam's log-probs hold
// NaN or every beam then holds an EOS, its ranking by the same ATen ops (topk, sort) on the same shapes.
std::vector<torch::Tensor> beam_steps(const Stack& stack, const Head& target, const torch::Tensor& emb, const torch::Tensor& x0,
                                      int64_t t0, int64_t limit, const torch::Tensor& scores0, const torch::Tensor& worst,
                                      int64_t length, double length_penalty, double temperature, int64_t eos, int64_t last,
                                      const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_all,
                                      const torch::Tensor& v_all, const torch::Tensor& table, const torch::Tensor& enc_keys,
                                      const torch::Tensor& enc_values, const c10::optional<torch::Tensor>& cross_mask,
                                      const c10::optional<torch::Tensor>& enc_rows, const c10::optional<torch::Tensor>& ended) {
  TORCH_CHECK(x0.dim() == 2 && x0.size(0) > 0 && x0.scalar_type() == at::kFloat && x0.is_contiguous(), "x0: contiguous float32 (R, dim)");
  TORCH_CHECK(!ended || (ended->dim() == 1 && ended->size(0) == x0.size(0) && ended->scalar_type() == at::kBool &&
                         ended->is_contiguous()), "ended: contiguous bool (R,)");
  TORCH_CHECK(scores0.dim() == 2 && scores0.scalar_type() == at::kDouble && scores0.is_contiguous() &&
              scores0.numel() == x0.size(0), "scores: contiguous float64 (items, K), one per row");
  const int64_t R = x0.size(0), dim = x0.size(1), a = scores0.size(0), K = scores0.size(1);
  TORCH_CHECK(worst.dim() == 1 && worst.size(0) == a && worst.scalar_type() == at::kDouble && worst.is_contiguous(),
              "worst: contiguous float64 (items,)");
  TORCH_CHECK(emb.dim() == 2 && emb.size(1) == dim && emb.is_contiguous() && emb.scalar_type() == at::kFloat,
              "emb: contiguous float32 (tokens, dim)");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == R && table.is_contiguous() && table.scalar_type() == at::kLong,
              "table: contiguous int64 (R, capacity)");
  const int64_t cap = table.size(1);
  TORCH_CHECK(0 <= t0 && t0 < cap && limit >= 0 && length >= 0 && temperature >= 0.0, "t0 within the cache, limit, length, temperature >= 0");
  int64_t* tab = table.data_ptr<int64_t>();
  const double* w = worst.data_ptr<double>();
  const c10::optional<torch::Tensor> none;
  auto x = x0;
  auto scores = scores0.clone();
  auto slots = torch::empty({R, 1}, table.options());
  std::vector<int64_t> host;  // per step taken: parents (R), then tokens (R)
  std::vector<int64_t> old;
  torch::Tensor pending;
  for (int64_t d = 0; t0 + d < cap; ++d) {
    const int64_t s = t0 + d;
    for (int64_t r = 0; r < R; ++r) tab[r * cap + s] = r;  // the slot each row writes is its own (`KVCache.claim`)
    slots.fill_(s);
    auto h = stack.run(x, 0, last, cos, sin, slots, slots, k_all, v_all, table, none, s + 1, enc_keys, enc_values, cross_mask,
                       enc_rows, none);
    auto logits = target(h);
    if (temperature != 1.0) logits = logits / std::max(temperature, 1e-10);
    auto logprobs = at::log_softmax(logits, -1).add_(logits.sum({-1}, true).mul_(0));
    if (d == limit) {
      pending = logprobs;
      break;
    }
    const bool applied = ended ? upstream_step(logprobs, scores, *ended, a, K, length + d == 0, eos, host)
                               : standard_step(logprobs, scores, w, a, K, std::pow(double(length + d + 1), length_penalty), eos, host);
    if (!applied) {
      pending = logprobs;
      break;
    }
    const int64_t *parent = host.data() + host.size() - 2 * R, *token = parent + R;
    bool moved = false;
    for (int64_t r = 0; r < R; ++r) moved = moved || parent[r] != r;
    if (moved) {  // rows become their parents: the slot tables' written part (`KVCache.reorder`)
      old.assign(tab, tab + R * cap);
      for (int64_t r = 0; r < R; ++r)
        std::copy(old.begin() + parent[r] * cap, old.begin() + parent[r] * cap + s + 1, tab + r * cap);
    }
    x = torch::empty({R, dim}, x0.options());
    for (int64_t r = 0; r < R; ++r)
      std::copy(emb.data_ptr<float>() + token[r] * dim, emb.data_ptr<float>() + (token[r] + 1) * dim, x.data_ptr<float>() + r * dim);
  }
  const int64_t taken = int64_t(host.size()) / (2 * R);
  auto steps = torch::from_blob(host.data(), {taken, 2, R}, table.options()).clone();
  return {steps, scores, x.view({R, 1, dim}), pending};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "x @ W (+ bias) (+ residual), W packed in 16-column panels, x optionally row-normalised");
  m.def("set_isa", &tts::set_isa, "the products' tiles: 'auto', 'avx512', 'avx2', or '' to ask which run");
  m.def("self_attention", &self_attention, "rotary + K/V cache write + attention for a few decoding queries");
  m.def("cross_attention", &cross_attention, "attention of a few decoding queries over source K/V");
  py::class_<Head>(m, "Head")
      .def(py::init<std::vector<torch::Tensor>, torch::Tensor, int64_t>())
      .def("__call__", &Head::operator(), "logits of hidden states (tokens, dim)");
  m.def("filtered_probs", &filtered_probs, "softmax(logits / temperature) after top-k / top-p, row by row");
  m.def("decode_steps", &decode_steps, "gamma decoding steps per row in one call: a draft phase, or a run of plain sampling");
  m.def("beam_steps", &beam_steps, "plain beam search steps while each step's new beams are its K best candidates");
  m.def("beam_draft", &beam_draft, "a speculative beam cycle's draft tree: levels of the exit head's beam search, every node kept");
  m.def("verify_accept", &verify_accept, "a speculative sampling cycle after its verify pass: head, accept rule, read-back, next input");
  m.def("speculative_accept", &speculative_accept, "Leviathan et al.'s accept rule for one cycle of every row");
  m.def("beam_top", &beam_top, "a beam step's ranked candidates per item, and its new beams' rows, tokens and scores");
  m.def("fingerprint", &fingerprint, "two 64-bit sums of each tensor's bytes (None unless all on the CPU)");
  m.def("reorder_rows", &reorder_rows, "in place: cache rows r become rows index[r] (slots below high)");
  m.def("commit_beams", &commit_beams, "a speculative beam cycle's commit: cache rows reordered, accepted paths moved, the next cycle's inputs");
  m.def("move_slots", &move_slots, "in place: slots src of given cache rows (where a slot table points) copied to slots dst (every buffer, layer, head)");
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<torch::Tensor>, int64_t, int64_t, int64_t>())
      .def("run", &Stack::run, "decoder layers [first, last) on a few tokens: products and attention in one call");
}
