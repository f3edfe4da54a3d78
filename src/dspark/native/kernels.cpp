// dspark's native CPU kernels, compiled for the running machine by dspark/native/__init__.py.
//
// quant_linear: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), W kept as the GGUF file stores it: each row K/32 blocks of
//   Q4_0  d f16 | 16 bytes        value = d·(q − 8)      q = low nibble of byte j (value j), high nibble (value j+16)
//   Q4_1  d f16 | m f16 | 16 bytes value = d·q + m
//   Q8_0  d f16 | 32 int8         value = d·q
// Two arithmetics:
//   exact (int8 = false): each block dequantized in registers with the reference's roundings (d·q then + m; the
//     build uses -ffp-contract=off, so no multiply-add is fused behind our back), then fp32 FMAs with the fp32
//     activations: F.linear over the dequantized weight, up to the order of the sums. The AVX2 path factors the
//     block scale out instead (d·Σ q·x + m·Σ x: the same function up to rounding, two operations fewer per 8
//     values; see its sums_exact).
//   int8 (int8 = true, llama.cpp's arithmetic): each activation row quantized per block of 32 to int8 (scale
//     max|x|/127, round to nearest even) and integer block dot products: Σ w·x ≈ d_w·d_x·Σ q_w·q_x + (offset term),
//     the offset term over exact fp32 block sums of x (Q4_1: m·Σx; Q4_0: −8·d·Σx).
// Code paths, chosen at compile time from the -march=native macros:
//   exact: AVX-512F (a Q4 block's 16 possible values in one register, looked up by nibble) / AVX2+FMA / scalar.
//   int8:  AVX-512 VNNI (two blocks per 512-bit vpdpbusd; Q8_0 weights flipped to unsigned, w + 128, and 128·Σq_x
//          subtracted per block) / AVX2 (vpmaddubsw + vpmaddwd; Q8_0 as |w| × sign(x, w)) / scalar.
// Rows: a weight block is unpacked once per tile of up to 8 (AVX2, scalar: 4) activation rows and applied to each;
//   every row's result is bit for bit its one-row result in both arithmetics (see the exact path's comment), so a
//   speculative verify of K+1 rows computes what K+1 decode steps would.
// Packed (qtype + kPacked, blocks from pack_int8): the int8 arithmetic over weights repacked 16 outputs side by side,
//   see packed_int8.h (what QuantLinear serves for int8 weights of 16k outputs).
// Threads: at::parallel_for over groups of output rows (torch's OpenMP pool: torch.set_num_threads applies).
//
// rms_norm / silu_mul: elementwise.cpp; paged_attention: attention.cpp; layouts and helpers: quant_blocks.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "packed_int8.h"
#include "quant_blocks.h"

