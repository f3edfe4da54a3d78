// attend_rows.h: attention of query rows over key rows, each query row alone, shared by mla_attend (one 576-wide
// latent head: keys and values are the same rows) and paged_attention (GQA: a KV head's keys and values read in
// place from the pool). A row's scores are one fixed-order sum each, its softmax sums the keys in fixed lanes and its
// weighted sum runs over the keys in their order, skipping hidden ones: whatever the tile, the number of rows, the
// chunk a prompt was prefilled in or where a cached prefix ended, a row's result is the same bits.
//
// Scores: wide rows (MLA's 576-wide latent) go in 4 query × 4 key tiles of lane accumulators, each score a lane
// chain over the width and a fixed lane reduction; narrow ones (GQA heads, at most kTransposeWidth wide) in
// transposed key tiles, where those reductions would cost more than the products. The choice depends on the width
// alone, never on the number of rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "dense.h"
#include "vmath.h"

namespace {

// out[j] = Σ_k row[k]·x[j][k] for N query vectors against one key row, each sum in dot_row's order (one lane
// accumulator over k, then a fixed lane reduction): a query's score does not depend on its tile-mates
template <WType T, int N>
inline void dots(const void* row, const float* x, int64_t ldx, int64_t K, float* out) {
#if defined(DSPARK_DENSE512)
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 w = load16<T>(row, k, 0xFFFF);
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + j * ldx + k), acc[j]);
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 w = load16<T>(row, k, m);
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x + j * ldx + k), acc[j]);
  }
  for (int j = 0; j < N; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
#else
  for (int j = 0; j < N; ++j) out[j] = dot_row<T>(row, x + j * ldx, K);
#endif
}

// out[4·j + k] = Σ_w q_j[w]·key_k[w] for 4 query rows j (stride ldq) and 4 key rows k, each sum in dots' order: a
// score never depends on its tile-mates
template <WType T>
inline void dots4x4(const uint8_t* const* keys, int64_t K, const float* q, int64_t ldq, float* out) {
#if defined(DSPARK_DENSE512)
  __m512 acc[4][4];
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_ps();
  for (int64_t w = 0; w < K; w += 16) {
    const __mmask16 m = K - w >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (K - w)) - 1);
    __m512 kv[4];
    for (int k = 0; k < 4; ++k) kv[k] = load16<T>(keys[k], w, m);
    for (int j = 0; j < 4; ++j) {
      const __m512 x = _mm512_maskz_loadu_ps(m, q + j * ldq + w);
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_fmadd_ps(kv[k], x, acc[j][k]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) out[4 * j + k] = _mm512_reduce_add_ps(acc[j][k]);
#elif defined(DSPARK_AVX2)
  // 2 query rows × 4 keys at a time, each score dot_row's sum (an 8-lane FMA chain over k, hsum256, the tail added
  // one product at a time), with a key vector read once for both rows
  auto key8 = [](const uint8_t* row, int64_t at) {
    if constexpr (T == WType::F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + at);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + at));
      if constexpr (T == WType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      return _mm256_cvtph_ps(h);
    }
  };
  for (int j0 = 0; j0 < 4; j0 += 2) {
    __m256 acc[2][4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 2; ++j)
      _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) acc[j][k] = _mm256_setzero_ps();
    int64_t w = 0;
    for (; w + 8 <= K; w += 8) {
      __m256 kv[4];
      _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) kv[k] = key8(keys[k], w);
      _Pragma("GCC unroll 4") for (int j = 0; j < 2; ++j) {
        const __m256 x = _mm256_loadu_ps(q + (j0 + j) * ldq + w);
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) acc[j][k] = _mm256_fmadd_ps(kv[k], x, acc[j][k]);
      }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < 2; ++j)
      _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) {
        float sum = hsum256(acc[j][k]);
        for (int64_t t = w; t < K; ++t) sum += widen<T>(keys[k], t) * q[(j0 + j) * ldq + t];
        out[4 * (j0 + j) + k] = sum;
      }
  }
#else
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) out[4 * j + k] = dot_row<T>(keys[k], q + j * ldq, K);
#endif
}

