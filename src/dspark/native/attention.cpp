// paged_attention: a few query rows per sequence attend over keys and values read in place from a paged pool plane,
// compiled for the running machine with kernels.cpp (same library, same torch.ops namespace).
//
//   q      [B, H, T, d]   queries (bf16, fp16 or fp32), H = n_kv · g (query head h reads KV head h / g)
//   plane  [N, W]         one layer of the pool: slot n holds a token's row; head j's key at k_off + j·d and its
//                         value at v_off + j·dv (GQA pages: [k of every head | v of every head])
//   slots  [B, S] int64   the slot of each visible key position (padding: any slot, hidden by the bias)
//   bias   [B, T, S] fp32 additive mask, 0 (visible) or -inf (hidden)
//   → out  [B, H, T, dv]  in q's dtype
//
// It replaces "gather every visible row into [B, S, W], then scaled-dot-product attention" in decode and
// verification: the rows are read once, where they lie, with no gathered copy and no strided-head SDPA (at batch 48
// over 1k-token contexts those two were ~60 % of a SmolLM2 decode step). Per sequence every key row is read once for
// all query rows (query head h reads KV head h / g), then every value row once: scores and the softmax in fp32, the weighted sum of values accumulated in fp32 and
// rounded once to q's dtype. Sums run in another order than torch's kernels, so the reduced-precision paths use it;
// fp32, the bit-exact reference, keeps torch's.
//
// Threads: at::parallel_for over sequences.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attend_rows.h"
#include "vmath.h"

namespace {

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Σ a[i]·b[i] over 16 lanes (one 512-bit or two 256-bit vectors), then a fixed tree across the lanes: one order
// whatever the number of query rows in the call (a `simd reduction` compiled to a chain of 16 scalar adds per score,
// most of a decode step's attention).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
  acc = _mm512_reduce_add_ps(v);
#elif defined(__AVX2__)
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    v0 = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    v1 = _mm256_add_ps(v1, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(v0, v1)), _mm256_extractf128_ps(_mm256_add_ps(v0, v1), 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  acc = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// the scores of n ≤ 4 query rows (each d long, back to back from q) against one key: per row the products summed in
// 16 lanes as dot() sums them, then the four rows' lanes reduced together by one fixed tree (each row's sum is
// ((l_i + l_i+8) + (l_i+4 + l_i+12)) over i, then (i, i+2), then (i, i+1), whichever slot it has): a quarter of the
// horizontal work of four dot() calls, and a row's score never depends on the rows beside it
#if defined(__AVX512F__)
constexpr bool kDot4 = true;
inline void dot4(const float* q, int64_t n, const float* k, int64_t d, float* out) {
  __m512 v[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_setzero_ps();
    if (i < n)
      for (int64_t e = 0; e < d; e += 16)
        v[i] = _mm512_add_ps(v[i], _mm512_mul_ps(_mm512_loadu_ps(q + i * d + e), _mm512_loadu_ps(k + e)));
  }
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));  // (i, i+2)
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));  // (i, i+1)
  out[0] = _mm_cvtss_f32(_mm512_castps512_ps128(u));  // lane 0 of each 128-bit block (no store and reload)
  if (n > 1) out[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(u, 1));
  if (n > 2) out[2] = _mm_cvtss_f32(_mm512_extractf32x4_ps(u, 2));
  if (n > 3) out[3] = _mm_cvtss_f32(_mm512_extractf32x4_ps(u, 3));
}
#else
constexpr bool kDot4 = false;
inline void dot4(const float*, int64_t, const float*, int64_t, float*) {}
#endif

// a key (or value) row as fp32: in place when the pool is fp32, else converted into buf
inline const float* key_row(const float* src, float*, int64_t) { return src; }
template <typename T>
inline const float* key_row(const T* src, float* buf, int64_t n) {
  to_float(src, buf, n);
  return buf;
}

template <typename T>
constexpr WType wtype_of_t() {
  if constexpr (std::is_same_v<T, float>) return WType::F32;
  if constexpr (std::is_same_v<T, c10::BFloat16>) return WType::BF16;
  return WType::F16;
}

constexpr int64_t kBlockPositions = 32;  // query positions per call of attend_rows: their scores stay bounded

