// Shared by the native layers of the dense (MLA, KDA, MoE) targets: weight rows stored fp32, bf16 or fp16 against
// fp32 activation rows, and the storage roundings torch applies between ops.
//
// dense_rows(W, x, M, y): y[m, n] = Σ_k x[m, k]·W[n, k] in fp32 (every product exact: a bf16/fp16 weight widens
// exactly), accumulated per output in one fixed order (lane vectors over k, then a fixed reduction tree), so a row's
// result does not depend on how many rows share the call: a decode step and a verification agree bit for bit.
// Against torch's GEMM the sums differ only in their order. round_as(v, dtype) rounds v to the dtype a torch tensor
// would hold it in (nearest even, as torch's conversions) and widens it back: the native layers round where the
// module path's intermediate tensors are bf16/fp16, so the two paths agree within the order of the sums.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "quant_blocks.h"

namespace {

enum class WType : int { F32 = 0, BF16 = 1, F16 = 2 };

struct DenseW {
  const void* p = nullptr;  // [N, K] row-major, contiguous
  WType t = WType::F32;
  int64_t N = 0, K = 0;
  const uint32_t* pk = nullptr;  // bf16 weights with pair products: the same rows packed (pairs_of)
  const void* pf = nullptr;      // AVX2 builds: the same rows as blocks of 8 outputs (f32_blocks_of)
  bool pf_half = false;          // ... holding bf16 bits (the weight's values are all bf16 values)
};

inline WType wtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return WType::F32;
    case at::kBFloat16: return WType::BF16;
    case at::kHalf: return WType::F16;
    default: TORCH_CHECK(false, what, ": weights must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline float bf16_to_f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even; NaN stays NaN (torch's c10::BFloat16 conversion)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f(uint16_t h) {
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return h2f(b);
}

inline uint16_t f_to_f16(float f) {  // round to nearest even
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to infinity
  if (ax < 0x38800000u) {                                              // subnormal half (or zero)
    const float v = std::fabs(f) * 16777216.0f;                       // in units of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v)));
  }
  const uint32_t r = ax + 0xC8000FFFu + ((ax >> 13) & 1u);  // rebias (−112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (r >> 13));
#endif
}

// v as the dtype would store it, widened back to fp32 (F32: v itself)
inline float round_as(float v, WType t) {
  if (t == WType::BF16) return bf16_to_f(f_to_bf16(v));
  if (t == WType::F16) return f16_to_f(f_to_f16(v));
  return v;
}

#if defined(__AVX512F__)
// round_as, 16 lanes (bf16: the same integer rounding, NaN → the quiet NaN; fp16: the conversion's nearest even)
inline __m512 round16(__m512 f, WType t) {
  if (t == WType::F32) return f;
  if (t == WType::F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m512i u = _mm512_castps_si512(f);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __mmask16 isnan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  const __m512i kept = _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(kept, isnan, _mm512_set1_epi32(0x7FC00000)));
}
#endif

inline void round_all(float* v, int64_t n, WType t) {
  if (t == WType::F32) return;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (t == WType::BF16)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, round16(_mm512_loadu_ps(v + i), t));
#endif
  for (; i < n; ++i) v[i] = round_as(v[i], t);
}

// element k of a weight row, widened exactly to fp32
template <WType T>
inline float widen(const void* row, int64_t k) {
  if constexpr (T == WType::F32) return static_cast<const float*>(row)[k];
  const uint16_t h = static_cast<const uint16_t*>(row)[k];
  return T == WType::BF16 ? bf16_to_f(h) : f16_to_f(h);
}