// Transposed scores go a tile of kScoreLanes key rows at a time: the tile is transposed once (kt[w · L + k] = key
// k's element w, zeros past the last key), then a query row's L scores are one vector chain of FMAs over w in order
// (lane k: Σ_w q[w]·key_k[w], left to right), with no reduction across lanes. Every query row's sums are the same
// whatever rows share the tile, and a tile's transposition is paid once for all the query rows (the heads of a GQA
// group and a verification's rows).
#if defined(DSPARK_DENSE512)
constexpr int kScoreLanes = 16;

// r[k] (key k, 16 elements) -> r[w] (element w of the 16 keys)
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // u[4j + e], 128-bit chunk c: element 4c + e of keys 4j .. 4j+3
    u[4 * j] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
    u[4 * j + 1] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
    u[4 * j + 2] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
    u[4 * j + 3] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[12 + e] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

template <WType T>
inline void transpose_keys(const uint8_t* const* keys, int64_t n, int64_t K, float* kt) {
  for (int64_t w = 0; w < K; w += 16) {
    const __mmask16 m = K - w >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (K - w)) - 1);
    __m512 r[16];
    for (int k = 0; k < 16; ++k) r[k] = k < n ? load16<T>(keys[k], w, m) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t e = 0; e < std::min<int64_t>(16, K - w); ++e) _mm512_storeu_ps(kt + (w + e) * 16, r[e]);
  }
}

// sc[j · L + k] = Σ_w q_j[w]·kt[w · L + k] for N query rows, each a chain over w in order;
// qt[w · kScoreRows + j] = q_j[w] (the rows' elements side by side: one base address for every broadcast)
template <int N>
inline void score_rows(const float* kt, int64_t K, const float* qt, float* sc) {
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t w = 0; w < K; ++w) {
    const __m512 k = _mm512_loadu_ps(kt + w * 16);
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(k, _mm512_set1_ps(qt[w * 8 + j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) _mm512_storeu_ps(sc + j * 16, acc[j]);
}
#elif defined(DSPARK_AVX2)
constexpr int kScoreLanes = 8;

template <WType T>
inline __m256 load8(const void* row, int64_t at) {
  if constexpr (T == WType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + at);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + at));
    if constexpr (T == WType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
}

// r[k] (key k, 8 elements) -> r[w] (element w of the 8 keys)
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 2; ++j) {  // u[4j + e], 128-bit half h: element 4h + e of keys 4j .. 4j+3
    u[4 * j] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
    u[4 * j + 1] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
    u[4 * j + 2] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
    u[4 * j + 3] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

template <WType T>
inline void transpose_keys(const uint8_t* const* keys, int64_t n, int64_t K, float* kt) {
  int64_t w = 0;
  for (; w + 8 <= K; w += 8) {
    __m256 r[8];
    for (int k = 0; k < 8; ++k) r[k] = k < n ? load8<T>(keys[k], w) : _mm256_setzero_ps();
    transpose8(r);
    for (int e = 0; e < 8; ++e) _mm256_storeu_ps(kt + (w + e) * 8, r[e]);
  }
  for (; w < K; ++w)
    for (int k = 0; k < 8; ++k) kt[w * 8 + k] = k < n ? widen<T>(keys[k], w) : 0.f;
}

template <int N>
inline void score_rows(const float* kt, int64_t K, const float* qt, float* sc) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t w = 0; w < K; ++w) {
    const __m256 k = _mm256_loadu_ps(kt + w * 8);
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(k, _mm256_set1_ps(qt[w * 8 + j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) _mm256_storeu_ps(sc + j * 8, acc[j]);
}
#else
constexpr int kScoreLanes = 8;

template <WType T>
inline void transpose_keys(const uint8_t* const* keys, int64_t n, int64_t K, float* kt) {
  for (int64_t w = 0; w < K; ++w)
    for (int k = 0; k < 8; ++k) kt[w * 8 + k] = k < n ? widen<T>(keys[k], w) : 0.f;
}

template <int N>
inline void score_rows(const float* kt, int64_t K, const float* qt, float* sc) {
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < 8; ++k) {
      float s = 0.f;
      for (int64_t w = 0; w < K; ++w) s = std::fma(qt[w * 8 + j], kt[w * 8 + k], s);
      sc[j * 8 + k] = s;
    }
}
#endif

constexpr int kScoreRows = 8;  // query rows per pass over a transposed tile (their chains in registers)

inline void score_tile(int n, const float* kt, int64_t K, const float* qt, float* sc) {
  switch (n) {
    case 1: return score_rows<1>(kt, K, qt, sc);
    case 2: return score_rows<2>(kt, K, qt, sc);
    case 3: return score_rows<3>(kt, K, qt, sc);
    case 4: return score_rows<4>(kt, K, qt, sc);
    case 5: return score_rows<5>(kt, K, qt, sc);
    case 6: return score_rows<6>(kt, K, qt, sc);
    case 7: return score_rows<7>(kt, K, qt, sc);
    default: return score_rows<8>(kt, K, qt, sc);
  }
}

// o_j[c] = Σ_s p_j[s]·value_s[c] for c < C and N query rows j (probabilities p_j, row stride S; outputs o_j, stride
// C): each output its own sum over the value rows in their order, a row's hidden keys (p 0) skipped, so a row's
// result is the same in any tile. A value row is read once for the N rows.
template <WType T, int N>
void weighted_values(const float* p, int64_t S, const uint8_t* const* values, int64_t C, float* o) {
  int64_t c = 0;
#if defined(DSPARK_DENSE512)
  for (; c < C; c += 64) {  // 4 registers of outputs per row held across all value rows
    const int64_t n = std::min<int64_t>(64, C - c);
    __mmask16 m[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * j));
      m[j] = static_cast<__mmask16>(left == 16 ? 0xFFFF : (1u << left) - 1);
    }
    __m512 acc[N][4];
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      bool any = false;
      for (int r = 0; r < N; ++r) any |= p[r * S + s] != 0.f;
      if (!any) continue;
      __m512 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load16<T>(values[s], c + 16 * j, m[j]);
      for (int r = 0; r < N; ++r) {  // a row whose weight is 0 keeps its sums: masked, without a branch
        const __m512 w = _mm512_set1_ps(p[r * S + s]);
        const __mmask16 on = _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_mask3_fmadd_ps(w, v[j], acc[r][j], on);
      }
    }
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(o + r * C + c + 16 * j, m[j], acc[r][j]);
  }
