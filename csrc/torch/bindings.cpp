// ringreduce torch layer: the Python module ringreduce._C.
//
// The only translation unit besides cpu_group.cpp (and, in CUDA builds, cuda_bindings.cpp) that
// sees torch. It converts Python arguments to the core's types once, maps rr::Error kinds to the
// Python exceptions users expect, and releases the GIL around every blocking call.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "../core/error.h"
#include "../core/frame.h"
#include "../core/plan.h"
#include "cpu_group.h"

#ifdef RR_WITH_CUDA
void registerCudaBindings(pybind11::module& m);
#endif

namespace py = pybind11;

namespace {

void raiseAs(int kind, const std::string& msg) {
  switch (static_cast<rr::ErrorKind>(kind)) {
    case rr::ErrorKind::kType: throw py::type_error(msg);
    case rr::ErrorKind::kValue: throw py::value_error(msg);
    case rr::ErrorKind::kRuntime: break;
    case rr::ErrorKind::kBackend: {
      py::object cls = py::module::import("torch.distributed").attr("DistBackendError");
      PyErr_SetString(cls.ptr(), msg.c_str());
      throw py::error_already_set();
    }
  }
  throw std::runtime_error(msg);
}

py::dict planSummary(int nranks, int rank, int64_t numel, int dtype, int64_t segment_bytes,
                     int num_slots, bool accum, bool gather, int phases, int owner_shift, bool exact_chunks) {
  rr::PlanOptions o;
  o.phases = static_cast<uint8_t>(phases);
  o.owner_shift = owner_shift;
  o.exact_chunks = exact_chunks;
  o.max_segment_bytes = segment_bytes;
  o.num_slots = num_slots;
  o.accum_float32 = accum;
  o.gather_into_data = gather;
  const rr::Plan p = rr::buildPlan(nranks, rank, numel, static_cast<rr::DType>(dtype), o);
  py::dict d;
  d["chunk"] = p.sched.chunk;
  d["segment"] = p.sched.segment;
  d["nsegs"] = p.sched.nsegs;
  d["num_exchanges"] = p.num_exchanges;
  d["num_ops"] = static_cast<int64_t>(p.ops.size());
  d["staging_bytes"] = p.stagingBytes();
  d["accum_elems"] = p.accum_elems;
  d["owned_chunk"] = p.sched.ownedChunk(rank);
  py::list bounds;
  for (int c = 0; c < nranks; ++c) {
    const rr::Range r = p.sched.chunkRange(c);
    bounds.append(py::make_tuple(r.begin, r.end));
  }
  d["chunks"] = bounds;
  d["text"] = p.describe();
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce native core: ring plan, CPU transport over c10d send/recv, CUDA+NCCL driver";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const rr::Error& e) {
      raiseAs(static_cast<int>(e.kind()), e.what());
    }
  });

  py::class_<rr::CallHandle, std::shared_ptr<rr::CallHandle>>(m, "CallHandle")
      .def("wait", &rr::CallHandle::wait, py::arg("timeout_ms") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &rr::CallHandle::isCompleted)
      .def("ok", &rr::CallHandle::ok)
      .def("error_kind", &rr::CallHandle::errorKind)
      .def("error_message", &rr::CallHandle::errorMessage)
      .def("raise_error", [](rr::CallHandle& h) { raiseAs(h.errorKind(), h.errorMessage()); })
      .def_property_readonly("seq", &rr::CallHandle::seq)
      .def("get_future", [](const rr::CallHandle& h) {
        return std::make_shared<torch::jit::PythonFutureWrapper>(h.future());
      });

  m.def(
      "submit_cpu",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& group_name,
         std::optional<at::Tensor> tensor, int op, bool accum_float32, int kind, int local_error,
         int ntensors, bool check, int64_t segment_bytes, int num_slots, int64_t timeout_ms,
         bool run_inline, std::vector<int> members, std::optional<at::Tensor> output, int local_size,
         int phases, int owner_shift, bool exact_chunks, std::vector<int> node_order,
         bool recv_only_waits) {
        rr::CallOptions o;
        o.op = static_cast<rr::RedOp>(op);
        o.accum_float32 = accum_float32;
        o.kind = kind;
        o.local_error = local_error;
        o.ntensors = ntensors;
        o.check = check;
        o.segment_bytes = segment_bytes;
        o.num_slots = num_slots;
        o.timeout_ms = timeout_ms;
        o.local_size = local_size;
        o.node_order = std::move(node_order);
        o.recv_only_waits = recv_only_waits;
        o.phases = phases;
        o.owner_shift = owner_shift;
        o.exact_chunks = exact_chunks;
        auto rt = rr::runtimeFor(pg, group_name, members);
        at::Tensor t = tensor.has_value() ? *tensor : at::Tensor();
        at::Tensor out = output.has_value() ? *output : at::Tensor();
        py::gil_scoped_release nogil;  // an inline call runs the whole ring here
        return rt->submit(t, out, o, run_inline);
      },
      py::arg("group"), py::arg("group_name"), py::arg("tensor"), py::arg("op"),
      py::arg("accum_float32"), py::arg("kind"), py::arg("local_error"), py::arg("ntensors"),
      py::arg("check"), py::arg("segment_bytes"), py::arg("num_slots"), py::arg("timeout_ms"),
      py::arg("run_inline") = false, py::arg("members") = std::vector<int>{},
      py::arg("output") = py::none(), py::arg("local_size") = 0, py::arg("phases") = 3,
      py::arg("owner_shift") = 0, py::arg("exact_chunks") = false, py::arg("node_order") = std::vector<int>{},
      py::arg("recv_only_waits") = true);

  m.def(
      "bytes_sent",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool reset) { return rr::bytesSent(pg.get(), reset); },
      py::arg("group"), py::arg("reset") = false,
      "Payload bytes this process sent to each rank of the group on the CPU path (frames excluded).");

  m.def(
      "staging_bytes", [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) { return rr::stagingBytes(pg.get()); },
      py::arg("group"), "Bytes of staging memory ringreduce holds for the group on the CPU path.");

  m.def("shutdown", &rr::shutdownAll, py::call_guard<py::gil_scoped_release>(),
        "Finish queued calls and join every group worker (called at interpreter exit).");

  m.def("dtype_code", [](at::ScalarType t) { return static_cast<int>(rr::toDType(t)); });
  m.def("unsupported_reason", [](int dtype, int op) -> py::object {
    const char* why = rr::unsupportedReason(static_cast<rr::DType>(dtype), static_cast<rr::RedOp>(op));
    if (why == nullptr) return py::none();
    return py::str(why);
  });
  m.def("plan_summary", &planSummary, py::arg("nranks"), py::arg("rank"), py::arg("numel"),
        py::arg("dtype"), py::arg("segment_bytes") = 1 << 20, py::arg("num_slots") = 4,
        py::arg("accum_float32") = false, py::arg("gather_into_data") = false, py::arg("phases") = 3,
        py::arg("owner_shift") = 0, py::arg("exact_chunks") = false,
        "The ring schedule and plan one rank would run (for tests and docs).");

  py::dict info;
  info["version"] = RR_VERSION;
  info["torch_built"] = RR_TORCH_VERSION;
  info["frame_bytes"] = static_cast<int64_t>(rr::kFrameBytes);
#ifdef RR_WITH_CUDA
  info["cuda"] = true;
  registerCudaBindings(m);
#else
  info["cuda"] = false;
#endif
  m.attr("native_info") = info;
}