// pack(w), made once per weight and packing: the entry holds the weight, so no other tensor can take its address
// while the copy is kept; an in-place write bumps the weight's version and the copy is made again. Entries whose
// weight only the cache still holds (its model is gone) are dropped whenever a new one is made.
inline const at::Tensor& packed_copy(const at::Tensor& w, at::Tensor (*pack)(const at::Tensor&)) {
  struct Entry {
    at::Tensor src;
    int64_t version;
    at::Tensor packed;
  };
  static std::mutex mu;
  static std::unordered_map<const void*, std::unordered_map<const void*, Entry>> by_pack;  // packing → weight address
  const int64_t version = w.is_inference() ? -1 : static_cast<int64_t>(w._version());
  std::lock_guard<std::mutex> lock(mu);
  auto& entries = by_pack[reinterpret_cast<const void*>(pack)];
  auto it = entries.find(w.data_ptr());
  if (it != entries.end() && it->second.version == version && it->second.src.sizes() == w.sizes())
    return it->second.packed;
  for (auto e = entries.begin(); e != entries.end();)
    e = e->second.src.use_count() == 1 ? entries.erase(e) : std::next(e);
  Entry& entry = entries[w.data_ptr()] = Entry{w, version, pack(w)};
  return entry.packed;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DSPARK_DENSE512 1  // 16-lane row products (the masked 16-bit loads need AVX-512 BW and VL)

// elements at .. at+15 of a weight row (lanes outside mask m: 0), widened exactly to fp32
template <WType T>
inline __m512 load16(const void* row, int64_t at, __mmask16 m) {
  if constexpr (T == WType::F32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + at);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + at);
    if constexpr (T == WType::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}
#endif

// Σ_k x[k]·w[k] over one weight row, in a fixed order
template <WType T>
inline float dot_row(const void* wrow, const float* x, int64_t K) {
#if defined(DSPARK_DENSE512)
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(load16<T>(wrow, k, 0xFFFF), _mm512_loadu_ps(x + k), acc);
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    acc = _mm512_fmadd_ps(load16<T>(wrow, k, m), _mm512_maskz_loadu_ps(m, x + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(DSPARK_AVX2)
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 w;
    if constexpr (T == WType::F32) {
      w = _mm256_loadu_ps(static_cast<const float*>(wrow) + k);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(wrow) + k));
      if constexpr (T == WType::BF16)
        w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      else
        w = _mm256_cvtph_ps(h);
    }
    acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + k), acc);
  }
  float s = hsum256(acc);
  for (; k < K; ++k) s += widen<T>(wrow, k) * x[k];
  return s;
#else
  float s = 0.0f;
  for (int64_t k = 0; k < K; ++k) s += widen<T>(wrow, k) * x[k];
  return s;
#endif
}

template <WType T>
void rows_of(const DenseW& W, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t esize = T == WType::F32 ? 4 : 2;
  for (int64_t n = n0; n < n1; ++n) {
    const void* wrow = static_cast<const uint8_t*>(W.p) + n * W.K * esize;
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot_row<T>(wrow, x + m * ldx, W.K);
  }
}

