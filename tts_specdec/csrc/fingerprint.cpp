// A fingerprint of each tensor's bytes, for `Decoder.begin` to tell whether a model's parameters
// changed since its weights were prepared (writes through `.data` leave the version counter alone).
//
// Per tensor, over its bytes read as 32-bit words w_0..w_{n-1} in 8 lanes (lane l: words 8j + l):
// A = sum w_i and B = sum_l (2l + 1) * sum_j a_l(j), a_l(j) the lane's running sum after block j
// (Fletcher's second sum), all mod 2^64. Any change of one word changes A; moving words between
// blocks or lanes changes B. One pass over each tensor's bytes in one call, in place of torch's
// per-tensor norms (several ops per tensor, every call).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

void fingerprint_bytes(const uint8_t* bytes, int64_t nbytes, int64_t* out) {
  const int64_t words = nbytes / 4;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
  int64_t i = 0;
  for (; i + 8 <= words; i += 8) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 4 * i));
    a0 = _mm256_add_epi64(a0, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(w)));
    a1 = _mm256_add_epi64(a1, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(w, 1)));
    b0 = _mm256_add_epi64(b0, a0);
    b1 = _mm256_add_epi64(b1, a1);
  }
  uint64_t a[8], b[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 4), a1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b), b0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + 4), b1);
  uint64_t sa = 0, sb = 0;
  for (int l = 0; l < 8; ++l) sa += a[l], sb += (2 * l + 1) * b[l];
  // the last < 8 words, then < 4 bytes (zero-padded to a word), each weighted by its position
  for (int64_t k = 4 * i; k < nbytes; k += 4) {
    uint32_t w = 0;
    std::memcpy(&w, bytes + k, std::min<int64_t>(4, nbytes - k));
    sa += w;
    sb += uint64_t(k / 4 + 1) * w;
  }
  out[0] = int64_t(sa);
  out[1] = int64_t(sb ^ uint64_t(nbytes));
}

}  // namespace

// (tensors, 2) int64: A and B of each tensor's bytes (non-contiguous tensors are read as if made
// contiguous); an undefined tensor (None) when any tensor is not on the CPU. Each tensor's sums are
// computed whole by one thread, so the result does not depend on the thread count; the tensors are
// dealt to torch's threads in bins of about equal bytes (one thread reads ~15 GB/s here, two ~30: a
// width-512 model's 236 MB took ~10 ms a call on one).
torch::Tensor fingerprint(const std::vector<torch::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (!t.device().is_cpu()) return torch::Tensor();
  const int64_t n = int64_t(tensors.size());
  auto out = torch::empty({n, 2}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<torch::Tensor> flat(tensors.size());  // contiguous copies made here, not on the worker threads
  std::vector<int64_t> bytes(tensors.size());
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    flat[k] = tensors[k].is_contiguous() ? tensors[k] : tensors[k].contiguous();
    bytes[k] = flat[k].numel() * int64_t(flat[k].element_size());
    total += bytes[k];
  }
  auto one = [&](int64_t k) { fingerprint_bytes(static_cast<const uint8_t*>(flat[k].data_ptr()), bytes[k], o + 2 * k); };
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || total < (int64_t(1) << 22)) {  // under 4 MB (a small model, in cache): a hand-off costs more
    for (int64_t k = 0; k < n; ++k) one(k);
    return out;
  }
  // largest first, each to the bin with the fewest bytes so far
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::vector<int64_t>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (int64_t k : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(k);
    load[b] += bytes[k];
  }
  at::parallel_for(0, threads, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k : bins[b]) one(k);
  });
  return out;
}
