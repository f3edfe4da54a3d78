// Shared by the native kernels: GGUF block layouts, the compile-time code paths, half-float conversion and
// small SIMD helpers (see kernels.cpp for the products, elementwise.cpp for the fp32 helpers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define DSPARK_VNNI512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DSPARK_AVX2 1
#endif

namespace {


constexpr int64_t QK = 32;  // values per block
enum QType : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

template <int QT>
constexpr int64_t kBlockBytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34;
template <int QT>
constexpr int64_t kQsOffset = QT == Q4_1 ? 4 : 2;

#if defined(DSPARK_VNNI512)
constexpr const char* kInt8Path = "avx512-vnni";
constexpr bool kPairs = true;   // two blocks per 512-bit product
constexpr bool kQ8Flip = true;  // Q8 weights made unsigned (w + 128), corrected per block
constexpr int kInt8Tile = 8;    // activation rows per pass over a weight row
#elif defined(DSPARK_AVX2)
constexpr const char* kInt8Path = "avx2";
constexpr bool kPairs = false;
constexpr bool kQ8Flip = false;
constexpr int kInt8Tile = 4;
#else
constexpr const char* kInt8Path = "scalar";
constexpr bool kPairs = false;
constexpr bool kQ8Flip = false;
constexpr int kInt8Tile = 4;
#endif

inline float h2f(const uint8_t* p) {  // IEEE half (little-endian bytes) -> float, exact
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    const float f = float(mant) * 5.9604644775390625e-08f;  // subnormal (or zero): mant · 2^-24
    return sign ? -f : f;
  }
  bits = exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The weight rows stream from memory once per product; with several activation rows per block the arithmetic is
// slow enough that the hardware prefetchers fall behind (measured: a cold 8-row pass over SmolLM2's weights ~16 %
// slower without this). Each block asks for the bytes kPrefetchBytes further on (rows lie back to back).
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + kPrefetchBytes, 0, 3); }  // prefetcht0

struct Weights {
  const uint8_t* blocks;  // [N, row_bytes]
  const float* bias;      // [N] or null
  int64_t row_bytes;
};

// One block of 32 floats -> 32 int8 (natural order), its scale, the sum of its int8 values and of its floats.
inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& isum, float& fsum) {
#if defined(DSPARK_AVX2) || defined(DSPARK_VNNI512)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i qi[4];
  __m256 fs = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round to nearest even
    fs = _mm256_add_ps(fs, v[i]);
  }
  __m256i is = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i is4 = _mm_add_epi32(_mm256_castsi256_si128(is), _mm256_extracti128_si256(is, 1));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
  isum = _mm_cvtsi128_si32(is4);
  fsum = hsum256(fs);
  // int32 -> int8: the packs interleave 128-bit lanes, the permute restores the order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.0f, s = 0.0f;
  for (int i = 0; i < QK; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    s += x[i];
  }
  d = amax / 127.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t is = 0;
  for (int i = 0; i < QK; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * id));
    q[i] = static_cast<int8_t>(v);
    is += v;
  }
  isum = is;
  fsum = s;
#endif
}

}  // namespace