namespace {


// ================================================================================================ exact path
//
// Each output row (n, m) is the sum of its block products accumulated in one fixed order whatever the batch:
// per lane vector (AVX-512: a0 over the low 16 values of each block, a1 over the high 16; AVX2: a0 over values
// 0-7 and 16-23, a1 over 8-15 and 24-31; scalar: block by block), then a0 + a1 summed across lanes by a fixed tree.
// The kernels only change how many rows share the work: a weight block is dequantized once per tile of up to
// kExactTile activation rows and applied to each (a tile's activations are read in chunks of blocks that fit
// kXTileBytes, so they stay in L1 while the weights stream; the accumulators carry over between chunks), and the
// lane sums of kGroup consecutive weight rows are reduced together by a transposed tree that adds the same pairs as
// the one-vector reduction. A row's result is therefore bit for bit the same at M = 1 and in any batch (tested),
// which keeps speculative verification lossless.

constexpr int64_t kXTileBytes = 24 * 1024;  // a tile's activations per chunk of blocks (L1)

// Balanced row tiles: the height of the tile that starts after `done` of M rows, with `left` tiles to go.
inline int64_t tile_rows(int64_t M, int64_t done, int64_t left) { return (M - done + left - 1) / left; }

#if defined(__AVX512F__)
constexpr const char* kExactPath = "avx512";
constexpr bool kFactored = false;  // blocks dequantized in registers (a 16-entry lookup)
constexpr int kExactTile = 8;
constexpr int kGroup = 16;  // weight rows reduced together (one output vector)
using Lanes = __m512;
inline Lanes lanes_zero() { return _mm512_setzero_ps(); }

template <int QT>
inline void deq_block(const uint8_t* blk, __m512& lo, __m512& hi) {
  uint32_t dm;  // d (and Q4_1's m) converted together
  std::memcpy(&dm, blk, 4);
  const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
  const __m512 vd = _mm512_broadcastss_ps(dm4);
  const uint8_t* q = blk + kQsOffset<QT>;
  if constexpr (QT == Q8_0) {
    const __m128i* p = reinterpret_cast<const __m128i*>(q);
    lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
    hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
  } else {
    // the block's 16 possible values in one register, looked up by nibble (vpermps reads the low 4 index bits)
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if constexpr (QT == Q4_0)
      table = _mm512_mul_ps(vd, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    else
      table = _mm512_add_ps(_mm512_mul_ps(vd, iota), _mm512_broadcastss_ps(_mm_movehdup_ps(dm4)));
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_permutexvar_ps(w, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table);
  }
}

// One weight row's blocks b0 .. b1-1 against MT activation rows. The lane accumulators start at zero (first) or
// from st (a previous chunk of blocks), and end as out[m · kGroup] = a0 + a1 (last; not yet reduced) or back in st:
// a row's blocks are always accumulated in order, however the blocks are chunked.
template <int MT, int QT>
inline void sums_exact(const uint8_t* row, int64_t b0, int64_t b1, const float* x, const float* /*sx*/, int64_t K,
                       __m512* st, bool first, bool last, __m512* out, float* /*cterm*/) {
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = first ? _mm512_setzero_ps() : st[2 * m];
    a1[m] = first ? _mm512_setzero_ps() : st[2 * m + 1];
  }
  for (int64_t b = b0; b < b1; ++b) {
    __m512 lo, hi;
    deq_block<QT>(row + kBlockBytes<QT> * b, lo, hi);
    prefetch_ahead(row + kBlockBytes<QT> * b);
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + QK * b;
      a0[m] = _mm512_fmadd_ps(lo, _mm512_load_ps(xb), a0[m]);
      a1[m] = _mm512_fmadd_ps(hi, _mm512_load_ps(xb + 16), a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    if (last) {
      out[m * kGroup] = _mm512_add_ps(a0[m], a1[m]);
    } else {
      st[2 * m] = a0[m];
      st[2 * m + 1] = a1[m];
    }
  }
}

// v[0..15] -> r with r[j] = the lane sum of v[j] by the tree (v[i] + v[i+8]), then (· + ·[i+4]), (· + ·[i+2]),
// (· + ·[i+1]): the pairs _mm512_reduce_add_ps adds, sixteen vectors at a time.
inline __m512 reduce_group(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // [v(2i) halves summed | v(2i+1) halves summed]
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: vector 4i + L, quarters summed
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: [v(8i+L) 2 partials, v(8i+4+L) 2 partials]
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
  // lane L: [r(L), r(L+4), r(L+8), r(L+12)] -> natural order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// the g (≤ kGroup) outputs of one activation row: reduced lane sums (+ a per-output term) (+ bias)
inline void store_group(const __m512* v, const float* term, const float* bias, int g, float* y) {
  const __mmask16 k = static_cast<__mmask16>((1u << g) - 1);
  __m512 r = reduce_group(v);
  if (term != nullptr) r = _mm512_add_ps(r, _mm512_loadu_ps(term));
  if (bias != nullptr) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(k, bias));
  _mm512_mask_storeu_ps(y, k, r);
}

#elif defined(DSPARK_AVX2)
constexpr const char* kExactPath = "avx2";
constexpr bool kFactored = true;  // each block's scale factored out of its sum (see sums_exact)
constexpr int kExactTile = 4;
constexpr int kGroup = 8;
using Lanes = __m256;
inline Lanes lanes_zero() { return _mm256_setzero_ps(); }

// The block's 32 quants as floats (Q4_0: q − 8, in integers), in value order 0-7, 8-15, 16-23, 24-31.
template <int QT>
inline void block_quants(const uint8_t* blk, __m256 f[4]) {
  const uint8_t* q = blk + kQsOffset<QT>;
  if constexpr (QT == Q8_0) {
    for (int i = 0; i < 4; ++i)
      f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m256i w0 = _mm256_cvtepu8_epi32(b), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low = _mm256_set1_epi32(15), off = _mm256_set1_epi32(QT == Q4_0 ? 8 : 0);
    f[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w0, low), off));
    f[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w1, low), off));
    f[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w0, 4), off));
    f[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w1, 4), off));
  }
}

// The block's 32 values as the reference dequantizes them (d·q, d·(q − 8), d·q + m; q − 8 is exact either way)
template <int QT>
inline void deq_block(const uint8_t* blk, __m256 v[4]) {
  block_quants<QT>(blk, v);
  const __m256 vd = _mm256_set1_ps(h2f(blk)), vm = _mm256_set1_ps(QT == Q4_1 ? h2f(blk + 2) : 0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_mul_ps(vd, v[i]);
    if constexpr (QT == Q4_1) v[i] = _mm256_add_ps(v[i], vm);
  }
}

