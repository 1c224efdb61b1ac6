// Attention of few query rows over the paged int8 KV cache of layers/kv_quant.py; the pieces it shares with the
// float32 cache's kernel are in attention_rows.h.
#include "tensor_api.h"

#include <immintrin.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "attention_rows.h"
#include "ops.h"

// ---------------------------------------------------------------------------------------------- int8 KV cache
// The cache of layers/kv_quant.py: rows int8 [slots, Hkv, D], one float16 scale per 16 channels [slots, Hkv, D/16],
// in a rotated (keys: shifted and smoothed) basis that the caller maps queries into and outputs out of. Attention
// reads each chunk of a row's slots as int8 and rebuilds the rows in registers (attend_chunk_i8; other head shapes
// dequantise the chunk into an L2-resident scratch and run the float chunk routine): the long context is read from
// memory as int8 (~3.6x fewer bytes than float32), every row goes through chunks + merge (one chunk for short
// rows), and nothing depends on the other rows of the call.

static inline void half4_to_float(const at::Half* h, int64_t n, float* out) {
#if defined(__F16C__)
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 f = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + i)));
    _mm_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i].x);
#else
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(h[i]);
#endif
}

// 16 int8 values times s into out[0 .. 16)
static inline void dequant16(const int8_t* q, float s, float* out) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  _mm512_storeu_ps(out, _mm512_mul_ps(f, _mm512_set1_ps(s)));
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  for (int half = 0; half < 2; ++half) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * half));
    _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
  }
#else
  for (int i = 0; i < 16; ++i) out[i] = float(q[i]) * s;
#endif
}

// rows slots[0 .. n) of KV head h, dequantised into out [n, D]
static void dequant_rows(const int8_t* data, const at::Half* scale, const int64_t* slots, int64_t n, int64_t Hkv,
                         int64_t h, int64_t D, float* out) {
  const int64_t NG = D / 16;
  float sc[16];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = slots[j] * Hkv + h;
    if (j + 4 < n) __builtin_prefetch(data + (slots[j + 4] * Hkv + h) * D);
    half4_to_float(scale + base * NG, NG, sc);
    for (int64_t c = 0; c < NG; ++c) dequant16(data + base * D + 16 * c, sc[c], out + j * D + 16 * c);
  }
}

#if defined(__AVX512F__)
constexpr int64_t kAhead = 32;  // rows prefetched ahead: ~15 cycles per row against ~300 for a line from DRAM

// one int8 row (NG groups of 16 channels, one float16 scale each) as NG float vectors
template <int NG>
static inline void load_row_i8(const int8_t* codes, const at::Half* scales, __m512* out) {
  float sc[NG];
  if (NG == 4) {
    _mm_storeu_ps(sc, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))));
  } else {
    for (int c = 0; c < NG; ++c) sc[c] = _cvtsh_ss(scales[c].x);
  }
  for (int c = 0; c < NG; ++c)
    out[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c)))),
                           _mm512_set1_ps(sc[c]));
}