#if defined(DSPARK_DENSE512)
// The same sums as rows_of (each output: dot_row's 16-lane FMA chain over k, masked tail, then the lane reduction),
// tiled for speed, bit for bit: a block of 4 weight rows is widened to fp32 once (the tail zero-padded, as the masked
// load reads it), then 4 x rows × 4 weight rows run as 16 independent chains. Fewer than 4 x rows (a decode step):
// 4 weight rows against one x row, widened in registers.
template <WType T>
void tiled_rows(const DenseW& W, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                int64_t n1) {
  const int64_t K = W.K, Kp = (K + 15) / 16 * 16, esize = T == WType::F32 ? 4 : 2, tail = K % 16;
  const __mmask16 tm = static_cast<__mmask16>((1u << tail) - 1);
  const auto* base = static_cast<const uint8_t*>(W.p);
  std::vector<float> buf(M >= 4 ? 4 * Kp : 0);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const void* w[4];
    for (int i = 0; i < 4; ++i) w[i] = base + (n + i) * K * esize;
    int64_t m = 0;
    if (M >= 4) {
      for (int i = 0; i < 4; ++i)
        for (int64_t k = 0; k < Kp; k += 16)
          _mm512_storeu_ps(buf.data() + i * Kp + k, load16<T>(w[i], k, k + 16 <= K ? 0xFFFF : tm));
      const float* b = buf.data();
      for (; m + 4 <= M; m += 4) {
        __m512 acc[4][4];
        for (auto& r : acc)
          for (auto& a : r) a = _mm512_setzero_ps();
        for (int64_t k = 0; k < Kp; k += 16) {
          const __mmask16 mk = k + 16 <= K ? 0xFFFF : tm;
          __m512 xv[4], wv[4];
          for (int j = 0; j < 4; ++j) xv[j] = _mm512_maskz_loadu_ps(mk, x + (m + j) * ldx + k);
          for (int i = 0; i < 4; ++i) wv[i] = _mm512_loadu_ps(b + i * Kp + k);
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_fmadd_ps(wv[i], xv[j], acc[j][i]);
        }
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) y[(m + j) * ldy + n + i] = _mm512_reduce_add_ps(acc[j][i]);
      }
    }
    for (; m < M; ++m) {
      const float* xm = x + m * ldx;
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 mk = k + 16 <= K ? 0xFFFF : tm;
        const __m512 xv = _mm512_maskz_loadu_ps(mk, xm + k);
        for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(load16<T>(w[i], k, mk), xv, a[i]);
      }
      for (int i = 0; i < 4; ++i) y[m * ldy + n + i] = _mm512_reduce_add_ps(a[i]);
    }
  }
  rows_of<T>(W, x, M, ldx, y, ldy, n, n1);
}
#endif

#if defined(DSPARK_DENSE512) && defined(__AVX512BF16__)
#define DSPARK_BF16_PAIRS 1
// bf16 weights on CPUs with AVX-512 BF16: a row of x whose values are all bf16 (what a bf16 module path multiplies)
// goes through bf16 pair products (vdpbf16ps: two bf16 products added in fp32, then added to an fp32 lane), half
// the instructions of widened fp32 FMAs, on a packed copy of the weight (pair_rows below). A row with other values
// keeps the fp32 path. Either way the path is chosen by the row alone, so a row's result never depends on the other
// rows of the call. dots_bf16 (attention scores over rows read in place) sums each output as 16 lane chains over k
// in 32-element steps, then reduce4's tree, whatever the tile.

// bf16 bits of fp32 values, rounded to nearest even (exact for values that are already bf16)
inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = f_to_bf16(x[i]);
}

// the four lane sums of a, b, c, d in one fixed tree (lane i + lane i+8, then i+4, then i+2, then i+1)
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const __m512 t = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                        0, 0, 0), u));
}

// out[4·j + k] = score of query row j (bf16, stride ldq) against key k, for N query rows and 4 keys
template <int N>
inline void dots_bf16(const uint16_t* const* keys, int64_t K, const uint16_t* q, int64_t ldq, float* out) {
  __m512 acc[N][4];
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_ps();
  int64_t w = 0;
  for (; w + 32 <= K; w += 32) {  // whole 32-element steps: plain loads
    __m512bh kv[4];
    for (int k = 0; k < 4; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(keys[k] + w);
    for (int j = 0; j < N; ++j) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(q + j * ldq + w);
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_dpbf16_ps(acc[j][k], kv[k], x);
    }
  }
  if (w < K) {  // the tail, zeros past K (the same step as a masked one)
    const __mmask32 m = static_cast<__mmask32>((1u << (K - w)) - 1);
    __m512bh kv[4];
    for (int k = 0; k < 4; ++k) kv[k] = (__m512bh)_mm512_maskz_loadu_epi16(m, keys[k] + w);
    for (int j = 0; j < N; ++j) {
      const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, q + j * ldq + w);
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_dpbf16_ps(acc[j][k], kv[k], x);
    }
  }
  for (int j = 0; j < N; ++j) _mm_storeu_ps(out + 4 * j, reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// Dense products of bf16 weights run on a packed copy of the weight: for each block of 16 output rows and each pair
// of inputs (2t, 2t+1), one vector whose lane i holds (W[16b+i, 2t], W[16b+i, 2t+1]) (zeros past N and K). The 16
// outputs of a block are then one vector chain over the pairs in order (x's pair broadcast, times the block's
// vector): no lane reduction, and a tile of up to 8 x rows reads each weight vector once. Each output is that one
// chain whatever the number of rows, the tile or the thread split.
inline int64_t pair_blocks(int64_t N) { return (N + 15) / 16; }
inline int64_t pair_steps(int64_t K) { return (K + 1) / 2; }

// the packed copy of a contiguous bf16 [.., N, K] tensor: every [N, K] matrix, one after the other
inline at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t N = w.size(-2), K = w.size(-1), mats = N * K == 0 ? 0 : w.numel() / (N * K);
  const int64_t NB = pair_blocks(N), K2 = pair_steps(K);
  at::Tensor out = at::zeros({std::max<int64_t>(1, mats * NB * K2 * 16)}, w.options().dtype(at::kInt));
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const auto* src = static_cast<const uint16_t*>(w.data_ptr());
  for (int64_t mat = 0; mat < mats; ++mat)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        o[((mat * NB + n / 16) * K2 + k / 2) * 16 + n % 16] |= uint32_t(src[(mat * N + n) * K + k]) << (16 * (k % 2));
  return out;
}