// The AVX2 path factors each block's scale out: Σ_i x_i·(d·q_i + m) = d·(Σ_i x_i·q_i) + m·(Σ_i x_i), the first
// sum in lanes (one multiply, three multiply-adds, then one multiply-add into the row's accumulator), the second a
// scalar from the block sums of x (computed once per product: sx). Without AVX-512's 16-entry lookup, dequantizing
// costs two more operations per 8 values than the products themselves; the factored form is the same function up
// to rounding (each product d·q is exact in fp32; the roundings fall at other places, as a different order of the
// sums would put them). Still one fixed order per row: a row's result is the same at M = 1 and in any batch.
template <int MT, int QT>
inline void sums_exact(const uint8_t* row, int64_t b0, int64_t b1, const float* x, const float* sx, int64_t K,
                       __m256* st, bool first, bool last, __m256* out, float* cterm) {
  const int64_t nb = K / QK;
  __m256 acc[MT];
  float cs[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = first ? _mm256_setzero_ps() : st[2 * m];
    cs[m] = first ? 0.0f : _mm256_cvtss_f32(st[2 * m + 1]);
  }
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = row + kBlockBytes<QT> * b;
    __m256 f[4];
    block_quants<QT>(blk, f);
    prefetch_ahead(blk);
    const __m256 vd = _mm256_set1_ps(h2f(blk));
    const float mn = QT == Q4_1 ? h2f(blk + 2) : 0.0f;
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + QK * b;
      __m256 t = _mm256_mul_ps(f[0], _mm256_load_ps(xb));
      t = _mm256_fmadd_ps(f[1], _mm256_load_ps(xb + 8), t);
      t = _mm256_fmadd_ps(f[2], _mm256_load_ps(xb + 16), t);
      t = _mm256_fmadd_ps(f[3], _mm256_load_ps(xb + 24), t);
      acc[m] = _mm256_fmadd_ps(vd, t, acc[m]);
      if constexpr (QT == Q4_1) cs[m] = cs[m] + mn * sx[m * nb + b];
    }
  }
  for (int m = 0; m < MT; ++m) {
    if (last) {
      out[m * kGroup] = acc[m];
      cterm[m * kGroup] = cs[m];
    } else {
      st[2 * m] = acc[m];
      st[2 * m + 1] = _mm256_set1_ps(cs[m]);
    }
  }
}

// the block sums of x's rows (the factored form's offset term), one fixed order
inline void block_sums(const float* x, int64_t M, int64_t K, float* sx) {
  for (int64_t i = 0; i < M * (K / QK); ++i) {
    const float* xb = x + i * QK;  // rows are K long and K is a multiple of 32: block i of the flat array
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(xb), _mm256_load_ps(xb + 8)),
                                   _mm256_add_ps(_mm256_load_ps(xb + 16), _mm256_load_ps(xb + 24)));
    sx[i] = hsum256(s);
  }
}