// attend_chunk straight from the int8 cache (no dequantised scratch): G query heads q [G, D] of KV head h over
// the rows slots[0 .. n), D = 16 NG. Scores four keys at a time (hsum4), then the same exp_scores, then each V row
// rebuilt once in registers for all G heads. part: G records [m, s, o[0 .. D)], as attend_chunk's.
template <int NG, int G>
static void attend_chunk_i8(const float* q, const int8_t* kd, const at::Half* ks, const int8_t* vd,
                            const at::Half* vs, const int64_t* slots, int64_t n, int64_t Hkv, int64_t h,
                            float scale, float* part, std::vector<float>& buf) {
  constexpr int64_t D = 16 * NG;
  const int64_t np = (n + 15) / 16 * 16;
  if (int64_t(buf.size()) < G * np) buf.resize(G * np);
  float* sh = buf.data();
  __m512 qv[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  auto row_of = [&](int64_t j) { return slots[j] * Hkv + h; };
  auto score = [&](const __m512* kf, int g) {  // q_g . k, as 16 lane sums
    __m512 a = _mm512_mul_ps(qv[g][0], kf[0]);
    for (int c = 1; c < NG; ++c) a = _mm512_fmadd_ps(qv[g][c], kf[c], a);
    return a;
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + kAhead < n) {
        __builtin_prefetch(kd + row_of(j + u + kAhead) * D);
        __builtin_prefetch(ks + row_of(j + u + kAhead) * NG);
      }
      __m512 kf[NG];
      load_row_i8<NG>(kd + row_of(j + u) * D, ks + row_of(j + u) * NG, kf);
      for (int g = 0; g < G; ++g) acc[g][u] = score(kf, g);
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(sh + g * np + j, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
  }
  for (; j < n; ++j) {  // the last n % 4 keys: the same products, summed lane by lane
    __m512 kf[NG];
    load_row_i8<NG>(kd + row_of(j) * D, ks + row_of(j) * NG, kf);
    for (int g = 0; g < G; ++g) sh[g * np + j] = _mm512_reduce_add_ps(score(kf, g)) * scale;
  }
  for (int g = 0; g < G; ++g) {
    float* rec = part + g * (D + 2);
    rec[1] = exp_scores(sh + g * np, n, np, &rec[0]);
  }
  __m512 o[G][NG];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) o[g][c] = _mm512_setzero_ps();
  for (j = 0; j < n; ++j) {
    if (j + kAhead < n) {
      __builtin_prefetch(vd + row_of(j + kAhead) * D);
      __builtin_prefetch(vs + row_of(j + kAhead) * NG);
    }
    __m512 vf[NG];
    load_row_i8<NG>(vd + row_of(j) * D, vs + row_of(j) * NG, vf);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(sh[g * np + j]);
      for (int c = 0; c < NG; ++c) o[g][c] = _mm512_fmadd_ps(vf[c], pj, o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NG; ++c) _mm512_storeu_ps(part + g * (D + 2) + 2 + 16 * c, o[g][c]);
}

// the fused chunk routine for this shape, or nullptr (then: dequantise into a scratch and attend_chunk)
template <int NG, int G>
struct ChunkI8Pick {
  static constexpr auto fn = attend_chunk_i8<NG, G>;
};
typedef void (*ChunkI8Fn)(const float*, const int8_t*, const at::Half*, const int8_t*, const at::Half*,
                          const int64_t*, int64_t, int64_t, int64_t, float, float*, std::vector<float>&);
static ChunkI8Fn chunk_i8_for(int64_t D, int64_t G) { return for_shape<ChunkI8Pick>(D, G); }
#else
typedef void (*ChunkI8Fn)(const float*, const int8_t*, const at::Half*, const int8_t*, const at::Half*,
                          const int64_t*, int64_t, int64_t, int64_t, float, float*, std::vector<float>&);
static ChunkI8Fn chunk_i8_for(int64_t, int64_t) { return nullptr; }
#endif

void attention_rows_i8(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale, torch::Tensor v_data,
                       torch::Tensor v_scale, torch::Tensor rows, torch::Tensor spans, torch::Tensor slots,
                       double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat, "attention_rows_i8: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
              "attention_rows_i8: out");
  check_int8_plane(k_data, k_scale, "attention_rows_i8: keys");
  check_int8_plane(v_data, v_scale, "attention_rows_i8: values");
  TORCH_CHECK(v_data.sizes() == k_data.sizes(), "attention_rows_i8: K and V planes differ in shape");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_data.size(1), G = H / Hkv;
  TORCH_CHECK(k_data.size(2) == D && H % Hkv == 0, "attention_rows_i8: head shapes");
  const int64_t R = rows.numel(), num_slots = k_data.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t pairs = check_rows(rows, spans, slots, T, num_slots, "attention_rows_i8");
  const RowTasks tasks = plan_row_tasks(span, sp, R, Hkv, true, false);
  std::vector<float> parts(tasks.first_part[R] * G * (D + 2));
  std::vector<int64_t> identity(std::min(kLongRow, pairs + 1));
  std::iota(identity.begin(), identity.end(), 0);
  const float* qp = q.data_ptr<float>();
  const int8_t* kd = k_data.data_ptr<int8_t>();
  const int8_t* vd = v_data.data_ptr<int8_t>();
  const at::Half* ks = k_scale.data_ptr<at::Half>();
  const at::Half* vs = v_scale.data_ptr<at::Half>();
  const int64_t num_tasks = int64_t(tasks.tasks.size()), work = pairs * H;
  const ChunkI8Fn fused = chunk_i8_for(D, G);  // the common shapes read the int8 rows in registers
  at::parallel_for(0, num_tasks, work >= kParallelScores ? 1 : num_tasks, [&](int64_t begin, int64_t end) {
    std::vector<float> buf, kbuf, vbuf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = tasks.tasks[task].r0, h = tasks.tasks[task].head, c = tasks.tasks[task].chunk, t = rp[r];
      const int64_t n = span[2 * r + 1] - span[2 * r];
      const Chunking ch = chunking(n);
      const int64_t j0 = c * ch.len, m = std::min(ch.len, n - j0);
      float* part = parts.data() + (tasks.first_part[r] + h * ch.count + c) * G * (D + 2);
      if (fused != nullptr) {
        fused(qp + t * H * D + h * G * D, kd, ks, vd, vs, sp + span[2 * r] + j0, m, Hkv, h, float(scale), part, buf);
        continue;
      }
      if (int64_t(kbuf.size()) < m * D) {
        kbuf.resize(m * D);
        vbuf.resize(m * D);
      }
      dequant_rows(kd, ks, sp + span[2 * r] + j0, m, Hkv, h, D, kbuf.data());
      dequant_rows(vd, vs, sp + span[2 * r] + j0, m, Hkv, h, D, vbuf.data());
      attend_chunk(qp + t * H * D + h * G * D, kbuf.data(), vbuf.data(), identity.data(), m, G, D, D, float(scale),
                   part, buf);
    }
  });
  merge_chunks(parts, tasks.first_part, rp, R, Hkv, G, D, out.data_ptr<float>());
}
