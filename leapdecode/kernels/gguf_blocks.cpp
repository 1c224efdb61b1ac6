// GGUF block formats -> the kernels' records (block_formats.h), and records -> float32 rows.
//
// repack_gguf reads a tensor's raw GGUF blocks (row-major, straight from the memory-mapped file) and writes the
// record layout the few-row kernels stream, once at load time; no float32 copy of the weight is ever made.
// unpack_records rebuilds float32 rows from records (embedding lookups, prompts longer than the kernels' row
// limit, drafters that read a subset of an LM head), with the same float operations as the kernels, so every
// path sees the same weights: bitwise gguf's own dequantisation (tests/test_block_formats.py).
#include "tensor_api.h"
#include <c10/util/Half.h>

#include <cstring>

#include "block_formats.h"
#include "ops.h"

// ggml's type ids of the formats handled here
enum GgmlType : int {
  T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};

static int64_t type_block_bytes(int t) {
  switch (t) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
  }
  return 0;
}

static bool is_k_quant(int t) { return t >= T_Q2_K && t <= T_Q6_K; }

int64_t natural_kind(int64_t t) {
  switch (t) {
    case T_Q4_0: case T_Q4_1: return KIND_Q4H;
    case T_Q4_K: return KIND_Q4K;
    case T_Q8_0: case T_Q5_0: return KIND_Q8;
    case T_Q5_1: case T_Q5_K: return KIND_Q8M;
    case T_Q6_K: return KIND_Q6K;
    case T_Q3_K: return KIND_Q8S;
    case T_Q2_K: return KIND_Q4S;
  }
  return -1;
}

static inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One block of 32 inputs of one row, decoded: codes q, and what each record kind stores of its scales
struct Block32 {
  int q[32];
  float d = 0.f, m = 0.f;             // Q4 / Q8 / Q8M: scale and minimum; Q8S / Q4S: the super-block's d (and dmin)
  int sc[2] = {0, 0}, mq[2] = {0, 0};  // Q8S: per-half scales; Q4S: per-half scales and minimum multipliers
  float dsup = 0.f, dmin = 0.f;  // Q4_K / Q5_K: the super-block's d and dmin (Q4K keeps them beside sc[0], mq[0])
};

// Q4_K / Q5_K: the 6-bit scale and minimum multiplier of sub-block s, from the 12 packed bytes
static inline void k_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63, min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
    min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

static void decode_legacy(int type, const uint8_t* blk, Block32& o) {
  const float d = half(blk);
  const bool has_min = type == T_Q4_1 || type == T_Q5_1;
  const float m = has_min ? half(blk + 2) : 0.f;
  if (type == T_Q8_0) {
    for (int t = 0; t < 32; ++t) o.q[t] = static_cast<int8_t>(blk[2 + t]);
    o.d = d, o.m = 0.f;
  } else if (type == T_Q4_0 || type == T_Q4_1) {
    const uint8_t* qs = blk + (has_min ? 4 : 2);
    for (int t = 0; t < 32; ++t) o.q[t] = (qs[t % 16] >> (4 * (t / 16))) & 15;
    o.d = d, o.m = has_min ? m : -8.f * d;  // d * (q - 8) == d * q - 8 d exactly: both sides are exact
  } else {  // Q5_0 / Q5_1
    uint32_t qh;
    std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
    const uint8_t* qs = blk + (has_min ? 8 : 6);
    for (int t = 0; t < 32; ++t) {
      const int q = ((qs[t % 16] >> (4 * (t / 16))) & 15) | (((qh >> t) & 1) << 4);
      o.q[t] = has_min ? q : q - 16;
    }
    o.d = d, o.m = m;
  }
}

