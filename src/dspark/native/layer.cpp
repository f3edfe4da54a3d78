// gqa_layer: one Llama/Qwen2 decoder layer over GGUF block weights for the rows of each sequence (a decode step, a
// verification, a prefill chunk), in one call instead of ~45 eager ops. Compiled with kernels.cpp into one
// library, one torch.ops namespace.
//
//   h       [B, T, D] fp32      the residual stream entering the layer
//   ln1/ln2 [D] fp32            input / post-attention RMSNorm weights (eps shared)
//   qkv     blocks of q|k|v     (H + 2·n_kv)·hd output rows, one block type; o, gate|up, down likewise
//   cos2/sin2 [B, T, 1, hd]     the full-width rotation tables of models/rope.py half_rotation_tables
//   plane   [N, W] fp32         this layer's plane of the pool: GQA rows [k of every head | v of every head]
//   writes  [B·T] int64         the slot of each new row (padding rows: the scratch slot)
//   slots   [B, S] int64        the slot of each visible key position
//   bias    [B, T, S] fp32      0 (visible) or -inf (hidden)
//   → h'    [B, T, D] fp32
//
// Each step is the operation the PyTorch modules run, in the same order: RMSNorm (rms_norm), the block product
// (quant_linear), the rotation x·(cos|cos) + roll(x)·(−sin|sin) with its products and sum rounded as torch rounds
// them (no contraction: -ffp-contract=off), the page rows written where the cache writes them, attention through
// paged_attention (keys and values read in place), o_proj, residual add + RMSNorm, gate|up, silu·up, down and the
// residual add. Every row is computed alone: a row's result does not depend on how many rows share the call, so a
// decode step and a verification of the same position agree bit for bit (speculation stays identical to plain
// decoding). The products of more than 64 rows (a prefill) and every other layer shape stay with the modules.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptT = std::optional<at::Tensor>;

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, int64_t, bool)>&
quant_linear_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dspark_native::quant_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, int64_t, bool)>();
  return op;
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                                  const OptT&)>&
rms_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dspark_native::rms_norm", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, const OptT&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)>& silu_mul_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("dspark_native::silu_mul", "").typed<at::Tensor(const at::Tensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          int64_t, int64_t, int64_t, int64_t, double)>&
paged_attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dspark_native::paged_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t, int64_t, int64_t, int64_t, double)>();
  return op;
}

// rotate q and k heads (torch's rounding: two products, one sum), scatter q to [B, H, T, hd] and write the page rows
void rotate_and_write(const float* qkv, const float* cos2, const float* sin2, float* q, float* plane,
                      const int64_t* writes, int64_t B, int64_t T, int64_t H, int64_t n_kv, int64_t hd, int64_t W) {
  const int64_t half = hd / 2, width = (H + 2 * n_kv) * hd;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = b * T + t;
      const float* src = qkv + row * width;
      const float *c = cos2 + row * hd, *s = sin2 + row * hd;
      float* page = plane + writes[row] * W;
      for (int64_t j = 0; j < H + n_kv; ++j) {
        const float* x = src + j * hd;
        float* dst = j < H ? q + ((b * H + j) * T + t) * hd : page + (j - H) * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const float a = x[i] * c[i];
          const float r = x[i < half ? i + half : i - half] * s[i];
          dst[i] = a + r;
        }
      }
      std::memcpy(page + n_kv * hd, src + (H + n_kv) * hd, sizeof(float) * n_kv * hd);  // v rows as they are
    }
  }
}

at::Tensor gqa_layer(const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                     const at::Tensor& qkv_w, int64_t qkv_type, const OptT& qkv_bias, const at::Tensor& o_w,
                     int64_t o_type, const OptT& o_bias, const at::Tensor& gu_w, int64_t gu_type, const OptT& gu_bias,
                     const at::Tensor& down_w, int64_t down_type, const OptT& down_bias, const at::Tensor& cos2,
                     const at::Tensor& sin2, const at::Tensor& plane, const at::Tensor& writes,
                     const at::Tensor& slots, const at::Tensor& bias, int64_t H, int64_t n_kv, int64_t hd,
                     double scale, bool int8) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "gqa_layer: h must be a contiguous fp32 [B, T, D]");
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2), W = plane.size(1);
  TORCH_CHECK(plane.dim() == 2 && plane.scalar_type() == at::kFloat && plane.is_contiguous(),
              "gqa_layer: the pool plane must be a contiguous fp32 [N, W]");
  TORCH_CHECK(W == 2 * n_kv * hd && H % n_kv == 0 && hd % 2 == 0, "gqa_layer: page width ", W, " != 2·", n_kv, "·",
              hd, " or heads disagree");
  TORCH_CHECK(cos2.scalar_type() == at::kFloat && sin2.scalar_type() == at::kFloat && cos2.is_contiguous() &&
                  sin2.is_contiguous() && cos2.numel() == B * T * hd && sin2.numel() == B * T * hd,
              "gqa_layer: rotation tables must be contiguous fp32 [B, T, 1, hd]");
  TORCH_CHECK(writes.scalar_type() == at::kLong && writes.is_contiguous() && writes.numel() == B * T,
              "gqa_layer: one int64 write slot per row");
  const int64_t N = plane.size(0);
  const int64_t* wr = writes.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(wr[i] >= 0 && wr[i] < N, "gqa_layer: write slot ", wr[i], " out of range");

  const OptT none;
  const at::Tensor x = std::get<0>(rms_norm_op().call(h, ln1, eps, none)).view({B * T, D});
  const at::Tensor qkv = quant_linear_op().call(x, qkv_w, qkv_bias, qkv_type, int8);
  TORCH_CHECK(qkv.size(1) == (H + 2 * n_kv) * hd, "gqa_layer: q|k|v has ", qkv.size(1), " outputs");
  at::Tensor q = at::empty({B, H, T, hd}, h.options());
  rotate_and_write(qkv.data_ptr<float>(), cos2.data_ptr<float>(), sin2.data_ptr<float>(), q.data_ptr<float>(),
                   plane.data_ptr<float>(), wr, B, T, H, n_kv, hd, W);
  const at::Tensor att = paged_attention_op().call(q, plane, slots, bias, n_kv, 0, n_kv * hd, hd, scale);
  const at::Tensor heads = att.transpose(1, 2).contiguous().view({B * T, H * hd});
  const at::Tensor a = quant_linear_op().call(heads, o_w, o_bias, o_type, int8).view({B, T, D});
  auto [x2, h2] = rms_norm_op().call(a, ln2, eps, h);  // h2 = a + h, x2 = its norm
  const at::Tensor gu = quant_linear_op().call(x2.view({B * T, D}), gu_w, gu_bias, gu_type, int8);
  const at::Tensor m = quant_linear_op().call(silu_mul_op().call(gu), down_w, down_bias, down_type, int8);
  float* out = h2.data_ptr<float>();
  const float* d = m.data_ptr<float>();
  for (int64_t i = 0; i < B * T * D; ++i) out[i] = out[i] + d[i];  // h + mlp(x)
  return h2;
}

