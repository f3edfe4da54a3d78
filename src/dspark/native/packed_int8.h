// The int8 arithmetic over weights repacked for many rows: 16 weight rows side by side, so that one 512-bit
// vpdpbusd (AVX2: two 256-bit vpmaddubsw halves) advances the dot products of 16 outputs at once and each lane ends a
// block holding one output's whole integer block sum. In the file's layout a lane holds part of one output's block
// and every (row, block pair) pays a conversion, a scale product and an accumulation for 64 products (plus the
// offset term and a reduction tree at the end); here they are paid once per 16 outputs and 32 products, ~3.5x fewer
// operations per activation row, which is what an 8-row verification is bound by.
//
// Packed layout (pack_int8), for a weight [N, K] with N a multiple of 16 and nb = K/32 blocks per row: group
// g = rows 16g .. 16g+15, then block b, one unit of 16 · (the block's bytes), so the tensor keeps the shape
// [N, K/32 · block bytes]:
//   quants  Q4: 4 chunks of 64 bytes, chunk k lane j = row j's quant bytes 4k .. 4k+3 (low nibbles: values 4k ..
//               4k+3, high nibbles: values 16+4k ..); Q8: 8 chunks, chunk k lane j = row j's values 4k .. 4k+3,
//               flipped to unsigned (w + 128)
//   d       16 fp16 scales (lane j: row j)
//   m       16 fp16 offsets (Q4_1 only)
// Operand k (Q4: chunk k & 3, low nibbles for k < 4, high ones after; Q8: chunk k) meets the activation bytes
// 4k .. 4k+3 of the same block, broadcast to every lane.
//
// Per output n and activation row x, block by block in order: acc = fma(float(Σ q_w·q_x) · d_x, d_w, acc), then
// acc = fma(c_w, t_x, acc) for the offset term (Q4_1: c = m, t = Σx; Q4_0: c = d, t = −8Σx; Q8 flipped:
// c = d, t = −128·d_x·Σq_x; the AVX2 path multiplies signed Q8 values, |w| · sign(x, w), and has no offset term).
// The integer sums are exact in any order, and the float operations of a row never meet another row's: a row's
// result is bit for bit the same whatever the number of rows in the call.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace {

constexpr int64_t kPackRows = 16;  // weight rows side by side
#if defined(DSPARK_VNNI512)
constexpr int kPackedTile = 8;  // activation rows per pass over a group's blocks (their accumulators in registers)
#else
constexpr int kPackedTile = 4;
#endif

template <int QT>
constexpr int64_t kQuantBytes = QT == Q8_0 ? 512 : 256;  // a unit's quants (16 rows of one block)
template <int QT>
constexpr int64_t kUnitBytes = kPackRows * kBlockBytes<QT>;

// rows n0 .. n0+15 of the file's blocks -> their packed units, block by block
template <int QT>
void pack_group(const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* out) {
  constexpr int64_t BB = kBlockBytes<QT>, OFF = kQsOffset<QT>, QB = kQuantBytes<QT>;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* u = out + b * kUnitBytes<QT>;
    for (int64_t j = 0; j < kPackRows; ++j) {
      const uint8_t* blk = rows + j * row_bytes + b * BB;
      for (int64_t k = 0; k < QB / 64; ++k)
        for (int64_t i = 0; i < 4; ++i) {
          const uint8_t q = blk[OFF + 4 * k + i];
          u[64 * k + 4 * j + i] = QT == Q8_0 ? static_cast<uint8_t>(q ^ 0x80) : q;
        }
      std::memcpy(u + QB + 2 * j, blk, 2);                                // d
      if constexpr (QT == Q4_1) std::memcpy(u + QB + 32 + 2 * j, blk + 2, 2);  // m
    }
  }
}

// Software prefetch of a unit's bytes kPrefetchBytes ahead: every cache line of it for tiles of kPrefetchAllRows rows
// or more (products bound by arithmetic; measured on AVX-512: 8-row products 17 % faster than with one line per
// unit), one line for fewer rows (bound by memory: the hardware prefetcher follows the stream, and more requests made
// 1-row products slower). The AVX2 path's arithmetic is heavier: every line from one row on.
#if defined(DSPARK_VNNI512)
constexpr int kPrefetchAllRows = 4;
#else
constexpr int kPrefetchAllRows = 1;
#endif

template <int MT, int QT>
inline void prefetch_unit(const uint8_t* u) {
  if constexpr (MT >= kPrefetchAllRows) {
    for (int64_t off = 0; off < kUnitBytes<QT>; off += 64) prefetch_ahead(u + off);
  } else {
    prefetch_ahead(u);
  }
}

