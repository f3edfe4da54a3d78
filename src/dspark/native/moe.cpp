// moe_rows: a whole MoE block (models/target.py MoE, models/k3.py K3MoE) for a few rows in one call instead of
// ~100-460 eager ops per layer: router, routed experts (optionally in a latent space, with the latent RMSNorm and
// the projections around them), shared expert and the sum. Compiled with kernels.cpp into one library.
//
//   x             [N, D]        bf16 / fp16 / fp32 (the model dtype T); → out [N, D] in T
//   router        [E, D] fp32   MoEGate's weight (fp32 copy);  bias [E] fp32 or none (noaux_tc correction)
//   gate_up       [E, 2I, W] T  stacked routed experts (W = D, or the latent width);  down [E, W, I] T
//   latent_down   [W, D] T, latent_norm [W], latent_up [D, W] T   (all three, or none)
//   shared_gate_up [2Is, D] T, shared_down [D, Is] T              (both, or none)
//   act           0: silu(g)·u   1: SiTU b_g·tanh(g/b_g)·σ(g) · b_u·tanh(u/b_u)
//
// The router runs in fp32 as MoEGate.forward (sigmoid or softmax scores; choice = scores + bias; group-limited
// routing when group_mode (1: a group scores the sum of its top-2 choices, noaux_tc; 2: its best) keeps the
// topk_group best of n_group groups; top-k by choice, ties to the lower index; weights = the chosen scores,
// renormalised over the k when norm_topk, × scaling). Every product is dense_rows (dense.h) and every value the
// module path holds in a T tensor is rounded to T (round_as): the GEMM outputs, each step of the activation, the
// weighted expert sum (Σ in fp32 over the experts in ascending order, rounded once, as the bf16 dense pass), the
// latent norm and the final sum. In fp32 the result therefore differs from the modules only in the order of the
// GEMM sums. Each row is computed alone (rows that share an expert share its weight reads, never a sum), so a row's
// result is bit for bit the same in a 1-row decode step and an 8-row verification.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "dense.h"
#include "vmath.h"

namespace {

using OptT = std::optional<at::Tensor>;

// exp16, tanh16, sigmoid16, silu16: vmath.h (each lane alone; rounded to the module's dtype right after, as the
// scalar path's results are)

struct Act {
  int64_t kind;  // 0 silu·u, 1 SiTU
  float bg, bu;
  WType t;  // the rounding of the module path's tensors

  // h[j] = act(g[j], u[j]) with each torch op's result rounded to t, in the order the module evaluates them
  void operator()(const float* g, const float* u, float* h, int64_t n) const {
#if defined(DSPARK_DENSE512)
    for (int64_t j = 0; j < n; j += 16) {  // every element through the same lanes' code, the tail masked
      const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + j), uv = _mm512_maskz_loadu_ps(m, u + j);
      __m512 hv;
      if (kind == 0) {
        const __m512 silu = silu16(gv);
        hv = round16(_mm512_mul_ps(round16(silu, t), uv), t);
      } else {  // bg * tanh(g / bg) * sigmoid(g) * (bu * tanh(u / bu))
        const __m512 a = round16(_mm512_mul_ps(splat(bg), round16(tanh16(round16(_mm512_div_ps(gv, splat(bg)), t)), t)), t);
        const __m512 s = round16(sigmoid16(gv), t);
        const __m512 b = round16(_mm512_mul_ps(splat(bu), round16(tanh16(round16(_mm512_div_ps(uv, splat(bu)), t)), t)), t);
        hv = round16(_mm512_mul_ps(round16(_mm512_mul_ps(a, s), t), b), t);
      }
      _mm512_mask_storeu_ps(h + j, m, hv);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (t != WType::F32) {  // bf16/fp16 activations on an AVX2 CPU: the scalar steps below
      scalar(g, u, h, n);
      return;
    }
    for (int64_t j = 0; j < n; j += 8) {  // fp32 (no rounding between the steps), the tail through the same lanes
      alignas(32) float gt[8] = {}, ut[8] = {}, ht[8];
      const int64_t w = std::min<int64_t>(8, n - j);
      std::copy(g + j, g + j + w, gt);
      std::copy(u + j, u + j + w, ut);
      const __m256 gv = _mm256_load_ps(gt), uv = _mm256_load_ps(ut);
      __m256 hv;
      if (kind == 0) {
        hv = _mm256_mul_ps(silu8(gv), uv);
      } else {
        const __m256 bgv = splat8(bg), buv = splat8(bu);
        const __m256 a = _mm256_mul_ps(bgv, tanh8(_mm256_div_ps(gv, bgv)));
        const __m256 b = _mm256_mul_ps(buv, tanh8(_mm256_div_ps(uv, buv)));
        hv = _mm256_mul_ps(_mm256_mul_ps(a, sigmoid8(gv)), b);
      }
      _mm256_store_ps(ht, hv);
      std::copy(ht, ht + w, h + j);
    }
#else
    scalar(g, u, h, n);
#endif
  }

