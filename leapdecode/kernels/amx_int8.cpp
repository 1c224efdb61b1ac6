// int8 activations on AMX tiles (linear_kernel="packed-int8act" where the CPU has AMX-INT8 and the OS grants it).
//
// The records need no repacking: in each 64-byte code line output j owns bytes 4j..4j+3 (int8_records.h), which
// is the layout of a tile B row (16 columns x 4 consecutive inputs). Per block of 32 inputs one TDPBSUD
// multiplies the activation codes (A: up to 16 rows x 32 int8, read in place with the row stride K) by the
// weight codes (B: 8 rows x 64 u8) into 16 x 16 exact int32 sums: the same integers the VNNI loop adds, so the
// float steps after them (the VNNI loop's, in its order) give bitwise its results, for every row count.
// Q8 code lines are B rows as stored; the nibble kinds (Q4, Q4K, Q4H) and Q6K are unpacked into an L1 buffer
// first (Q6K as two B tiles of 16 inputs each: its int8 scales weigh each half's integer sum).
//
// Rows are taken 16 at a time (the codes padded with zero rows to a multiple of 16, so one tile configuration
// serves every call); each thread loads it once per call. One block's tile multiply overlaps the float steps of
// the block before it.
#include "tensor_api.h"

#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "few_rows.h"
#include "int8_records.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__x86_64__)
namespace {

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

struct TileConfig {  // the ldtilecfg memory form (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int r, int bytes) { rows[tile] = uint8_t(r), colsb[tile] = uint16_t(bytes); }
};

// whether this CPU has AMX-TILE and AMX-INT8, the OS saves tile state (XCR0 bits 17, 18) and grants this process
// tile data (asked once: the permission is the process's, for all its threads)
bool amx_granted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// one block's weight codes as B rows: 4 inputs of 16 outputs per 64-byte row (rows 2g, 2g + 1 from line g)
template <int A>
inline const uint8_t* b_rows(const A8Block<A>& blk, uint8_t (*buf)[64]) {
  const uint8_t* codes = blk.codes();
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (A == A8_Q8) {
    return codes;
  } else if constexpr (A == A8_Q6K) {  // u = low nibble | top 2 bits << 4 (see int8_records.h)
    for (int h = 0; h < 2; ++h) {
      __m512i u[4];
      a8_q6k_half(codes, h, u);
      for (int i = 0; i < 4; ++i) _mm512_store_si512(buf[4 * h + i], u[i]);
    }
    return buf[0];
  } else {
    for (int g = 0; g < 4; ++g) {
      const __m512i L = _mm512_loadu_si512(codes + 64 * g);
      _mm512_store_si512(buf[2 * g], _mm512_and_si512(L, low4));
      _mm512_store_si512(buf[2 * g + 1], _mm512_and_si512(_mm512_srli_epi16(L, 4), low4));
    }
    return buf[0];
  }
}

// Tile ops of block b (B rows w) into the sums of parity par (the tiles and sums alternate between even and odd
// blocks, so one block's multiply runs while the previous block's sums go through the float steps):
//   Q4, Q4K, Q4H, Q8: C 0 | 1, A 2 | 3, B 4 | 5;   Q6K (per half h of 16 inputs): C 2 par + h, A 4 + h, B 6 + h
template <int A>
inline void tiles_of_block(const uint8_t* w, const int8_t* xb, int64_t K, int par, int32_t (*sums)[16][16]) {
  if constexpr (A == A8_Q6K) {
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + 256, 64);
    _tile_loadd(4, xb, K);
    _tile_loadd(5, xb + 16, K);
    if (par) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_dpbsud(2, 4, 6);
      _tile_dpbsud(3, 5, 7);
      _tile_stored(2, sums[0], 64);
      _tile_stored(3, sums[1], 64);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 5, 7);
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
    }
  } else if (par) {
    _tile_loadd(5, w, 64);
    _tile_loadd(3, xb, K);
    _tile_zero(1);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(1, sums[0], 64);
  } else {
    _tile_loadd(4, w, 64);
    _tile_loadd(2, xb, K);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, sums[0], 64);
  }
}

