// markov_greedy: the Markov head's serial greedy loop (vanilla head) for every request in one call, instead of K
// rounds of ~10 eager ops: per slot k, e = W1[prev] (the previous token's row), the correction W2·e rounded to the
// head's dtype (what the module's product returns), added to the base logits in fp32, and the first index of the maximum
// (torch.argmax's choice) as the next token, mapped through ids when the logits cover a reduced draft vocabulary.
// Compiled with kernels.cpp into one library, one torch.ops namespace.
//
//   base   [B, K, N] fp32   the drafter's base logits of the K slots (N: the vocabulary, or the reduced one)
//   w1     [V, r]           the head's W1 (fp32, bf16 or fp16), rows by target token id
//   w2     [N, r]           W2 (or its rows of the reduced vocabulary), contiguous: the correction is dense.h's
//                           dense_rows over it (bf16: its packed pair copy, 16 outputs a vector chain), every request
//                           of a slot in one pass over the weight. W1's dtype, or bf16 where W2's fp32 values are all
//                           bf16 values (a drafter stored in bf16): the same products, half the bytes read per slot
//   anchor [B] int64        the token before slot 0
//   ids    [N] int64        optional: draft index -> target token id
//   -> tokens [B, K] int64 (target ids)
//
// Every output of the correction is one fixed-order sum (dense_rows: each row alone), so a request's drafts never
// depend on the other requests of the call. Their order is not oneDNN's or MKL's, so a correction can differ from the module's in
// the last bit and, at an exact tie, pick another draft; drafts only decide what is verified, never the output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "dense.h"

namespace {

inline float widen_any(const void* row, int64_t j, WType t) {
  if (t == WType::BF16) return bf16_to_f(static_cast<const uint16_t*>(row)[j]);
  if (t == WType::F16) return f16_to_f(static_cast<const uint16_t*>(row)[j]);
  return static_cast<const float*>(row)[j];
}

// the first index of the maximum of lg[n] + c[n] (torch.argmax's choice; AVX-512: per lane the first maximum, then
// the lowest index among the lanes that hold the overall one)
inline int64_t argmax_sum(const float* lg, const float* c, int64_t N) {
  int64_t n = 0, best = 0;
  float top = lg[0] + c[0];
#if defined(DSPARK_DENSE512)
  if (N >= 16) {
    __m512 vmax = _mm512_add_ps(_mm512_loadu_ps(lg), _mm512_loadu_ps(c));
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i cur = vidx;
    for (n = 16; n + 16 <= N; n += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(lg + n), _mm512_loadu_ps(c + n));
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    alignas(64) float mv[16];
    alignas(64) int32_t mi[16];
    _mm512_store_ps(mv, vmax);
    _mm512_store_si512(mi, vidx);
    top = mv[0];
    best = mi[0];
    for (int l = 1; l < 16; ++l)
      if (mv[l] > top || (mv[l] == top && mi[l] < best)) {
        top = mv[l];
        best = mi[l];
      }
  }
#endif
  for (n = std::max<int64_t>(n, 1); n < N; ++n) {
    const float v = lg[n] + c[n];
    if (v > top) {
      top = v;
      best = n;
    }
  }
  return best;
}

at::Tensor markov_greedy(const at::Tensor& base, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& anchor,
                         const std::optional<at::Tensor>& ids) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && base.is_contiguous(),
              "markov_greedy: base logits must be a contiguous fp32 [B, K, N]");
  const int64_t B = base.size(0), K = base.size(1), N = base.size(2);
  TORCH_CHECK(w2.dim() == 2 && w2.is_contiguous() && w1.dim() == 2 && w1.is_contiguous(),
              "markov_greedy: W1 [V, r] and W2 [N, r] must be contiguous 2-D");
  const WType t1 = wtype_of(w1, "markov_greedy W1");
  const int64_t V = w1.size(0), r = w1.size(1);
  TORCH_CHECK(w2.size(1) == r && w2.size(0) == N,
              "markov_greedy: W1 [V, r] and W2 [N, r] must share r, and W2 cover the logits' ", N, " entries");
  const DenseW W2 = dense_of(w2, "markov_greedy W2");
  TORCH_CHECK(anchor.dim() == 1 && anchor.size(0) == B && anchor.scalar_type() == at::kLong && anchor.is_contiguous(),
              "markov_greedy: one int64 anchor per request");
  const int64_t* map = nullptr;
  if (ids.has_value()) {
    TORCH_CHECK(ids->dim() == 1 && ids->size(0) == N && ids->scalar_type() == at::kLong && ids->is_contiguous(),
                "markov_greedy: ids must be int64 [N]");
    map = ids->data_ptr<int64_t>();
  }
  const size_t row_bytes = static_cast<size_t>(r) * w1.element_size();
  const auto* w1p = static_cast<const uint8_t*>(w1.data_ptr());
  const float* bp = base.data_ptr<float>();
  at::Tensor tokens = at::empty({B, K}, anchor.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  std::vector<int64_t> prev(anchor.data_ptr<int64_t>(), anchor.data_ptr<int64_t>() + B);
  std::vector<float> e(B * r), corr(B * N);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(prev[b] >= 0 && prev[b] < V, "markov_greedy: token ", prev[b], " outside W1's ", V, " rows");
      const void* row = w1p + prev[b] * row_bytes;
      for (int64_t j = 0; j < r; ++j) e[b * r + j] = widen_any(row, j, t1);
    }
    dense_rows(W2, e.data(), B, r, corr.data(), N);  // every request's correction W2·e, each row alone
    round_all(corr.data(), B * N, t1);                // the module's product returns the head's dtype (W1's)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t best = argmax_sum(bp + (b * K + k) * N, corr.data() + b * N, N);
      const int64_t tok = map != nullptr ? map[best] : best;
      tp[b * K + k] = tok;
      prev[b] = tok;
    }
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("markov_greedy(Tensor base, Tensor w1, Tensor w2, Tensor anchor, Tensor? ids) -> Tensor");
  m.impl("markov_greedy", c10::DispatchKey::CPU, &markov_greedy);
}
