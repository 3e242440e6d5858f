// The extension module: every kernel of kernels.h, the page format's constants, and the mapping of a failed
// check to Kiln's typed error.
//
// The GIL is released for the calls that run long (about a millisecond or more: the LM head, projections
// over many rows, attention over a long history or many rows, unpacking weights): the kernels read and
// write tensor memory only and never touch a Python object, so the server's other Python threads (the
// event loop serving streams and /metrics, the snapshot saver) run meanwhile. Short calls keep it: taking
// the GIL back while another thread is busy in Python waits out that thread's switch interval (5 ms), and
// a decode step makes over a hundred short calls (releasing on every call, a step under one busy thread
// took ~0.7 s: 1.4 tokens/s). pybind converts the arguments and the result under the GIL either way.
//
// A failed TORCH_CHECK in a kernel (c10::Error) is a caller's broken contract, an internal bug: it becomes
// kiln.errors.InvariantViolation (kind "kernel_contract"), which fails the requests of the step that made
// the call and nothing else.
#include <torch/extension.h>

#include "decoder_layer.h"
#include "isa.h"
#include "kernels.h"
#include "page_format.h"

#include <algorithm>
#include <exception>
#include <utility>

namespace py = pybind11;

namespace {

void raise_invariant_violation(const char* detail) {
  const py::object violation = py::module_::import("kiln.errors").attr("InvariantViolation");
  const py::object error = violation("kernel_contract", detail);
  PyErr_SetObject(violation.ptr(), error.ptr());
}

py::dict page_format() {
  namespace f = kiln::page_format;
  py::dict out;
  out["tiny_scale"] = f::kTinyScale;
  out["int8_max"] = f::kInt8Max;
  out["int4_max"] = f::kInt4Max;
  out["chunk_tokens"] = f::kChunkTokens;
  out["max_page_tokens"] = f::kMaxPageTokens;
  return out;
}

// Work (multiply-adds) past which a call is worth releasing the GIL for: about a millisecond on this
// hardware class for each kernel family (the linears stream int8/float weights, attention does float math
// per key).
constexpr int64_t kLinearReleaseWork = int64_t{48} << 20;
constexpr int64_t kAttentionReleaseWork = int64_t{8} << 20;

int64_t rows(const torch::Tensor& x) { return x.numel() / std::max<int64_t>(x.dim() ? x.size(-1) : 1, 1); }

// `kernel` bound so that it runs without the GIL when `work(args...)` reaches `threshold`.
template <typename Result, typename... Args, typename Work>
auto released_when_long(Result (*kernel)(Args...), Work work, int64_t threshold) {
  return [kernel, work, threshold](Args... args) -> Result {
    if (work(args...) < threshold) return kernel(std::move(args)...);
    py::gil_scoped_release released;
    return kernel(std::move(args)...);
  };
}

// Rows x weight elements, for linear_f32 and linear_int8 (packed or not, w holds N x K elements).
const auto linear_work = [](const torch::Tensor& x, const torch::Tensor& w, const auto&...) { return rows(x) * w.numel(); };
// Rows x N x K for linear_blocks.
const auto blocks_work = [](const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&, const auto&, const auto&, int64_t N) {
  return x.numel() * N;
};
// Query elements x the key positions a block table row spans (its width x the page size), raw and coded.
const auto attention_work = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor&,
                               const torch::Tensor& block_table, const auto&...) {
  return block_table.dim() == 2 && k.dim() > 1 ? q.numel() * block_table.size(1) * k.size(1) : 0;  // else: the kernel refuses
};
const auto coded_attention_work = [](const torch::Tensor& q, const torch::Tensor& k_codes, const torch::Tensor&,
                                     const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                     const torch::Tensor& block_table, const auto&...) {
  return block_table.dim() == 2 && k_codes.dim() > 1 ? q.numel() * block_table.size(1) * k_codes.size(1) : 0;
};

