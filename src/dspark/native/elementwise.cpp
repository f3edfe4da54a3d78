// fp32 helpers of the native kernels (compiled with kernels.cpp into one library, one torch.ops namespace):
// rms_norm (fused residual add + RMSNorm) and silu_mul (SwiGLU's silu(g)·u, through vmath.h's vector exp where the CPU
// has one: the same bits on AVX-512 and AVX2, within ~2 ulp of expf).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "quant_blocks.h"
#include "vmath.h"

namespace {

inline float dot_f32(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(DSPARK_AVX2)
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum256(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
#endif
}

// x, residual [..., D] fp32 (residual optional); w [D] -> (w · h / rms(h), h) with h = x (+ residual)
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "dspark rms_norm: fp32 only");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t D = x.size(-1), R = D ? x.numel() / D : 0;
  TORCH_CHECK(w.numel() == D, "dspark rms_norm: weight has ", w.numel(), " values for rows of ", D);
  const bool add = residual.has_value();
  if (add) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "dspark rms_norm: residual must match x");
  }
  const at::Tensor r = add ? residual->contiguous() : x;
  at::Tensor h = add ? at::empty(x.sizes(), x.options()) : x;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *rp = r.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* src = xp + i * D;
      if (add) {
        float* hr = hp + i * D;
        const float* rr = rp + i * D;
        for (int64_t j = 0; j < D; ++j) hr[j] = src[j] + rr[j];
        src = hr;
      }
      const float inv = 1.0f / std::sqrt(dot_f32(src, src, D) / float(D) + float(eps));
      float* yr = yp + i * D;
      for (int64_t j = 0; j < D; ++j) yr[j] = wp[j] * (src[j] * inv);
    }
  });
  return {y, h};
}

// gate_up [..., 2I] fp32 -> silu(gate) · up [..., I]
at::Tensor silu_mul(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.scalar_type() == at::kFloat, "dspark silu_mul: fp32 only");
  const at::Tensor gu = gu_in.contiguous();
  const int64_t I2 = gu.size(-1), I = I2 / 2, R = I2 ? gu.numel() / I2 : 0;
  TORCH_CHECK(I2 % 2 == 0, "dspark silu_mul: last dim ", I2, " is odd");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor y = at::empty(shape, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float *g = gp + i * I2, *u = g + I;
      float* o = yp + i * I;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j < I; j += 16) {  // every element through the same lanes' code, the tail masked
        const __mmask16 m = I - j >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (I - j)) - 1);
        _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(silu16(_mm512_maskz_loadu_ps(m, g + j)), _mm512_maskz_loadu_ps(m, u + j)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; j + 8 <= I; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + j)), _mm256_loadu_ps(u + j)));
      if (j < I) {  // the tail through the same lanes' code
        alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
        std::memcpy(gt, g + j, sizeof(float) * (I - j));
        std::memcpy(ut, u + j, sizeof(float) * (I - j));
        _mm256_store_ps(ot, _mm256_mul_ps(silu8(_mm256_load_ps(gt)), _mm256_load_ps(ut)));
        std::memcpy(o + j, ot, sizeof(float) * (I - j));
        j = I;
      }
#endif
      for (; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)", &rms_norm);
  lib.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