// pack_pairs(w), made once per weight (packed_copy)
inline const uint32_t* pairs_of(const at::Tensor& w) {
  return reinterpret_cast<const uint32_t*>(packed_copy(w, &pack_pairs).data_ptr<int32_t>());
}

// y[j·ldy + 16·b + i] for MT x rows (bf16 pairs xp [MT, K2]) and NB blocks of 16 outputs (cols valid columns from
// the first block's start)
template <int MT, int NB>
inline void pair_tile(const uint32_t* pk, int64_t K2, const uint32_t* xp, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[MT][NB];
  for (int j = 0; j < MT; ++j)
    for (int b = 0; b < NB; ++b) acc[j][b] = _mm512_setzero_ps();
  for (int64_t t = 0; t < K2; ++t) {
    __m512bh w[NB];
    for (int b = 0; b < NB; ++b) w[b] = (__m512bh)_mm512_loadu_si512(pk + (b * K2 + t) * 16);
    for (int j = 0; j < MT; ++j) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[j * K2 + t]));
      for (int b = 0; b < NB; ++b) acc[j][b] = _mm512_dpbf16_ps(acc[j][b], w[b], x);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t left = std::min<int64_t>(16, cols - 16 * b);
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int j = 0; j < MT; ++j) _mm512_mask_storeu_ps(y + j * ldy + 16 * b, m, acc[j][b]);
  }
}

// tiles of MT <= 8 rows × NB blocks; few rows take more blocks a tile, so that enough chains are in flight
template <int MT>
inline void pair_blocks_of(const uint32_t* pk, int64_t K2, const uint32_t* xm, float* ym, int64_t ldy, int64_t N,
                           int64_t b, int64_t b1) {
  constexpr int NB = MT <= 2 ? 8 : MT <= 4 ? 4 : 2;
  for (; b + NB <= b1; b += NB) pair_tile<MT, NB>(pk + b * K2 * 16, K2, xm, ym + 16 * b, ldy, N - 16 * b);
  for (; b < b1; ++b) pair_tile<MT, 1>(pk + b * K2 * 16, K2, xm, ym + 16 * b, ldy, N - 16 * b);
}

// y[m, n] for the output blocks b0 <= b < b1 from bf16 pair rows xp [M, K2], 8 rows at a time
inline void pair_rows(const DenseW& W, const uint32_t* xp, int64_t M, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  const int64_t K2 = pair_steps(W.K);
  for (int64_t m = 0; m < M; m += 8) {
    const uint32_t* xm = xp + m * K2;
    float* ym = y + m * ldy;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: pair_blocks_of<1>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 2: pair_blocks_of<2>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 3: pair_blocks_of<3>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 4: pair_blocks_of<4>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 5: pair_blocks_of<5>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 6: pair_blocks_of<6>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      case 7: pair_blocks_of<7>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
      default: pair_blocks_of<8>(W.pk, K2, xm, ym, ldy, W.N, b0, b1); break;
    }
  }
}