#elif defined(DSPARK_AVX2)
  // 16 outputs per row held across all value rows, each one FMA chain over the value rows in order (AVX-512's sums);
  // a row whose weight is 0 keeps its sums
  for (; c + 16 <= C; c += 16) {
    __m256 acc[N][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < N; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      bool any = false;
      for (int r = 0; r < N; ++r) any |= p[r * S + s] != 0.f;
      if (!any) continue;
      __m256 v[2];
      _Pragma("GCC unroll 2") for (int j = 0; j < 2; ++j) {
        if constexpr (T == WType::F32) {
          v[j] = _mm256_loadu_ps(reinterpret_cast<const float*>(values[s]) + c + 8 * j);
        } else {
          const __m128i h =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(values[s]) + c + 8 * j));
          v[j] = T == WType::BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                  : _mm256_cvtph_ps(h);
        }
      }
      _Pragma("GCC unroll 4") for (int r = 0; r < N; ++r) {
        const float pw = p[r * S + s];
        if (pw == 0.f) continue;
        const __m256 w = _mm256_set1_ps(pw);
        acc[r][0] = _mm256_fmadd_ps(w, v[0], acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v[1], acc[r][1]);
      }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < N; ++r) {
      _mm256_storeu_ps(o + r * C + c, acc[r][0]);
      _mm256_storeu_ps(o + r * C + c + 8, acc[r][1]);
    }
  }
  for (int r = 0; r < N; ++r) std::fill(o + r * C + c, o + r * C + C, 0.f);
  for (int64_t s = 0; s < S && c < C; ++s)  // the last C % 16 outputs, the same chains one at a time
    for (int r = 0; r < N; ++r) {
      const float w = p[r * S + s];
      if (w == 0.f) continue;
      for (int64_t t = c; t < C; ++t) o[r * C + t] = std::fma(w, widen<T>(values[s], t), o[r * C + t]);
    }
