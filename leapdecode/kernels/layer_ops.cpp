// The small per-row operations of a decode step, for CPU float32: RMSNorm, RoPE, SiLU-and-multiply. At one token
// per step each of these does a few thousand flops, and what torch charges per call (dispatch, allocation, OpenMP
// fork for RMSNorm's five ops) is 10-70 us; a step has ~60 norms, which was a large share of a batch-1 step once the
// projections read Q4 blocks (see kernels/small_gemm.cpp). Row results never depend on the other rows of the call.
#include "tensor_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "few_rows.h"
#include "ops.h"
#include "vec_math.h"

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.is_contiguous() &&
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
  over_rows(rows, body);
  return y;
}

// RoPE in place: each of the first num_heads heads (d wide) of every row of qkv [T, W] becomes
// x * cos + roll(x, d/2) * sin_signed, with cos / sin_signed [T, d] (the sign of the rotate-half folded into sin).
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat, "rope_: qkv");
  const int64_t T = qkv.size(0), W = qkv.size(1), d = cos.size(-1), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == T * d &&
                  sin_signed.numel() == T * d && num_heads * d <= W && d % 2 == 0,
              "rope_: tables must be contiguous [T, d]");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  // x[i] = fma(x[i], cos[i], x[i +- d/2] * sin[i]), written out: the earlier loop's form, whose expression the
  // compiler had contracted to this fma, so the same bits whatever a compiler contracts; each pair (i, i + d/2) is
  // read before either is written, so no copy of the head, and both halves vectorise
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < num_heads; ++h) {
        float* __restrict x = xp + t * W + h * d;
        const float* __restrict c = cp + t * d;
        const float* __restrict s = sp + t * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = std::fma(a, c[i], b * s[i]);
          x[i + half] = std::fma(b, c[i + half], a * s[i + half]);
        }
      }
  };
  over_rows(T, body);  // (a prompt's rows on every thread)
}

// act(gate) * up for gate_up [T, 2I] -> [T, I], a register's lanes of outputs at a time; the last I % lanes run the
// same formula on a broadcast, lane by lane, so no row depends on its width (nor on the lane count: all of it is
// lane by lane)
template <class Act>
static torch::Tensor gated_product(torch::Tensor gate_up, const char* name, Act act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat &&
                  gate_up.size(1) % 2 == 0,
              name, ": contiguous float32 [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + kRowLanes <= I; i += kRowLanes) {
        vrf gv, uv;
        __builtin_memcpy(&gv, g + i, sizeof(vrf));
        __builtin_memcpy(&uv, u + i, sizeof(vrf));
        vrf r = act(gv) * uv;
        __builtin_memcpy(o + i, &r, sizeof(vrf));
      }
      for (; i < I; ++i) o[i] = act(vrf{} + g[i])[0] * u[i];
    }
  };
  // (a prompt's rows on every thread: the bundled model's 30 layers, 330 rows 11-15 -> 6-10 ms, 1,000 rows 41-49
  // -> 24-27 ms, A/B on Zen 4)
  over_rows(T, body);
  return out;
}

// silu(gate) * up; silu(g) = g / (1 + e^-g)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  return gated_product(gate_up, "silu_mul", [](vrf g) { return g / (1.0f + exp_row_lanes(vrf{} - g)); });
}

// gelu(gate) * up, GELU in its tanh form: g / 2 (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi), with
// tanh(y) = 1 - 2 / (1 + e^2y) (exp_lanes saturates, so |y| large gives +-1)
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  const float c = 0.7978845608028654f, a = 0.044715f;
  return gated_product(gate_up, "gelu_tanh_mul", [=](vrf g) {
    const vrf y = c * (g + a * g * g * g);
    return 0.5f * g * (2.0f - 2.0f / (1.0f + exp_row_lanes(2.0f * y)));
  });
}

// Per row of logits [T, V]: the k largest values (descending; of equal values the lower index first) with their
// indices, and the row's logsumexp, in two passes over the row (its max and top-k list, then the exponentials'
// sum), where topk and logsumexp in torch read the row three times and allocate between. The
// training-free drafters learn from every verified row this way, so it runs once per row of every step.
std::vector<torch::Tensor> row_top_k(torch::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat,
              "row_top_k: contiguous float32 [T, V] logits");
  const int64_t T = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "row_top_k: k must be in [1, V], got ", k);
  auto values = torch::empty({T, k}, logits.options());
  auto indices = torch::empty({T, k}, logits.options().dtype(torch::kLong));
  auto lse = torch::empty({T}, logits.options());
  const float* lp = logits.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* sp = lse.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> top(k);
    std::vector<int64_t> at(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      int64_t filled = 0;
      std::fill(top.begin(), top.end(), neg_inf);
      std::fill(at.begin(), at.end(), int64_t(-1));
      auto offer = [&](float v, int64_t i) {  // insert v (index i) if it beats the k-th; ties keep the earlier
        if (filled == k && !(v > top[k - 1])) return;
        int64_t j = filled < k ? filled++ : k - 1;
        while (j > 0 && v > top[j - 1]) {
          top[j] = top[j - 1];
          at[j] = at[j - 1];
          --j;
        }
        top[j] = v;
        at[j] = i;
      };
      // pass 1: the row's max and its top-k (a chunk is offered only where a lane beats the k-th value so far)
      float m = neg_inf;
      int64_t i = 0;
      vrf mv = vrf{} + neg_inf;
      for (; i + kRowLanes <= V; i += kRowLanes) {
        vrf xv;
        __builtin_memcpy(&xv, x + i, sizeof(vrf));
        mv = xv > mv ? xv : mv;
        if (filled < k || any_row_lane(xv > (vrf{} + top[k - 1])))
          for (int j = 0; j < kRowLanes; ++j) offer(xv[j], i + j);
      }
      for (int j = 0; j < kRowLanes; ++j) m = std::max(m, mv[j]);
      for (int64_t t = i; t < V; ++t) {
        m = std::max(m, x[t]);
        offer(x[t], t);
      }
      // pass 2: the exponentials' sum, nothing else in the loop
      vrf acc{};
      float tail = 0.f;
      if (m > neg_inf) {
        for (i = 0; i + kRowLanes <= V; i += kRowLanes) {
          vrf xv;
          __builtin_memcpy(&xv, x + i, sizeof(vrf));
          acc += exp_row_lanes(xv - m);
        }
        for (; i < V; ++i) tail += exp_row_lanes(vrf{} + (x[i] - m))[0];
      }
      for (int64_t j = 0; j < k; ++j) {
        vp[r * k + j] = top[j];
        ip[r * k + j] = at[j];
      }
      sp[r] = m > neg_inf ? m + std::log(hsum_row_lanes(acc) + tail) : neg_inf;
    }
  };
  if (T >= 2) at::parallel_for(0, T, 1, body);  // a verified tree or a batch: rows are independent
  else body(0, T);
  return {values, indices, lse};
}