// rows r0 .. r0 + rows - 1 (rows <= R <= 16) of one panel, acc[r] as rows_x_a8panel / rows_x_a8q6k make it; xq
// holds the codes padded with zero rows to a multiple of 16, so every A tile is 16 full rows
template <int R, int A>
void rows_x_tiles(const QuantizedRows& xr, const int8_t* xq, int64_t r0, int rows, const uint8_t* __restrict base,
                  float* __restrict y, int64_t K, int64_t N) {
  constexpr bool Q4 = A8Block<A>::Q4;
  const int64_t nb = K / 32;
  // unpacked B rows, two blocks ahead of their tile load: a tile load of bytes just stored waits for the stores
  // to reach the cache (measured: it made a block's tile work 3x slower)
  alignas(64) uint8_t buf[4][8][64];
  const uint8_t* w[4];
  alignas(64) int32_t sums[2][2][16][16];  // [parity][half (Q6K)][row][output]
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  xq += r0 * K;
  for (int64_t b = 0; b < std::min<int64_t>(2, nb); ++b) w[b] = b_rows(A8Block<A>(base, b), buf[b]);
  tiles_of_block<A>(w[0], xq, K, 0, sums[0]);
  for (int64_t b = 0; b < nb; ++b) {
    const A8Block<A> blk(base, b);
    A8Block<A>(base, b + PREFETCH_RECORDS).prefetch();
    const int par = int(b & 1);
    if (b + 2 < nb) w[(b + 2) & 3] = b_rows(A8Block<A>(base, b + 2), buf[(b + 2) & 3]);
    if (b + 1 < nb) tiles_of_block<A>(w[(b + 1) & 3], xq + 32 * (b + 1), K, 1 - par, sums[1 - par]);
    const int32_t (*s)[16][16] = sums[par];
    if constexpr (A == A8_Q6K) {
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 64 + 32 * blk.sb)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.rec + 80 + 32 * blk.sb)));
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk.rec));
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const int64_t i = (r0 + r) * nb + b;
        const __m512i c0 = _mm512_sub_epi32(_mm512_load_si512(s[0][r]), _mm512_set1_epi32(32 * xr.half[2 * i]));
        const __m512i c1 = _mm512_sub_epi32(_mm512_load_si512(s[1][r]), _mm512_set1_epi32(32 * xr.half[2 * i + 1]));
        const __m512i tot = _mm512_add_epi32(_mm512_mullo_epi32(c0, sc0), _mm512_mullo_epi32(c1, sc1));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(d, _mm512_set1_ps(xr.d[i])), acc[r]);
      }
    } else {
      const __m512 d = a8_scale(blk), m = Q4 ? a8_minimum(blk) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const int64_t i = (r0 + r) * nb + b;
        __m512i isum = _mm512_load_si512(s[0][r]);
        if (!Q4) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xr.sum[i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(xr.d[i])), acc[r]);
        if (Q4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xr.s[i]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R && r < rows; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

template <int A>
void panel_x_tiles(const QuantizedRows& xr, const int8_t* xq, int64_t M, const uint8_t* panel, float* y, int64_t K,
                   int64_t N) {
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int rows = int(std::min<int64_t>(16, M - r0));
    float* out = y + r0 * N;
    if (rows > 8) rows_x_tiles<16, A>(xr, xq, r0, rows, panel, out, K, N);
    else if (rows > 4) rows_x_tiles<8, A>(xr, xq, r0, rows, panel, out, K, N);
    else rows_x_tiles<4, A>(xr, xq, r0, rows, panel, out, K, N);
  }
}

TileConfig tile_config(int kind) {
  TileConfig c;
  if (kind == A8_Q6K) {
    for (int t = 0; t < 4; ++t) c.set(t, 16, 64);
    c.set(4, 16, 16), c.set(5, 16, 16), c.set(6, 4, 64), c.set(7, 4, 64);
  } else {
    c.set(0, 16, 64), c.set(1, 16, 64), c.set(2, 16, 32), c.set(3, 16, 32), c.set(4, 8, 64), c.set(5, 8, 64);
  }
  return c;
}

}  // namespace

bool a8_amx_available() { return amx_granted(); }

bool a8_amx_linear(int kind, const QuantizedRows& xr, int64_t M, const uint8_t* wp, int64_t panels,
                   int64_t panel_bytes, float* y, int64_t K, int64_t N) {
  if (!amx_granted()) return false;
  const TileConfig cfg = tile_config(kind);
  const int64_t padded = (M + 15) / 16 * 16;
  std::vector<int8_t> xq(padded * K, 0);
  std::memcpy(xq.data(), xr.q.data(), M * K);
  at::parallel_for(0, panels, 8, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&cfg);  // per thread, per call: other code on this thread may have used tiles since
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = wp + p * panel_bytes;
      float* out = y + p * 16;
      switch (kind) {
        case A8_Q4: panel_x_tiles<A8_Q4>(xr, xq.data(), M, panel, out, K, N); break;
        case A8_Q8: panel_x_tiles<A8_Q8>(xr, xq.data(), M, panel, out, K, N); break;
        case A8_Q4K: panel_x_tiles<A8_Q4K>(xr, xq.data(), M, panel, out, K, N); break;
        case A8_Q6K: panel_x_tiles<A8_Q6K>(xr, xq.data(), M, panel, out, K, N); break;
        default: panel_x_tiles<A8_Q4H>(xr, xq.data(), M, panel, out, K, N);
      }
    }
    _tile_release();  // tile state back to its initial form: no 8 KB of it saved at every context switch
  });
  return true;
}
#else
bool a8_amx_available() { return false; }
bool a8_amx_linear(int, const QuantizedRows&, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t) {
  return false;
}
#endif
