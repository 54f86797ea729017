// A beam step's ranked candidates in one call, for `beam.beam_step` on the CPU. The same step in torch
// ops (cast, add, topk, two read-backs, the new beams' tensors) is some 15 small operations; in a
// speculative beam cycle, right after a call that streams every weight, each costs ~15-90 us, and the
// replay runs ~2.6 steps a cycle. Plain and speculative beam search both step through this function,
// so their rankings agree to the bit whatever the rule for ties.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "kernels.h"

using Ranked = std::tuple<std::vector<std::vector<double>>, std::vector<std::vector<int64_t>>, torch::Tensor,
                          torch::Tensor, torch::Tensor>;

namespace {

// Item i's candidates are scores[i, j] (cast to T, as `scores.to(logprobs.dtype)`) + lp[row of beam j, v],
// flat index j * V + v; its n best, NaN first (as torch.topk ranks NaN), then by value, ties to the
// lower flat index.
template <typename T>
void rank(const double* scores, const T* lp, int64_t ld, const std::vector<int64_t>& rows, int64_t a, int64_t k,
          int64_t V, int64_t n, std::vector<std::vector<double>>& values, std::vector<std::vector<int64_t>>& index) {
  std::vector<T> cand(k * V);
  std::vector<int64_t> order(k * V);
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const T s = static_cast<T>(scores[i * k + j]);
      const T* l = lp + (rows.empty() ? i * k + j : rows[i * k + j]) * ld;
      for (int64_t v = 0; v < V; ++v) cand[j * V + v] = s + l[v];
    }
    std::iota(order.begin(), order.end(), int64_t(0));
    auto better = [&](int64_t x, int64_t y) {
      const bool nx = std::isnan(cand[x]), ny = std::isnan(cand[y]);
      if (nx != ny) return nx;
      if (!nx && cand[x] != cand[y]) return cand[x] > cand[y];
      return x < y;
    };
    std::partial_sort(order.begin(), order.begin() + n, order.end(), better);
    values[i].resize(n);
    index[i].resize(n);
    for (int64_t r = 0; r < n; ++r) values[i][r] = static_cast<double>(cand[order[r]]), index[i][r] = order[r];
  }
}

}  // namespace

namespace tts {

// `rank` for float32 log-probs, row r for beam r, into flat (a, n) outputs (`beam_steps` in layers.cpp)
void beam_rank(const double* scores, const float* lp, int64_t ld, int64_t a, int64_t k, int64_t V, int64_t n, double* values,
               int64_t* index) {
  std::vector<std::vector<double>> vals(a);
  std::vector<std::vector<int64_t>> idx(a);
  rank(scores, lp, ld, {}, a, k, V, n, vals, idx);
  for (int64_t i = 0; i < a; ++i) std::copy(vals[i].begin(), vals[i].end(), values + i * n), std::copy(idx[i].begin(), idx[i].end(), index + i * n);
}

}  // namespace tts

// scores (a, k) float64: the live beams' summed log-probs; logprobs (N, V) float32 or float64 on the CPU,
// rows of unit stride; rows: beam r's row of logprobs (empty: row r); n <= k * V candidates per item.
// Returns the n best per item (values as float64, flat indices), and for the k best the new beams' rows
// (i * k + index / V) and tokens (index % V), (a * k,) int64, and their scores (a, k) float64.
Ranked beam_top(const torch::Tensor& scores, const torch::Tensor& logprobs, const std::vector<int64_t>& rows, int64_t n) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kDouble && scores.is_contiguous() && scores.device().is_cpu(),
              "scores: contiguous float64 CPU (items, beams)");
  TORCH_CHECK(logprobs.dim() == 2 && logprobs.device().is_cpu() && logprobs.stride(1) == 1 &&
                  (logprobs.scalar_type() == at::kFloat || logprobs.scalar_type() == at::kDouble),
              "logprobs: float32 or float64 CPU (rows, vocab), unit stride along the vocabulary");
  const int64_t a = scores.size(0), k = scores.size(1), V = logprobs.size(1), N = logprobs.size(0);
  TORCH_CHECK(rows.empty() ? N == a * k : int64_t(rows.size()) == a * k, "rows: one per beam (or none: row r for beam r)");
  for (int64_t r : rows) TORCH_CHECK(0 <= r && r < N, "rows: out of range");
  TORCH_CHECK(k <= n && n <= k * V, "n: between the beams and the candidates per item");
  std::vector<std::vector<double>> values(a);
  std::vector<std::vector<int64_t>> index(a);
  if (logprobs.scalar_type() == at::kFloat)
    rank(scores.data_ptr<double>(), logprobs.data_ptr<float>(), logprobs.stride(0), rows, a, k, V, n, values, index);
  else
    rank(scores.data_ptr<double>(), logprobs.data_ptr<double>(), logprobs.stride(0), rows, a, k, V, n, values, index);
  auto opt = torch::TensorOptions().dtype(torch::kLong);
  auto parents = torch::empty({a * k}, opt), tokens = torch::empty({a * k}, opt);
  auto best = torch::empty({a, k}, torch::TensorOptions().dtype(torch::kDouble));
  int64_t* pp = parents.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  double* bp = best.data_ptr<double>();
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < k; ++j)
      pp[i * k + j] = i * k + index[i][j] / V, tp[i * k + j] = index[i][j] % V, bp[i * k + j] = values[i][j];
  return {values, index, parents, tokens, best};
}
