// markov_greedy: the Markov head's serial greedy loop (vanilla head) for every request in one call, instead of K
// rounds of ~10 eager ops: per slot k, e = W1[prev] (the previous token's row), the correction W2·e rounded to W2's
// dtype (what the module's product returns), added to the base logits in fp32, and the first index of the maximum
// (torch.argmax's choice) as the next token, mapped through ids when the logits cover a reduced draft vocabulary.
// Compiled with kernels.cpp into one library, one torch.ops namespace.
//
//   base   [B, K, N] fp32   the drafter's base logits of the K slots (N: the vocabulary, or the reduced one)
//   w1     [V, r]           the head's W1 (fp32, bf16 or fp16), rows by target token id
//   w2     [N, r]           W2 (or its rows of the reduced vocabulary), same dtypes
//   anchor [B] int64        the token before slot 0
//   ids    [N] int64        optional: draft index -> target token id
//   -> tokens [B, K] int64 (target ids)
//
// The products are dense.h's dense_rows: every output one fixed-order sum, so a request's drafts never depend on the
// other requests of the call. Their order is not oneDNN's or MKL's, so a correction can differ from the module's in
// the last bit and, at an exact tie, pick another draft; drafts only decide what is verified, never the output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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

at::Tensor markov_greedy(const at::Tensor& base, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& anchor,
                         const std::optional<at::Tensor>& ids) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && base.is_contiguous(),
              "markov_greedy: base logits must be a contiguous fp32 [B, K, N]");
  const int64_t B = base.size(0), K = base.size(1), N = base.size(2);
  const DenseW W2 = dense_of(w2, "markov_greedy W2");
  TORCH_CHECK(w1.dim() == 2 && w1.is_contiguous() && w1.size(1) == W2.K && W2.N == N,
              "markov_greedy: W1 [V, r] and W2 [N, r] must share r, and W2 cover the logits' ", N, " entries");
  const WType t1 = wtype_of(w1, "markov_greedy W1");
  TORCH_CHECK(anchor.dim() == 1 && anchor.size(0) == B && anchor.scalar_type() == at::kLong && anchor.is_contiguous(),
              "markov_greedy: one int64 anchor per request");
  const int64_t* map = nullptr;
  if (ids.has_value()) {
    TORCH_CHECK(ids->dim() == 1 && ids->size(0) == N && ids->scalar_type() == at::kLong && ids->is_contiguous(),
                "markov_greedy: ids must be int64 [N]");
    map = ids->data_ptr<int64_t>();
  }
  const int64_t V = w1.size(0), r = W2.K;
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
    dense_rows(W2, e.data(), B, r, corr.data(), N);
    for (int64_t b = 0; b < B; ++b) {
      const float* lg = bp + (b * K + k) * N;
      const float* c = corr.data() + b * N;
      int64_t best = 0;
      float top = lg[0] + round_as(c[0], W2.t);
      for (int64_t n = 1; n < N; ++n) {
        const float v = lg[n] + round_as(c[n], W2.t);
        if (v > top) {
          top = v;
          best = n;
        }
      }
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
