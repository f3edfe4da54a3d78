// res_mix: one AttnRes mixing point of the K3 targets (models/k3.py ResMix) in one call instead of ~17 eager ops:
// for every row, score_j = ⟨v_j / rms(v_j), norm.weight ⊙ proj.weight⟩ over the J values (block snapshots and the
// running prefix), p = softmax_j(score), mix = Σ_j p_j·v_j, all in fp32 from the values as stored, the result in
// their dtype. Rows are independent (a decode step and a verification agree); only the order of sums differs from
// the module.
//
//   values  J tensors [..., D] of one shape and dtype      w [D] fp32 (norm.weight ⊙ proj.weight)     eps
//   → [..., D] in the values' dtype

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "dense.h"

namespace {

at::Tensor res_mix(at::TensorList values, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(!values.empty(), "res_mix: no values to mix");
  const at::Tensor& first = values[0];
  const WType dt = wtype_of(first, "res_mix values");
  const int64_t J = static_cast<int64_t>(values.size()), D = first.size(-1), R = D ? first.numel() / D : 0;
  std::vector<at::Tensor> vs;
  std::vector<const float*> vp;
  for (const at::Tensor& v : values) {
    TORCH_CHECK(v.sizes() == first.sizes() && v.scalar_type() == first.scalar_type(),
                "res_mix: every value must have the first one's shape and dtype");
    vs.push_back(v.to(at::kFloat).contiguous());
    vp.push_back(vs.back().data_ptr<float>());
  }
  const at::Tensor w = w_in.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == D, "res_mix: weight has ", w.numel(), " values for rows of ", D);
  const float* wp = w.data_ptr<float>();
  at::Tensor out = at::empty(first.sizes(), first.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(J);
    for (int64_t r = r0; r < r1; ++r) {
      float top = -INFINITY;
      for (int64_t j = 0; j < J; ++j) {
        const float* v = vp[j] + r * D;
        float ss = 0.0f;
        for (int64_t d = 0; d < D; ++d) ss += v[d] * v[d];
        const float inv = 1.0f / std::sqrt(ss / float(D) + float(eps));
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += (v[d] * inv) * wp[d];
        p[j] = s;
        top = std::max(top, s);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < J; ++j) {
        p[j] = std::exp(p[j] - top);
        total += p[j];
      }
      float* o = op + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int64_t j = 0; j < J; ++j) {
        const float pj = p[j] / total;
        const float* v = vp[j] + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += pj * v[d];
      }
    }
  });
  return dt == WType::F32 ? out : out.to(first.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("res_mix(Tensor[] values, Tensor w, float eps) -> Tensor");
  m.impl("res_mix", c10::DispatchKey::CPU, &res_mix);
}