// v[0..7] -> r with r[j] = hsum256(v[j]) (the pairs (i, i+4), then (i, i+2), then (0, 1)), eight at a time
inline __m256 reduce_group(const __m256* v) {
  __m256 s1[4], s2[2];
  for (int i = 0; i < 4; ++i)  // [v(2i) halves summed | v(2i+1) halves summed]
    s1[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // 128-bit lane L: [v(4i+L) 2 partials, v(4i+2+L) 2 partials]
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  // lane L: [r(L), r(L+2), r(L+4), r(L+6)] -> natural order
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline void store_group(const __m256* v, const float* term, const float* bias, int g, float* y) {
  alignas(32) float r[kGroup];
  _mm256_store_ps(r, reduce_group(v));
  for (int j = 0; j < g; ++j) {
    const float s = term != nullptr ? r[j] + term[j] : r[j];
    y[j] = bias != nullptr ? s + bias[j] : s;
  }
}

#else
constexpr const char* kExactPath = "scalar";
constexpr bool kFactored = false;
constexpr int kExactTile = 4;
constexpr int kGroup = 1;
using Lanes = float;
inline Lanes lanes_zero() { return 0.0f; }

template <int MT, int QT>
inline void sums_exact(const uint8_t* row, int64_t b0, int64_t b1, const float* x, const float* /*sx*/, int64_t K,
                       float* st, bool first, bool last, float* out, float* /*cterm*/) {
  float v[QK], acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = first ? 0.0f : st[m];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = row + kBlockBytes<QT> * b;
    const uint8_t* q = blk + kQsOffset<QT>;
    const float d = h2f(blk), mn = QT == Q4_1 ? h2f(blk + 2) : 0.0f;
    for (int i = 0; i < QK; ++i) {
      if constexpr (QT == Q8_0) {
        v[i] = d * float(static_cast<int8_t>(q[i]));
      } else {
        const float qi = float(i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4));
        v[i] = QT == Q4_0 ? d * (qi - 8.0f) : d * qi + mn;
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + QK * b;
      float s = 0.0f;
      for (int i = 0; i < QK; ++i) s += v[i] * xb[i];
      acc[m] += s;
    }
  }
  for (int m = 0; m < MT; ++m) (last ? out[m * kGroup] : st[m]) = acc[m];
}

inline void store_group(const float* v, const float* term, const float* bias, int /*g*/, float* y) {
  const float s = term != nullptr ? v[0] + term[0] : v[0];
  y[0] = bias != nullptr ? s + bias[0] : s;
}
#endif

// Blocks per chunk: MT activation rows of a chunk fit kXTileBytes, so they stay in L1 while the weights stream.
inline int64_t exact_chunk(int mt) { return std::max<int64_t>(1, kXTileBytes / (mt * QK * int64_t(sizeof(float)))); }

// Weight rows n0 .. n0+g-1 (g ≤ kGroup) against activation rows m0 .. m0+MT-1, block chunk by block chunk.
template <int MT, int QT>
void group_exact(const Weights& W, const float* x, const float* sx, int64_t K, int64_t m0, int64_t n0, int g, float* y,
                 int64_t N) {
  const int64_t nb = K / QK, chunk = exact_chunk(MT);
  Lanes sums[MT * kGroup];
  alignas(64) float cterm[MT * kGroup] = {};  // the factored form's per-output offset terms
  Lanes state[kGroup][2 * MT];  // the lane accumulators between chunks
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    for (int j = 0; j < g; ++j)
      sums_exact<MT, QT>(W.blocks + (n0 + j) * W.row_bytes, b0, b1, x + m0 * K, sx ? sx + m0 * nb : nullptr, K, state[j], b0 == 0,
                         b1 == nb, sums + j, cterm + j);
  }
  for (int j = g; j < kGroup; ++j)
    for (int m = 0; m < MT; ++m) sums[m * kGroup + j] = lanes_zero();
  const float* bias = W.bias != nullptr ? W.bias + n0 : nullptr;
  for (int m = 0; m < MT; ++m)
    store_group(sums + m * kGroup, kFactored ? cterm + m * kGroup : nullptr, bias, g, y + (m0 + m) * N + n0);
}

template <int QT>
void tile_exact(int mt, const Weights& W, const float* x, const float* sx, int64_t K, int64_t m0, int64_t n0, int g,
                float* y, int64_t N) {
  switch (mt) {
    case 1: return group_exact<1, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 2: return group_exact<2, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 3: return group_exact<3, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 4: return group_exact<4, QT>(W, x, sx, K, m0, n0, g, y, N);
#if defined(__AVX512F__)
    case 5: return group_exact<5, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 6: return group_exact<6, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 7: return group_exact<7, QT>(W, x, sx, K, m0, n0, g, y, N);
    case 8: return group_exact<8, QT>(W, x, sx, K, m0, n0, g, y, N);
#endif
    default: TORCH_CHECK(false, "dspark quant_linear: bad tile ", mt);
  }
}

template <int QT>
void run_exact(const Weights& W, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t tiles = (M + kExactTile - 1) / kExactTile, groups = (N + kGroup - 1) / kGroup;
  thread_local std::vector<float> sums;  // block sums of x (the factored form of Q4_1; the caller's thread)
  if constexpr (kFactored && QT == Q4_1) {
#if defined(DSPARK_AVX2) && !defined(__AVX512F__)
    sums.resize(M * (K / QK));
    block_sums(x, M, K, sums.data());
#endif
  }
  const float* sx = sums.empty() ? nullptr : sums.data();
  at::parallel_for(0, groups, std::max<int64_t>(1, 16 / kGroup), [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n0 = grp * kGroup;
      const int g = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {  // the group's weight rows stay in cache across the tiles
        const int64_t mt = tile_rows(M, m0, tiles - t);
        tile_exact<QT>(static_cast<int>(mt), W, x, sx, K, m0, n0, g, y, N);
        m0 += mt;
      }
    }
  });
}

// ================================================================================================ int8 path

// The quantized activation rows, laid out tile by tile in the order the row kernels read them. Units: block pairs
// on the pair path (Q4 pair bytes [b lo16 | b+1 lo16 | b hi16 | b+1 hi16], Q8 [b | b+1]), then single blocks (every
// block elsewhere, the last of an odd count on the pair path). Within a tile of mt rows starting at row m0, a
// unit's data for the tile's rows lie one after another (unit u of row i at (u·mt + i)), so a kernel reads each
// array as one stream at offsets fixed by the tile height.
struct Act {
  int64_t nb = 0, np = 0, ns = 0;  // blocks, pairs, single blocks per row
  std::vector<int8_t> q;           // nb·32 bytes per row
  std::vector<float> s;            // per row: 16 lane scales per pair (Q4 [b×4, b+1×4, b×4, b+1×4], Q8 [b×8, b+1×8]),
                                   // then one scale per single block
  std::vector<float> t;            // per row and block: the offset term's activation factor (Q4_1 Σx, Q4_0 −8Σx,
                                   // Q8 flip −128·d·Σq); pairs' two values adjacent
  int64_t s_row() const { return np * 16 + ns; }
};

