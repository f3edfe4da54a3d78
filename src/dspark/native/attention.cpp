// paged_attention: the query rows of each sequence attend over keys and values read in place from a paged pool plane,
// compiled for the running machine with kernels.cpp (same library, same torch.ops namespace).
//
//   q      [B, H, T, d]   queries (bf16, fp16 or fp32), H = n_kv · g (query head h reads KV head h / g)
//   plane  [N, W]         one layer of the pool: slot n holds a token's row; head j's key at k_off + j·d and its
//                         value at v_off + j·dv (GQA pages: [k of every head | v of every head])
//   slots  [B, S] int64   the slot of each visible key position (padding: any slot, hidden by the bias)
//   bias   [B, T, S] fp32 additive mask, 0 (visible) or -inf (hidden)
//   → out  [B, H, T, dv]  in q's dtype
//
// It replaces "gather every visible row into [B, S, W], then scaled-dot-product attention" for every row count (a
// decode step, a verification, a prefill chunk) and dtype: the rows are read once per query tile, where they lie,
// with no gathered copy and no strided-head SDPA (at batch 48 over 1k-token contexts those two were ~60 % of a
// SmolLM2 decode step). Per sequence and KV head, its query rows (query head h reads KV head h / g) go through
// attend_rows.h: scores, softmax and the weighted sum of values in fp32, each query row alone and each sum in key
// order, rounded once to q's dtype. A row's result therefore depends on nothing but its own query and the keys it
// sees: not the batch, the chunk its prompt was prefilled in, or where a cached prefix ended.
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
