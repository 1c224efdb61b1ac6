// What the few-row kernels share (small_gemm.cpp: float and block-record weights; int8_gemm.cpp: int8 activations):
// how many rows one pass keeps in registers, how far ahead record streams are prefetched, and the dispatch that
// makes the row count a template parameter.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
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
// ordinary hint: they take longer over each byte, and there the hint measured 0.96-1.03x, no gain.
static inline void prefetch_weights(const void* p) { __builtin_prefetch(p, 0, 0); }
// The same as volatile asm, which no optimiser may delete. GCC's optimisers count __builtin_prefetch as free of
// side effects, and GCC 12 deleted every call to A8Block<Q6K>::prefetch (a member of nothing but prefetch loops;
// marked always_inline, the other kinds' went too), so the Q6_K int8 kernels ran without software prefetch: a
// Q6_K LM head of 49,152 x 2,048 took 5.7 ms at 4 rows and takes 2.6 this way (16 rows: 10.7 -> 7.1 ms; 2 threads,
// Zen 4). The other kinds keep the builtin, which GCC did keep there (the asm form for every kind measured
// 0.96-1.01x at 16 rows of the bundled model's Q4_1 and 0.95x of the 1.1B file's, against this; kernel_ab).
static inline void prefetch_weights_kept(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetchnta %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 0);
#endif
}
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

// body(begin, end) over a projection's panels [0, n): each thread starts on its own contiguous share (as an even
// split would give it), taken from the front `step` panels at a time, and a thread that runs out takes `step`
// panels at a time from the back of the shares not yet done. Threads on a shared VM run at unequal speeds (a
// 16-row int8 step of the bundled model on Zen 3: one thread took ~13% more samples over the same panels while
// the other waited at the join); an even split made steps 9-14% slower at 4-16 rows and 2-4% at one row, int8
// and float32 alike (A/B alternating in one process). Each panel's result is the same whoever computes it. Shares
// are (front | back << 32) words, so one compare-exchange settles a race between an owner and a thief. The
// attention kernels deal their tasks this way too (over_row_tasks in attention_rows.h).
template <class F>
static inline void over_panels(int64_t n, int64_t grain, int64_t step, F&& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) return body(0, n);
  std::unique_ptr<std::atomic<uint64_t>[]> shares(new std::atomic<uint64_t>[threads]);
  for (int64_t i = 0; i < threads; ++i)
    shares[i].store(uint64_t(n * i / threads) | uint64_t(n * (i + 1) / threads) << 32, std::memory_order_relaxed);
  // one piece of share i, from its front (the owner) or its back (a thief); false when the share is done
  auto take = [&](int64_t i, bool front) {
    uint64_t w = shares[i].load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = int64_t(w & 0xffffffffu), hi = int64_t(w >> 32);
      if (lo >= hi) return false;
      const int64_t a = front ? lo : std::max(lo, hi - step), b = front ? std::min(hi, lo + step) : hi;
      const uint64_t next = front ? uint64_t(b) | uint64_t(hi) << 32 : uint64_t(lo) | uint64_t(a) << 32;
      if (shares[i].compare_exchange_weak(w, next, std::memory_order_relaxed)) {
        body(a, b);
        return true;
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      while (take(i, true)) {
      }
    for (int64_t k = 1; k < threads; ++k)  // the others' shares, the next thread's first
      while (take((first + k) % threads, false)) {
      }
  });
}
