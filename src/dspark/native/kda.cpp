// kda_rows: the tokens of each sequence (a decode step, a verification, a prefill chunk) through a Kimi Delta
// Attention layer (models/kda.py), from its input projections to the input of o_proj, in one call instead of ~90 eager ops (decode)
// or ~145 (the chunked form of an 8-row verification): the short causal conv + SiLU, the forget gate (f_b
// projection, dt_bias, the Kimi Linear softplus or the K3 lower-bounded sigmoid), β, the L2 norms, the delta rule
// token by token (the recurrent form) and the gated per-head RMSNorm. The input projections and o_proj stay with
// the module. Every row runs the same recurrence whatever T: a verification's rows equal the decode steps' rows
// bit for bit, and the state after each row comes for free (a copy).
//
//   z       [B, T, 3W] (dtype)  q|k|v before the conv (W = H·Dk)    fa, ga [B, T, Dk] (dtype)   bl [B, T, H] (dtype)
//   state   [B, numel] fp32     the packed KDAState: recurrent [H, Dk, Dk], then the conv tail [K−1, 3W]; or [0]: zeros
//   lengths [B] int64           valid rows per sequence (≤ T); rows beyond leave the state unchanged
//   conv_w  [3W, 1, K]          f_b [W, Dk]   dt_bias [W]   a_log [H]   g_b [W, Dk]   norm_w [Dk]   (any float dtype)
//   keep_per_row                also return the packed state after every row
//   → (o [B, T, W] in z's dtype: σ(gate) ⊙ RMSNorm_head(o), the state after each sequence's last valid row
//      [B, numel] fp32, the state after every row [B, T, numel] fp32 (or [0]))
//
// The module's order of operations and its roundings: where the module holds a bf16/fp16 tensor (conv output, SiLU,
// the f_b and g_b products, o before the norm, the result) the value is rounded to that dtype (round_as), so the
// two paths agree up to the order of the sums and the exp (vmath.h's vector exp, within ~2 ulp of expf). Rows are independent (one sequence each).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "dense.h"
#include "vmath.h"

namespace {

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

inline float softplus_f(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// S ← S·diag(a) by rows (S [Dk key channels, Dk values]); pred[j] = Σ_c kc[c]·S[c, j] over c in order. Columns go
// 64 at a time with their sums in registers (AVX-512), the same arithmetic as the plain loops below.
inline void decay_predict(float* S, const float* a, const float* kc, int64_t Dk, float* pred) {
  int64_t j0 = 0;
#if defined(DSPARK_DENSE512)
  for (; j0 + 64 <= Dk; j0 += 64) {
    __m512 acc[4];
    for (int u = 0; u < 4; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m512 av = _mm512_set1_ps(a[c]), kv = _mm512_set1_ps(kc[c]);
      for (int u = 0; u < 4; ++u) {
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(srow + 16 * u), av);
        _mm512_storeu_ps(srow + 16 * u, sv);
        acc[u] = _mm512_add_ps(acc[u], _mm512_mul_ps(kv, sv));
      }
    }
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(pred + j0 + 16 * u, acc[u]);
  }
#elif defined(DSPARK_AVX2)
  for (; j0 + 32 <= Dk; j0 += 32) {  // the same arithmetic, 32 columns at a time in 8-lane vectors
    __m256 acc[4];
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m256 av = _mm256_set1_ps(a[c]), kv = _mm256_set1_ps(kc[c]);
      for (int u = 0; u < 4; ++u) {
        const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(srow + 8 * u), av);
        _mm256_storeu_ps(srow + 8 * u, sv);
        acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(kv, sv));
      }
    }
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(pred + j0 + 8 * u, acc[u]);
  }
#endif
  std::fill(pred + j0, pred + Dk, 0.0f);
  for (int64_t c = 0; c < Dk; ++c) {
    float* srow = S + c * Dk;
    for (int64_t j = j0; j < Dk; ++j) {
      srow[j] = srow[j] * a[c];
      pred[j] += kc[c] * srow[j];
    }
  }
}

