// A decoder layer's step as one call (decoder_layer.h says why and what it composes).
#include "decoder_layer.h"

#include "kernels.h"

#include <utility>

namespace kiln {

namespace {

c10::optional<torch::Tensor> weight_of(const Norm& norm) { return std::get<0>(norm); }

torch::Tensor normed(const torch::Tensor& x, const Norm& norm) {
  return rms_norm(x, *std::get<0>(norm), std::get<1>(norm), std::get<2>(norm));
}

// residual_norm with the two norms as the layer holds them.
std::tuple<torch::Tensor, torch::Tensor> add_normed(const torch::Tensor& x, const torch::Tensor& y, const Norm& y_norm,
                                                    const Norm& out_norm) {
  return residual_norm(x, y, weight_of(y_norm), std::get<1>(y_norm), std::get<2>(y_norm), weight_of(out_norm),
                       std::get<1>(out_norm), std::get<2>(out_norm));
}

void check_norm(const Norm& norm, bool required, const char* name) {
  TORCH_CHECK(!required || weight_of(norm).has_value(), name, ": the layer needs this norm's weight");
}

}  // namespace

Projection Projection::float32(torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  const int64_t K = packed.dim() == 4 ? packed.size(1) * 8 : 0;  // linear_f32 checks the packing itself
  return {Kind::kFloat32, std::move(packed), torch::Tensor(), c10::nullopt, std::move(bias), N, K};
}

Projection Projection::int8(torch::Tensor packed, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  const int64_t N = scales.numel(), K = packed.dim() == 4 ? packed.size(1) * 8 : 0;
  return {Kind::kInt8, std::move(packed), std::move(scales), c10::nullopt, std::move(bias), N, K};
}

Projection Projection::blocks(torch::Tensor data, torch::Tensor segments, c10::optional<torch::Tensor> columns,
                              c10::optional<torch::Tensor> bias, int64_t N, int64_t K) {
  return {Kind::kBlocks, std::move(data), std::move(segments), std::move(columns), std::move(bias), N, K};
}

Projection Projection::matrix(torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 2, "weight: [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  return {Kind::kMatrix, std::move(weight), torch::Tensor(), c10::nullopt, std::move(bias), N, K};
}

torch::Tensor Projection::operator()(const torch::Tensor& x) const {
  switch (kind) {
    case Kind::kFloat32: return linear_f32(x, weight, bias, out_features);
    case Kind::kInt8: return linear_int8(x, weight, scales, bias);
    case Kind::kBlocks: return linear_blocks(x, weight, scales, columns, bias, out_features);
    case Kind::kMatrix: return at::linear(x, weight, bias);
  }
  TORCH_CHECK(false, "unknown projection kind");
}

DecoderLayer::DecoderLayer(Norm input, Projection qkv, Norm qk_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           double scale, Projection o_proj, Norm attention_out, Norm mlp_in, Projection gate_up,
                           std::string activation, Projection down, Norm mlp_out)
    : input_(std::move(input)), qk_norm_(std::move(qk_norm)), attention_out_(std::move(attention_out)),
      mlp_in_(std::move(mlp_in)), mlp_out_(std::move(mlp_out)), qkv_(std::move(qkv)), o_proj_(std::move(o_proj)),
      gate_up_(std::move(gate_up)), down_(std::move(down)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
      scale_(scale), activation_(std::move(activation)) {
  check_norm(input_, true, "input");
  check_norm(mlp_in_, true, "mlp_in");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
  TORCH_CHECK(qkv_.out_features == (heads + 2 * kv_heads) * head_dim, "qkv: ", (heads + 2 * kv_heads) * head_dim,
              " outputs for ", heads, " + 2 x ", kv_heads, " heads of ", head_dim, ", got ", qkv_.out_features);
  TORCH_CHECK(o_proj_.in_features == heads * head_dim && o_proj_.out_features == qkv_.in_features,
              "o_proj: [hidden, heads x head_dim]");
  TORCH_CHECK(gate_up_.in_features == qkv_.in_features && down_.in_features * 2 == gate_up_.out_features &&
                  down_.out_features == qkv_.in_features,
              "gate_up: [2 x intermediate, hidden]; down: [hidden, intermediate]");
  work_per_row_ = 0;
  for (const Projection* p : {&qkv_, &o_proj_, &gate_up_, &down_}) work_per_row_ += p->out_features * p->in_features;
}

torch::Tensor DecoderLayer::run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                const torch::Tensor& k_codes, const torch::Tensor& k_scales, const torch::Tensor& k_zeros,
                                const torch::Tensor& v_codes, const torch::Tensor& v_scales, const torch::Tensor& v_zeros,
                                const torch::Tensor& write_pages, const torch::Tensor& write_offsets,
                                const torch::Tensor& block_table, const torch::Tensor& first_pos, const torch::Tensor& row_seq,
                                const torch::Tensor& row_pos, int64_t window) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == qkv_.in_features, "x: [N, ", qkv_.in_features, "]");
  const int64_t N = x.size(0);
  // Attention: the fused q/k norms and RoPE read q and k out of the projection; v is its last heads.
  const auto qkv = qkv_(normed(x, input_)).view({N, heads_ + 2 * kv_heads_, head_dim_});
  const auto [q, k] = qk_norm_rope(qkv, weight_of(qk_norm_), std::get<1>(qk_norm_), std::get<2>(qk_norm_),
                                   cos.reshape({N, -1}), sin.reshape({N, -1}), heads_);
  const auto v = qkv.narrow(1, heads_ + kv_heads_, kv_heads_).contiguous();
  store_kv(k, k_codes, k_scales, k_zeros, write_pages, write_offsets);
  store_kv(v, v_codes, v_scales, v_zeros, write_pages, write_offsets);
  const bool raw = k_codes.scalar_type() == torch::kFloat32 || k_codes.scalar_type() == torch::kHalf;
  const auto attended = raw ? paged_attention(q, k_codes, v_codes, block_table, first_pos, row_seq, row_pos, window, scale_)
                            : paged_attention_coded(q, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, block_table,
                                                    first_pos, row_seq, row_pos, window, scale_);
  const auto [residual, h] = add_normed(x, o_proj_(attended.reshape({N, heads_ * head_dim_})), attention_out_, mlp_in_);
  // The gated MLP, its output added (normed first where the model norms it).
  const auto y = down_(gated_activation(gate_up_(h), activation_));
  return std::get<0>(add_normed(residual, y, mlp_out_, Norm{c10::nullopt, 0.0, 0.0}));
}

}  // namespace kiln