#else
  for (int r = 0; r < N; ++r) std::fill(o + r * C, o + r * C + C, 0.f);
  for (int64_t s = 0; s < S; ++s) {
    for (int r = 0; r < N; ++r) {
      const float w = p[r * S + s];
      if (w == 0.f) continue;
      float* orow = o + r * C;
      for (c = 0; c < C; ++c) orow[c] = orow[c] + w * widen<T>(values[s], c);
    }
  }
#endif
}

// Σ p[s] over s < S: key s in lane s % L of a lane accumulator (the tail zero-padded), then a fixed lane reduction.
// A key keeps its lane whatever S is and hidden keys add +0, so the sum does not depend on how many keys follow.
inline float lane_sum(const float* p, int64_t S) {
#if defined(DSPARK_DENSE512)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; s += 16) {
    const __mmask16 k = S - s >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (S - s)) - 1);
    acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(k, p + s));
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(DSPARK_AVX2)
  __m256 acc = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + s));
  if (s < S) {
    alignas(32) float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::copy(p + s, p + S, t);
    acc = _mm256_add_ps(acc, _mm256_load_ps(t));
  }
  return hsum256(acc);
#else
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t s = 0; s < S; ++s) lanes[s % 8] += p[s];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
}

// one query row's raw scores p [S] → its attention weights as torch's softmax computes them in the model dtype:
// x = round(score)·scale + bias, exp(x − max) (hidden keys 0), times 1 / Σ (lane_sum), rounded to md.
// Each element alone but the max and the sum, whose orders do not depend on anything but S.
inline void softmax_row(float* p, const float* bias, int64_t S, float scale, WType md) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t s = 0;
#if defined(DSPARK_DENSE512)
  __m512 vmx = _mm512_set1_ps(mx);
  for (; s + 16 <= S; s += 16) {
    const __m512 r = _mm512_mul_ps(round16(_mm512_loadu_ps(p + s), md), _mm512_set1_ps(scale));
    const __m512 x = _mm512_add_ps(r, _mm512_loadu_ps(bias + s));
    _mm512_storeu_ps(p + s, x);
    vmx = _mm512_max_ps(vmx, x);
  }
  mx = _mm512_reduce_max_ps(vmx);
#endif
  for (; s < S; ++s) {
    const float r = round_as(p[s], md) * scale;
    p[s] = r + bias[s];
    mx = std::max(mx, p[s]);
  }
  exp_shifted(p, S, mx);
  const float sum = lane_sum(p, S);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees no key at all (padding) weighs nothing
  s = 0;
#if defined(DSPARK_DENSE512)
  for (; s + 16 <= S; s += 16)
    _mm512_storeu_ps(p + s, round16(_mm512_mul_ps(_mm512_loadu_ps(p + s), _mm512_set1_ps(inv)), md));
#endif
  for (; s < S; ++s) p[s] = round_as(p[s] * inv, md);
}

constexpr int64_t kTransposeWidth = 128;  // widest key rows scored in transposed tiles
constexpr int64_t kKeyBlock = 256;        // key rows scored against every query tile before the next block

