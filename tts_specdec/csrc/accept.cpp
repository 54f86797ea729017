// The speculative accept rule (Leviathan et al. 2022, Algorithm 1) for one cycle, all rows in one call.
// `sampling.speculative_accept` is the reference written in torch ops; this is the same rule on the
// same random numbers, for float32 CPU tensors, where ~20 small torch ops cost more than a decoder layer.
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

// p (rows, g + 1, V) target distributions, q (rows, g, V) draft distributions, drafts (rows, g) int64,
// u (rows, g) uniforms, race (rows, V) Exp(1) draws, limit (rows,) int64 drafts each row proposes or
// none (all g). Row r keeps drafts while u * q(x) < p(x) (up to its limit; a draft < 0, one picked from
// logits that were not finite, is rejected), then its next token is argmax_i w_i / race_i with
// w = max(p_a - q_a, 0) after a rejection at a, or w = p at its limit (or when p_a <= q_a everywhere):
// the exponential race draws i with probability w_i / sum(w), as `sampling.draw` does with the
// normalised weights. Returns (accepted, next_token), int64 (rows,).
std::vector<torch::Tensor> speculative_accept(const torch::Tensor& p, const torch::Tensor& q, const torch::Tensor& drafts,
                                              const torch::Tensor& u, const torch::Tensor& race,
                                              const c10::optional<torch::Tensor>& limit) {
  for (const torch::Tensor* t : {&p, &q, &u, &race})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "p, q, u, race: contiguous float32 CPU tensors");
  TORCH_CHECK(drafts.scalar_type() == at::kLong && drafts.is_contiguous() && drafts.dim() == 2, "drafts: contiguous int64 (rows, gamma)");
  const int64_t rows = drafts.size(0), g = drafts.size(1);
  TORCH_CHECK(p.dim() == 3 && p.size(0) == rows && p.size(1) == g + 1, "p: (rows, gamma + 1, V)");
  const int64_t V = p.size(2);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == rows && q.size(1) == g && q.size(2) == V, "q: (rows, gamma, V)");
  TORCH_CHECK(u.dim() == 2 && u.size(0) == rows && u.size(1) == g, "u: (rows, gamma)");
  TORCH_CHECK(race.dim() == 2 && race.size(0) == rows && race.size(1) == V, "race: (rows, V)");
  const int64_t* lp = nullptr;
  if (limit) {
    TORCH_CHECK(limit->scalar_type() == at::kLong && limit->is_contiguous() && limit->dim() == 1 && limit->size(0) == rows,
                "limit: contiguous int64 (rows,)");
    lp = limit->data_ptr<int64_t>();
  }
  const float* pp = p.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const float* ep = race.data_ptr<float>();
  const int64_t* dp = drafts.data_ptr<int64_t>();
  auto accepted = torch::empty({rows}, drafts.options());
  auto next = torch::empty({rows}, drafts.options());
  int64_t* ap = accepted.data_ptr<int64_t>();
  int64_t* np = next.data_ptr<int64_t>();
  const float tiny = std::numeric_limits<float>::min();  // a zero draw would make 0 / 0 win
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t proposed = lp ? lp[r] : g;
    TORCH_CHECK(0 <= proposed && proposed <= g, "limit out of range");
    int64_t a = 0;
    for (; a < proposed; ++a) {
      const int64_t x = dp[r * g + a];
      TORCH_CHECK(x < V, "draft token out of range");
      if (x < 0) break;  // finite.NONFINITE: a draft picked from logits that were not finite is rejected
      if (!(up[r * g + a] * qp[(r * g + a) * V + x] < pp[(r * (g + 1) + a) * V + x])) break;
    }
    const float* pa = pp + (r * (g + 1) + a) * V;
    const float* qa = a < proposed ? qp + (r * g + a) * V : nullptr;
    const float* e = ep + r * V;
    bool positive = false;
    for (int64_t i = 0; i < V && qa && !positive; ++i) positive = pa[i] > qa[i];
    int64_t best = 0;
    float best_score = -1.0f;
    for (int64_t i = 0; i < V; ++i) {
      const float w = positive ? std::max(pa[i] - qa[i], 0.0f) : pa[i];
      const float score = w / std::max(e[i], tiny);
      if (score > best_score) best_score = score, best = i;
    }
    ap[r] = a;
    np[r] = best;
  }
  return {accepted, next};
}