// A tile's view: the arrays' starts for rows m0 .. m0+mt-1.
struct ActTile {
  const int8_t* q;
  const float* s;
  const float* t;
  int64_t np, ns;
  ActTile(const Act& a, int64_t m0) : q(a.q.data() + m0 * a.nb * QK), s(a.s.data() + m0 * a.s_row()),
                                      t(a.t.data() + m0 * a.nb), np(a.np), ns(a.ns) {}
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t qtype, int64_t tiles, Act& a) {
  const int64_t nb = K / QK, np = kPairs ? nb / 2 : 0, ns = nb - 2 * np;
  a.nb = nb, a.np = np, a.ns = ns;
  a.q.resize(M * K);
  a.s.resize(M * a.s_row());
  a.t.resize(M * nb);
  const bool q4 = qtype != Q8_0;
  int8_t tmp[QK];
  for (int64_t tile = 0, m0 = 0; tile < tiles; ++tile) {
    const int64_t mt = tile_rows(M, m0, tiles - tile);
    int8_t* q = a.q.data() + m0 * K;
    float* s = a.s.data() + m0 * a.s_row();
    float* t = a.t.data() + m0 * nb;
    for (int64_t i = 0; i < mt; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        float d, fsum;
        int32_t isum;
        quantize_block(x + (m0 + i) * K + b * QK, tmp, d, isum, fsum);
        const float tv = qtype == Q4_1 ? fsum : qtype == Q4_0 ? -8.0f * fsum : -128.0f * d * float(isum);
        if (b < 2 * np) {  // a pair: the two blocks' bytes interleaved (Q4: low nibbles' values first)
          const int64_t p = b / 2, u = p * mt + i, half = b & 1;
          int8_t* dst = q + u * 2 * QK;
          if (q4) {
            std::memcpy(dst + half * 16, tmp, 16);
            std::memcpy(dst + 32 + half * 16, tmp + 16, 16);
          } else {
            std::memcpy(dst + half * QK, tmp, QK);
          }
          for (int l = 0; l < 16; ++l)
            if ((q4 ? (l / 4) % 2 : l / 8) == half) s[u * 16 + l] = d;
          t[u * 2 + half] = tv;
        } else {
          const int64_t u = (b - 2 * np) * mt + i;
          std::memcpy(q + np * mt * 2 * QK + u * QK, tmp, QK);
          s[np * mt * 16 + u] = d;
          t[np * mt * 2 + u] = tv;
        }
      }
    }
    m0 += mt;
  }
}

// Each row kernel computes, for one weight row and MT activation rows, Σ_b d_w·d_x·Σ q_w·q_x plus the offset term:
// acc[m · kGroup] the lane sums (reduced like the exact path's), cterm[m · kGroup] a scalar added after.
template <int QT>
constexpr bool kOffset = QT != Q8_0 || kQ8Flip;

