// The small per-layer operations of a decode step, for CPU float32. At one token per step each of these does a few
// thousand flops, and what torch charges per call (dispatch, allocation, OpenMP fork for RMSNorm's five ops) is
// 10-70 us; a step has ~60 norms and 30 attentions, which was ~40% of a batch-1 step once the projections read
// Q4 blocks (see kernels/small_gemm.cpp). Row results never depend on the other rows of the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// the 16 lanes summed pairwise (a log-depth tree: a serial loop over lanes cost more than the products)
static inline float hsum(v16f v) {
  v8f a, b;
  __builtin_memcpy(&a, &v, 32);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  a += b;
  v4f c, d;
  __builtin_memcpy(&c, &a, 16);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// q . k over d floats in a fixed order (16 lanes, then the lanes summed): vectorised without -ffast-math
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  int64_t i = 0;
  float tail = 0.f;
  if (d >= 16) {
    v16f acc = v16f{};
    for (; i + 16 <= d; i += 16) {
      v16f x, y;
      __builtin_memcpy(&x, a + i, 64);
      __builtin_memcpy(&y, b + i, 64);
      acc += x * y;
    }
    tail = hsum(acc);
  }
  for (; i < d; ++i) tail += a[i] * b[i];
  return tail;
}

// y += a * x over d floats (explicit vectors: the compiler cannot rule out aliasing of y and x)
static inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    v16f xv, yv;
    __builtin_memcpy(&xv, x + i, 64);
    __builtin_memcpy(&yv, y + i, 64);
    yv += xv * a;
    __builtin_memcpy(y + i, &yv, 64);
  }
  for (; i < d; ++i) y[i] += a * x[i];
}

typedef int32_t v16i __attribute__((vector_size(64)));

// e^x for 16 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial; ~1 ulp), since
// scalar std::exp was most of a decode attention's time. Inputs here are scores minus their max (<= 0).
static inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.3f, hi = v16f{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v16f t = x * 1.44269504088896341f + 0.5f;
  v16f fx = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);
  fx = fx + __builtin_convertvector(fx > t, v16f);  // truncation -> floor (the mask is -1 where fx > t)
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  v16f y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
            1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  v16i e = (__builtin_convertvector(fx, v16i) + 127) << 23;
  return y * (v16f)e;
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  w.is_contiguous(),
              "rms_norm: contiguous float32 tensors");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float* yr = yp + r * d;
      const float inv = float(1.0 / std::sqrt(double(dot(xr, xr, d)) / d + eps));
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * wp[i];
    }
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, body);  // a prefill chunk
  else body(0, rows);  // a decode step: threads would cost more than the work
  return y;
}

// Attention for query rows that each see an explicit list of cache slots (decode tokens, drafts, tree nodes), in
// place over the paged cache. q: [T, H, D]; k_cache, v_cache: [num_slots, Hkv, D]; row t = rows[r] attends to
// slots[offsets[r] .. offsets[r+1]) (in position order) and its [H, D] result is written to out[t].
// Each (row, KV head) is computed alone, in one fixed order, so a token's result depends only on its own query
// and visible K/V: the same whether it is decoded alone, batched, or verified among drafts or tree candidates.
// Softmax in float32 with the max subtracted.
static void attend(const float* q, const float* kp, const float* vp, const int64_t* slots, int64_t n, int64_t h,
                   int64_t G, int64_t D, int64_t row, float scale, float* o, std::vector<float>& buf) {
  const int64_t np = (n + 15) / 16 * 16;  // scores padded to whole vectors
  if (int64_t(buf.size()) < G * np) buf.resize(G * np);
  float* sh = buf.data();
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = kp + slots[j] * row + h * D;
    for (int64_t g = 0; g < G; ++g) sh[g * np + j] = dot(q + (h * G + g) * D, kj, D) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sh + g * np;
    float m = sg[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, sg[j]);
    for (int64_t j = n; j < np; ++j) sg[j] = m;
    v16f acc = v16f{};
    for (int64_t j = 0; j < np; j += 16) {
      v16f e;
      __builtin_memcpy(&e, sg + j, 64);
      e = exp16(e - m);
      __builtin_memcpy(sg + j, &e, 64);
    }
    for (int64_t j = n; j < np; ++j) sg[j] = 0.f;  // padding
    for (int64_t j = 0; j < np; j += 16) {
      v16f e;
      __builtin_memcpy(&e, sg + j, 64);
      acc += e;
    }
    const float inv = 1.f / hsum(acc);
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
    float* og = o + (h * G + g) * D;
    for (int64_t i = 0; i < D; ++i) og[i] = 0.f;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = vp + slots[j] * row + h * D;
    for (int64_t g = 0; g < G; ++g) axpy(sh[g * np + j], vj, o + (h * G + g) * D, D);
  }
}

void attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor rows,
                    torch::Tensor offsets, torch::Tensor slots, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "attention_rows: q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat32,
              "attention_rows: out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "attention_rows: contiguous float32 caches [slots, Hkv, D]");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && offsets.scalar_type() == torch::kLong &&
                  slots.scalar_type() == torch::kLong && rows.is_contiguous() && offsets.is_contiguous() &&
                  slots.is_contiguous() && offsets.numel() == rows.numel() + 1,
              "attention_rows: int64 rows [R], offsets [R + 1], slots");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t R = rows.numel(), num_slots = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "attention_rows: head shapes");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < T && op[r] < op[r + 1] && op[r + 1] <= slots.numel(),
                "attention_rows: row ", r, " is out of range or sees no position");
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "attention_rows: slot out of range");
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int64_t work = (op[R] - op[0]) * H;  // score count: one thread unless waking a second one pays
  at::parallel_for(0, R * Hkv, work >= 16384 ? 1 : R * Hkv, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv, t = rp[r];
      attend(qp + t * H * D, kp, vp, sp + op[r], op[r + 1] - op[r], h, G, D, Hkv * D, float(scale),
             outp + t * H * D, buf);
    }
  });
}
