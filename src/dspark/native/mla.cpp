// mla_attend: the absorbed Multi-head Latent Attention core of models/mla.py (MLAttention.attend_queries with
// absorbed=True, backend "torch") for the query rows of each sequence (decode, verification, prefill chunks), in one
// call instead of ~30 eager ops per layer. Compiled with kernels.cpp into one library, one torch.ops namespace.
//
//   q_nope [B, T, H, Dn]   q_pe [B, T, H, R] (rotated)      the projected queries, model dtype
//   kv     [B, S, C+R]     the visible latents [kv_a_layernorm(c_kv) | rope(k_pe)], model dtype
//   bias   [B, 1, T, S] (or [B, T, S]) fp32 additive mask (0 visible, -inf hidden)
//   w_uk_t [H, C, Dn]      W_UK transposed (rows over Dn)    w_uv [H, Dv, C] (rows over C)
//   gate_x [B, T, D] and g_proj [H·Dv, D]: the output gate sigmoid(g_proj(x)) (both or neither)
//   o_proj [D, H·Dv], o_bias [D]
//   → [B, T, D] in the model dtype
//
// The module's steps in its order: q_lat = q_nope·W_UK, scores = [q_lat | q_pe]·kvᵀ (the product rounded to the
// model dtype as torch's GEMM output is), ·scale in fp32, + bias, fp32 softmax, probs rounded to the model dtype,
// o_lat = probs·kv[:, :C], out = o_lat·W_UVᵀ, out·sigmoid(g_proj(x)), o_proj. Every product accumulates in fp32 and
// is rounded (round_as) wherever the module path holds a bf16/fp16 tensor, so the two paths differ only in the order
// of the sums (fp32: nothing else). Each query row is computed alone (dense_rows and the per-row attention below
// use one fixed order per row): a row's result does not depend on how many rows share the call, so a verification
// of K+1 rows computes what K+1 decode steps would.
//
// Threads: the products split their output rows (dense_rows), the attention splits sequences.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attend_rows.h"
#include "dense.h"

namespace {

using OptT = std::optional<at::Tensor>;

at::Tensor mla_attend(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_in,
                      const at::Tensor& bias_in, const at::Tensor& w_uk_t, const at::Tensor& w_uv, double scale,
                      const OptT& gate_x, const OptT& g_proj, const at::Tensor& o_proj, const OptT& o_bias) {
  TORCH_CHECK(q_nope.dim() == 4 && q_pe.dim() == 4 && kv_in.dim() == 3, "mla_attend: q_nope [B,T,H,Dn], q_pe [B,T,H,R],",
              " kv [B,S,C+R]");
  const int64_t B = q_nope.size(0), T = q_nope.size(1), H = q_nope.size(2), Dn = q_nope.size(3), R = q_pe.size(3);
  const int64_t S = kv_in.size(1), W = kv_in.size(2), C = W - R, BT = B * T;
  const auto dtype = q_nope.scalar_type();
  const WType md = wtype_of(q_nope, "mla_attend");
  TORCH_CHECK(q_pe.scalar_type() == dtype && kv_in.scalar_type() == dtype, "mla_attend: q and kv differ in dtype");
  TORCH_CHECK(q_pe.size(0) == B && q_pe.size(1) == T && q_pe.size(2) == H && kv_in.size(0) == B && C > 0,
              "mla_attend: query and latent shapes disagree");
  TORCH_CHECK(w_uk_t.dim() == 3 && w_uk_t.is_contiguous() && w_uk_t.size(0) == H && w_uk_t.size(1) == C &&
                  w_uk_t.size(2) == Dn,
              "mla_attend: w_uk_t must be a contiguous [H, C, Dn]");
  TORCH_CHECK(w_uv.dim() == 3 && w_uv.is_contiguous() && w_uv.size(0) == H && w_uv.size(2) == C,
              "mla_attend: w_uv must be a contiguous [H, Dv, C]");
  const int64_t Dv = w_uv.size(1);
  const at::Tensor bias = bias_in.contiguous();
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == BT * S && bias.size(0) == B &&
                  bias.size(-1) == S && bias.size(-2) == T,
              "mla_attend: bias must be fp32 [B, 1, T, S] or [B, T, S]");
  const DenseW o = dense_of(o_proj, "mla_attend o_proj");
  TORCH_CHECK(o.K == H * Dv, "mla_attend: o_proj takes ", o.K, " inputs, not H·Dv = ", H * Dv);
  TORCH_CHECK(gate_x.has_value() == g_proj.has_value(), "mla_attend: the gate needs both gate_x and g_proj");
  if (o_bias.has_value())
    TORCH_CHECK(o_bias->numel() == o.N, "mla_attend: o_bias must have ", o.N, " values");