#if defined(DSPARK_VNNI512)
template <int MT, int QT>
inline void sums_int8(const uint8_t* row, const ActTile& a, __m512* acc_out, float* cterm) {
  constexpr int64_t BB = kBlockBytes<QT>, OFF = kQsOffset<QT>;
  constexpr bool Q8 = QT == Q8_0;
  __m512 acc[MT];
  __m128 accc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
    accc[m] = _mm_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i idx = Q8 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                         : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const int8_t* aq = a.q;
  const float *as = a.s, *at = a.t;
  for (int64_t p = 0; p < a.np; ++p, aq += MT * 64, as += MT * 16, at += MT * 2) {
    const uint8_t* b0 = row + 2 * p * BB;
    const uint8_t* b1 = b0 + BB;
    prefetch_ahead(b0);
    __m512i wq;
    if constexpr (Q8) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + OFF));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + OFF));
      wq = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1), flip);
    } else {
      const __m256i v = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + OFF))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + OFF)), 1);
      wq = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
    }
    uint16_t h0, h1;
    std::memcpy(&h0, b0, 2);
    std::memcpy(&h1, b1, 2);
    const __m128 d2 = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(h0), h1, 1));  // [d_b, d_b+1, 0, 0]
    __m128 c2 = d2;
    if constexpr (QT == Q4_1) {
      std::memcpy(&h0, b0 + 2, 2);
      std::memcpy(&h1, b1 + 2, 2);
      c2 = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(h0), h1, 1));  // [m_b, m_b+1, 0, 0]
    }
    const __m512 sw = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2));
    for (int m = 0; m < MT; ++m) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(aq + 64 * m));
      const __m512 sc = _mm512_mul_ps(sw, _mm512_loadu_ps(as + 16 * m));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[m]);
      if constexpr (kOffset<QT>) {
        const __m128 t2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(at + 2 * m)));
        accc[m] = _mm_fmadd_ps(c2, t2, accc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    acc_out[m * kGroup] = acc[m];
    cterm[m * kGroup] = _mm_cvtss_f32(accc[m]) + _mm_cvtss_f32(_mm_movehdup_ps(accc[m]));
  }
  for (int64_t sb = 0; sb < a.ns; ++sb) {  // single blocks (the last of an odd count), in natural order
    const uint8_t* blk = row + (2 * a.np + sb) * BB;
    __m256i wq;
    if constexpr (Q8) {
      wq = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + OFF)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + OFF));
      wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    }
    const float d = h2f(blk), c = QT == Q4_1 ? h2f(blk + 2) : d;
    const int8_t* sq = a.q + a.np * MT * 64 + sb * MT * QK;
    const float *ss = a.s + a.np * MT * 16 + sb * MT, *st = a.t + a.np * MT * 2 + sb * MT;
    for (int m = 0; m < MT; ++m) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sq + QK * m));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, av);
      cterm[m * kGroup] += hsum256(_mm256_cvtepi32_ps(dot)) * d * ss[m] + c * st[m];
    }
  }
}

#elif defined(DSPARK_AVX2)
template <int MT, int QT>
inline void sums_int8(const uint8_t* row, const ActTile& a, __m256* acc_out, float* cterm) {
  constexpr int64_t BB = kBlockBytes<QT>, OFF = kQsOffset<QT>;
  __m256 acc[MT];
  float cs[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
    cs[m] = 0.0f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* aq = a.q;
  const float *as = a.s, *at = a.t;
  for (int64_t b = 0; b < a.ns; ++b, aq += MT * QK, as += MT, at += MT) {
    const uint8_t* blk = row + b * BB;
    prefetch_ahead(blk);
    __m256i wq, wv;
    if constexpr (QT == Q8_0) {
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + OFF));
      wq = _mm256_sign_epi8(wv, wv);  // |w| as unsigned bytes
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + OFF));
      wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
    }
    const float d = h2f(blk), c = QT == Q4_1 ? h2f(blk + 2) : d;
    for (int m = 0; m < MT; ++m) {
      __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + QK * m));
      if constexpr (QT == Q8_0) av = _mm256_sign_epi8(av, wv);  // x·sign(w), so |w|·that = w·x
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, av), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * as[m]), acc[m]);
      if constexpr (kOffset<QT>) cs[m] += c * at[m];
    }
  }
  for (int m = 0; m < MT; ++m) {
    acc_out[m * kGroup] = acc[m];
    cterm[m * kGroup] = cs[m];
  }
}

#else
template <int MT, int QT>
inline void sums_int8(const uint8_t* row, const ActTile& a, float* acc_out, float* cterm) {
  constexpr int64_t BB = kBlockBytes<QT>, OFF = kQsOffset<QT>;
  float out[MT];
  for (int m = 0; m < MT; ++m) out[m] = 0.0f;
  for (int64_t b = 0; b < a.ns; ++b) {
    const uint8_t* blk = row + b * BB;
    const uint8_t* q = blk + OFF;
    const float d = h2f(blk), c = QT == Q4_1 ? h2f(blk + 2) : d;
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = a.q + (b * MT + m) * QK;
      int32_t s = 0;
      if constexpr (QT == Q8_0) {
        for (int i = 0; i < QK; ++i) s += int32_t(static_cast<int8_t>(q[i])) * x[i];
      } else {
        for (int i = 0; i < 16; ++i) s += int32_t(q[i] & 0x0F) * x[i] + int32_t(q[i] >> 4) * x[i + 16];
      }
      out[m] += float(s) * d * a.s[b * MT + m];
      if constexpr (kOffset<QT>) out[m] += c * a.t[b * MT + m];
    }
  }
  for (int m = 0; m < MT; ++m) {
    acc_out[m * kGroup] = out[m];
    cterm[m * kGroup] = 0.0f;
  }
}
#endif

