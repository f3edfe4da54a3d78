// attend_rows.h: attention of query rows over key rows, each query row alone, shared by mla_attend (one 576-wide
// latent head: keys and values are the same rows) and paged_attention (GQA: a KV head's keys and values read in
// place from the pool). A row's scores are one fixed-order sum each (a lane accumulator over the width, then a fixed
// lane reduction), its softmax sums the keys in their order and its weighted sum runs over the keys in their order,
// skipping hidden ones: whatever the tile, the number of rows, the chunk a prompt was prefilled in or where a cached
// prefix ended, a row's result is the same bits.
#pragma once

#include <algorithm>
#include <cmath>
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
#else
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) out[4 * j + k] = dot_row<T>(keys[k], q + j * ldq, K);
#endif
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
      for (int r = 0; r < N; ++r) {
        if (p[r * S + s] == 0.f) continue;
        const __m512 w = _mm512_set1_ps(p[r * S + s]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(w, v[j], acc[r][j]);
      }
    }
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(o + r * C + c + 16 * j, m[j], acc[r][j]);
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

constexpr int64_t kKeyBlock = 256;  // key rows scored against every query tile before the next block

// one query row's raw scores p [S] → its attention weights as torch's softmax computes them in the model dtype:
// x = round(score)·scale + bias, exp(x − max) (hidden keys 0), times 1 / Σ (summed in key order), rounded to md.
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
  float sum = 0.f;
  for (s = 0; s < S; ++s) sum += p[s];
  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees no key at all (padding) weighs nothing
  s = 0;
#if defined(DSPARK_DENSE512)
  for (; s + 16 <= S; s += 16)
    _mm512_storeu_ps(p + s, round16(_mm512_mul_ps(_mm512_loadu_ps(p + s), _mm512_set1_ps(inv)), md));
#endif
  for (; s < S; ++s) p[s] = round_as(p[s] * inv, md);
}

// scores, softmax and weighted values of one sequence's query rows: q [M, K] fp32 (row i at position i / G), key
// rows keys[s] (K wide), value rows values[s] (C wide), bias [positions, S] → o [M, C] rounded to md; p: [M, S]
// scratch. Every key row is read once per query tile; each query row's sums run over the keys in their order,
// whatever M. A key hidden from a row (bias −inf: a later position of a prefill chunk, padding) is not scored for
// it: its weight is 0 either way.
template <WType T>
void attend_rows(const float* q, int64_t K, const uint8_t* const* keys, const uint8_t* const* values, int64_t C,
                 WType md, const float* bias, int64_t M, int64_t G, int64_t S, float scale, float* o, float* p) {
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
  for (int64_t i = 0; i < M; ++i) softmax_row(p + i * S, bias + (i / G) * S, S, scale, md);
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) weighted_values<T, 4>(p + i * S, S, values, C, o + i * C);
  for (; i < M; ++i) weighted_values<T, 1>(p + i * S, S, values, C, o + i * C);
  round_all(o, M * C, md);
}

}  // namespace
