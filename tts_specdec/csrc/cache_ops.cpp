// The cache operations of beam search on the CPU kernels' float32 caches: a beam step's row reordering,
// a speculative beam cycle's accepted paths moved into place, and that cycle's whole commit in one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

// In place: rows r < n of t (layers, rows, heads, capacity, d; any strides but unit ones within a slot
// and between slots) become rows index[r] of it (index (n,), n <= rows), slots below `high` only; rows at
// n and past are left as they are (the caller views the first n: rows that end drop out of a batch without
// moving the others' storage). Rows that keep their place are not touched; every source is read before
// it is written.
void reorder_rows(torch::Tensor t, const torch::Tensor& index, int64_t high) {
  TORCH_CHECK(t.dim() == 5 && t.stride(4) == 1 && t.stride(3) == t.size(4) && t.scalar_type() == at::kFloat &&
              t.device().is_cpu(), "t: float32 CPU (layers, rows, heads, capacity, d) with contiguous slots");
  const int64_t layers = t.size(0), rows = t.size(1), heads = t.size(2), cap = t.size(3), d = t.size(4);
  TORCH_CHECK(index.dim() == 1 && index.size(0) <= rows && index.scalar_type() == at::kLong, "index: int64 (n,), n <= rows");
  TORCH_CHECK(0 <= high && high <= cap, "high out of range");
  const auto idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t n = index.size(0);
  std::vector<int64_t> moved;
  std::vector<char> is_moved(rows, 0);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(0 <= ip[r] && ip[r] < rows, "index out of range");
    if (ip[r] != r) moved.push_back(r), is_moved[r] = 1;
  }
  if (moved.empty() || high == 0) return;
  // rows are written in increasing order, so each can be copied straight to its place (half the memory
  // traffic of going through tmp) unless its source is a row written before it: a speculative beam
  // cycle's rows copy from rows that stay; a batch's rows that go on move down over those that ended
  bool direct = true;
  for (int64_t r : moved) direct = direct && !(ip[r] < r && is_moved[ip[r]]);
  float* base = t.data_ptr<float>();
  const int64_t span = high * d, layer_stride = t.stride(0), row_stride = t.stride(1), head_stride = t.stride(2);
  // a thread per layer only when a layer's copies are large (a fork/join costs some microseconds)
  const int64_t layer_bytes = int64_t(moved.size()) * heads * span * int64_t(sizeof(float));
  at::parallel_for(0, layers, layer_bytes >= (1 << 18) ? 1 : layers, [&](int64_t l0, int64_t l1) {
    if (direct) {
      for (int64_t l = l0; l < l1; ++l) {
        float* layer = base + l * layer_stride;
        for (int64_t r : moved)
          for (int64_t h = 0; h < heads; ++h) {
            const float* src = layer + ip[r] * row_stride + h * head_stride;
            std::copy(src, src + span, layer + r * row_stride + h * head_stride);
          }
      }
      return;
    }
    std::vector<float> tmp(moved.size() * heads * span);
    for (int64_t l = l0; l < l1; ++l) {
      float* layer = base + l * layer_stride;
      for (size_t m = 0; m < moved.size(); ++m)
        for (int64_t h = 0; h < heads; ++h) {
          const float* src = layer + ip[moved[m]] * row_stride + h * head_stride;
          std::copy(src, src + span, tmp.data() + (m * heads + h) * span);
        }
      for (size_t m = 0; m < moved.size(); ++m)
        for (int64_t h = 0; h < heads; ++h) {
          const float* src = tmp.data() + (m * heads + h) * span;
          std::copy(src, src + span, layer + moved[m] * row_stride + h * head_stride);
        }
    }
  });
}

