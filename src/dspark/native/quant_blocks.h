// Shared by the native kernels: GGUF block layouts, the compile-time code paths, half-float conversion and
// small SIMD helpers (see kernels.cpp for the products, elementwise.cpp for the fp32 helpers).
#pragma once

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

}  // namespace