// Weight rows n0 .. n0+g-1 (g ≤ kGroup) against the MT rows of one activation tile.
template <int MT, int QT>
void group_int8(const Weights& W, const ActTile& a, int64_t m0, int64_t n0, int g, float* y, int64_t N) {
  Lanes sums[MT * kGroup];
  alignas(64) float cterm[MT * kGroup];
  for (int j = 0; j < g; ++j) sums_int8<MT, QT>(W.blocks + (n0 + j) * W.row_bytes, a, sums + j, cterm + j);
  for (int j = g; j < kGroup; ++j)
    for (int m = 0; m < MT; ++m) {
      sums[m * kGroup + j] = lanes_zero();
      cterm[m * kGroup + j] = 0.0f;
    }
  const float* bias = W.bias != nullptr ? W.bias + n0 : nullptr;
  for (int m = 0; m < MT; ++m) store_group(sums + m * kGroup, cterm + m * kGroup, bias, g, y + (m0 + m) * N + n0);
}

template <int QT>
void tile_int8(int mt, const Weights& W, const ActTile& a, int64_t m0, int64_t n0, int g, float* y, int64_t N) {
  switch (mt) {
    case 1: return group_int8<1, QT>(W, a, m0, n0, g, y, N);
    case 2: return group_int8<2, QT>(W, a, m0, n0, g, y, N);
    case 3: return group_int8<3, QT>(W, a, m0, n0, g, y, N);
    case 4: return group_int8<4, QT>(W, a, m0, n0, g, y, N);
#if defined(DSPARK_VNNI512)
    case 5: return group_int8<5, QT>(W, a, m0, n0, g, y, N);
    case 6: return group_int8<6, QT>(W, a, m0, n0, g, y, N);
    case 7: return group_int8<7, QT>(W, a, m0, n0, g, y, N);
    case 8: return group_int8<8, QT>(W, a, m0, n0, g, y, N);
#endif
    default: TORCH_CHECK(false, "dspark quant_linear: bad tile ", mt);
  }
}

template <int QT>
void run_int8(const Weights& W, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  thread_local Act act;  // reused between calls (the caller's thread quantizes; workers only read)
  const int64_t tiles = (M + kInt8Tile - 1) / kInt8Tile, groups = (N + kGroup - 1) / kGroup;
  quantize_rows(x, M, K, QT, tiles, act);
  const Act& a = act;
  at::parallel_for(0, groups, std::max<int64_t>(1, 16 / kGroup), [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n0 = grp * kGroup;
      const int g = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int64_t mt = tile_rows(M, m0, tiles - t);
        tile_int8<QT>(static_cast<int>(mt), W, ActTile(a, m0), m0, n0, g, y, N);
        m0 += mt;
      }
    }
  });
}

// ================================================================================================ entry points

int64_t block_bytes(int64_t qtype) {
  return qtype == Q4_0 ? kBlockBytes<Q4_0> : qtype == Q4_1 ? kBlockBytes<Q4_1> : kBlockBytes<Q8_0>;
}

constexpr int64_t kPacked = 16;  // added to a qtype: the blocks are pack_int8's layout (int8 arithmetic only)

// blocks uint8 [N, K/32 · block bytes], the file's layout -> the same shape in the packed layout (packed_int8.h)
at::Tensor pack_int8(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dspark pack_int8: unknown qtype ", qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % block_bytes(qtype) == 0 && blocks.size(0) % kPackRows == 0,
              "dspark pack_int8: blocks must be contiguous uint8 [N, K/32 · block bytes] with N a multiple of 16, got ",
              blocks.sizes());
  at::Tensor out = at::empty(blocks.sizes(), blocks.options());
  const int64_t row_bytes = blocks.size(1), nb = row_bytes / block_bytes(qtype);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n0 = 0; n0 < blocks.size(0); n0 += kPackRows) {
    const uint8_t* rows = src + n0 * row_bytes;
    if (qtype == Q4_0) pack_group<Q4_0>(rows, row_bytes, nb, dst + n0 * row_bytes);
    if (qtype == Q4_1) pack_group<Q4_1>(rows, row_bytes, nb, dst + n0 * row_bytes);
    if (qtype == Q8_0) pack_group<Q8_0>(rows, row_bytes, nb, dst + n0 * row_bytes);
  }
  return out;
}