// gqa_stack: every layer of a GGUF Llama/Qwen2 stack through gqa_layer in one call (one dispatch per forward instead
// of one Python call, checks and argument marshalling per layer). Per layer l: norms[2l], norms[2l+1]; blocks,
// types and biases [4l .. 4l+3] = q|k|v, o, gate|up, down; its pool plane pool[layer_offset + l]. Returns h after the
// last layer and h after each layer listed in taps (ascending), the taps a drafter reads.
std::tuple<at::Tensor, std::vector<at::Tensor>> gqa_stack(
    const at::Tensor& h0, at::TensorList norms, double eps, at::TensorList blocks, at::IntArrayRef types,
    const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos2, const at::Tensor& sin2,
    const at::Tensor& pool, int64_t layer_offset, const at::Tensor& writes, const at::Tensor& slots,
    const at::Tensor& bias, int64_t H, int64_t n_kv, int64_t hd, double scale, bool int8, at::IntArrayRef taps) {
  const int64_t L = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(blocks.size()) == 4 * L &&
                  static_cast<int64_t>(types.size()) == 4 * L && static_cast<int64_t>(biases.size()) == 4 * L,
              "gqa_stack: 2 norms and 4 products per layer");
  TORCH_CHECK(pool.dim() == 3 && pool.is_contiguous() && layer_offset >= 0 && layer_offset + L <= pool.size(0),
              "gqa_stack: the pool must be a contiguous [layers, N, W] holding layers ", layer_offset, " .. ",
              layer_offset + L - 1);
  at::Tensor h = h0;
  std::vector<at::Tensor> out;
  size_t next = 0;
  for (int64_t l = 0; l < L; ++l) {
    const OptT b0 = biases.get(4 * l), b1 = biases.get(4 * l + 1), b2 = biases.get(4 * l + 2), b3 = biases.get(4 * l + 3);
    h = gqa_layer(h, norms[2 * l], norms[2 * l + 1], eps, blocks[4 * l], types[4 * l], b0, blocks[4 * l + 1],
                  types[4 * l + 1], b1, blocks[4 * l + 2], types[4 * l + 2], b2, blocks[4 * l + 3], types[4 * l + 3],
                  b3, cos2, sin2, pool.select(0, layer_offset + l), writes, slots, bias, H, n_kv, hd, scale, int8);
    if (next < taps.size() && taps[next] == l) {
      out.push_back(h);
      ++next;
    }
  }
  TORCH_CHECK(next == taps.size(), "gqa_stack: taps must be ascending layer indices below ", L);
  return {h, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dspark_native, m) {
  m.def("gqa_layer(Tensor h, Tensor ln1, Tensor ln2, float eps, Tensor qkv, int qkv_type, Tensor? qkv_bias, "
        "Tensor o, int o_type, Tensor? o_bias, Tensor gate_up, int gate_up_type, Tensor? gate_up_bias, Tensor down, "
        "int down_type, Tensor? down_bias, Tensor cos2, Tensor sin2, Tensor(a!) plane, Tensor writes, Tensor slots, "
        "Tensor bias, int H, int n_kv, int hd, float scale, bool int8) -> Tensor");
  m.impl("gqa_layer", c10::DispatchKey::CPU, &gqa_layer);
  m.def("gqa_stack(Tensor h, Tensor[] norms, float eps, Tensor[] blocks, int[] types, Tensor?[] biases, Tensor cos2, "
        "Tensor sin2, Tensor(a!) pool, int layer_offset, Tensor writes, Tensor slots, Tensor bias, int H, int n_kv, "
        "int hd, float scale, bool int8, int[] taps) -> (Tensor, Tensor[])");
  m.impl("gqa_stack", c10::DispatchKey::CPU, &gqa_stack);
}