// scores of every query row against every key (p [M, S]; a key hidden from a row: 0), in transposed key tiles
template <WType T>
void score_transposed(const float* q, int64_t K, const uint8_t* const* keys, const float* bias, int64_t M,
                      int64_t G, int64_t S, float* p) {
  constexpr int L = kScoreLanes;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> kt, qt;
  kt.resize(K * L);
  const int64_t groups = (M + kScoreRows - 1) / kScoreRows;
  qt.assign(groups * K * kScoreRows, 0.f);  // group g's rows side by side: qt[(g · K + w) · kScoreRows + j]
  for (int64_t i = 0; i < M; ++i)
    for (int64_t w = 0; w < K; ++w) qt[((i / kScoreRows) * K + w) * kScoreRows + i % kScoreRows] = q[i * K + w];
  float sc[kScoreRows * L];
  for (int64_t s0 = 0; s0 < S; s0 += L) {
    const int64_t n = std::min<int64_t>(L, S - s0);
    bool transposed = false;
    for (int64_t i0 = 0; i0 < M; i0 += kScoreRows) {
      const int64_t mt = std::min<int64_t>(kScoreRows, M - i0);
      bool any = false;  // a key of the tile some row of the group sees
      for (int64_t i = i0; i < i0 + mt && !any; ++i)
        for (int64_t k = 0; k < n && !any; ++k) any = bias[(i / G) * S + s0 + k] != ninf;
      if (any && !transposed) {
        transpose_keys<T>(keys + s0, n, K, kt.data());
        transposed = true;
      }
      if (any) score_tile(static_cast<int>(mt), kt.data(), K, qt.data() + (i0 / kScoreRows) * K * kScoreRows, sc);
      for (int64_t j = 0; j < mt; ++j) {
        const float* brow = bias + ((i0 + j) / G) * S + s0;
        float* prow = p + (i0 + j) * S + s0;
        for (int64_t k = 0; k < n; ++k) prow[k] = brow[k] == ninf ? 0.f : sc[j * L + k];  // + the bias: −inf
      }
    }
  }
}

// the same scores in 4 × 4 tiles of lane accumulators, a block of kKeyBlock key rows kept in cache for every query
// tile
template <WType T>
void score_lanes(const float* q, int64_t K, const uint8_t* const* keys, const float* bias, int64_t M, int64_t G,
                 int64_t S, float* p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  auto hidden = [&](int64_t i, int64_t s) { return bias[(i / G) * S + s] == ninf; };
  auto score_one = [&](int64_t i, int64_t s) {
    if (hidden(i, s)) p[i * S + s] = 0.f;  // + the bias below: −inf, as a score would give
    else dots<T, 1>(keys[s], q + i * K, K, K, p + i * S + s);
  };
  float sc[16];
  const int64_t M4 = M - M % 4, S4 = S - S % 4;
  for (int64_t s0 = 0; s0 < S4; s0 += kKeyBlock) {  // a block of key rows stays in cache for every query tile
    const int64_t s1 = std::min(S4, s0 + kKeyBlock);
    for (int64_t i = 0; i < M4; i += 4)
      for (int64_t s = s0; s < s1; s += 4) {
        bool all_hidden = true;
        for (int j = 0; j < 4 && all_hidden; ++j)
          for (int k = 0; k < 4 && all_hidden; ++k) all_hidden = hidden(i + j, s + k);
        if (all_hidden) {
          for (int j = 0; j < 4; ++j) std::fill(p + (i + j) * S + s, p + (i + j) * S + s + 4, 0.f);
          continue;
        }
        dots4x4<T>(keys + s, K, q + i * K, K, sc);
        for (int j = 0; j < 4; ++j) std::copy(sc + 4 * j, sc + 4 * j + 4, p + (i + j) * S + s);
      }
  }
  for (int64_t i = 0; i < M; ++i)  // the rest: key rows past the last full 4, query rows past the last full 4
    for (int64_t s = i < M4 ? S4 : 0; s < S; ++s) score_one(i, s);
}

#if defined(DSPARK_BF16_PAIRS)
// bf16 models on CPUs with AVX-512 BF16: the scores of wide rows and every weighted sum run as bf16 pair products
// (vdpbf16ps: two bf16 products added in fp32, then added to the fp32 lane), half the instructions of widened fp32
// FMAs. The operands are the module path's bf16 values (queries, latents and probabilities are rounded to bf16
// there), so only the order of the sums changes, and it is fixed per output: a score is 16 lane chains over its
// width in 32-element steps, then reduce4's tree; a weighted sum runs over the keys in pairs (s, s+1), s even,
// in their order. Nothing depends on how many rows share the call.