// Per row of logits [T, V]: the index of its largest value, as torch.argmax gives it (the first of equal maxima; the
// first NaN where a row has one), in one vector pass over the row: the greedy token of every row of a decode step or
// a verification, where torch's argmax read a 49,152-wide row at ~4.5 GB/s (43 us a row, 0.33 ms for 16).
std::vector<int64_t> row_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat &&
                  logits.size(1) >= 1,
              "row_argmax: contiguous float32 [T, V] logits, V >= 1");
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  std::vector<int64_t> out(T);
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      // per lane: the largest value seen and its first index (a strict > keeps the earlier of equals)
      vrf best = vrf{} + x[0];
      vri at = vri{};
      vrf nan_seen = vrf{};
      int64_t i = 0;
      vri lanes;
      for (int l = 0; l < kRowLanes; ++l) lanes[l] = l;
      for (; i + kRowLanes <= V; i += kRowLanes) {
        vrf xv;
        __builtin_memcpy(&xv, x + i, sizeof(vrf));
        const vri gt = xv > best;
        best = gt ? xv : best;
        at = gt ? lanes + static_cast<int>(i) : at;
        nan_seen += (xv != xv) ? vrf{} + 1.f : vrf{};
      }
      float m = best[0];
      int64_t idx = at[0];
      for (int l = 1; l < kRowLanes; ++l)
        if (best[l] > m || (best[l] == m && at[l] < idx)) m = best[l], idx = at[l];
      bool nan = false;
      for (int l = 0; l < kRowLanes; ++l) nan = nan || nan_seen[l] != 0.f;
      for (; i < V; ++i) {
        if (x[i] != x[i]) nan = true;
        if (x[i] > m) m = x[i], idx = i;
      }
      if (nan)  // torch's rule: the first NaN
        for (int64_t j = 0; j < V; ++j)
          if (x[j] != x[j]) {
            idx = j;
            break;
          }
      out[r] = idx;
    }
  };
  if (T >= 2) at::parallel_for(0, T, 1, body);
  else body(0, T);
  return out;
}

// Token Recycling's successor matrix learns from verified rows: for each row r of logits [T, V] whose input token
// is tokens[r], the row's top-k (row_top_k) becomes matrix row tokens[r] -- successor ids (int32) and their
// probabilities exp(value - logsumexp) as float16. Rows are written in order, so a token given twice keeps its
// last row; a token outside the matrix is skipped. One call per step instead of ~12 torch calls.
void record_successors(torch::Tensor logits, const std::vector<int64_t>& tokens, torch::Tensor succ_tokens,
                       torch::Tensor succ_probs) {
  const int64_t k = succ_tokens.size(1), rows = succ_tokens.size(0), T = logits.size(0);
  TORCH_CHECK(int64_t(tokens.size()) == T, "record_successors: one input token per logits row");
  TORCH_CHECK(succ_tokens.is_contiguous() && succ_tokens.scalar_type() == torch::kInt &&
                  succ_probs.is_contiguous() && succ_probs.scalar_type() == torch::kHalf &&
                  succ_probs.sizes() == succ_tokens.sizes(),
              "record_successors: contiguous int32 ids and float16 probabilities of one shape [rows, k]");
  const auto top = row_top_k(logits, k);
  const float* vp = top[0].data_ptr<float>();
  const int64_t* ip = top[1].data_ptr<int64_t>();
  const float* sp = top[2].data_ptr<float>();
  const int64_t* tp = tokens.data();
  int32_t* st = succ_tokens.data_ptr<int32_t>();
  at::Half* pp = succ_probs.data_ptr<at::Half>();
  for (int64_t r = 0; r < T; ++r) {
    const int64_t t = tp[r];
    if (t < 0 || t >= rows) continue;
    for (int64_t j = 0; j < k; ++j) {
      st[t * k + j] = static_cast<int32_t>(ip[r * k + j]);
      pp[t * k + j] = at::Half(std::exp(vp[r * k + j] - sp[r]));
    }
  }
}