inline bool bf16_valued(const float* x, int64_t K) {
  int64_t k = 0;
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  for (; k + 16 <= K; k += 16)
    if (_mm512_test_epi32_mask(_mm512_loadu_si512(x + k), low)) return false;
  for (; k < K; ++k) {
    uint32_t u;
    std::memcpy(&u, x + k, 4);
    if (u & 0xFFFFu) return false;
  }
  return true;
}
#endif

#if !defined(DSPARK_DENSE512) && defined(DSPARK_AVX2)
#define DSPARK_F32_BLOCKS 1
// Dense products on AVX2 CPUs run on a packed copy of the weight: for each block of 8 output rows and each input k,
// one vector whose lane i holds W[8b+i, k] (zeros past N), as bf16 bits where every value of the weight is a bf16
// value (a bf16 checkpoint served in fp32: half the bytes, widened exactly in registers), else as fp32. The 8 outputs
// of a block are then one FMA chain over k in order (x[k] broadcast), with no lane reduction, and a tile of up to 8
// x rows reads each weight vector once. Each output is that one chain whatever the number of rows, the tile or the
// thread split.
inline int64_t f32_blocks(int64_t N) { return (N + 7) / 8; }

// the packed copy of a contiguous [.., N, K] tensor (every [N, K] matrix, one after the other): bf16 bits (int16) if
// every value is a bf16 value, else fp32
inline at::Tensor pack_f32_blocks(const at::Tensor& w) {
  const int64_t N = w.size(-2), K = w.size(-1), mats = N * K == 0 ? 0 : w.numel() / (N * K), NB = f32_blocks(N);
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  const float* src = wf.data_ptr<float>();
  bool halves = true;
  for (int64_t i = 0; i < wf.numel() && halves; ++i) halves = bf16_to_f(f_to_bf16(src[i])) == src[i] || std::isnan(src[i]);
  halves = halves && w.numel() > 0;
  const int64_t total = std::max<int64_t>(1, mats * NB * K * 8);
  at::Tensor out = at::zeros({total}, w.options().dtype(halves ? at::kShort : at::kFloat));
  for (int64_t mat = 0; mat < mats; ++mat)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t at = ((mat * NB + n / 8) * K + k) * 8 + n % 8;
        const float v = src[(mat * N + n) * K + k];
        if (halves)
          reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>())[at] = f_to_bf16(v);
        else
          out.data_ptr<float>()[at] = v;
      }
  return out;
}

// the packed blocks of w and whether they hold bf16 bits
inline std::pair<const void*, bool> f32_blocks_of(const at::Tensor& w) {
  const at::Tensor& p = packed_copy(w, &pack_f32_blocks);
  return {p.data_ptr(), p.scalar_type() == at::kShort};
}

template <bool HALF>
inline __m256 block8(const void* pk, int64_t at) {
  if constexpr (HALF) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(pk) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(pk) + at);
  }
}

// y[j·ldy + 8·b + i] for MT x rows (stride ldx) and NB blocks of 8 outputs (cols valid columns from the first
// block's start); pk points at the first block
template <bool HALF, int MT, int NB>
inline void f32_tile(const void* pk, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[MT][NB];
  _Pragma("GCC unroll 8") for (int j = 0; j < MT; ++j)
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) acc[j][b] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[NB];
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) w[b] = block8<HALF>(pk, (b * K + k) * 8);
    _Pragma("GCC unroll 8") for (int j = 0; j < MT; ++j) {
      const __m256 xv = _mm256_broadcast_ss(x + j * ldx + k);
      _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) acc[j][b] = _mm256_fmadd_ps(w[b], xv, acc[j][b]);
    }
  }
  _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
    const int left = static_cast<int>(std::min<int64_t>(8, cols - 8 * b));
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _Pragma("GCC unroll 8") for (int j = 0; j < MT; ++j) _mm256_maskstore_ps(y + j * ldy + 8 * b, m, acc[j][b]);
  }
}