// One decoder layer's step, without the GIL when its projections' work reaches kLinearReleaseWork (a larger
// model's layer, or many rows); a small model's decode layer keeps it, as its separate kernels did.
torch::Tensor run_layer(const kiln::DecoderLayer& layer, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& k_codes, const torch::Tensor& k_scales, const torch::Tensor& k_zeros,
                        const torch::Tensor& v_codes, const torch::Tensor& v_scales, const torch::Tensor& v_zeros,
                        const torch::Tensor& write_pages, const torch::Tensor& write_offsets, const torch::Tensor& block_table,
                        const torch::Tensor& first_pos, const torch::Tensor& row_seq, const torch::Tensor& row_pos, int64_t window) {
  const auto run = [&] {
    return layer.run(x, cos, sin, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, write_pages, write_offsets, block_table,
                     first_pos, row_seq, row_pos, window);
  };
  if (rows(x) * layer.work_per_row() < kLinearReleaseWork) return run();
  py::gil_scoped_release released;
  return run();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::register_local_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const c10::Error& error) {
      raise_invariant_violation(error.what_without_backtrace());
    }
  });
  m.def("rms_norm", &rms_norm, "fused RMSNorm (norms.cpp)");
  m.def("residual_norm", &residual_norm, "residual add of a (normed) sublayer output, and its norm (norms.cpp)");
  m.def("qk_norm_rope", &qk_norm_rope, "fused q/k head norms and rotary embedding (norms.cpp)");
  m.def("gated_activation", &gated_activation, "act(gate) * up of a fused gate/up projection (activations.cpp)");
  m.def("argmax_rows", &argmax_rows, "each row's torch.argmax (argmax.cpp)");
  m.def("paged_attention", released_when_long(&paged_attention, attention_work, kAttentionReleaseWork),
        "batch-invariant paged attention (attention.cpp)");
  m.def("paged_attention_coded", released_when_long(&paged_attention_coded, coded_attention_work, kAttentionReleaseWork),
        "paged attention over 8-bit / 4-bit coded pages (attention.cpp)");
  m.def("paged_attention_merge", released_when_long(&paged_attention_merge, attention_work, kAttentionReleaseWork),
        "paged attention merged into an online-softmax state (attention.cpp)");
  m.def("paged_attention_coded_merge",
        released_when_long(&paged_attention_coded_merge, coded_attention_work, kAttentionReleaseWork),
        "coded paged attention merged into an online-softmax state (attention.cpp)");
  m.def("store_kv", &store_kv, "new K/V rows stored into raw or coded pages (kv_store.cpp)");
  m.def("linear_f32", released_when_long(&linear_f32, linear_work, kLinearReleaseWork),
        "batch-invariant float32 linear, packed weights (linear.cpp)");
  m.def("linear_int8", released_when_long(&linear_int8, linear_work, kLinearReleaseWork),
        "weight-only int8 linear, packed weights and per-row scales (linear.cpp)");
  m.def("linear_blocks", released_when_long(&linear_blocks, blocks_work, kLinearReleaseWork),
        "linear over GGUF block-quantised weights as stored (blocks.cpp)");
  m.def("repacked_row_bytes", &repacked_row_bytes, "a row's bytes once repacked eight rows to a group; 0: the type does not repack (repack.cpp)");
  m.def("repack_blocks", &repack_blocks, "GGUF rows repacked eight to a group into out; returns the repacked type (repack.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return kiln::isa_name(kiln::active_isa()); }, "the instruction-set path the kernels take (isa.h)");
  m.def("cpu_has_avx512_vnni", [] { return kiln::cpu_has(kiln::Isa::kAvx512Vnni); }, "whether this CPU runs the AVX-512 VNNI path");
  m.def("use_isa", &kiln::use_isa, "take the path named avx2 or avx512_vnni from now on; returns the previous one's name");
  m.def("unpack", &unpack, "packed weights -> row-major float32 (linear.cpp)", py::call_guard<py::gil_scoped_release>());
  py::class_<kiln::Projection>(m, "Projection", "a linear layer's weights as its kernel takes them (decoder_layer.h)")
      .def_static("float32", &kiln::Projection::float32, py::arg("packed"), py::arg("bias"), py::arg("out_features"))
      .def_static("int8", &kiln::Projection::int8, py::arg("packed"), py::arg("scales"), py::arg("bias"))
      .def_static("blocks", &kiln::Projection::blocks, py::arg("data"), py::arg("segments"), py::arg("columns"), py::arg("bias"),
                  py::arg("out_features"), py::arg("in_features"))
      .def_static("matrix", &kiln::Projection::matrix, py::arg("weight"), py::arg("bias"));
  py::class_<kiln::DecoderLayer>(m, "DecoderLayer", "a decoder layer's step as one call (decoder_layer.h)")
      .def(py::init<kiln::Norm, kiln::Projection, kiln::Norm, int64_t, int64_t, int64_t, double, kiln::Projection, kiln::Norm,
                    kiln::Norm, kiln::Projection, std::string, kiln::Projection, kiln::Norm>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("qk_norm"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("o_proj"), py::arg("attention_out_norm"), py::arg("mlp_in_norm"), py::arg("gate_up"),
           py::arg("activation"), py::arg("down"), py::arg("mlp_out_norm"))
      .def("run", &run_layer, "the step's rows through the layer, their K/V stored (decoder_layer.h)");
  m.def("page_format", &page_format, "the page format's constants (page_format.h), for page_format.py to match");
}