// x [M, K] fp32 (bf16/fp16 converted); blocks uint8 [N, K/32 · block bytes]; bias fp32 [N] or none -> y fp32 [M, N].
// qtype + kPacked: blocks in pack_int8's layout, the int8 arithmetic over 16 outputs at a time.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                        int64_t qtype_in, bool int8) {
  const bool packed = qtype_in >= kPacked;
  const int64_t qtype = packed ? qtype_in - kPacked : qtype_in;
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dspark quant_linear: unknown qtype ", qtype_in);
  TORCH_CHECK(!packed || (int8 && blocks.size(0) % kPackRows == 0),
              "dspark quant_linear: packed blocks take the int8 arithmetic and a multiple of 16 rows");
  TORCH_CHECK(x_in.dim() == 2, "dspark quant_linear: x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu() && blocks.device().is_cpu(), "dspark quant_linear: CPU tensors only");
  at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  if (!int8 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 64 != 0) x = x.clone();  // aligned rows for the loads
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % QK == 0, "dspark quant_linear: K = ", K, " is not a multiple of 32");
  const int64_t row_bytes = K / QK * block_bytes(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == row_bytes &&
                  blocks.is_contiguous(),
              "dspark quant_linear: blocks must be contiguous uint8 [N, ", row_bytes, "], got ", blocks.sizes());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "dspark quant_linear: bias must be contiguous fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Weights W{blocks.data_ptr<uint8_t>(), bp, row_bytes};
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (packed) {
    if (qtype == Q4_0) run_packed<Q4_0>(W.blocks, bp, xp, M, K, N, yp);
    if (qtype == Q4_1) run_packed<Q4_1>(W.blocks, bp, xp, M, K, N, yp);
    if (qtype == Q8_0) run_packed<Q8_0>(W.blocks, bp, xp, M, K, N, yp);
  } else if (int8) {
    if (qtype == Q4_0) run_int8<Q4_0>(W, xp, M, K, N, yp);
    if (qtype == Q4_1) run_int8<Q4_1>(W, xp, M, K, N, yp);
    if (qtype == Q8_0) run_int8<Q8_0>(W, xp, M, K, N, yp);
  } else {
    if (qtype == Q4_0) run_exact<Q4_0>(W, xp, M, K, N, yp);
    if (qtype == Q4_1) run_exact<Q4_1>(W, xp, M, K, N, yp);
    if (qtype == Q8_0) run_exact<Q8_0>(W, xp, M, K, N, yp);
  }
  return y;
}

// blocks uint8 [N, K/32 · block bytes] -> fp32 [N, K], the reference's values (for products of many rows, where a
// dense GEMM over the dequantized weight beats the block kernels)
template <int QT>
void dequantize_rows(const uint8_t* blocks, int64_t row_bytes, int64_t nb, float* out, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    float* o = out + n * nb * QK;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + kBlockBytes<QT> * b;
#if defined(__AVX512F__)
      __m512 lo, hi;
      deq_block<QT>(blk, lo, hi);
      _mm512_storeu_ps(o + QK * b, lo);
      _mm512_storeu_ps(o + QK * b + 16, hi);
#elif defined(DSPARK_AVX2)
      __m256 v[4];
      deq_block<QT>(blk, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + QK * b + 8 * i, v[i]);
#else
      const uint8_t* q = blk + kQsOffset<QT>;
      const float d = h2f(blk), mn = QT == Q4_1 ? h2f(blk + 2) : 0.0f;
      for (int i = 0; i < QK; ++i) {
        if constexpr (QT == Q8_0) {
          o[QK * b + i] = d * float(static_cast<int8_t>(q[i]));
        } else {
          const float qi = float(i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4));
          o[QK * b + i] = QT == Q4_0 ? d * (qi - 8.0f) : d * qi + mn;
        }
      }
#endif
    }
  }
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "dspark dequantize: unknown qtype ", qtype);
  TORCH_CHECK(K % QK == 0, "dspark dequantize: K = ", K, " is not a multiple of 32");
  const int64_t N = blocks.size(0), nb = K / QK, row_bytes = nb * block_bytes(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == row_bytes &&
                  blocks.is_contiguous() && blocks.device().is_cpu(),
              "dspark dequantize: blocks must be contiguous CPU uint8 [N, ", row_bytes, "], got ", blocks.sizes());
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (qtype == Q4_0) dequantize_rows<Q4_0>(bp, row_bytes, nb, op, n0, n1);
    if (qtype == Q4_1) dequantize_rows<Q4_1>(bp, row_bytes, nb, op, n0, n1);
    if (qtype == Q8_0) dequantize_rows<Q8_0>(bp, row_bytes, nb, op, n0, n1);
  });
  return out;
}

std::string build_info() {
  return std::string("exact=") + kExactPath + " int8=" + kInt8Path + (kQ8Flip ? "+q8flip" : "");
}

}  // namespace

TORCH_LIBRARY(dspark_native, lib) {
  lib.def("quant_linear(Tensor x, Tensor blocks, Tensor? bias, int qtype, bool int8=False) -> Tensor", &quant_linear);
  lib.def("dequantize(Tensor blocks, int qtype, int K) -> Tensor", &dequantize);
  lib.def("pack_int8(Tensor blocks, int qtype) -> Tensor", &pack_int8);
  lib.def("build_info() -> str", &build_info);
}