// S[c, j] ← S[c, j] + kc[c]·delta[j]; o[j] = Σ_c qc[c]·S[c, j] over c in order (as decay_predict)
inline void update_read(float* S, const float* kc, const float* qc, const float* delta, int64_t Dk, float* o) {
  int64_t j0 = 0;
#if defined(DSPARK_DENSE512)
  for (; j0 + 64 <= Dk; j0 += 64) {
    __m512 acc[4], dv[4];
    for (int u = 0; u < 4; ++u) {
      acc[u] = _mm512_setzero_ps();
      dv[u] = _mm512_loadu_ps(delta + j0 + 16 * u);
    }
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m512 kv = _mm512_set1_ps(kc[c]), qv = _mm512_set1_ps(qc[c]);
      for (int u = 0; u < 4; ++u) {
        const __m512 sv = _mm512_add_ps(_mm512_loadu_ps(srow + 16 * u), _mm512_mul_ps(kv, dv[u]));
        _mm512_storeu_ps(srow + 16 * u, sv);
        acc[u] = _mm512_add_ps(acc[u], _mm512_mul_ps(qv, sv));
      }
    }
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + j0 + 16 * u, acc[u]);
  }
#elif defined(DSPARK_AVX2)
  for (; j0 + 32 <= Dk; j0 += 32) {
    __m256 acc[4], dv[4];
    for (int u = 0; u < 4; ++u) {
      acc[u] = _mm256_setzero_ps();
      dv[u] = _mm256_loadu_ps(delta + j0 + 8 * u);
    }
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m256 kv = _mm256_set1_ps(kc[c]), qv = _mm256_set1_ps(qc[c]);
      for (int u = 0; u < 4; ++u) {
        const __m256 sv = _mm256_add_ps(_mm256_loadu_ps(srow + 8 * u), _mm256_mul_ps(kv, dv[u]));
        _mm256_storeu_ps(srow + 8 * u, sv);
        acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(qv, sv));
      }
    }
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(o + j0 + 8 * u, acc[u]);
  }
#endif
  std::fill(o + j0, o + Dk, 0.0f);
  for (int64_t c = 0; c < Dk; ++c) {
    float* srow = S + c * Dk;
    for (int64_t j = j0; j < Dk; ++j) {
      srow[j] = srow[j] + kc[c] * delta[j];
      o[j] += qc[c] * srow[j];
    }
  }
}

// One pass for two rows: the previous row's update and read-out (update_read with kp, qp, dp: its o lands in o) and
// this row's decay and prediction (decay_predict with a, kc: pred), element by element in the same operations and
// orders as those two loops, so the results are the same bits; the state after the previous row goes to snap (when
// given) on the way. A verification's T rows then take T + 1 passes over the state instead of 2T.
inline void update_decay(float* S, const float* kp, const float* qp, const float* dp, const float* a, const float* kc,
                         int64_t Dk, float* o, float* pred, float* snap) {
  int64_t j0 = 0;
#if defined(DSPARK_DENSE512)
  for (; j0 + 64 <= Dk; j0 += 64) {
    __m512 ao[4], ap[4], dv[4];
    for (int u = 0; u < 4; ++u) {
      ao[u] = _mm512_setzero_ps();
      ap[u] = _mm512_setzero_ps();
      dv[u] = _mm512_loadu_ps(dp + j0 + 16 * u);
    }
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m512 kpv = _mm512_set1_ps(kp[c]), qpv = _mm512_set1_ps(qp[c]);
      const __m512 av = _mm512_set1_ps(a[c]), kv = _mm512_set1_ps(kc[c]);
      for (int u = 0; u < 4; ++u) {
        __m512 sv = _mm512_add_ps(_mm512_loadu_ps(srow + 16 * u), _mm512_mul_ps(kpv, dv[u]));
        ao[u] = _mm512_add_ps(ao[u], _mm512_mul_ps(qpv, sv));
        if (snap != nullptr) _mm512_storeu_ps(snap + c * Dk + j0 + 16 * u, sv);
        sv = _mm512_mul_ps(sv, av);
        _mm512_storeu_ps(srow + 16 * u, sv);
        ap[u] = _mm512_add_ps(ap[u], _mm512_mul_ps(kv, sv));
      }
    }
    for (int u = 0; u < 4; ++u) {
      _mm512_storeu_ps(o + j0 + 16 * u, ao[u]);
      _mm512_storeu_ps(pred + j0 + 16 * u, ap[u]);
    }
  }