// tiles of MT <= 8 rows × NB blocks (as many chains in flight as the 16 vector registers allow)
template <bool HALF, int MT>
inline void f32_blocks_range(const void* pk, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                             int64_t N, int64_t b, int64_t b1) {
  constexpr int NB = MT == 1 ? 8 : MT == 2 ? 4 : MT == 3 ? 3 : MT <= 6 ? 2 : 1;
  constexpr int64_t esize = HALF ? 2 : 4;
  const auto* base = static_cast<const uint8_t*>(pk);
  for (; b + NB <= b1; b += NB)
    f32_tile<HALF, MT, NB>(base + b * K * 8 * esize, K, x, ldx, y + 8 * b, ldy, N - 8 * b);
  for (; b < b1; ++b) f32_tile<HALF, MT, 1>(base + b * K * 8 * esize, K, x, ldx, y + 8 * b, ldy, N - 8 * b);
}

// y[m, n] for the output blocks b0 <= b < b1, 8 rows at a time
template <bool HALF>
inline void f32_block_rows(const DenseW& W, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t b0,
                           int64_t b1) {
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: f32_blocks_range<HALF, 1>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 2: f32_blocks_range<HALF, 2>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 3: f32_blocks_range<HALF, 3>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 4: f32_blocks_range<HALF, 4>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 5: f32_blocks_range<HALF, 5>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 6: f32_blocks_range<HALF, 6>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      case 7: f32_blocks_range<HALF, 7>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
      default: f32_blocks_range<HALF, 8>(W.pf, W.K, xm, ldx, ym, ldy, W.N, b0, b1); break;
    }
  }
}
#endif

// A contiguous 2-D weight [N, K] (K = in_features) as rows for dense_rows.
inline DenseW dense_of(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), what, ": weight must be a contiguous CPU [N, K],",
              " got ", w.sizes());
  DenseW W{w.data_ptr(), wtype_of(w, what), w.size(0), w.size(1)};
#if defined(DSPARK_BF16_PAIRS)
  if (W.t == WType::BF16) W.pk = pairs_of(w);
#endif
#if defined(DSPARK_F32_BLOCKS)
  std::tie(W.pf, W.pf_half) = f32_blocks_of(w);
#endif
  return W;
}

// matrix e of a contiguous [E, N, K] weight stack (experts, heads) as rows for dense_rows
inline DenseW dense_entry(const at::Tensor& stack, int64_t e, const char* what) {
  TORCH_CHECK(stack.dim() == 3 && stack.is_contiguous() && stack.device().is_cpu() && e >= 0 && e < stack.size(0),
              what, ": weights must be a contiguous CPU [E, N, K], got ", stack.sizes());
  const int64_t N = stack.size(1), K = stack.size(2);
  DenseW W{static_cast<const uint8_t*>(stack.data_ptr()) + e * N * K * stack.element_size(), wtype_of(stack, what), N, K};
#if defined(DSPARK_BF16_PAIRS)
  if (W.t == WType::BF16) W.pk = pairs_of(stack) + e * pair_blocks(N) * pair_steps(K) * 16;
#endif
#if defined(DSPARK_F32_BLOCKS)
  const auto [pk, half] = f32_blocks_of(stack);
  W.pf = static_cast<const uint8_t*>(pk) + e * f32_blocks(N) * K * 8 * (half ? 2 : 4);
  W.pf_half = half;
#endif
  return W;
}