// sub-block s (32 inputs) of one K-quant super-block of 256
static void decode_k(int type, const uint8_t* sb, int s, Block32& o) {
  switch (type) {
    case T_Q4_K: case T_Q5_K: {
      int scale, min;
      k_scale_min(sb + 4, s, scale, min);
      o.dsup = half(sb), o.dmin = half(sb + 2), o.sc[0] = scale, o.mq[0] = min;
      const float d = o.dsup * float(scale), m = -(o.dmin * float(min));
      const uint8_t* qs = sb + (type == T_Q4_K ? 16 : 48);
      for (int t = 0; t < 32; ++t) {
        int q = (qs[32 * (s / 2) + t] >> (4 * (s % 2))) & 15;
        if (type == T_Q5_K) q |= ((sb[16 + t] >> s) & 1) << 4;
        o.q[t] = q;
      }
      o.d = d, o.m = m;
      return;
    }
    case T_Q6_K: {
      const uint8_t *ql = sb, *qh = sb + 128;
      const float d = half(sb + 208);
      for (int t = 0; t < 32; ++t) {
        const int e = 32 * s + t;
        const int lo = (ql[64 * (e / 128) + e % 64] >> (4 * ((e % 128) / 64))) & 15;
        const int hi = (qh[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        o.q[t] = (lo | (hi << 4)) - 32;
      }
      o.d = d;
      for (int h = 0; h < 2; ++h) o.sc[h] = static_cast<int8_t>(sb[192 + 2 * s + h]);
      return;
    }
    case T_Q3_K: {
      const uint8_t *hmask = sb, *qs = sb + 32, *scales = sb + 96;
      const float d = half(sb + 108);
      for (int t = 0; t < 32; ++t) {
        const int e = 32 * s + t;
        const int lo = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        const int hbit = (hmask[e % 32] >> (e / 32)) & 1;
        o.q[t] = lo - ((hbit ^ 1) << 2);
      }
      o.d = d;
      for (int h = 0; h < 2; ++h) {
        const int u = 2 * s + h;
        const int lsc = (scales[u % 8] >> (4 * (u / 8))) & 15, hsc = (scales[8 + u % 4] >> (2 * (u / 4))) & 3;
        o.sc[h] = static_cast<int8_t>(lsc | (hsc << 4)) - 32;
      }
      return;
    }
    default: {  // Q2_K
      const uint8_t *scales = sb, *qs = sb + 16;
      const float d = half(sb + 80), dmin = half(sb + 82);
      for (int t = 0; t < 32; ++t) {
        const int e = 32 * s + t;
        o.q[t] = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      }
      o.d = d, o.m = dmin;
      for (int h = 0; h < 2; ++h) o.sc[h] = scales[2 * s + h] & 15, o.mq[h] = scales[2 * s + h] >> 4;
    }
  }
}

static void put_f32(uint8_t* rec, int64_t off, int j, float v) { std::memcpy(rec + off + 4 * j, &v, 4); }

// write row j's share of sub-block sb of one record of the given kind
static void write_record(int kind, const Block32& o, uint8_t* rec, int j, int sb) {
  const int64_t c = kind_codes_offset(kind) + (kind == KIND_Q4K ? 256 * sb : 0);
  if (kind == KIND_Q6K) {
    for (int i = 0; i < 16; ++i)
      rec[320 + 256 * sb + i * 16 + j] = uint8_t(((o.q[2 * i] + 32) & 15) | (((o.q[2 * i + 1] + 32) & 15) << 4));
    for (int i = 0; i < 8; ++i) {
      int hi = 0;
      for (int u = 0; u < 4; ++u) hi |= (((o.q[4 * i + u] + 32) >> 4) & 3) << (2 * u);
      rec[2368 + 128 * sb + i * 16 + j] = uint8_t(hi);
    }
  } else if (kind_nibbles(kind)) {
    for (int i = 0; i < 16; ++i) rec[c + i * 16 + j] = uint8_t(o.q[2 * i] | (o.q[2 * i + 1] << 4));
  } else {
    for (int t = 0; t < 32; ++t) rec[c + t * 16 + j] = uint8_t(o.q[t] & 255);
  }
  switch (kind) {
    case KIND_Q4: case KIND_Q8M: put_f32(rec, 0, j, o.d), put_f32(rec, 64, j, o.m); break;
    case KIND_Q8: put_f32(rec, 0, j, o.d); break;
    case KIND_Q4H: {  // the file's fp16 scale and minimum (Q4_0's -8 d is exact in fp16 too)
      const uint16_t d = c10::Half(o.d).x, m = c10::Half(o.m).x;
      std::memcpy(rec + 2 * j, &d, 2), std::memcpy(rec + 32 + 2 * j, &m, 2);
      break;
    }
    case KIND_Q8S:
      put_f32(rec, 0, j, o.d);
      for (int h = 0; h < 2; ++h) rec[64 + 16 * h + j] = uint8_t(static_cast<int8_t>(o.sc[h]));
      break;
    case KIND_Q4K:
      put_f32(rec, 0, j, o.dsup), put_f32(rec, 64, j, o.dmin);
      rec[128 + 16 * sb + j] = uint8_t(o.sc[0]), rec[256 + 16 * sb + j] = uint8_t(o.mq[0]);
      break;
    case KIND_Q6K:
      put_f32(rec, 0, j, o.d);
      for (int h = 0; h < 2; ++h) rec[64 + 16 * (2 * sb + h) + j] = uint8_t(static_cast<int8_t>(o.sc[h]));
      break;
    default:  // KIND_Q4S
      put_f32(rec, 0, j, o.d), put_f32(rec, 64, j, o.m);
      for (int h = 0; h < 2; ++h) rec[128 + 16 * h + j] = uint8_t(o.sc[h]), rec[160 + 16 * h + j] = uint8_t(o.mq[h]);
  }
}

// raw [N, row bytes] uint8 GGUF blocks of ggml type `type` -> out, records [N/16, K/32, bytes] of `kind` (the
// type's own kind); row n of out is row rows[n] of raw (rows empty: n), which
// undoes a row permutation (llama.cpp's Q/K order) without a copy of the raw blocks
void repack_gguf(torch::Tensor raw, int64_t type, torch::Tensor rows, torch::Tensor out) {
  const int64_t bb = type_block_bytes(int(type)), per_block = is_k_quant(int(type)) ? 256 : 32;
  TORCH_CHECK(bb > 0, "repack_gguf: unsupported ggml type ", type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kByte && raw.is_contiguous(),
              "repack_gguf: raw must be a contiguous [N, row bytes] uint8 tensor");
  TORCH_CHECK(out.dim() == 3 && out.scalar_type() == torch::kByte && out.is_contiguous(),
              "repack_gguf: out must be a contiguous [N/16, K/32, bytes] uint8 tensor");
  const int kind = kind_of_record(out.size(2));
  TORCH_CHECK(kind == natural_kind(type), "repack_gguf: type ", type, " cannot be kind ", kind);
  const int64_t span = kind_span(kind), subs = span / 32;
  const int64_t N = raw.size(0), nrec = out.size(1), K = nrec * span, nb = K / 32, REC = out.size(2);
  TORCH_CHECK(kind >= 0, "repack_gguf: unknown record size ", out.size(2));
  TORCH_CHECK(out.size(0) * 16 == N, "repack_gguf: out holds ", out.size(0) * 16, " rows, raw ", N);
  TORCH_CHECK(K % per_block == 0 && raw.size(1) == K / per_block * bb, "repack_gguf: row bytes do not match K");
  auto idx = rows.to(torch::kLong).contiguous();
  TORCH_CHECK(idx.numel() == 0 || idx.numel() == N, "repack_gguf: rows must be empty or hold N indices");
  const int64_t* ip = idx.numel() ? idx.data_ptr<int64_t>() : nullptr;
  for (int64_t n = 0; ip && n < N; ++n) TORCH_CHECK(ip[n] >= 0 && ip[n] < N, "repack_gguf: row index out of range");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    Block32 o;
    for (int64_t p = begin; p < end; ++p)
      for (int j = 0; j < 16; ++j) {
        const int64_t n = p * 16 + j;
        const uint8_t* row = src + (ip ? ip[n] : n) * raw.size(1);
        for (int64_t b = 0; b < nb; ++b) {
          if (per_block == 256) decode_k(int(type), row + (b / 8) * bb, int(b % 8), o);
          else decode_legacy(int(type), row + b * bb, o);
          write_record(kind, o, dst + (p * nrec + b / subs) * REC, j, int(b % subs));
        }
      }
  });
}