namespace {

// move_slots' work on raw indexes: n rows rp, s slots each (sp, dp: n * s); tab (or null) the slot table.
void move_slots_of(const std::vector<torch::Tensor>& bufs, const int64_t* rp, const int64_t* sp, const int64_t* dp, int64_t n,
                   int64_t s, int64_t* tab, int64_t tab_row, int64_t tab_rows) {
  TORCH_CHECK(!bufs.empty(), "bufs: the cache's buffers");
  for (const auto& t : bufs)
    TORCH_CHECK(t.dim() == 5 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                t.sizes() == bufs[0].sizes(), "bufs: contiguous float32 CPU (layers, rows, heads, capacity, d), one shape");
  const auto& t0 = bufs[0];
  const int64_t layers = t0.size(0), n_rows = t0.size(1), heads = t0.size(2), cap = t0.size(3), d = t0.size(4);
  std::vector<int64_t> from(n * s);  // the row each source slot is read from
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= rp[i] && rp[i] < n_rows && (!tab || rp[i] < tab_rows), "rows: out of range");
    for (int64_t j = 0; j < s; ++j) {
      TORCH_CHECK(0 <= sp[i * s + j] && sp[i * s + j] < cap && 0 <= dp[i * s + j] && dp[i * s + j] < cap, "slot out of range");
      from[i * s + j] = tab ? tab[rp[i] * tab_row + sp[i * s + j]] : rp[i];
      TORCH_CHECK(0 <= from[i * s + j] && from[i * s + j] < n_rows, "table: row out of range");
    }
  }
  // the moves that copy anything (a slot onto itself in its own row is skipped)
  std::vector<int64_t> moves;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < s; ++j)
      if (from[i * s + j] != rp[i] || sp[i * s + j] != dp[i * s + j]) moves.push_back(i * s + j);
  const int64_t row_stride = heads * cap * d, count = int64_t(moves.size());
  const int64_t n_bufs = int64_t(bufs.size());
  std::vector<float*> bases;
  for (const auto& t : bufs) bases.push_back(t.data_ptr<float>());
  // every (buffer, layer) on its own; scattered slots of a cache the weights' stream evicted come from
  // memory, so two threads share them where there is enough to move (a fork/join costs some microseconds)
  const int64_t bytes = 2 * n_bufs * layers * count * heads * d * int64_t(sizeof(float));
  at::parallel_for(0, n_bufs * layers, bytes >= (1 << 17) ? 1 : n_bufs * layers, [&](int64_t b0, int64_t b1) {
    std::vector<float> tmp(count * heads * d);
    for (int64_t b = b0; b < b1; ++b) {
      float* layer = bases[b / layers] + (b % layers) * n_rows * row_stride;
      for (int64_t pass = 0; pass < 2; ++pass)  // 0: gather every source, 1: write every destination
        for (int64_t c = 0; c < count; ++c)
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t m = moves[c], i = m / s;
            const int64_t row = pass ? rp[i] : from[m];
            float* slot = layer + row * row_stride + h * cap * d + (pass ? dp : sp)[m] * d;
            float* kept = tmp.data() + (c * heads + h) * d;
            if (pass) std::copy(kept, kept + d, slot); else std::copy(slot, slot + d, kept);
          }
    }
  });
  for (int64_t i = 0; tab && i < n; ++i)
    for (int64_t j = 0; j < s; ++j) tab[rp[i] * tab_row + dp[i * s + j]] = rp[i];
}

int64_t* table_of(const c10::optional<torch::Tensor>& table, int64_t cap) {
  if (!table) return nullptr;
  TORCH_CHECK(table->dim() == 2 && table->size(1) == cap && table->is_contiguous() && table->scalar_type() == at::kLong &&
              table->device().is_cpu(), "table: contiguous int64 CPU (rows, capacity)");
  return table->data_ptr<int64_t>();
}

}  // namespace

// In place, within each given row of the cache buffers (K and V: layers, rows, heads, capacity, d, all of
// one shape): slots src[i, j] are copied to slots dst[i, j] of row rows[i], every layer and head; all
// sources are read before any slot is written (overlapping src and dst are safe). table (rows', capacity)
// int64 or none, a cache by reference: source slot [i, j] is read from row table[rows[i], src[i, j]], and
// then table[rows[i], dst[i, j]] = rows[i] (the row reads its own storage there). A speculative beam
// cycle's accepted path: a few slots of a few rows, where torch's indexing took ~0.3 ms of small kernels.
void move_slots(const std::vector<torch::Tensor>& bufs, const torch::Tensor& rows, const torch::Tensor& src,
                const torch::Tensor& dst, const c10::optional<torch::Tensor>& table) {
  TORCH_CHECK(!bufs.empty(), "bufs: the cache's buffers");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: int64 (n,)");
  TORCH_CHECK(src.dim() == 2 && src.sizes() == dst.sizes() && src.size(0) == rows.size(0) && src.scalar_type() == at::kLong &&
              dst.scalar_type() == at::kLong, "src, dst: int64 (n, s), one row each per entry of rows");
  const auto r = rows.contiguous(), sc = src.contiguous(), dc = dst.contiguous();
  int64_t* tab = table_of(table, bufs[0].size(3));
  move_slots_of(bufs, r.data_ptr<int64_t>(), sc.data_ptr<int64_t>(), dc.data_ptr<int64_t>(), rows.size(0), src.size(1), tab,
                tab ? table->size(1) : 0, tab ? table->size(0) : 0);
}