// y[m, n] (row stride ldy) = Σ_k x[m, k] (row stride ldx) · W[n, k], for m < M; rows of W split across threads.
// Every output is one dot_row, whatever M, the thread count and the split: a row's result never depends on the
// other rows of the call (the batch-invariance the lossless check and prefix caching rely on).
inline void dense_rows(const DenseW& W, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy) {
  if (M == 0 || W.N == 0) return;
#if defined(DSPARK_F32_BLOCKS)
  if (W.pf != nullptr) {  // every row by the packed blocks' FMA chains
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 13) / std::max<int64_t>(1, W.K * M));
    at::parallel_for(0, f32_blocks(W.N), grain, [&](int64_t b0, int64_t b1) {
      if (W.pf_half)
        f32_block_rows<true>(W, x, M, ldx, y, ldy, b0, b1);
      else
        f32_block_rows<false>(W, x, M, ldx, y, ldy, b0, b1);
    });
    return;
  }
#endif
#if defined(DSPARK_BF16_PAIRS)
  if (W.t == WType::BF16 && W.pk != nullptr) {  // rows of bf16 values by pair products, the others below, each alone
    std::vector<int64_t> pairs, rest;
    for (int64_t m = 0; m < M; ++m) (bf16_valued(x + m * ldx, W.K) ? pairs : rest).push_back(m);
    if (!pairs.empty()) {
      const int64_t P = static_cast<int64_t>(pairs.size()), K = W.K, K2 = pair_steps(K);
      std::vector<uint32_t> xp(P * K2, 0u);
      for (int64_t i = 0; i < P; ++i) to_bf16(x + pairs[i] * ldx, K, reinterpret_cast<uint16_t*>(xp.data() + i * K2));
      const bool direct = P == M;  // every row: straight into y
      std::vector<float> yb(direct ? 0 : P * W.N);
      float* out = direct ? y : yb.data();
      const int64_t ldo = direct ? ldy : W.N;
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 13) / std::max<int64_t>(1, K2 * P));
      at::parallel_for(0, pair_blocks(W.N), grain, [&](int64_t b0, int64_t b1) {
        pair_rows(W, xp.data(), P, out, ldo, b0, b1);
      });
      if (direct) return;
      for (int64_t i = 0; i < P; ++i) std::copy(yb.data() + i * W.N, yb.data() + (i + 1) * W.N, y + pairs[i] * ldy);
      std::vector<float> xr(rest.size() * W.K), yr(rest.size() * W.N);
      for (size_t i = 0; i < rest.size(); ++i) std::copy(x + rest[i] * ldx, x + rest[i] * ldx + W.K, xr.data() + i * W.K);
      const int64_t R = static_cast<int64_t>(rest.size());
      at::parallel_for(0, W.N, 4, [&](int64_t n0, int64_t n1) {
        tiled_rows<WType::BF16>(W, xr.data(), R, W.K, yr.data(), W.N, n0, n1);
      });
      for (int64_t i = 0; i < R; ++i) std::copy(yr.data() + i * W.N, yr.data() + (i + 1) * W.N, y + rest[i] * ldy);
      return;
    }
  }
#endif
  const int64_t grain = std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(1, W.K * M));
  at::parallel_for(0, W.N, grain, [&](int64_t n0, int64_t n1) {
#if defined(DSPARK_DENSE512)
    if (W.t == WType::F32) tiled_rows<WType::F32>(W, x, M, ldx, y, ldy, n0, n1);
    if (W.t == WType::BF16) tiled_rows<WType::BF16>(W, x, M, ldx, y, ldy, n0, n1);
    if (W.t == WType::F16) tiled_rows<WType::F16>(W, x, M, ldx, y, ldy, n0, n1);
#else
    if (W.t == WType::F32) rows_of<WType::F32>(W, x, M, ldx, y, ldy, n0, n1);
    if (W.t == WType::BF16) rows_of<WType::BF16>(W, x, M, ldx, y, ldy, n0, n1);
    if (W.t == WType::F16) rows_of<WType::F16>(W, x, M, ldx, y, ldy, n0, n1);
#endif
  });
}

inline float silu_f(float g) { return g / (1.0f + std::exp(-g)); }
inline float sigmoid_f(float g) { return 1.0f / (1.0f + std::exp(-g)); }

}  // namespace