#elif defined(DSPARK_AVX2)
  for (; j0 + 16 <= Dk; j0 += 16) {  // 16 columns: two rows' sums and δ in the 16 vector registers
    __m256 ao[2], ap[2], dv[2];
    for (int u = 0; u < 2; ++u) {
      ao[u] = _mm256_setzero_ps();
      ap[u] = _mm256_setzero_ps();
      dv[u] = _mm256_loadu_ps(dp + j0 + 8 * u);
    }
    for (int64_t c = 0; c < Dk; ++c) {
      float* srow = S + c * Dk + j0;
      const __m256 kpv = _mm256_set1_ps(kp[c]), qpv = _mm256_set1_ps(qp[c]);
      const __m256 av = _mm256_set1_ps(a[c]), kv = _mm256_set1_ps(kc[c]);
      for (int u = 0; u < 2; ++u) {
        __m256 sv = _mm256_add_ps(_mm256_loadu_ps(srow + 8 * u), _mm256_mul_ps(kpv, dv[u]));
        ao[u] = _mm256_add_ps(ao[u], _mm256_mul_ps(qpv, sv));
        if (snap != nullptr) _mm256_storeu_ps(snap + c * Dk + j0 + 8 * u, sv);
        sv = _mm256_mul_ps(sv, av);
        _mm256_storeu_ps(srow + 8 * u, sv);
        ap[u] = _mm256_add_ps(ap[u], _mm256_mul_ps(kv, sv));
      }
    }
    for (int u = 0; u < 2; ++u) {
      _mm256_storeu_ps(o + j0 + 8 * u, ao[u]);
      _mm256_storeu_ps(pred + j0 + 8 * u, ap[u]);
    }
  }