// The activation rows quantized per block: int8 values (natural order), scale and offset factor per block.
struct PackedAct {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, nb]
  std::vector<float> t;   // [M, nb]
};

inline void quantize_packed(const float* x, int64_t M, int64_t K, int64_t qtype, PackedAct& a) {
  const int64_t nb = K / QK;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.t.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {  // rows are K long: block i of the flat array
    float fsum;
    int32_t isum;
    quantize_block(x + i * QK, a.q.data() + i * QK, a.d[i], isum, fsum);
    a.t[i] = qtype == Q4_1 ? fsum : qtype == Q4_0 ? -8.0f * fsum : -128.0f * a.d[i] * float(isum);
  }
}

struct PackedTile {  // MT activation rows of one call
  const int8_t* q;
  const float* d;
  const float* t;
  int64_t nb;
};

#if defined(DSPARK_VNNI512)
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// one group's 16 outputs for MT activation rows, into out[m] (lane j: output 16g + j)
template <int MT, int QT>
inline void packed_sums(const uint8_t* group, const PackedTile& a, __m512* out) {
  constexpr int64_t QB = kQuantBytes<QT>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* u = group + b * kUnitBytes<QT>;
    prefetch_unit<MT, QT>(u);
    __m512i w[8];
    for (int k = 0; k < QB / 64; ++k) {
      const __m512i v = _mm512_loadu_si512(u + 64 * k);
      if constexpr (QT == Q8_0) {
        w[k] = v;
      } else {
        w[k] = _mm512_and_si512(v, low4);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + QB)));
    const __m512 cw = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + QB + 32)))
                                 : dw;
    for (int m = 0; m < MT; ++m) {
      const int8_t* xq = a.q + (m * a.nb + b) * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(xq + 4));
      for (int k = 2; k < 8; k += 2) {  // two chains: integer sums, exact in any order
        s0 = _mm512_dpbusd_epi32(s0, w[k], bcast4(xq + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, w[k + 1], bcast4(xq + 4 * k + 4));
      }
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(a.d[m * a.nb + b]));
      acc[m] = _mm512_fmadd_ps(f, dw, acc[m]);
      acc[m] = _mm512_fmadd_ps(cw, _mm512_set1_ps(a.t[m * a.nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}

template <int MT, int QT>
void packed_group(const uint8_t* group, const PackedTile& a, const float* bias, float* y, int64_t N) {
  __m512 s[MT];
  packed_sums<MT, QT>(group, a, s);
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * N, bias != nullptr ? _mm512_add_ps(s[m], bv) : s[m]);
}

#elif defined(DSPARK_AVX2)
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One pass over a group's blocks for MT activation rows, both 8-output halves of every 64-byte chunk together: the
// weights stream from memory once while the products run (two passes, one per half, left the second pass's
// arithmetic unoverlapped with the first's memory reads: ~1.7x the time of one pass at one row). Per block the
// operands are unpacked once, then per row and half: Σ q_w·q_x in int16 pair sums (Q4: eight pair sums of
// ≤ 2·15·127 stay within int16; Q8: |w| · sign(x, w), each pair sum ≤ 2·128·127, summed in int32), then the block's
// float steps in the order of the module doc.
template <int MT, int QT>
void packed_group(const uint8_t* group, const PackedTile& a, const float* bias, float* y, int64_t N) {
  constexpr int64_t QB = kQuantBytes<QT>;
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* u = group + b * kUnitBytes<QT>;
    prefetch_unit<MT, QT>(u);
    __m256i w[8][2], wabs[8][2];
    for (int k = 0; k < QB / 64; ++k)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * k + 32 * h));
        if constexpr (QT == Q8_0) {
          w[k][h] = _mm256_xor_si256(v, flip);  // signed again
          wabs[k][h] = _mm256_sign_epi8(w[k][h], w[k][h]);
        } else {
          w[k][h] = _mm256_and_si256(v, low4);
          w[k + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
    __m256 dw[2], cw[2];
    for (int h = 0; h < 2; ++h) {
      dw[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + QB + 16 * h)));
      cw[h] = QT == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + QB + 32 + 16 * h)))
                         : dw[h];
    }
    for (int m = 0; m < MT; ++m) {
      const int8_t* xq = a.q + (m * a.nb + b) * QK;
      __m256i s[2];
      if constexpr (QT == Q8_0) {
        s[0] = s[1] = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) {
          const __m256i x = bcast4(xq + 4 * k);
          for (int h = 0; h < 2; ++h)
            s[h] = _mm256_add_epi32(
                s[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[k][h], _mm256_sign_epi8(x, w[k][h])), ones));
        }
      } else {
        const __m256i x0 = bcast4(xq);
        __m256i p0 = _mm256_maddubs_epi16(w[0][0], x0), p1 = _mm256_maddubs_epi16(w[0][1], x0);
        for (int k = 1; k < 8; ++k) {
          const __m256i x = bcast4(xq + 4 * k);
          p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[k][0], x));
          p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[k][1], x));
        }
        s[0] = _mm256_madd_epi16(p0, ones);
        s[1] = _mm256_madd_epi16(p1, ones);
      }
      const __m256 dx = _mm256_set1_ps(a.d[m * a.nb + b]);
      for (int h = 0; h < 2; ++h) {
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s[h]), dx);
        acc[m][h] = _mm256_fmadd_ps(f, dw[h], acc[m][h]);
        if constexpr (QT != Q8_0) acc[m][h] = _mm256_fmadd_ps(cw[h], _mm256_set1_ps(a.t[m * a.nb + b]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m256 r = bias != nullptr ? _mm256_add_ps(acc[m][h], _mm256_loadu_ps(bias + 8 * h)) : acc[m][h];
      _mm256_storeu_ps(y + m * N + 8 * h, r);
    }
}

