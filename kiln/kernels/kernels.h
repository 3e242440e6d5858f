// Every kernel the extension exports, declared once: each .cpp defines its own, bindings.cpp binds them all.
//
// Contracts: tensors are CPU tensors in the layouts each definition's file states. Every argument a kernel
// trusts for memory safety (shapes, dtypes, strides, index ranges: page ids, rows' sequences, positions) is
// checked with TORCH_CHECK before any memory is touched; a failed check surfaces in Python as
// kiln.errors.InvariantViolation (bindings.cpp), never as a crash. Kernels touch no Python object, so the
// bindings release the GIL while they run.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

// linear.cpp
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor unpack(torch::Tensor w, c10::optional<torch::Tensor> scale, int64_t N, torch::Tensor out);

// blocks.cpp
torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor data, torch::Tensor segments, c10::optional<torch::Tensor> columns,
                            c10::optional<torch::Tensor> bias, int64_t N);

// repack.cpp
int64_t repacked_row_bytes(int64_t type, int64_t cols);
int64_t repack_blocks(torch::Tensor stored, int64_t type, torch::Tensor out);

// attention.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                              torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                              double scale);
torch::Tensor paged_attention_coded(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor k_zeros,
                                    torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_zeros,
                                    torch::Tensor block_table, torch::Tensor first_pos, torch::Tensor row_seq,
                                    torch::Tensor row_pos, int64_t window, double scale);
// The same over a part of each row's keys, merged into the caller's online-softmax state (attention.cpp).
void paged_attention_merge(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                           torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window, double scale,
                           torch::Tensor acc, torch::Tensor top, torch::Tensor total);
void paged_attention_coded_merge(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor k_zeros,
                                 torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_zeros, torch::Tensor block_table,
                                 torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                                 double scale, torch::Tensor acc, torch::Tensor top, torch::Tensor total);

// kv_store.cpp
void store_kv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, torch::Tensor pages,
              torch::Tensor offsets);

// norms.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset);
std::tuple<torch::Tensor, torch::Tensor> residual_norm(torch::Tensor x, torch::Tensor y, c10::optional<torch::Tensor> y_weight,
                                                       double y_eps, double y_offset, c10::optional<torch::Tensor> out_weight,
                                                       double out_eps, double out_offset);
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor qkv, c10::optional<torch::Tensor> norm_weight,
                                                      double eps, double offset, torch::Tensor cos, torch::Tensor sin,
                                                      int64_t heads);

// activations.cpp
torch::Tensor gated_activation(torch::Tensor gate_up, const std::string& activation);

// argmax.cpp
torch::Tensor argmax_rows(torch::Tensor logits);
