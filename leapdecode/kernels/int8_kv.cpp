// The int8 KV cache's row transforms (layers/kv_quant.py): quantize-on-write and the change of basis of queries
// and outputs. Both go through rows_times (row_times' sums), so keys and queries change basis with the same rounding.
#include "tensor_api.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "few_rows.h"
#include "ops.h"
#include "vec_math.h"

void check_int8_plane(const torch::Tensor& data, const torch::Tensor& scale, const char* what) {
  TORCH_CHECK(data.dim() == 3 && data.scalar_type() == torch::kChar && data.is_contiguous() && data.size(2) % 16 == 0,
              what, ": int8 data must be contiguous [slots, Hkv, D] with D a multiple of 16");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == torch::kHalf && scale.is_contiguous() &&
                  scale.size(0) == data.size(0) && scale.size(1) == data.size(1) && scale.size(2) * 16 == data.size(2),
              what, ": scales must be contiguous float16 [slots, Hkv, D/16]");
}

// Quantize-on-write of kv_quant.QuantizedKV in one call: row x[t, h] becomes y = ((x - shift[h]) / smooth[h]) @ R,
// then per 16 channels scale = float16(absmax / 127), q = round-half-even(y / scale) in [-127, 127], stored at
// slots[t]. shift / smooth / rotation may be empty (identity).
void quantize_kv_rows(torch::Tensor x, torch::Tensor shift, torch::Tensor smooth, torch::Tensor rotation,
                      torch::Tensor slots, torch::Tensor data, torch::Tensor scale) {
  check_int8_plane(data, scale, "quantize_kv_rows");
  const int64_t T = x.size(0), Hkv = data.size(1), D = data.size(2), NG = D / 16;
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.size(1) == Hkv &&
                  x.size(2) == D, "quantize_kv_rows: x must be contiguous float32 [T, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T,
              "quantize_kv_rows: int64 slots [T]");
  for (const auto* t : {&shift, &smooth})
    TORCH_CHECK(t->numel() == 0 || (t->is_contiguous() && t->scalar_type() == torch::kFloat && t->numel() == Hkv * D),
                "quantize_kv_rows: shift / smooth must be empty or contiguous float32 [Hkv, D]");
  TORCH_CHECK(rotation.numel() == 0 || (rotation.is_contiguous() && rotation.scalar_type() == torch::kFloat &&
                                        rotation.numel() == D * D), "quantize_kv_rows: rotation must be [D, D]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < data.size(0), "quantize_kv_rows: slot out of range");
  const float* xp = x.data_ptr<float>();
  const float* mu = shift.numel() ? shift.data_ptr<float>() : nullptr;
  const float* sm = smooth.numel() ? smooth.data_ptr<float>() : nullptr;
  const float* rot = rotation.numel() ? rotation.data_ptr<float>() : nullptr;
  int8_t* dp = data.data_ptr<int8_t>();
  at::Half* scp = scale.data_ptr<at::Half>();
  // a prompt's rows on every thread (each row's result is its own; its slot is written by its row alone)
  over_rows(T, [&](int64_t t0, int64_t t1) {
    constexpr int64_t kRows = kRowsTimesGroup;  // (row, head) pairs
    std::vector<float> y(kRows * D), z(rot ? kRows * D : 0);
    for (int64_t p0 = t0 * Hkv; p0 < t1 * Hkv; p0 += kRows) {
      const int64_t n = std::min(kRows, t1 * Hkv - p0);
      for (int64_t k = 0; k < n; ++k) {
        const int64_t h = (p0 + k) % Hkv;
        const float* xr = xp + (p0 + k) * D;
        for (int64_t i = 0; i < D; ++i) {
          float v = xr[i];
          if (mu) v -= mu[h * D + i];
          if (sm) v /= sm[h * D + i];
          y[k * D + i] = v;
        }
      }
      if (rot) rows_times(y.data(), n, rot, z.data(), D);
      const float* rows = rot ? z.data() : y.data();  // without a rotation the shifted, smoothed rows themselves
      for (int64_t k = 0; k < n; ++k) {
        const float* zk = rows + k * D;
        const int64_t t = (p0 + k) / Hkv, base = sp[t] * Hkv + (p0 + k) % Hkv;
        for (int64_t c = 0; c < NG; ++c) {
          float amax = 0.f;
          for (int64_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(zk[16 * c + i]));
          const at::Half sh = at::Half(std::min(amax / 127.f, 65504.f));
          scp[base * NG + c] = sh;
          const float sf = std::max(static_cast<float>(sh), 1e-12f);
          for (int64_t i = 0; i < 16; ++i) {
            const float qv = std::nearbyint(zk[16 * c + i] / sf);
            dp[base * D + 16 * c + i] = int8_t(std::max(-127.f, std::min(127.f, qv)));
          }
        }
      }
    }
  });
}

// Rows x [T, H, D] into / out of an int8 plane's basis in one call: y = (x * s) @ R, or y = x @ R^T with
// `transpose` (s: [Hkv, D] per KV head, the H = Hkv * G query heads sharing it in groups; empty = 1; R: [D, D],
// empty = identity). Each row sums over i = 0 .. D-1 in order, so a row's result does not depend on the others;
// kv_quant.QuantizedKV's query_to_cache_basis / unrotate and decoder_layer_i8 all go through it (one rounding).
torch::Tensor rotate_rows(torch::Tensor x, torch::Tensor smooth, torch::Tensor rot, bool transpose) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat, "rotate_rows: x must be float32 [T, H, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(smooth.numel() == 0 || (smooth.scalar_type() == torch::kFloat && smooth.dim() == 2 &&
                                      smooth.size(1) == D && H % smooth.size(0) == 0),
              "rotate_rows: smooth must be empty or float32 [Hkv, D]");
  TORCH_CHECK(rot.numel() == 0 || (rot.scalar_type() == torch::kFloat && rot.dim() == 2 && rot.size(0) == D &&
                                   rot.size(1) == D), "rotate_rows: rotation must be empty or float32 [D, D]");
  auto xc = x.contiguous();
  if (rot.numel() == 0 && smooth.numel() == 0) return xc;
  auto y = torch::empty({T, H, D}, x.options());
  const auto r = rot.numel() ? (transpose ? rot.t().contiguous() : rot.contiguous()) : rot;
  const auto sm = smooth.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* rp = r.numel() ? r.data_ptr<float>() : nullptr;
  const float* sp = sm.numel() ? sm.data_ptr<float>() : nullptr;
  const int64_t G = sm.numel() ? H / sm.size(0) : 1;
  float* yp = y.data_ptr<float>();
  over_rows(T, [&](int64_t t0, int64_t t1) {  // a prompt's rows on every thread
    constexpr int64_t kRows = kRowsTimesGroup;
    std::vector<float> xs(kRows * D);
    for (int64_t row = t0 * H; row < t1 * H; row += kRows) {
      const int64_t n = std::min(kRows, t1 * H - row);
      for (int64_t k = 0; k < n; ++k) {
        const float* xr = xp + (row + k) * D;
        const float* s = sp ? sp + (((row + k) % H) / G) * D : nullptr;
        for (int64_t i = 0; i < D; ++i) xs[k * D + i] = s ? xr[i] * s[i] : xr[i];
      }
      float* yr = yp + row * D;
      if (rp) {
        rows_times(xs.data(), n, rp, yr, D);
      } else {
        std::copy(xs.begin(), xs.begin() + n * D, yr);
      }
    }
  });
  return y;
}