#else
// the unit's quant of output j, value i, as the integer it multiplies (Q8: flipped, w + 128)
template <int QT>
inline int32_t packed_quant(const uint8_t* u, int64_t j, int64_t i) {
  if constexpr (QT == Q8_0) return u[64 * (i / 4) + 4 * j + i % 4];
  const uint8_t byte = u[64 * ((i % 16) / 4) + 4 * j + i % 4];
  return i < 16 ? (byte & 0x0F) : (byte >> 4);
}

template <int MT, int QT>
void packed_group(const uint8_t* group, const PackedTile& a, const float* bias, float* y, int64_t N) {
  constexpr int64_t QB = kQuantBytes<QT>;
  for (int m = 0; m < MT; ++m)
    for (int64_t j = 0; j < kPackRows; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* u = group + b * kUnitBytes<QT>;
        const int8_t* xq = a.q + (m * a.nb + b) * QK;
        int32_t s = 0;
        for (int64_t i = 0; i < QK; ++i) s += packed_quant<QT>(u, j, i) * xq[i];
        const float dw = h2f(u + QB + 2 * j), cw = QT == Q4_1 ? h2f(u + QB + 32 + 2 * j) : dw;
        acc = acc + float(s) * a.d[m * a.nb + b] * dw;
        acc = acc + cw * a.t[m * a.nb + b];
      }
      y[m * N + j] = bias != nullptr ? acc + bias[j] : acc;
    }
}
#endif

template <int QT>
void tile_packed(int mt, const uint8_t* group, const PackedTile& a, const float* bias, float* y, int64_t N) {
  switch (mt) {
    case 1: return packed_group<1, QT>(group, a, bias, y, N);
    case 2: return packed_group<2, QT>(group, a, bias, y, N);
    case 3: return packed_group<3, QT>(group, a, bias, y, N);
    case 4: return packed_group<4, QT>(group, a, bias, y, N);
#if defined(DSPARK_VNNI512)
    case 5: return packed_group<5, QT>(group, a, bias, y, N);
    case 6: return packed_group<6, QT>(group, a, bias, y, N);
    case 7: return packed_group<7, QT>(group, a, bias, y, N);
    case 8: return packed_group<8, QT>(group, a, bias, y, N);
#endif
    default: TORCH_CHECK(false, "dspark quant_linear: bad packed tile ", mt);
  }
}

// y [M, N] = x [M, K] · Wᵀ (+ bias) over packed blocks; each group's blocks stream once for all M rows (tiles of
// kPackedTile rows reuse them from cache)
template <int QT>
void run_packed(const uint8_t* packed, const float* bias, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  thread_local PackedAct act;  // the caller's thread quantizes; workers only read
  quantize_packed(x, M, K, QT, act);
  const int64_t nb = K / QK, tiles = (M + kPackedTile - 1) / kPackedTile, group_bytes = nb * kUnitBytes<QT>;
  const PackedAct& a = act;
  at::parallel_for(0, N / kPackRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n0 = grp * kPackRows;
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int64_t mt = (M - m0 + (tiles - t) - 1) / (tiles - t);  // balanced tiles
        const PackedTile tile{a.q.data() + m0 * K, a.d.data() + m0 * nb, a.t.data() + m0 * nb, nb};
        tile_packed<QT>(static_cast<int>(mt), packed + grp * group_bytes, tile, bias ? bias + n0 : nullptr,
                        y + m0 * N + n0, N);
        m0 += mt;
      }
    }
  });
}

}  // namespace