  void scalar(const float* g, const float* u, float* h, int64_t n) const {
    for (int64_t j = 0; j < n; ++j) {
      if (kind == 0) {
        h[j] = round_as(round_as(silu_f(g[j]), t) * u[j], t);
      } else {  // bg * tanh(g / bg) * sigmoid(g) * (bu * tanh(u / bu))
        const float a = round_as(bg * round_as(std::tanh(round_as(g[j] / bg, t)), t), t);
        const float s = round_as(sigmoid_f(g[j]), t);
        const float b = round_as(bu * round_as(std::tanh(round_as(u[j] / bu, t)), t), t);
        h[j] = round_as(round_as(a * s, t) * b, t);
      }
    }
  }
};

// y[M, out] = T(down · act(T(gate_up · x))) for M rows x [M, in] (gate_up [2I, in], down [out, I])
void glu_rows(const DenseW& gate_up, const DenseW& down, const float* x, int64_t M, const Act& act, float* y,
              std::vector<float>& gu, std::vector<float>& h) {
  const int64_t I = gate_up.N / 2;
  gu.resize(M * 2 * I);
  h.resize(M * I);
  dense_rows(gate_up, x, M, gate_up.K, gu.data(), 2 * I);
  round_all(gu.data(), M * 2 * I, act.t);
  for (int64_t m = 0; m < M; ++m) act(gu.data() + m * 2 * I, gu.data() + m * 2 * I + I, h.data() + m * I, I);
  dense_rows(down, h.data(), M, I, y, down.N);
  round_all(y, M * down.N, act.t);
}

// the index of the largest v[i] not yet taken (ties: the lower index, as torch.topk for distinct values)
int64_t take_max(const float* v, std::vector<char>& taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  taken[best] = 1;
  return best;
}

struct Router {
  int64_t E, k, n_group, topk_group, group_mode;  // group_mode: 0 none, 1 Σ top-2 per group (noaux_tc), 2 max
  bool softmax, norm_topk;
  float scaling;
  const float* bias;

  // MoEGate.forward on one row of fp32 logits s [E] (overwritten by the scores): the k chosen experts (descending
  // choice) and their weights
  void operator()(float* s, int64_t* idx, float* w) const {
    if (softmax) {
      float mx = s[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, s[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(s[e] - mx));
      for (int64_t e = 0; e < E; ++e) s[e] = s[e] / sum;
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = sigmoid_f(s[e]);
    }
    std::vector<float> c(s, s + E);
    if (bias)
      for (int64_t e = 0; e < E; ++e) c[e] = s[e] + bias[e];
    if (group_mode) {  // keep the topk_group best groups, the others' choices -inf
      const int64_t G = E / n_group;
      std::vector<float> gs(n_group);
      for (int64_t g = 0; g < n_group; ++g) {
        std::vector<char> t(G, 0);
        const float* cg = c.data() + g * G;
        const float first = cg[take_max(cg, t, G)];
        gs[g] = group_mode == 1 ? first + cg[take_max(cg, t, G)] : first;
      }
      std::vector<char> keep(n_group, 0), t(n_group, 0);
      for (int64_t j = 0; j < topk_group; ++j) keep[take_max(gs.data(), t, n_group)] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / G]) c[e] = -INFINITY;
    }
    std::vector<char> taken(E, 0);
    for (int64_t j = 0; j < k; ++j) idx[j] = take_max(c.data(), taken, E), w[j] = s[idx[j]];
    if (norm_topk) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += w[j];
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / (sum + 1e-20f);
    }
    if (scaling != 1.0f)
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] * scaling;
  }
};