// A speculative beam cycle's commit (`spec_beam.commit`, unguided, no item finished) on a CPU float32
// cache in one call: as separate operations it took some fifteen small tensor kernels, each slow right
// after a call that streamed every weight (~0.4 ms a cycle at width 512 on a Zen 3). In place, the
// cache's R rows become rows `source` of the old ones (a slot table's rows, else the K/V below `high`,
// `reorder_rows`); then within new row rows[i] the slots src[i] move to dst[i] (R x s each, `move_slots`).
// Returns, by new row: t (R,) the slot of its pending input (its item's length, `lengths` per item: also
// the cache's new lengths), x (R, 1, dim) = emb[tokens], score (R,) float32 (new beam i's `scores[i]` at
// row rows[i]), and, where some node[r] >= 0, ready (R,) = node >= 0 and carried (R, V) = logprobs[node]
// (else both undefined: None).
std::vector<torch::Tensor> commit_beams(const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& table,
                                        int64_t high, const std::vector<int64_t>& source, const std::vector<int64_t>& rows,
                                        const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                                        const std::vector<int64_t>& lengths, const std::vector<int64_t>& tokens,
                                        const std::vector<int64_t>& node, const std::vector<double>& scores,
                                        const torch::Tensor& emb, const torch::Tensor& logprobs) {
  const int64_t R = int64_t(source.size());
  TORCH_CHECK(k.dim() == 5 && R == (table ? table->size(0) : k.size(1)), "source: one entry per cache row");
  TORCH_CHECK(int64_t(rows.size()) == R && int64_t(tokens.size()) == R && int64_t(node.size()) == R &&
              int64_t(scores.size()) == R, "rows, tokens, node, scores: one entry per row");
  TORCH_CHECK(!lengths.empty() && R % int64_t(lengths.size()) == 0, "lengths: one per item");
  TORCH_CHECK(src.size() == dst.size() && src.size() % std::max<int64_t>(R, 1) == 0, "src, dst: R x s slots");
  TORCH_CHECK(emb.dim() == 2 && emb.is_contiguous() && emb.scalar_type() == at::kFloat, "emb: contiguous float32 (tokens, dim)");
  TORCH_CHECK(logprobs.dim() == 2 && logprobs.is_contiguous() && logprobs.scalar_type() == at::kFloat,
              "logprobs: contiguous float32 (nodes, V)");
  const int64_t cap = k.size(3), K = R / int64_t(lengths.size()), dim = emb.size(1);
  int64_t* tab = table_of(table, cap);
  bool moved = false;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= source[r] && source[r] < R && 0 <= rows[r] && rows[r] < R, "source, rows: out of range");
    TORCH_CHECK(0 <= tokens[r] && tokens[r] < emb.size(0) && node[r] < logprobs.size(0), "tokens, node: out of range");
    moved = moved || source[r] != r;
  }
  if (moved && tab) {  // by reference: the rows' slot tables, never K/V
    std::vector<int64_t> old(tab, tab + R * cap);
    for (int64_t r = 0; r < R; ++r) std::copy(old.begin() + source[r] * cap, old.begin() + (source[r] + 1) * cap, tab + r * cap);
  } else if (moved) {
    auto index = torch::tensor(source, torch::kLong);
    reorder_rows(k, index, high);
    reorder_rows(v, index, high);
  }
  move_slots_of({k, v}, rows.data(), src.data(), dst.data(), R, R ? int64_t(src.size()) / R : 0, tab, cap, R);
  auto opt = torch::TensorOptions().dtype(torch::kLong);
  auto t = torch::empty({R}, opt);
  auto x = torch::empty({R, 1, dim}, emb.options());
  auto score = torch::empty({R}, emb.options());
  int64_t* tp = t.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  float* sp = score.data_ptr<float>();
  bool any_ready = false;
  for (int64_t r = 0; r < R; ++r) {
    tp[r] = lengths[r / K];
    std::copy(emb.data_ptr<float>() + tokens[r] * dim, emb.data_ptr<float>() + (tokens[r] + 1) * dim, xp + r * dim);
    sp[rows[r]] = float(scores[r]);  // as `Tensor.float()` rounds a float64 score
    any_ready = any_ready || node[r] >= 0;
  }
  torch::Tensor ready, carried;
  if (any_ready) {
    const int64_t V = logprobs.size(1);
    ready = torch::empty({R}, opt.dtype(torch::kBool));
    carried = torch::empty({R, V}, logprobs.options());
    for (int64_t r = 0; r < R; ++r) {
      ready.data_ptr<bool>()[r] = node[r] >= 0;
      const float* from = logprobs.data_ptr<float>() + std::max<int64_t>(node[r], 0) * V;
      std::copy(from, from + V, carried.data_ptr<float>() + r * V);
    }
  }
  return {t, x, score, ready, carried};
}
