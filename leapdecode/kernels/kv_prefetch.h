// How the attention kernels fetch K and V rows ahead of the key they read (attention_rows.h's loops, the callers'
// first keys of each pass): the prefetch distance by instruction set, and the two fetch helpers.
#pragma once
#include <algorithm>
#include <cstdint>

// fetch the first `bytes` of a row into L2 (line by line)
template <typename T>
static inline void prefetch_row(const T* r, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(r) + b, 0, 1);
}

// How far ahead of the key being read its K or V rows are fetched, into L2: a batch's rows each read their own
// K/V from memory, and a core keeps only so many lines in flight into L1. With AVX-512 (Zen 4), 64 keys into L2
// took 16 sequences of 1,000 positions from 16 to 20 GB/s (30 layers: 47.8 -> 37.4 ms). The AVX2 loops read a key
// in more instructions, and there 64 fetched too far ahead: 24 measured 1.08x / 1.12x for 16 sequences at 1,000 /
// 128 positions and 1.06-1.12x for 1-8 tree rows at 1,024 (calls alternating with the 64 build in one process,
// Zen 3; whole int8 steps at 1,024 positions 1.04-1.08x, same bits; 12 and 40 measured between). The callers fetch
// a pass's first keys before it starts (prefetch_rows).
#if defined(__AVX512F__)
constexpr int64_t kPrefetchKeys = 64;
#else
constexpr int64_t kPrefetchKeys = 24;
#endif

// the rows of the first keys of a pass over slots[0 .. n) (their first `bytes` each), into L2
template <typename T>
static inline void prefetch_rows(const T* base, const int64_t* slots, int64_t n, int64_t row, int64_t bytes) {
  for (int64_t j = 0; j < std::min(n, kPrefetchKeys); ++j) prefetch_row(base + slots[j] * row, bytes);
}