at::Tensor moe_rows(const at::Tensor& x_in, const at::Tensor& router, const OptT& bias, int64_t top_k, bool softmax,
                    bool norm_topk, double scaling, int64_t n_group, int64_t topk_group, int64_t group_mode,
                    const at::Tensor& gate_up, const at::Tensor& down,
                    const OptT& latent_down, const OptT& latent_norm, double eps, const OptT& latent_up,
                    const OptT& shared_gate_up, const OptT& shared_down, int64_t act_kind, double beta_g,
                    double beta_u) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "moe_rows: x must be a CPU [N, D]");
  const at::Tensor x = x_in.contiguous();
  const WType t = wtype_of(x, "moe_rows: x");
  const int64_t N = x.size(0), D = x.size(1), E = router.size(0);
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(1) == D && router.is_contiguous(),
              "moe_rows: the router weight must be a contiguous fp32 [E, D]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == E && bias->is_contiguous()),
              "moe_rows: the correction bias must be a contiguous fp32 [E]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_rows: top_k ", top_k, " of ", E, " experts");
  TORCH_CHECK(group_mode >= 0 && group_mode <= 2 && n_group >= 1 && E % n_group == 0 && topk_group >= 1 &&
                  topk_group <= n_group && (group_mode != 1 || E / n_group >= 2),
              "moe_rows: groups ", n_group, " (keep ", topk_group, ", mode ", group_mode, ") of ", E, " experts");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == E && down.size(0) == E &&
                  gate_up.is_contiguous() && down.is_contiguous() && gate_up.size(1) == 2 * down.size(2),
              "moe_rows: stacks must be contiguous gate_up [E, 2I, W] and down [E, W, I]");
  const bool latent = latent_down.has_value();
  TORCH_CHECK(latent == latent_norm.has_value() && latent == latent_up.has_value(),
              "moe_rows: latent_down, latent_norm and latent_up come together");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "moe_rows: shared gate_up and down together");
  TORCH_CHECK(act_kind == 0 || act_kind == 1, "moe_rows: act is 0 (silu) or 1 (SiTU)");
  const int64_t W = latent ? latent_down->size(0) : D;
  TORCH_CHECK(gate_up.size(2) == W && down.size(1) == W, "moe_rows: expert width ", gate_up.size(2), " != ", W);
  DenseW ldown, lup, sgu, sdown;
  at::Tensor lnorm;
  if (latent) {
    ldown = dense_of(*latent_down, "moe_rows: latent_down");
    lup = dense_of(*latent_up, "moe_rows: latent_up");
    lnorm = latent_norm->to(at::kFloat).contiguous();
    TORCH_CHECK(ldown.K == D && lup.N == D && lup.K == W && lnorm.numel() == W, "moe_rows: latent shapes disagree");
  }
  if (shared_gate_up) {
    sgu = dense_of(*shared_gate_up, "moe_rows: shared gate_up");
    sdown = dense_of(*shared_down, "moe_rows: shared down");
    TORCH_CHECK(sgu.K == D && sdown.N == D && sgu.N == 2 * sdown.K, "moe_rows: shared expert shapes disagree");
  }
  const Act act{act_kind, float(beta_g), float(beta_u), t};

  // x in fp32 (exact), then the router: logits, scores, the k experts of each row and their weights
  std::vector<float> xf(N * D), logits(N * E), wts(N * top_k);
  std::vector<int64_t> idx(N * top_k);
  {
    const at::Tensor x32 = t == WType::F32 ? x : x.to(at::kFloat);
    std::memcpy(xf.data(), x32.data_ptr<float>(), sizeof(float) * N * D);
  }
  dense_rows(dense_of(router, "moe_rows: router"), xf.data(), N, D, logits.data(), E);
  const Router route{E,       top_k,     n_group, topk_group, group_mode, softmax, norm_topk, float(scaling),
                     bias ? bias->data_ptr<float>() : nullptr};
  for (int64_t m = 0; m < N; ++m) route(logits.data() + m * E, idx.data() + m * top_k, wts.data() + m * top_k);

  // the routed experts' input: x, or T(latent_down · x)
  std::vector<float> lat;
  if (latent) {
    lat.resize(N * W);
    dense_rows(ldown, xf.data(), N, D, lat.data(), W);
    round_all(lat.data(), N * W, t);
  }
  const float* inp = latent ? lat.data() : xf.data();

  // each expert once over the rows that chose it; acc[m] += T(w)·y in ascending expert order
  std::vector<float> acc(N * W, 0.0f), rows, y, gu, h;
  std::vector<int64_t> who;
  std::vector<float> who_w;
  for (int64_t e = 0; e < E; ++e) {
    who.clear();
    who_w.clear();
    for (int64_t m = 0; m < N; ++m)
      for (int64_t j = 0; j < top_k; ++j)
        if (idx[m * top_k + j] == e) who.push_back(m), who_w.push_back(round_as(wts[m * top_k + j], t));
    const int64_t M = static_cast<int64_t>(who.size());
    if (M == 0) continue;
    rows.resize(M * W);
    y.resize(M * W);
    for (int64_t r = 0; r < M; ++r) std::memcpy(rows.data() + r * W, inp + who[r] * W, sizeof(float) * W);
    glu_rows(dense_entry(gate_up, e, "moe_rows: gate_up"), dense_entry(down, e, "moe_rows: down"), rows.data(), M, act,
             y.data(), gu, h);
    for (int64_t r = 0; r < M; ++r) {
      float* a = acc.data() + who[r] * W;
      const float* yr = y.data() + r * W;
      for (int64_t j = 0; j < W; ++j) a[j] = a[j] + who_w[r] * yr[j];
    }
  }
  round_all(acc.data(), N * W, t);

  // latent: T(latent_up · T(norm_w · T(acc / rms(acc))))
  std::vector<float> out_f;
  const float* routed = acc.data();
  if (latent) {
    const float* nw = lnorm.data_ptr<float>();
    for (int64_t m = 0; m < N; ++m) {
      float* a = acc.data() + m * W;
      float ss = 0.0f;
      for (int64_t j = 0; j < W; ++j) ss += a[j] * a[j];
      const float inv = 1.0f / std::sqrt(ss / float(W) + float(eps));
      for (int64_t j = 0; j < W; ++j) a[j] = round_as(nw[j] * round_as(a[j] * inv, t), t);
    }
    out_f.resize(N * D);
    dense_rows(lup, acc.data(), N, W, out_f.data(), D);
    round_all(out_f.data(), N * D, t);
    routed = out_f.data();
  }

  // + the shared expert on x, rounded once more
  at::Tensor out32 = at::empty({N, D}, x.options().dtype(at::kFloat));
  float* o = out32.data_ptr<float>();
  if (shared_gate_up) {
    std::vector<float> sh(N * D);
    glu_rows(sgu, sdown, xf.data(), N, act, sh.data(), gu, h);
    for (int64_t i = 0; i < N * D; ++i) o[i] = round_as(routed[i] + sh[i], t);
  } else {
    std::memcpy(o, routed, sizeof(float) * N * D);
  }
  return t == WType::F32 ? out32 : out32.to(x.scalar_type());
}

