// y[M, N] = x[M, K] @ W^T for few rows (decode steps, draft/tree verification, small batches): M <= 64.
//
// W is pre-packed into panels of 16 output features, [N/16][K][16]: one panel is one contiguous stream and each
// 64-byte row of it (16 outputs at one k) is one cache line. For each panel the kernel walks the rows of x in
// chunks of up to 8, keeping a chunk's 8 x 16 partial sums in vector registers (two sets, for even and odd k, to
// halve the FMA dependency chains). The panel (36 KB at K = 576) comes from memory once and stays in L1/L2 for
// the later chunks, so the call stays bound by weight bandwidth well past M = 8, where a general small-M GEMM
// costs 2-2.5x a vector-matrix product on the CPUs we measured.
//
// Every output element is summed in the same order (even and odd k separately, then added) whatever M and the
// row's chunk are, so a token's result does not depend on how many rows share the call: plain decoding and the
// verification of drafts see bit-identical projections.
#include <torch/extension.h>
#include <ATen/Parallel.h>

typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t PREFETCH = 32;  // k-rows (cache lines) ahead in the panel stream

template <int R>
static inline void rows_x_panel(const float* __restrict x, const float* __restrict w, float* __restrict y,
                                int64_t K, int64_t N) {
  v16f acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = v16f{};
  for (int64_t k = 0; k < K; k += 2) {
    __builtin_prefetch(w + (k + PREFETCH) * 16);
    __builtin_prefetch(w + (k + PREFETCH + 1) * 16);
    v16f w0, w1;
    __builtin_memcpy(&w0, w + k * 16, 64);
    __builtin_memcpy(&w1, w + (k + 1) * 16, 64);
    for (int r = 0; r < R; ++r) {
      acc0[r] += w0 * x[r * K + k];
      acc1[r] += w1 * x[r * K + k + 1];
    }
  }
  for (int r = 0; r < R; ++r) {
    v16f s = acc0[r] + acc1[r];
    __builtin_memcpy(y + r * N, &s, 64);
  }
}

static void rows_x_panel_any(int64_t rows, const float* x, const float* w, float* y, int64_t K, int64_t N) {
  switch (rows) {
    case 1: rows_x_panel<1>(x, w, y, K, N); break;
    case 2: rows_x_panel<2>(x, w, y, K, N); break;
    case 3: rows_x_panel<3>(x, w, y, K, N); break;
    case 4: rows_x_panel<4>(x, w, y, K, N); break;
    case 5: rows_x_panel<5>(x, w, y, K, N); break;
    case 6: rows_x_panel<6>(x, w, y, K, N); break;
    case 7: rows_x_panel<7>(x, w, y, K, N); break;
    default: rows_x_panel<8>(x, w, y, K, N); break;
  }
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "small_linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == torch::kFloat32 &&
                  packed.is_contiguous(),
              "small_linear: packed weight must be a contiguous [N/16, K, 16] float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) == K && K % 2 == 0, "small_linear: K mismatch or odd K");
  TORCH_CHECK(M >= 1 && M <= 64, "small_linear: 1..64 rows");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // ~8 panels (300 KB of weights at K = 576) per task keeps the threading overhead small against the reads
  at::parallel_for(0, N / 16, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = wp + p * K * 16;
      for (int64_t r0 = 0; r0 < M; r0 += 8)
        rows_x_panel_any(std::min<int64_t>(8, M - r0), xp + r0 * K, w, yp + r0 * N + p * 16, K, N);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x @ W^T for 1..64 rows, W packed as [N/16, K, 16]");
}
