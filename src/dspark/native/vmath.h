// Vector forms of the activations' functions, each lane alone (a row's values never depend on the others'):
// exp by range reduction to [-ln2/2, ln2/2] and a degree-7 polynomial, scaled by 2^n (within ~2 ulp of expf; the
// 16- and 8-lane forms give the same bits); tanh by an odd polynomial below |x| 0.625, else 1 - 2/(e^{2|x|} + 1)
// with x's sign (within a few ulp of tanhf).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "quant_blocks.h"

namespace {

#if defined(__AVX512F__)
inline __m512 splat(float v) { return _mm512_set1_ps(v); }

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, splat(-87.3f)), splat(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(0.693359375f), x);  // x − n·ln2 in two parts (the first exact)
  r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  __m512 p = splat(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, splat(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, splat(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, splat(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, splat(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, splat(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, splat(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 tanh16(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(int(0x80000000u)));
  const __m512 ax = _mm512_andnot_ps(sign, x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = splat(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, splat(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, splat(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, splat(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, splat(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 e = exp16(_mm512_add_ps(ax, ax));
  const __m512 big = _mm512_sub_ps(splat(1.0f), _mm512_div_ps(splat(2.0f), _mm512_add_ps(e, splat(1.0f))));
  const __m512 signed_big = _mm512_or_ps(big, _mm512_and_ps(x, sign));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, splat(0.625f), _CMP_LT_OQ), signed_big, small);
}

inline __m512 sigmoid16(__m512 x) {
  return _mm512_div_ps(splat(1.0f), _mm512_add_ps(splat(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(splat(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 splat8(float v) { return _mm256_set1_ps(v); }

inline __m256 exp8(__m256 x) {  // exp16's steps; 2^n as a product (exact: n ≥ −126 keeps it normal)
  x = _mm256_min_ps(_mm256_max_ps(x, splat8(-87.3f)), splat8(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, splat8(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, splat8(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, splat8(-2.12194440e-4f), r);
  __m256 p = splat8(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, splat8(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, splat8(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, splat8(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, splat8(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, splat8(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, splat8(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(splat8(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

inline __m256 sigmoid8(__m256 x) {
  return _mm256_div_ps(splat8(1.0f), _mm256_add_ps(splat8(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline __m256 tanh8(__m256 x) {  // tanh16's steps
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = splat8(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, splat8(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, splat8(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, splat8(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, splat8(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 e = exp8(_mm256_add_ps(ax, ax));
  const __m256 big = _mm256_sub_ps(splat8(1.0f), _mm256_div_ps(splat8(2.0f), _mm256_add_ps(e, splat8(1.0f))));
  const __m256 signed_big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(signed_big, small, _mm256_cmp_ps(ax, splat8(0.625f), _CMP_LT_OQ));
}
#endif

// y[i] = exp(s·x[i]) for i < n (s = 1 or −1), each element alone through the vector exp above where the CPU has one
// (the same bits on AVX-512 and AVX2; std::exp otherwise)
inline void exp_array(const float* x, float* y, int64_t n, float s = 1.0f) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, k, exp16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), splat(s))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_mul_ps(_mm256_loadu_ps(x + i), splat8(s))));
  if (i < n) {  // the tail through the same lanes' code
    alignas(32) float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(t, x + i, sizeof(float) * (n - i));
    _mm256_store_ps(t, exp8(_mm256_mul_ps(_mm256_load_ps(t), splat8(s))));
    std::memcpy(y + i, t, sizeof(float) * (n - i));
    i = n;
  }
#endif
  for (; i < n; ++i) y[i] = std::exp(s * x[i]);
}

// x[s] = exp(x[s] − mx), 0 where x[s] is −inf (a hidden key): each element alone through the vector exp above where
// the CPU has one (the same bits on AVX-512 and AVX2), so a row's weights never depend on the other rows of the call
inline void exp_shifted(float* x, int64_t n, float mx) {
  int64_t s = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; s < n; s += 16) {
    const __mmask16 k = n - s >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - s)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + s);
    const __mmask16 hidden = _mm512_cmp_ps_mask(v, ninf, _CMP_EQ_OQ);
    _mm512_mask_storeu_ps(x + s, k, _mm512_maskz_mov_ps(~hidden, exp16(_mm512_sub_ps(v, m))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; s + 8 <= n; s += 8) {
    const __m256 v = _mm256_loadu_ps(x + s);
    const __m256 visible = _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ);
    _mm256_storeu_ps(x + s, _mm256_and_ps(visible, exp8(_mm256_sub_ps(v, m))));
  }
  if (s < n) {  // the tail through the same lanes' code
    alignas(32) float t[8];
    std::fill(t, t + 8, -std::numeric_limits<float>::infinity());
    std::memcpy(t, x + s, sizeof(float) * (n - s));
    const __m256 v = _mm256_load_ps(t);
    _mm256_store_ps(t, _mm256_and_ps(_mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ), exp8(_mm256_sub_ps(v, m))));
    std::memcpy(x + s, t, sizeof(float) * (n - s));
    s = n;
  }
#endif
  for (; s < n; ++s) x[s] = std::isinf(x[s]) ? 0.f : std::exp(x[s] - mx);
}

}  // namespace