#endif
  std::fill(o + j0, o + Dk, 0.0f);
  std::fill(pred + j0, pred + Dk, 0.0f);
  for (int64_t c = 0; c < Dk; ++c) {
    float* srow = S + c * Dk;
    for (int64_t j = j0; j < Dk; ++j) {
      float sv = srow[j] + kp[c] * dp[j];
      o[j] += qp[c] * sv;
      if (snap != nullptr) snap[c * Dk + j] = sv;
      sv = sv * a[c];
      srow[j] = sv;
      pred[j] += kc[c] * sv;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kda_rows(
    const at::Tensor& z_in, const at::Tensor& fa_in, const at::Tensor& ga_in, const at::Tensor& bl_in,
    const at::Tensor& state_in, const at::Tensor& lengths_in, const at::Tensor& conv_w_in, const at::Tensor& f_b_in,
    const at::Tensor& dt_bias_in, const at::Tensor& a_log_in, const at::Tensor& g_b_in, const at::Tensor& norm_w_in,
    int64_t H, int64_t Dk, std::optional<double> lower_bound, double eps, bool keep_per_row) {
  const WType dt = wtype_of(z_in, "kda_rows z");
  const int64_t W = H * Dk, CW = 3 * W;
  TORCH_CHECK(z_in.dim() == 3 && z_in.size(2) == CW, "kda_rows: z must be [B, T, 3·H·Dk = ", CW, "], got ",
              z_in.sizes());
  const int64_t B = z_in.size(0), T = z_in.size(1);
  TORCH_CHECK(fa_in.sizes() == at::IntArrayRef({B, T, Dk}) && ga_in.sizes() == at::IntArrayRef({B, T, Dk}) &&
                  bl_in.sizes() == at::IntArrayRef({B, T, H}),
              "kda_rows: fa, ga must be [B, T, Dk] and bl [B, T, H]");
  TORCH_CHECK(conv_w_in.dim() == 3 && conv_w_in.size(0) == CW && conv_w_in.size(1) == 1,
              "kda_rows: conv weight must be [3W, 1, K], got ", conv_w_in.sizes());
  const int64_t K = conv_w_in.size(2), K1 = K - 1;
  const int64_t rec = H * Dk * Dk, numel = rec + K1 * CW;
  const bool fresh = state_in.numel() == 0;
  TORCH_CHECK(fresh || (state_in.dim() == 2 && state_in.size(0) == B && state_in.size(1) == numel &&
                        state_in.scalar_type() == at::kFloat),
              "kda_rows: state must be fp32 [B, ", numel, "] (or empty), got ", state_in.sizes());
  TORCH_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.numel() == B, "kda_rows: lengths must be int64 [B]");
  const DenseW fb = dense_of(f_b_in.contiguous(), "kda_rows f_b"), gb = dense_of(g_b_in.contiguous(), "kda_rows g_b");
  TORCH_CHECK(fb.N == W && fb.K == Dk && gb.N == W && gb.K == Dk, "kda_rows: f_b and g_b must be [W, Dk]");

  const at::Tensor z = f32(z_in), fa = f32(fa_in), ga = f32(ga_in), bl = f32(bl_in), cw = f32(conv_w_in);
  const at::Tensor dtb = f32(dt_bias_in), alog = f32(a_log_in), nw = f32(norm_w_in), lengths = lengths_in.contiguous();
  TORCH_CHECK(dtb.numel() == W && alog.numel() == H && nw.numel() == Dk, "kda_rows: dt_bias [W], A_log [H], norm [Dk]");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= T, "kda_rows: length ", lp[b], " of sequence ", b, " is not in [0, ", T, "]");
  at::Tensor state = fresh ? at::zeros({B, numel}, z.options()) : state_in.contiguous().clone();
  at::Tensor out = at::empty({B, T, W}, z.options());
  at::Tensor rows = keep_per_row ? at::empty({B, T, numel}, z.options()) : at::empty({0}, z.options());

  // the two low-rank products of every row at once (rows independent), rounded as the module's tensors are
  at::Tensor fbo = at::empty({B * T, W}, z.options()), gbo = at::empty({B * T, W}, z.options());
  dense_rows(fb, fa.data_ptr<float>(), B * T, Dk, fbo.data_ptr<float>(), W);
  dense_rows(gb, ga.data_ptr<float>(), B * T, Dk, gbo.data_ptr<float>(), W);
  round_all(fbo.data_ptr<float>(), B * T * W, dt);
  round_all(gbo.data_ptr<float>(), B * T * W, dt);

  const float *zp = z.data_ptr<float>(), *blp = bl.data_ptr<float>(), *cwp = cw.data_ptr<float>();
  const float *dtp = dtb.data_ptr<float>(), *alp = alog.data_ptr<float>(), *nwp = nw.data_ptr<float>();
  const float *fbp = fbo.data_ptr<float>(), *gbp = gbo.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>(), *rp = keep_per_row ? rows.data_ptr<float>() : nullptr;
  const float qscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
  const bool bounded = lower_bound.has_value();
  const float lb = bounded ? static_cast<float>(*lower_bound) : 0.0f;

  std::vector<float> cwt(K * CW);  // the conv weights tap-major, so a row's channels run in vector lanes
  for (int64_t c = 0; c < CW; ++c)
    for (int64_t j = 0; j < K; ++j) cwt[j * CW + c] = cwp[c * K + j];

  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> mixed(CW), ex(CW), pred(Dk), o(Dk), gh(Dk), decay(Dk);
    // each head's pending row (its update and read-out, done in the next row's pass): k|q, δ, the output gate
    std::vector<float> kq(H * 2 * Dk), delta(H * Dk), og(H * Dk), kc(2 * Dk);
    // the gated RMSNorm of head h's read-out o for row `row`, in fp32 from o as the model dtype holds it
    auto finish = [&](int64_t h, int64_t row) {
      float* dst = op + row * W + h * Dk;
      const float* g = og.data() + h * Dk;
      float ss = 0.0f;
      for (int64_t j = 0; j < Dk; ++j) {
        o[j] = round_as(o[j], dt);
        ss += o[j] * o[j];
      }
      const float inv = 1.0f / std::sqrt(ss / float(Dk) + float(eps));
      for (int64_t j = 0; j < Dk; ++j) dst[j] = o[j] * inv * nwp[j] * (1.0f / (1.0f + g[j]));
      round_all(dst, Dk, dt);
    };
    for (int64_t b = b0; b < b1; ++b) {
      float* S = sp + b * numel;
      float* tail = S + rec;  // [K−1, CW]: the pre-conv rows of the last K−1 tokens
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = b * T + t;
        const bool valid = t < lp[b];
        const float* zr = zp + row * CW;
        // short conv over [tail | z_t] (the window's last K rows, each channel's taps in order), then SiLU
        std::fill(mixed.begin(), mixed.end(), 0.0f);
        for (int64_t j = 0; j < K; ++j) {
          const float* w = j < K1 ? tail + j * CW : zr;
          const float* cj = cwt.data() + j * CW;
          for (int64_t c = 0; c < CW; ++c) mixed[c] += w[c] * cj[c];
        }
        round_all(mixed.data(), CW, dt);
        exp_array(mixed.data(), ex.data(), CW, -1.0f);
        for (int64_t c = 0; c < CW; ++c) mixed[c] = mixed[c] / (1.0f + ex[c]);
        round_all(mixed.data(), CW, dt);
        if (valid && K1 > 0) {  // the new tail: the window's rows 1 .. K−1
          for (int64_t j = 0; j + 1 < K1; ++j) std::memcpy(tail + j * CW, tail + (j + 1) * CW, sizeof(float) * CW);
          std::memcpy(tail + (K1 - 1) * CW, zr, sizeof(float) * CW);
        }
        if (rp != nullptr) std::memcpy(rp + row * numel + rec, tail, sizeof(float) * K1 * CW);
        const float* q = mixed.data();
        const float* k = q + W;
        const float* v = k + W;
        for (int64_t h = 0; h < H; ++h) {
          float* Sh = S + h * Dk * Dk;  // [Dk (key channel), Dk (value)]
          float* kh = kq.data() + h * 2 * Dk;
          float* dh = delta.data() + h * Dk;
          const float rate = std::exp(alp[h]);
          const float beta = valid ? sigmoid_f(blp[row * H + h]) : 0.0f;
          for (int64_t c = 0; c < Dk; ++c) gh[c] = fbp[row * W + h * Dk + c] + dtp[h * Dk + c];  // raw
          if (bounded) {  // lb·σ(rate·raw)
            for (int64_t c = 0; c < Dk; ++c) gh[c] = rate * gh[c];
            exp_array(gh.data(), decay.data(), Dk, -1.0f);
            for (int64_t c = 0; c < Dk; ++c) gh[c] = valid ? lb * (1.0f / (1.0f + decay[c])) : 0.0f;
          } else {
            for (int64_t c = 0; c < Dk; ++c) gh[c] = valid ? -rate * softplus_f(gh[c]) : 0.0f;
          }
          exp_array(gh.data(), decay.data(), Dk);  // the decay of each key channel
          // L2 norms (eps inside the root), q scaled by Dk^-1/2
          float qq = 0.0f, kk = 0.0f;
          for (int64_t c = 0; c < Dk; ++c) {
            qq += q[h * Dk + c] * q[h * Dk + c];
            kk += k[h * Dk + c] * k[h * Dk + c];
          }
          const float qn = 1.0f / std::sqrt(qq + 1e-6f), kn = 1.0f / std::sqrt(kk + 1e-6f);
          for (int64_t c = 0; c < Dk; ++c) {
            kc[c] = k[h * Dk + c] * kn;
            kc[Dk + c] = q[h * Dk + c] * qn * qscale;
          }
          // decay, then the prediction kᵀS; the rank-one update with δ = β(v − kᵀS), then the read-out qᵀS. Each
          // output column j sums over the key channels c in order (products and sums rounded apart). The update
          // and read-out of a row run in the next row's pass (update_decay), the last row's on its own below.
          if (t == 0) {
            decay_predict(Sh, decay.data(), kc.data(), Dk, pred.data());
          } else {
            float* snap = rp != nullptr ? rp + (row - 1) * numel + h * Dk * Dk : nullptr;
            update_decay(Sh, kh, kh + Dk, dh, decay.data(), kc.data(), Dk, o.data(), pred.data(), snap);
            finish(h, row - 1);
          }
          for (int64_t j = 0; j < Dk; ++j) dh[j] = beta * (v[h * Dk + j] - pred[j]);
          std::copy(kc.begin(), kc.end(), kh);
          exp_array(gbp + row * W + h * Dk, og.data() + h * Dk, Dk, -1.0f);  // the output gate: σ = 1 / (1 + e^−g)
        }
      }
      if (T > 0) {  // the last row's update and read-out
        const int64_t last = b * T + T - 1;
        for (int64_t h = 0; h < H; ++h) {
          float* Sh = S + h * Dk * Dk;
          const float* kh = kq.data() + h * 2 * Dk;
          update_read(Sh, kh, kh + Dk, delta.data() + h * Dk, Dk, o.data());
          finish(h, last);
          if (rp != nullptr) std::memcpy(rp + last * numel + h * Dk * Dk, Sh, sizeof(float) * Dk * Dk);
        }
      }
    }
  });
  return {dt == WType::F32 ? out : out.to(z_in.scalar_type()), state, rows};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("kda_rows(Tensor z, Tensor fa, Tensor ga, Tensor bl, Tensor state, Tensor lengths, Tensor conv_w, "
        "Tensor f_b, Tensor dt_bias, Tensor a_log, Tensor g_b, Tensor norm_w, int H, int Dk, float? lower_bound, "
        "float eps, bool keep_per_row) -> (Tensor, Tensor, Tensor)");
  m.impl("kda_rows", c10::DispatchKey::CPU, &kda_rows);
}
