// The extension module: every kernel of kernels.h, the page format's constants, and the mapping of a failed
// check to Kiln's typed error.
//
// The GIL is released for every call (py::call_guard): the kernels read and write tensor memory only and
// never touch a Python object, and a decode step spends most of its time in them, so the server's other
// Python threads (the event loop serving streams and /metrics, the snapshot saver) run meanwhile. pybind
// converts the arguments before the guard is taken and the result after it is dropped, both under the GIL.
//
// A failed TORCH_CHECK in a kernel (c10::Error) is a caller's broken contract, an internal bug: it becomes
// kiln.errors.InvariantViolation (kind "kernel_contract"), which fails the requests of the step that made
// the call and nothing else.
#include <torch/extension.h>

#include "kernels.h"
#include "page_format.h"

#include <exception>

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::register_local_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const c10::Error& error) {
      raise_invariant_violation(error.what_without_backtrace());
    }
  });
  const auto released = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "fused RMSNorm (norms.cpp)", released);
  m.def("residual_norm", &residual_norm, "residual add of a (normed) sublayer output, and its norm (norms.cpp)", released);
  m.def("qk_norm_rope", &qk_norm_rope, "fused q/k head norms and rotary embedding (norms.cpp)", released);
  m.def("gated_activation", &gated_activation, "act(gate) * up of a fused gate/up projection (activations.cpp)", released);
  m.def("argmax_rows", &argmax_rows, "each row's torch.argmax (argmax.cpp)", released);
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (attention.cpp)", released);
  m.def("paged_attention_coded", &paged_attention_coded, "paged attention over 8-bit / 4-bit coded pages (attention.cpp)",
        released);
  m.def("paged_attention_merge", &paged_attention_merge, "paged attention merged into an online-softmax state (attention.cpp)",
        released);
  m.def("paged_attention_coded_merge", &paged_attention_coded_merge,
        "coded paged attention merged into an online-softmax state (attention.cpp)", released);
  m.def("store_kv", &store_kv, "new K/V rows stored into raw or coded pages (kv_store.cpp)", released);
  m.def("linear_f32", &linear_f32, "batch-invariant float32 linear, packed weights (linear.cpp)", released);
  m.def("linear_int8", &linear_int8, "weight-only int8 linear, packed weights and per-row scales (linear.cpp)", released);
  m.def("unpack", &unpack, "packed weights -> row-major float32 (linear.cpp)", released);
  m.def("page_format", &page_format, "the page format's constants (page_format.h), for kiln/kv/page_format.py to match");
}