// every sequence's query rows, per KV head and per block of positions, through attend_rows (attend_rows.h): the keys
// and values read in place where the slots put them, each query row alone
template <typename T>
void attend(const T* q, const T* plane, const int64_t* slots, const float* bias, T* out, int64_t B, int64_t H,
            int64_t T_, int64_t S, int64_t d, int64_t dv, int64_t W, int64_t n_kv, int64_t k_off, int64_t v_off,
            float scale) {
  constexpr WType WT = wtype_of_t<T>();
  const int64_t g = H / n_kv, P = std::min(T_, kBlockPositions), M = P * g;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(M * d), p(M * S), o(M * dv);
    std::vector<const uint8_t*> keys(S), values(S);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* sl = slots + b * S;
      for (int64_t j = 0; j < n_kv; ++j) {
        for (int64_t s = 0; s < S; ++s) {
          keys[s] = reinterpret_cast<const uint8_t*>(plane + sl[s] * W + k_off + j * d);
          values[s] = reinterpret_cast<const uint8_t*>(plane + sl[s] * W + v_off + j * dv);
        }
        for (int64_t t0 = 0; t0 < T_; t0 += P) {
          const int64_t n = std::min(P, T_ - t0), m = n * g;  // rows (position t0 + i / g, head j·g + i % g)
          for (int64_t i = 0; i < m; ++i) {
            const T* src = q + ((b * H + j * g + i % g) * T_ + t0 + i / g) * d;
            for (int64_t e = 0; e < d; ++e) qf[i * d + e] = static_cast<float>(src[e]) * scale;
          }
          attend_rows<WT>(qf.data(), d, keys.data(), values.data(), dv, WType::F32, bias + (b * T_ + t0) * S, m, g,
                          S, 1.0f, o.data(), p.data());
          for (int64_t i = 0; i < m; ++i) {
            T* dst = out + ((b * H + j * g + i % g) * T_ + t0 + i / g) * dv;
            for (int64_t e = 0; e < dv; ++e) dst[e] = static_cast<T>(o[i * dv + e]);
          }
        }
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& plane, const at::Tensor& slots,
                           const at::Tensor& bias, int64_t n_kv, int64_t k_off, int64_t v_off, int64_t dv,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && plane.dim() == 2 && slots.dim() == 2 && bias.dim() == 3,
              "paged_attention: q [B,H,T,d], plane [N,W], slots [B,S], bias [B,T,S]");
  TORCH_CHECK(q.is_contiguous() && plane.is_contiguous() && slots.is_contiguous() && bias.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.scalar_type() == plane.scalar_type(), "paged_attention: q and the pool plane differ in dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && bias.scalar_type() == at::kFloat,
              "paged_attention: slots int64, bias fp32");
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), d = q.size(3), S = slots.size(1), W = plane.size(1);
  TORCH_CHECK(H % n_kv == 0 && slots.size(0) == B && bias.size(0) == B && bias.size(1) == T_ && bias.size(2) == S,
              "paged_attention: shapes disagree");
  TORCH_CHECK(k_off + n_kv * d <= W && v_off + n_kv * dv <= W, "paged_attention: heads run past the row width");
  at::Tensor out = at::empty({B, H, T_, dv}, q.options());
  const auto* sl = slots.data_ptr<int64_t>();
  const auto* bi = bias.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      attend(q.data_ptr<float>(), plane.data_ptr<float>(), sl, bi, out.data_ptr<float>(), B, H, T_, S, d, dv, W,
             n_kv, k_off, v_off, sc);
      break;
    case at::kBFloat16:
      attend(q.data_ptr<c10::BFloat16>(), plane.data_ptr<c10::BFloat16>(), sl, bi, out.data_ptr<c10::BFloat16>(), B,
             H, T_, S, d, dv, W, n_kv, k_off, v_off, sc);
      break;
    case at::kHalf:
      attend(q.data_ptr<c10::Half>(), plane.data_ptr<c10::Half>(), sl, bi, out.data_ptr<c10::Half>(), B, H, T_, S, d,
             dv, W, n_kv, k_off, v_off, sc);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: fp32, bf16 or fp16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("paged_attention(Tensor q, Tensor plane, Tensor slots, Tensor bias, int n_kv, int k_off, int v_off, int dv, "
        "float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
