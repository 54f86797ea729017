/* The FMA units' peak on this CPU, float32, one thread per core: independent fused multiply-adds in a
   tight loop, 24 accumulator chains (more than latency x throughput on the CPUs we run on), so nothing
   but the FMA units limits it. The ceiling tools/gemm_rows.py's products are measured against: an n-row
   product over W weights does 2 n W flops, which no code does faster than at this rate.

       gcc -O2 -pthread tools/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak 2
*/
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 24
#define ITERS 8000000L

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int lanes = 8;

__attribute__((target("avx512f"))) static float run512(void) {
  __m512 a[CHAINS];
  const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-9f);
  for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_ps((float)i);
  for (long it = 0; it < ITERS; ++it)
#pragma GCC unroll 24
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

__attribute__((target("avx2,fma"))) static float run256(void) {
  __m256 a[CHAINS];
  const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-9f);
  for (int i = 0; i < CHAINS; ++i) a[i] = _mm256_set1_ps((float)i);
  for (long it = 0; it < ITERS; ++it)
#pragma GCC unroll 24
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  float s = 0, o[8];
  for (int i = 0; i < CHAINS; ++i) {
    _mm256_storeu_ps(o, a[i]);
    for (int j = 0; j < 8; ++j) s += o[j];
  }
  return s;
}

static void* work(void* out) {
  *(float*)out = lanes == 16 ? run512() : run256();
  return NULL;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1 || threads > 64) {  /* the count the figure is computed for must be the count that ran */
    fprintf(stderr, "threads: 1 to 64, not %s\n", argv[1]);
    return 2;
  }
  __builtin_cpu_init();
  lanes = __builtin_cpu_supports("avx512f") ? 16 : 8;
  pthread_t t[64];
  float sink[64];
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
    for (int i = 0; i < threads; ++i) pthread_create(&t[i], NULL, work, &sink[i]);
    for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  const double flops = 2.0 * lanes * CHAINS * ITERS * threads;
  printf("%s FMAs, %d threads: %.1f GFLOPS (%.1f per thread), best of 5\n", lanes == 16 ? "AVX-512" : "AVX2", threads,
         flops / best / 1e9, flops / best / 1e9 / threads);
  return sink[0] == 12345.0f;  /* keeps the sums live */
}