// score_lanes' scores from bf16 keys and queries: tiles of up to 4 query rows × 4 keys (past the last key: a zero
// row), a block of kKeyBlock key rows kept in cache for every query tile
inline void score_pairs(const float* q, int64_t K, const uint8_t* const* keys, const float* bias, int64_t M,
                        int64_t G, int64_t S, float* p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<uint16_t> qb, zero;
  qb.resize(M * K);
  to_bf16(q, M * K, qb.data());
  zero.assign(K, 0);
  float sc[16];
  const uint16_t* kp[4];
  for (int64_t s0 = 0; s0 < S; s0 += kKeyBlock) {
    const int64_t s1 = std::min(S, s0 + kKeyBlock);
    for (int64_t i = 0; i < M; i += 4) {
      const int nq = static_cast<int>(std::min<int64_t>(4, M - i));
      for (int64_t s = s0; s < s1; s += 4) {
        const int nk = static_cast<int>(std::min<int64_t>(4, s1 - s));
        bool all_hidden = true;
        for (int j = 0; j < nq && all_hidden; ++j)
          for (int k = 0; k < nk && all_hidden; ++k) all_hidden = bias[((i + j) / G) * S + s + k] == ninf;
        if (!all_hidden) {
          for (int k = 0; k < 4; ++k) kp[k] = k < nk ? reinterpret_cast<const uint16_t*>(keys[s + k]) : zero.data();
          const uint16_t* qi = qb.data() + i * K;
          switch (nq) {
            case 1: dots_bf16<1>(kp, K, qi, K, sc); break;
            case 2: dots_bf16<2>(kp, K, qi, K, sc); break;
            case 3: dots_bf16<3>(kp, K, qi, K, sc); break;
            default: dots_bf16<4>(kp, K, qi, K, sc); break;
          }
        }
        for (int j = 0; j < nq; ++j)
          for (int k = 0; k < nk; ++k) p[(i + j) * S + s + k] = all_hidden ? 0.f : sc[4 * j + k];
      }
    }
  }
}

// acc[r][g] += Σ over the key pairs (s, s+1) of [s0, s1) of pb_r(s, s+1)·(value_s, value_{s+1}), for the 64 columns
// at c (lanes in unpack order: see weighted_pairs); a pair no row weighs is skipped, a row whose pair is 0 keeps
// its sums
template <int N>
inline void pair_block(const uint32_t* pb, int64_t ldp, const uint16_t* const* values, const uint16_t* zero,
                       int64_t S, int64_t s0, int64_t s1, int64_t c, int64_t C, float* acc_mem, int64_t ldacc) {
  __mmask32 m[2];
  for (int g = 0; g < 2; ++g) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(32, C - c - 32 * g));
    m[g] = left == 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << left) - 1);
  }
  __m512 acc[N][4];
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(acc_mem + r * ldacc + 16 * j);
  for (int64_t s = s0; s < s1; s += 2) {
    uint32_t w[N];
    bool any = false;
    for (int r = 0; r < N; ++r) any |= (w[r] = pb[r * ldp + s / 2]) != 0;
    if (!any) continue;
    const uint16_t* v0 = values[s];
    const uint16_t* v1 = s + 1 < S ? values[s + 1] : zero;
    __m512bh v[4];
    for (int g = 0; g < 2; ++g) {
      const __m512i a = _mm512_maskz_loadu_epi16(m[g], v0 + c + 32 * g);
      const __m512i b = _mm512_maskz_loadu_epi16(m[g], v1 + c + 32 * g);
      v[2 * g] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      v[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < N; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r]));
      const __mmask16 on = w[r] != 0 ? __mmask16(0xFFFF) : __mmask16(0);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_mask_dpbf16_ps(acc[r][j], on, v[j], x);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_mem + r * ldacc + 16 * j, acc[r][j]);
}

