// A decoder layer's step as one call: the kernels of kernels.h composed in C++ in the order the model's
// modules call them (kiln/models/fused_block.py builds one per layer).
//
// Why: a small model's decode step made ~220 kernel calls, twelve a layer, each reached through Python
// (module calls, views, a pybind dispatch), and about a fifth of the step was spent between kernels
// (bench/README.md § Design figures). Composed here, a layer costs one Python call; each kernel still
// runs on the spinning pool (pool.h), whose workers stay awake between a layer's kernels.
//
// The same kernels on the same inputs in the same order: the results are the module path's bits, which
// the tests check (tests/models/test_fused_block.py).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

namespace kiln {

// One linear layer's weights as its kernel takes them.
struct Projection {
  enum class Kind { kFloat32, kInt8, kBlocks, kMatrix };
  Kind kind;
  torch::Tensor weight;                 // packed float32 or int8 (linear.cpp), the blocks' bytes (blocks.cpp), or [N, K]
  torch::Tensor scales;                 // int8: per output row; blocks: the segments table; else undefined
  c10::optional<torch::Tensor> columns;  // blocks: the output column of each row, when the parts are reordered
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
  int64_t in_features;

  static Projection float32(torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);
  static Projection int8(torch::Tensor packed, torch::Tensor scales, c10::optional<torch::Tensor> bias);
  static Projection blocks(torch::Tensor data, torch::Tensor segments, c10::optional<torch::Tensor> columns,
                           c10::optional<torch::Tensor> bias, int64_t N, int64_t K);
  // A float matrix computed by ATen's linear, as nn.Linear computes it (weights the kernels do not hold).
  static Projection matrix(torch::Tensor weight, c10::optional<torch::Tensor> bias);

  torch::Tensor operator()(const torch::Tensor& x) const;
};

// An RMSNorm's weight, eps and offset (kernels/norms.cpp); no weight: no norm.
using Norm = std::tuple<c10::optional<torch::Tensor>, double, double>;

// A pre-norm block: x + attention(norm(x)) (the attention output normed when attention_out has a weight),
// then that + mlp(mlp_in(it)) (normed when mlp_out has one). Gemma 3 norms both outputs; Llama neither.
class DecoderLayer {
 public:
  DecoderLayer(Norm input, Projection qkv, Norm qk_norm, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
               Projection o_proj, Norm attention_out, Norm mlp_in, Projection gate_up, std::string activation,
               Projection down, Norm mlp_out);

  // x [N, hidden] of the step's rows; cos, sin [N, 1, head_dim / 2]; the layer's K and V pages as the
  // codec's kernel parts (codes, scales, zeros: kv/codec.py); where the rows' K/V go (write_pages,
  // write_offsets) and what each row reads (block_table, first_pos, row_seq, row_pos, window), as
  // kv/step.py describes them. Stores the rows' K/V; returns the residual stream after the layer.
  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_codes,
                    const torch::Tensor& k_scales, const torch::Tensor& k_zeros, const torch::Tensor& v_codes,
                    const torch::Tensor& v_scales, const torch::Tensor& v_zeros, const torch::Tensor& write_pages,
                    const torch::Tensor& write_offsets, const torch::Tensor& block_table, const torch::Tensor& first_pos,
                    const torch::Tensor& row_seq, const torch::Tensor& row_pos, int64_t window) const;

  // Multiply-adds of the layer's projections per row: what decides whether a call is long enough to run
  // without the GIL (bindings.cpp).
  int64_t work_per_row() const { return work_per_row_; }

 private:
  Norm input_, qk_norm_, attention_out_, mlp_in_, mlp_out_;
  Projection qkv_, o_proj_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  std::string activation_;
  int64_t work_per_row_;
};

}  // namespace kiln
