// What the few-row kernels share (small_gemm.cpp: float and block-record weights; int8_gemm.cpp: int8 activations):
// how many rows one pass keeps in registers, how far ahead record streams are prefetched, and the dispatch that
// makes the row count a template parameter.
#pragma once
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

// block records (384-576 bytes each) prefetched ahead in the Q4/Q8 record streams: 8 rather than 2 made a decode
// step 8% (int8 activations) to 17% (float activations) faster here, interleaved A/B in one process; with the
// weights resident in the shared L3 it hardly matters, when other tenants push them to DRAM it does
#ifndef PREFETCH_RECORDS
#define PREFETCH_RECORDS 8
#endif
// the int8 kernels' weight streams: read once per step and evicted by the rest of the model before the next step
// reads them again, so fetched with the non-temporal hint, to displace less of what a step does reuse (the KV
// cache, the interpreter's own data between forwards: Python right after a forward ran ~6x slower than the same
// call repeated, ~2x with the hint; whole requests ~4% faster, interleaved A/B). The float kernels keep the
// ordinary hint: they take longer over each byte, and there the hint measured 0.96-1.03x, no gain
static inline void prefetch_weights(const void* p) { __builtin_prefetch(p, 0, 0); }
// rows per chunk: 8 x 16 partial sums (x2 for even / odd k) fill half of AVX-512's 32 registers; AVX2 has 16
// registers of half the width, so its kernels (below) take 4 rows over one 8-output half of a panel at a time
#if defined(__AVX2__) && !defined(__AVX512F__)
#define HALF_PANELS 1
constexpr int ROW_CHUNK = 4;
#else
constexpr int ROW_CHUNK = 8;
#endif


// f(std::integral_constant<int, R>{}) for R = rows (1 .. ROW_CHUNK - 1), or ROW_CHUNK for more: the kernels' row
// count is a template parameter so that a chunk's partial sums live in registers
template <int R = 1, class F>
static inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R < ROW_CHUNK) {
    if (rows <= R) return f(std::integral_constant<int, R>{});
    return with_rows<R + 1>(rows, f);
  } else {
    f(std::integral_constant<int, R>{});
  }
}

// body(begin, end) over rows [0, rows): a prompt's rows (64 or more) on every thread, 16 to a task; the few rows
// of a decode step or a tree on the calling thread, where the threads' fork and join cost more than the work
// (rms_norm, the gated products, the int8 rounding of rows: each row's result is its own either way)
template <class F>
static inline void over_rows(int64_t rows, F&& body) {
  if (rows >= 64) at::parallel_for(0, rows, 16, body);
  else body(0, rows);
}
