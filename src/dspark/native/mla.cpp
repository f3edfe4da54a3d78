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

#include "dense.h"
#include "vmath.h"

namespace {

using OptT = std::optional<at::Tensor>;

// one head's block of a [H, N, K] weight as dense rows
DenseW head_rows(const at::Tensor& w, int64_t h) {
  const int64_t N = w.size(1), K = w.size(2);
  const int64_t esize = w.scalar_type() == at::kFloat ? 4 : 2;
  return DenseW{static_cast<const uint8_t*>(w.data_ptr()) + h * N * K * esize, wtype_of(w, "mla_attend"), N, K};
}

// out[j] = Σ_k row[k]·x[j][k] for N query vectors against one latent row, each sum in dot_row's order (one lane
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

// out[4·j + k] = Σ_w q_j[w]·kv_k[w] for 4 query rows j (stride ldq) and 4 latent rows k (stride W), each sum in
// dots' order (one lane accumulator over w, then a fixed lane reduction): a score never depends on its tile-mates
template <WType T>
inline void dots4x4(const uint8_t* kv, int64_t W, const float* q, int64_t ldq, float* out) {
  const int64_t esize = T == WType::F32 ? 4 : 2;
#if defined(DSPARK_DENSE512)
  __m512 acc[4][4];
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_ps();
  for (int64_t w = 0; w < W; w += 16) {
    const __mmask16 m = W - w >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (W - w)) - 1);
    __m512 kvv[4];
    for (int k = 0; k < 4; ++k) kvv[k] = load16<T>(kv + k * W * esize, w, m);
    for (int j = 0; j < 4; ++j) {
      const __m512 x = _mm512_maskz_loadu_ps(m, q + j * ldq + w);
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_fmadd_ps(kvv[k], x, acc[j][k]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) out[4 * j + k] = _mm512_reduce_add_ps(acc[j][k]);
#else
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) out[4 * j + k] = dot_row<T>(kv + k * W * esize, q + j * ldq, W);
#endif
}

// o_j[c] = Σ_s p_j[s]·kv[s][c] for c < C and N query rows j (probabilities p_j, row stride S; outputs o_j, stride
// C): each output its own sum over the latent rows in their order, a row's hidden keys (p 0) skipped, so a row's
// result is the same in any tile. A latent row is read once for the N rows.
template <WType T, int N>
void weighted_latents(const float* p, int64_t S, const uint8_t* kv, int64_t W, int64_t C, float* o) {
  const int64_t esize = T == WType::F32 ? 4 : 2;
  int64_t c = 0;
#if defined(DSPARK_DENSE512)
  for (; c < C; c += 64) {  // 4 registers of outputs per row held across all latent rows
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
      const void* row = kv + s * W * esize;
      __m512 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load16<T>(row, c + 16 * j, m[j]);
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
    const uint8_t* row = kv + s * W * esize;
    for (int r = 0; r < N; ++r) {
      const float w = p[r * S + s];
      if (w == 0.f) continue;
      float* orow = o + r * C;
      for (c = 0; c < C; ++c) orow[c] = orow[c] + w * widen<T>(row, c);
    }
  }
#endif
}

constexpr int64_t kKeyBlock = 256;  // latent rows scored against every query tile before the next block (~300 KB)

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
  const float inv = 1.f / sum;
  s = 0;
#if defined(DSPARK_DENSE512)
  for (; s + 16 <= S; s += 16) _mm512_storeu_ps(p + s, round16(_mm512_mul_ps(_mm512_loadu_ps(p + s), _mm512_set1_ps(inv)), md));
#endif
  for (; s < S; ++s) p[s] = round_as(p[s] * inv, md);
}

// scores, softmax and probs·latents of one sequence's query rows: q [M, W] fp32 (row i = (position i / H, head
// i % H)), kv [S, W], bias [T, S] → o_lat [M, C] rounded to md. Every latent row is read once for all query rows;
// each query row's sums run over the latent rows in their order, whatever M. A key hidden from a row (bias −inf:
// a later position of a prefill chunk, padding) is not scored for it: its weight is 0 either way.
template <WType T>
void attend_seq(const float* q, const uint8_t* kv, WType md, const float* bias, int64_t M, int64_t H, int64_t S,
                int64_t W, int64_t C, float scale, float* o_lat, float* p) {
  const int64_t esize = T == WType::F32 ? 4 : 2;
  const float ninf = -std::numeric_limits<float>::infinity();
  auto hidden = [&](int64_t i, int64_t s) { return bias[(i / H) * S + s] == ninf; };
  auto score_one = [&](int64_t i, int64_t s) {
    if (hidden(i, s)) p[i * S + s] = 0.f;  // + the bias below: −inf, as a score would give
    else dots<T, 1>(kv + s * W * esize, q + i * W, W, W, p + i * S + s);
  };
  float sc[16];
  const int64_t M4 = M - M % 4, S4 = S - S % 4;
  for (int64_t s0 = 0; s0 < S4; s0 += kKeyBlock) {  // a block of latent rows stays in cache for every query tile
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
        dots4x4<T>(kv + s * W * esize, W, q + i * W, W, sc);
        for (int j = 0; j < 4; ++j) std::copy(sc + 4 * j, sc + 4 * j + 4, p + (i + j) * S + s);
      }
  }
  for (int64_t i = 0; i < M; ++i)  // the rest: latent rows past the last full 4, query rows past the last full 4
    for (int64_t s = i < M4 ? S4 : 0; s < S; ++s) score_one(i, s);
  for (int64_t i = 0; i < M; ++i) softmax_row(p + i * S, bias + (i / H) * S, S, scale, md);
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) weighted_latents<T, 4>(p + i * S, S, kv, W, C, o_lat + i * C);
  for (; i < M; ++i) weighted_latents<T, 1>(p + i * S, S, kv, W, C, o_lat + i * C);
  round_all(o_lat, M * C, md);
}

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
  for (int64_t h = 0; h < H; ++h) dense_rows(head_rows(w_uk_t, h), qn_p + h * Dn, BT, H * Dn, q.data() + h * W, H * W);
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
    std::vector<float> p(M * S);
    for (int64_t b = b0; b < b1; ++b) {
      const float* qb = q.data() + b * M * W;
      const uint8_t* kvb = kv_p + b * S * W * esize;
      const float* bb = bias_p + b * T * S;
      float* ob = o_lat.data() + b * M * C;
      if (md == WType::BF16) attend_seq<WType::BF16>(qb, kvb, md, bb, M, H, S, W, C, sc, ob, p.data());
      if (md == WType::F16) attend_seq<WType::F16>(qb, kvb, md, bb, M, H, S, W, C, sc, ob, p.data());
      if (md == WType::F32) attend_seq<WType::F32>(qb, kvb, md, bb, M, H, S, W, C, sc, ob, p.data());
    }
  });

  // out = o_lat·W_UVᵀ per head: [BT, H·Dv]
  std::vector<float> out(BT * H * Dv);
  for (int64_t h = 0; h < H; ++h)
    dense_rows(head_rows(w_uv, h), o_lat.data() + h * C, BT, H * C, out.data() + h * Dv, H * Dv);
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
