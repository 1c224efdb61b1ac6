// The arithmetic peak of this CPU for the instructions the projection kernels are built on: how many
// multiply-adds per second all threads reach when they do nothing else. bench/step_rows.py divides a step's
// multiply-adds by it: the compute floor under which no kernel plan can take a step of n rows.
#include "tensor_api.h"

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

// one thread's multiply-adds per second of `step(acc, w, x)` on kChains accumulators (`macs` per step), timed for
// `seconds`; the operands are unknown to the compiler at every step, so nothing is hoisted or shared between steps
template <class V, class Step>
double chains_rate(double seconds, double macs, V zero, V w, V x, Step step) {
  V acc[kChains];
  for (auto& a : acc) a = zero;
  const auto start = Clock::now();
  long iterations = 0;
  double elapsed = 0;
  do {
    for (long i = 0; i < kBurst; ++i)
      for (auto& a : acc) {
        a = step(a, w, x);
        // per chain: a product that does not depend on the accumulator (AVX2's vpmaddubsw + vpmaddwd) would
        // otherwise be computed once for all chains, and the loop would time the adds alone
        __asm__ volatile("" : "+x"(w), "+x"(x));
      }
    iterations += kBurst;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  for (auto& a : acc) __asm__ volatile("" : : "x"(a));
  return iterations * kChains * macs / elapsed;
}

double int8_rate(double seconds) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // vpdpbusd on 512 bits: 64 u8 x s8 products into 16 int32 sums, as int8_gemm.cpp's loop
  return chains_rate(seconds, 64, _mm512_setzero_si512(), _mm512_set1_epi8(3), _mm512_set1_epi8(2),
                     [](__m512i a, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(a, w, x); });
#elif defined(__AVX2__)
  // vpmaddubsw + vpmaddwd + vpaddd on 256 bits: 32 products per three instructions, as the AVX2 loop
  const __m256i ones = _mm256_set1_epi16(1);
  return chains_rate(seconds, 32, _mm256_setzero_si256(), _mm256_set1_epi8(3), _mm256_set1_epi8(2),
                     [ones](__m256i a, __m256i w, __m256i x) {
                       return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
                     });
#else
  (void)seconds;
  return 0.0;  // the portable loop has no fixed instruction to measure
#endif
}

double float_rate(double seconds) {
#if defined(__AVX512F__)
  return chains_rate(seconds, 16, _mm512_setzero_ps(), _mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f),
                     [](__m512 a, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, a); });
#elif defined(__AVX2__) && defined(__FMA__)
  return chains_rate(seconds, 8, _mm256_setzero_ps(), _mm256_set1_ps(0.5f), _mm256_set1_ps(0.25f),
                     [](__m256 a, __m256 w, __m256 x) { return _mm256_fmadd_ps(w, x, a); });
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