// float32 rows `rows` (int64 [R]) of a record tensor [N/16, K/32, bytes] -> [R, K]
torch::Tensor unpack_records(torch::Tensor records, torch::Tensor rows) {
  TORCH_CHECK(records.dim() == 3 && records.scalar_type() == torch::kByte && records.is_contiguous(),
              "unpack_records: records must be a contiguous [N/16, K/32, bytes] uint8 tensor");
  const int kind = kind_of_record(records.size(2));
  TORCH_CHECK(kind >= 0, "unpack_records: unknown record size ", records.size(2));
  auto idx = rows.to(torch::kLong).contiguous();
  const int64_t span = kind_span(kind), subs = span / 32;
  const int64_t R = idx.size(0), nrec = records.size(1), K = nrec * span, REC = records.size(2);
  const int64_t N = records.size(0) * 16;
  auto out = torch::empty({R, K}, records.options().dtype(torch::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "unpack_records: row ", ip[r], " out of range");
  const uint8_t* src = records.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = ip[r] / 16;
      const int j = int(ip[r] % 16);
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* rec = src + (p * nrec + b / subs) * REC;
        const int sb = int(b % subs);
        for (int h = 0; h < 2; ++h) {
          float s, m;
          record_scale(kind, rec, sb, h, j, s, m);
          for (int t = 16 * h; t < 16 * h + 16; ++t)
            dst[r * K + b * 32 + t] = float(record_code(kind, rec, sb, j, t)) * s + m;
        }
      }
    }
  });
  return out;
}
