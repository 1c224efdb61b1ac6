// The kernel record formats that GGUF weights are repacked into (shared by small_gemm.cpp and gguf_blocks.cpp).
//
// A weight [N, K] becomes [N/16, K/32, record]: one record per panel of 16 output rows and block of 32 inputs.
// Every record is a run of fields, each an array [count][16] whose last index is the output row j of the panel,
// so a row's share of a record is found the same way in every field (layers/block_formats.py relies on this).
// The weight is rebuilt, per block half h (inputs 0-15, 16-31), as  w = float(code) * scale[h] + minimum[h]:
//
//   kind  sources        fields                                                         bytes  scale / minimum
//   Q4H   Q4_0 Q4_1      d f16 | m f16 | 16 pairs of nibbles (the file's own fp16 scales)  320  d / m (Q4_0: m = -8 d)
//   Q4    (Q4_K's int8-activation form; float records of it are Q4K)
//                        d f32 | m f32 | 16 pairs of nibbles (lo = input 2i, hi = 2i+1)   384  d / m
//   Q8    Q8_0 Q5_0      d f32 | 32 x int8 code                                           576  d / 0
//   Q8M   Q5_1 Q5_K      d f32 | m f32 | 32 x uint8 code                                  640  d / m
//   Q8S   Q6_K Q3_K      d f32 | sc int8 [2] | 32 x int8 code                             608  d * sc[h] / 0
//   Q4S   Q2_K           d f32 | dmin f32 | sc u8 [2] | mq u8 [2] | 16 pairs of nibbles   448  d * sc[h] / -(dmin * mq[h])
//
// The K-quants' own kinds cover a whole super-block of 256 inputs per record (8 sub-blocks sb of 32), so the
// super-block's d is stored once, as the file does (4.75 and 6.6 bits per weight instead of 6 and 9.5):
//   Q4K   Q4_K           d f32 | dmin f32 | sc u8 [8] | mq u8 [8] | 8 x 16 pairs of nibbles    2432  d * sc[sb] / -(dmin * mq[sb])
//   Q6K   Q6_K           d f32 | sc int8 [16] | 8 x 16 pairs of low nibbles | 8 x 8 bytes of 4 high 2-bit parts
//                                                                                         3392  d * sc[2 sb + h] / 0
//   (a Q6K code is (low | high << 4) - 32; high byte i2 holds inputs 4 i2 .. 4 i2 + 3, two bits each)
//
// Each scale and minimum is computed by exactly the float32 operations gguf's own dequantisation uses, and every
// product code * scale is exact in float32 except for Q6_K, where it is the same single rounding gguf makes; so
// the rebuilt weights are bitwise gguf's float32 weights, whichever kernel or fused path rebuilds them.
#pragma once
#include <cstdint>

enum RecordKind : int {
  KIND_Q4 = 0, KIND_Q8 = 1, KIND_Q8M = 2, KIND_Q8S = 3, KIND_Q4S = 4, KIND_Q4K = 5, KIND_Q6K = 6, KIND_Q4H = 7
};

// an IEEE half's bits -> float, exactly (every half is a float)
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 1024));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 1023) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

constexpr int64_t record_bytes(int kind) {
  return kind == KIND_Q4 ? 384 : kind == KIND_Q8 ? 576 : kind == KIND_Q8M ? 640 : kind == KIND_Q8S ? 608
       : kind == KIND_Q4S ? 448 : kind == KIND_Q4K ? 2432 : kind == KIND_Q6K ? 3392 : 320;
}

// inputs one record covers: a block of 32, or a K-quant super-block of 256
constexpr int64_t kind_span(int kind) { return kind == KIND_Q4K || kind == KIND_Q6K ? 256 : 32; }

// the record kind of a packed tensor's last dimension (the sizes are distinct), or -1
constexpr int kind_of_record(int64_t bytes) {
  return bytes == 384 ? KIND_Q4 : bytes == 576 ? KIND_Q8 : bytes == 640 ? KIND_Q8M : bytes == 608 ? KIND_Q8S
       : bytes == 448 ? KIND_Q4S : bytes == 2432 ? KIND_Q4K : bytes == 3392 ? KIND_Q6K
       : bytes == 320 ? KIND_Q4H : -1;
}

constexpr bool kind_nibbles(int kind) {
  return kind == KIND_Q4 || kind == KIND_Q4S || kind == KIND_Q4K || kind == KIND_Q4H;
}
constexpr bool kind_unsigned(int kind) { return kind == KIND_Q8M; }  // byte codes 0..255 (the others: int8)
constexpr int64_t kind_codes_offset(int kind) {
  return kind == KIND_Q4 ? 128 : kind == KIND_Q8 ? 64 : kind == KIND_Q8M ? 128 : kind == KIND_Q8S ? 96
       : kind == KIND_Q4S ? 192 : kind == KIND_Q4K ? 384 : kind == KIND_Q6K ? 320 : 64;
}

// Row j's scale and minimum for block half h of sub-block sb of one record, as the kernels and gguf compute them.
inline void record_scale(int kind, const uint8_t* rec, int sb, int h, int j, float& s, float& m) {
  auto f32 = [&](int64_t off) {
    float v;
    __builtin_memcpy(&v, rec + off + 4 * j, 4);
    return v;
  };
  switch (kind) {
    case KIND_Q4: case KIND_Q8M: s = f32(0), m = f32(64); break;
    case KIND_Q4H: {
      uint16_t d, mh;
      __builtin_memcpy(&d, rec + 2 * j, 2);
      __builtin_memcpy(&mh, rec + 32 + 2 * j, 2);
      s = half_bits_to_float(d), m = half_bits_to_float(mh);
      break;
    }
    case KIND_Q8S: s = f32(0) * float(static_cast<int8_t>(rec[64 + 16 * h + j])), m = 0.f; break;
    case KIND_Q4S: s = f32(0) * float(rec[128 + 16 * h + j]), m = -(f32(64) * float(rec[160 + 16 * h + j])); break;
    case KIND_Q4K: s = f32(0) * float(rec[128 + 16 * sb + j]), m = -(f32(64) * float(rec[256 + 16 * sb + j])); break;
    case KIND_Q6K: s = f32(0) * float(static_cast<int8_t>(rec[64 + 16 * (2 * sb + h) + j])), m = 0.f; break;
    default: s = f32(0), m = 0.f;  // KIND_Q8
  }
}

// Code of row j, input t (0..31) of sub-block sb of one record.
inline int record_code(int kind, const uint8_t* rec, int sb, int j, int t) {
  if (kind == KIND_Q6K) {
    const int lo = (rec[320 + 256 * sb + (t / 2) * 16 + j] >> (4 * (t % 2))) & 15;
    const int hi = (rec[2368 + 128 * sb + (t / 4) * 16 + j] >> (2 * (t % 4))) & 3;
    return (lo | (hi << 4)) - 32;
  }
  const uint8_t* c = rec + kind_codes_offset(kind) + (kind == KIND_Q4K ? 256 * sb : 0);
  if (kind_nibbles(kind)) return (c[(t / 2) * 16 + j] >> (4 * (t % 2))) & 15;
  const uint8_t b = c[t * 16 + j];
  return kind_unsigned(kind) ? int(b) : int(static_cast<int8_t>(b));
}