// glu: a dense gated MLP (models/layers.py SwiGLU, k3.py GatedMLP) in one call, as moe_rows' shared expert:
// T(down · act(T(gate_up · x))) for x [..., D] (gate_up [2I, D], down [out, I], all in x's dtype T), each row alone
at::Tensor glu(const at::Tensor& x_in, const at::Tensor& gate_up, const at::Tensor& down, int64_t act_kind,
               double beta_g, double beta_u) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "glu: x must be a CPU [..., D]");
  const WType t = wtype_of(x_in, "glu: x");
  TORCH_CHECK(act_kind == 0 || act_kind == 1, "glu: act is 0 (silu) or 1 (SiTU)");
  TORCH_CHECK(gate_up.scalar_type() == x_in.scalar_type() && down.scalar_type() == x_in.scalar_type(),
              "glu: the weights must be in x's dtype");
  const DenseW gu_w = dense_of(gate_up, "glu: gate_up"), down_w = dense_of(down, "glu: down");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(gu_w.K == D && gu_w.N == 2 * down_w.K, "glu: gate_up [", gu_w.N, ", ", gu_w.K, "] and down [", down_w.N,
              ", ", down_w.K, "] do not fit x's ", D, " features");
  const int64_t M = D == 0 ? 0 : x_in.numel() / D;
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = down_w.N;
  at::Tensor y = at::empty(shape, x_in.options().dtype(at::kFloat));
  std::vector<float> gu, h;
  glu_rows(gu_w, down_w, xf.data_ptr<float>(), M, Act{act_kind, float(beta_g), float(beta_u), t}, y.data_ptr<float>(),
           gu, h);
  return t == WType::F32 ? y : y.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("glu(Tensor x, Tensor gate_up, Tensor down, int act, float beta_g, float beta_u) -> Tensor");
  m.impl("glu", c10::DispatchKey::CPU, &glu);
  m.def("moe_rows(Tensor x, Tensor router, Tensor? bias, int top_k, bool softmax, bool norm_topk, float scaling, "
        "int n_group, int topk_group, int group_mode, Tensor gate_up, Tensor down, Tensor? latent_down, "
        "Tensor? latent_norm, float eps, Tensor? latent_up, Tensor? shared_gate_up, Tensor? shared_down, int act, "
        "float beta_g, float beta_u) -> Tensor");
  m.impl("moe_rows", c10::DispatchKey::CPU, &moe_rows);
}
