// mla_project: the projections of models/mla.py's MLAttention.project for every row (decode, verification,
// prefill chunks) in one call instead of ~25 eager ops per layer: the query (q_proj, or q_a_proj → q_a_layernorm →
// q_b_proj), the latent (kv_a_proj_with_mqa → kv_a_layernorm on c_kv) and the RoPE of q_pe and k_pe (unless the
// model uses no position encoding in MLA, use_nope).
//
//   x      [B, T, D] (model dtype)        cos, sin [B, T, R/2] (the rotation tables; any float dtype)
//   wq     [H·(Dn+R), D], or q_a [Lq, D] with q_a_norm [Lq] and q_b [H·(Dn+R), Lq]
//   wkv    [C+R, D]   kv_norm [C]
//   → (latent [B, T, C+R], q_nope [B, T, H, Dn], q_pe [B, T, H, R]), all in the model dtype
//
// The module's operations and roundings: every product accumulates in fp32 (dense.h) and is rounded to the model
// dtype as torch's GEMM output is; RMSNorm is x·rsqrt(mean(x²) + eps) rounded, then ·weight rounded (the module's
// weight * F.rms_norm(x)); the rotation (x1·cos − x2·sin, x2·cos + x1·sin) in fp32, rounded, on adjacent pairs
// (interleave) or halves. Each row is computed alone: a row's result does not depend on how many rows share the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "dense.h"

namespace {

using OptT = std::optional<at::Tensor>;

// y[0..n) = round(round(x·rsqrt(mean(x²) + eps))·w), in place
void rms_norm_rounded(float* x, int64_t n, const float* w, float eps, WType dt) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = round_as(w[i] * round_as(x[i] * inv, dt), dt);
}

// rotate v[0..R) by cos/sin [R/2] in place (the values are already rounded to the model dtype)
void rotate(float* v, int64_t R, const float* c, const float* s, bool interleave, WType dt) {
  const int64_t half = R / 2;
  float tmp[512];
  TORCH_CHECK(R <= 512, "mla_project: rope dim ", R, " > 512");
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleave ? v[2 * i] : v[i], x2 = interleave ? v[2 * i + 1] : v[i + half];
    const float a = x1 * c[i] - x2 * s[i], b = x2 * c[i] + x1 * s[i];
    tmp[interleave ? 2 * i : i] = round_as(a, dt);
    tmp[interleave ? 2 * i + 1 : i + half] = round_as(b, dt);
  }
  std::memcpy(v, tmp, sizeof(float) * R);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_project(
    const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor& wq_in,
    const OptT& q_a_norm, double q_eps, const OptT& q_b_in, const at::Tensor& wkv_in, const at::Tensor& kv_norm,
    double kv_eps, int64_t H, int64_t Dn, int64_t R, bool use_nope, bool interleave) {
  const WType dt = wtype_of(x_in, "mla_project x");
  TORCH_CHECK(x_in.dim() == 3, "mla_project: x must be [B, T, D], got ", x_in.sizes());
  const int64_t B = x_in.size(0), T = x_in.size(1), D = x_in.size(2), M = B * T, QW = H * (Dn + R);
  const DenseW wq = dense_of(wq_in.contiguous(), "mla_project q"), wkv = dense_of(wkv_in.contiguous(), "mla_project kv_a");
  const bool lora = q_b_in.has_value();
  TORCH_CHECK(lora == q_a_norm.has_value(), "mla_project: q_a_norm and q_b come together");
  TORCH_CHECK(wq.K == D && wkv.K == D && wkv.N > R, "mla_project: projection widths disagree with x");
  const int64_t C = wkv.N - R;
  TORCH_CHECK(kv_norm.numel() == C, "mla_project: kv_a_layernorm has ", kv_norm.numel(), " weights for ", C);
  DenseW qb;
  at::Tensor qan;
  if (lora) {
    qb = dense_of(q_b_in->contiguous(), "mla_project q_b");
    qan = q_a_norm->to(at::kFloat).contiguous();
    TORCH_CHECK(qb.N == QW && qb.K == wq.N && qan.numel() == wq.N, "mla_project: q_a/q_b shapes disagree");
  } else {
    TORCH_CHECK(wq.N == QW, "mla_project: q_proj has ", wq.N, " outputs for H·(Dn+R) = ", QW);
  }
  TORCH_CHECK(R % 2 == 0 && cos_in.numel() == M * (R / 2) && sin_in.numel() == M * (R / 2),
              "mla_project: cos/sin must be [B, T, R/2]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), cs = cos_in.to(at::kFloat).contiguous();
  const at::Tensor sn = sin_in.to(at::kFloat).contiguous(), kvn = kv_norm.to(at::kFloat).contiguous();
  const auto opts = x.options();
  at::Tensor qa = at::empty({M, wq.N}, opts), q = lora ? at::empty({M, QW}, opts) : qa, kv = at::empty({M, C + R}, opts);
  dense_rows(wq, x.data_ptr<float>(), M, D, qa.data_ptr<float>(), wq.N);
  dense_rows(wkv, x.data_ptr<float>(), M, D, kv.data_ptr<float>(), C + R);
  round_all(qa.data_ptr<float>(), M * wq.N, dt);
  round_all(kv.data_ptr<float>(), M * (C + R), dt);
  if (lora) {
    for (int64_t m = 0; m < M; ++m)
      rms_norm_rounded(qa.data_ptr<float>() + m * wq.N, wq.N, qan.data_ptr<float>(), float(q_eps), dt);
    dense_rows(qb, qa.data_ptr<float>(), M, wq.N, q.data_ptr<float>(), QW);
    round_all(q.data_ptr<float>(), M * QW, dt);
  }
  at::Tensor q_nope = at::empty({B, T, H, Dn}, opts), q_pe = at::empty({B, T, H, R}, opts);
  float *qp = q.data_ptr<float>(), *kp = kv.data_ptr<float>(), *np = q_nope.data_ptr<float>(), *pp = q_pe.data_ptr<float>();
  const float *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float *c = cp + m * (R / 2), *s = sp + m * (R / 2);
    rms_norm_rounded(kp + m * (C + R), C, kvn.data_ptr<float>(), float(kv_eps), dt);
    if (!use_nope) rotate(kp + m * (C + R) + C, R, c, s, interleave, dt);
    for (int64_t h = 0; h < H; ++h) {
      float* head = qp + m * QW + h * (Dn + R);
      if (!use_nope) rotate(head + Dn, R, c, s, interleave, dt);
      std::memcpy(np + (m * H + h) * Dn, head, sizeof(float) * Dn);
      std::memcpy(pp + (m * H + h) * R, head + Dn, sizeof(float) * R);
    }
  }
  const auto t = x_in.scalar_type();
  if (dt == WType::F32) return {kv.view({B, T, C + R}), q_nope, q_pe};
  return {kv.view({B, T, C + R}).to(t), q_nope.to(t), q_pe.to(t)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("mla_project(Tensor x, Tensor cos, Tensor sin, Tensor wq, Tensor? q_a_norm, float q_eps, Tensor? q_b, "
        "Tensor wkv, Tensor kv_norm, float kv_eps, int H, int Dn, int R, bool use_nope, bool interleave) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("mla_project", c10::DispatchKey::CPU, &mla_project);
}
