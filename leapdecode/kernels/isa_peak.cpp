// The arithmetic peak of this CPU for the instructions the projection kernels are built on: how many
// multiply-adds per second all threads reach when they do nothing else. bench/step_rows.py divides a step's
// multiply-adds by it: the compute floor under which no kernel plan can take a step of n rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace {

constexpr int kChains = 12;  // independent accumulators: more than latency x issue width on the CPUs measured
constexpr long kBurst = 1 << 16;  // iterations between clock reads

using Clock = std::chrono::steady_clock;

// one thread's multiply-adds per second of `body` (kChains instructions of `macs` multiply-adds per iteration)
template <class Body>
double rate(double seconds, double macs, Body&& body) {
  const auto start = Clock::now();
  long iterations = 0;
  double elapsed = 0;
  do {
    for (long i = 0; i < kBurst; ++i) body();
    iterations += kBurst;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return iterations * kChains * macs / elapsed;
}

double int8_rate(double seconds) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // vpdpbusd on 512 bits: 64 u8 x s8 products into 16 int32 sums, as int8_gemm.cpp's loop
  __m512i acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(2);
  const double r = rate(seconds, 64, [&] {
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, w, x);
    __asm__ volatile("" : "+v"(w), "+v"(x));  // the operands stay live and unknown: nothing is hoisted
  });
  for (auto& a : acc) __asm__ volatile("" : : "v"(a));
  return r;
#elif defined(__AVX2__)
  // vpmaddubsw + vpmaddwd + vpaddd on 256 bits: 32 products per three instructions, as the AVX2 loop
  __m256i acc[kChains];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(2);
  const __m256i ones = _mm256_set1_epi16(1);
  const double r = rate(seconds, 32, [&] {
    for (auto& a : acc) a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
    __asm__ volatile("" : "+x"(w), "+x"(x));
  });
  for (auto& a : acc) __asm__ volatile("" : : "x"(a));
  return r;
#else
  (void)seconds;
  return 0.0;  // the portable loop has no fixed instruction to measure
#endif
}

double float_rate(double seconds) {
#if defined(__AVX512F__)
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 w = _mm512_set1_ps(0.5f), x = _mm512_set1_ps(0.25f);
  const double r = rate(seconds, 16, [&] {
    for (auto& a : acc) a = _mm512_fmadd_ps(w, x, a);
    __asm__ volatile("" : "+v"(w), "+v"(x));
  });
  for (auto& a : acc) __asm__ volatile("" : : "v"(a));
  return r;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kChains];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256 w = _mm256_set1_ps(0.5f), x = _mm256_set1_ps(0.25f);
  const double r = rate(seconds, 8, [&] {
    for (auto& a : acc) a = _mm256_fmadd_ps(w, x, a);
    __asm__ volatile("" : "+x"(w), "+x"(x));
  });
  for (auto& a : acc) __asm__ volatile("" : : "x"(a));
  return r;
#else
  (void)seconds;
  return 0.0;
#endif
}

}  // namespace

double isa_peak_macs(const std::string& kind, double seconds) {
  TORCH_CHECK(kind == "int8" || kind == "float32", "isa_peak_macs: kind must be 'int8' or 'float32', got ", kind);
  TORCH_CHECK(seconds > 0 && seconds <= 10, "isa_peak_macs: seconds must be in (0, 10]");
  const int threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  // every thread at once, as a step runs them: a neighbour on a shared core or a lower all-core clock shows
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) rates[t] = kind == "int8" ? int8_rate(seconds) : float_rate(seconds);
  });
  double total = 0;
  for (double r : rates) total += r;
  return total;
}
