// dense_linear: y = x·Wᵀ (+ bias) for inference, every output one fixed-order sum (dense.h's dense_rows) and the
// bias added after it, so a row's result does not depend on how many rows share the call. fp32's GEMMs (MKL) block
// their sums by the row count, which makes a prompt's rows depend on the chunks it is prefilled in and a decode
// step's on the batch; models/packing.py's Linear takes this kernel for fp32 inference instead.
//
//   x [..., K] (fp32, bf16 or fp16), W [N, K] (same dtype), bias [N] or None → [..., N] in x's dtype

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "dense.h"

namespace {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const DenseW W = dense_of(w, "dense_linear");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == W.K, "dense_linear: x has ", x.size(-1), " features, the weight ", W.K);
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "dense_linear: x and the weight differ in dtype");
  const int64_t M = W.K == 0 ? 0 : x.numel() / W.K;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W.N;
  at::Tensor y = at::empty(shape, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  dense_rows(W, xf.data_ptr<float>(), M, W.K, yp, W.N);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == W.N, "dense_linear: bias must have ", W.N, " values");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    const float* bp = b.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < W.N; ++n) yp[m * W.N + n] += bp[n];
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
}