  const at::Tensor kv = kv_in.contiguous();
  const at::Tensor qn = q_nope.to(at::kFloat).contiguous();  // [BT, H, Dn]
  const at::Tensor qp = q_pe.to(at::kFloat).contiguous();    // [BT, H, R]
  const float* qn_p = qn.data_ptr<float>();
  const float* qp_p = qp.data_ptr<float>();

  // q = [q_nope·W_UK | q_pe] per head: [BT, H, W]
  std::vector<float> q(BT * H * W);
  for (int64_t h = 0; h < H; ++h)
    dense_rows(dense_entry(w_uk_t, h, "mla_attend w_uk_t"), qn_p + h * Dn, BT, H * Dn, q.data() + h * W, H * W);
  for (int64_t r = 0; r < BT * H; ++r) {
    round_all(q.data() + r * W, C, md);
    std::memcpy(q.data() + r * W + C, qp_p + r * R, R * sizeof(float));
  }

  // attention per sequence: o_lat [BT, H, C]
  std::vector<float> o_lat(BT * H * C);
  const auto* kv_p = static_cast<const uint8_t*>(kv.data_ptr());
  const int64_t esize = kv.element_size();
  const float* bias_p = bias.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t M = T * H;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> p;  // every score is written before it is read: kept, never zeroed, between calls
    thread_local std::vector<const uint8_t*> rows;
    p.resize(M * S);
    rows.resize(S);
    for (int64_t b = b0; b < b1; ++b) {
      const float* qb = q.data() + b * M * W;
      const uint8_t* kvb = kv_p + b * S * W * esize;
      for (int64_t s = 0; s < S; ++s) rows[s] = kvb + s * W * esize;  // a latent row is its key and its value
      const float* bb = bias_p + b * T * S;
      float* ob = o_lat.data() + b * M * C;
      if (md == WType::BF16) attend_rows<WType::BF16>(qb, W, rows.data(), rows.data(), C, md, bb, M, H, S, sc, ob, p.data());
      if (md == WType::F16) attend_rows<WType::F16>(qb, W, rows.data(), rows.data(), C, md, bb, M, H, S, sc, ob, p.data());
      if (md == WType::F32) attend_rows<WType::F32>(qb, W, rows.data(), rows.data(), C, md, bb, M, H, S, sc, ob, p.data());
    }
  });

  // out = o_lat·W_UVᵀ per head: [BT, H·Dv]
  std::vector<float> out(BT * H * Dv);
  for (int64_t h = 0; h < H; ++h)
    dense_rows(dense_entry(w_uv, h, "mla_attend w_uv"), o_lat.data() + h * C, BT, H * C, out.data() + h * Dv, H * Dv);
  round_all(out.data(), BT * H * Dv, md);

  if (g_proj.has_value()) {  // out · sigmoid(g_proj(x)), each step rounded as its tensor
    const DenseW g = dense_of(*g_proj, "mla_attend g_proj");
    TORCH_CHECK(g.N == H * Dv && gate_x->numel() == BT * g.K, "mla_attend: gate shapes disagree");
    const at::Tensor xg = gate_x->to(at::kFloat).contiguous();
    std::vector<float> gv(BT * g.N);
    dense_rows(g, xg.data_ptr<float>(), BT, g.K, gv.data(), g.N);
    for (int64_t i = 0; i < BT * g.N; ++i) {
      const float sg = round_as(sigmoid_f(round_as(gv[i], md)), md);
      out[i] = round_as(out[i] * sg, md);
    }
  }

  at::Tensor y = at::empty({B, T, o.N}, q_nope.options().dtype(at::kFloat));
  float* y_p = y.data_ptr<float>();
  dense_rows(o, out.data(), BT, H * Dv, y_p, o.N);
  if (o_bias.has_value()) {
    const at::Tensor ob = o_bias->to(at::kFloat).contiguous();
    const float* b = ob.data_ptr<float>();
    for (int64_t r = 0; r < BT; ++r)
      for (int64_t n = 0; n < o.N; ++n) y_p[r * o.N + n] += b[n];
  }
  return dtype == at::kFloat ? y : y.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("mla_attend(Tensor q_nope, Tensor q_pe, Tensor kv, Tensor bias, Tensor w_uk_t, Tensor w_uv, float scale, "
        "Tensor? gate_x, Tensor? g_proj, Tensor o_proj, Tensor? o_bias) -> Tensor");
  m.impl("mla_attend", c10::DispatchKey::CPU, &mla_attend);
}