// weighted_values for every query row from bf16 probabilities p [M, S] (already bf16 values) and bf16 value rows:
// o [M, C]. Key blocks go outermost (a block stays in cache for every row tile); the sums wait in memory between
// blocks, so each output is still one sum over the key pairs in order.
inline void weighted_pairs(const float* p, int64_t M, int64_t S, const uint8_t* const* values_in, int64_t C,
                           float* o) {
  const int64_t S2 = (S + 1) / 2, Cp = (C + 63) / 64 * 64;
  thread_local std::vector<uint32_t> pb;
  thread_local std::vector<float> acc;
  thread_local std::vector<uint16_t> zero;
  pb.resize(M * S2);
  for (int64_t i = 0; i < M; ++i) {
    pb[i * S2 + S2 - 1] = 0u;  // an odd S leaves the last pair's second half 0
    to_bf16(p + i * S, S, reinterpret_cast<uint16_t*>(pb.data() + i * S2));
  }
  acc.assign(M * Cp, 0.f);
  zero.assign(Cp, 0);
  const auto* const* values = reinterpret_cast<const uint16_t* const*>(values_in);
  for (int64_t s0 = 0; s0 < S; s0 += kKeyBlock) {
    const int64_t s1 = std::min(S, s0 + kKeyBlock);
    for (int64_t i = 0; i < M; i += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, M - i));
      for (int64_t c = 0; c < C; c += 64) {
        const uint32_t* pi = pb.data() + i * S2;
        float* ai = acc.data() + i * Cp + c;
        switch (n) {
          case 1: pair_block<1>(pi, S2, values, zero.data(), S, s0, s1, c, C, ai, Cp); break;
          case 2: pair_block<2>(pi, S2, values, zero.data(), S, s0, s1, c, C, ai, Cp); break;
          case 3: pair_block<3>(pi, S2, values, zero.data(), S, s0, s1, c, C, ai, Cp); break;
          default: pair_block<4>(pi, S2, values, zero.data(), S, s0, s1, c, C, ai, Cp); break;
        }
      }
    }
  }
  // unpack order → columns: in 32 columns at 32·g, lane 4·l + e of the low half is column 8·l + e, of the high half
  // column 8·l + 4 + e (unpacklo/hi work within 128-bit chunks)
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < C; c += 32) {
      const float* a = acc.data() + i * Cp + c;
      float out[32];
      for (int l = 0; l < 4; ++l)
        for (int e = 0; e < 4; ++e) {
          out[8 * l + e] = a[4 * l + e];
          out[8 * l + 4 + e] = a[16 + 4 * l + e];
        }
      std::copy(out, out + std::min<int64_t>(32, C - c), o + i * C + c);
    }
}
#endif

// scores, softmax and weighted values of one sequence's query rows: q [M, K] fp32 (row i at position i / G), key
// rows keys[s] (K wide), value rows values[s] (C wide), bias [positions, S] → o [M, C] rounded to md; p: [M, S]
// scratch. Each query row's sums run in the orders above, whatever M. A key hidden from a row (bias −inf: a later
// position of a prefill chunk, padding) is not used for it: its weight is 0 either way.
template <WType T>
void attend_rows(const float* q, int64_t K, const uint8_t* const* keys, const uint8_t* const* values, int64_t C,
                 WType md, const float* bias, int64_t M, int64_t G, int64_t S, float scale, float* o, float* p) {
#if defined(DSPARK_BF16_PAIRS)
  if constexpr (T == WType::BF16) {
    if (md == WType::BF16) {
      if (K <= kTransposeWidth)
        score_transposed<T>(q, K, keys, bias, M, G, S, p);
      else
        score_pairs(q, K, keys, bias, M, G, S, p);
      for (int64_t i = 0; i < M; ++i) softmax_row(p + i * S, bias + (i / G) * S, S, scale, md);
      weighted_pairs(p, M, S, values, C, o);
      round_all(o, M * C, md);
      return;
    }
  }
#endif
  if (K <= kTransposeWidth)
    score_transposed<T>(q, K, keys, bias, M, G, S, p);
  else
    score_lanes<T>(q, K, keys, bias, M, G, S, p);
  for (int64_t i = 0; i < M; ++i) softmax_row(p + i * S, bias + (i / G) * S, S, scale, md);
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) weighted_values<T, 4>(p + i * S, S, values, C, o + i * C);
  for (; i < M; ++i) weighted_values<T, 1>(p + i * S, S, values, C, o + i * C);
  round_all(o, M * C, md);
}

}  // namespace
