// ringreduce torch layer: the Python module ringreduce._C.
//
// Translation only: Python arguments to the core's types (one bound CallOptions per call), the
// core's enums as Python enums (so Python copies no C++ constant), rr::Error kinds to the Python
// exceptions users expect, and the GIL released around everything that can block. The CPU glue is
// cpu_ops.cpp; in CUDA builds cuda_bindings.cpp adds the GPU functions.
// torch's pybind11 casters and c10d, not <torch/extension.h> (all of torch's C++ API: a quarter of
// this file's compile time; Note [First-build time] in setup.py).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <cctype>

#include "../core/error.h"
#include "../core/frame.h"
#include "../core/plan.h"
#include "../cpu/runtime_registry.h"
#include "cpu_ops.h"

#ifdef RR_WITH_CUDA
void registerCudaBindings(pybind11::module& m);
#endif

namespace py = pybind11;
using PG = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace {

[[noreturn]] void raiseAs(rr::ErrorKind kind, const std::string& msg) {
  switch (kind) {
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

// The plan one rank would run (plan_summary): `options` as rr::PlanOptions (one struct across the
// boundary, bound as ringreduce._C.PlanOptions).
py::dict planSummary(int nranks, int rank, int64_t numel, int dtype, const rr::PlanOptions& o) {
  const rr::Plan p = rr::buildPlan(nranks, rank, numel, static_cast<rr::DType>(dtype), o);
  py::dict d;
  d["chunk"] = p.sched.chunk;
  d["segment"] = p.sched.segment;
  d["nsegs"] = p.sched.nsegs;
  d["num_exchanges"] = p.num_exchanges;
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

// The core's enum as a Python enum: member i is E(i), named as the core names it, in capitals
// (DType.FLOAT32, RedOp.SUM, CallKind.ALL_REDUCE), so Python copies no C++ constant.
template <typename E, typename NameOf>
void bindEnum(py::module& m, const char* name, int count, NameOf name_of) {
  py::enum_<E> e(m, name);
  for (int i = 0; i < count; ++i) {
    std::string member = name_of(static_cast<E>(i));
    for (char& c : member) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    e.value(member.c_str(), static_cast<E>(i));
  }
}

// A call of `ring` from Python, without the GIL. A synchronous call may run right here; while it
// waits it asks for Ctrl-C (Note [Interrupting a wait]): the KeyboardInterrupt that the signal
// handler raised is kept and raised once the call has failed. Only run()'s handle has no future.
std::shared_ptr<rr::CpuCall> submitFromPython(rr::CpuRing& ring, const std::optional<at::Tensor>& tensor,
                                              const std::optional<at::Tensor>& output, const rr::CallOptions& options,
                                              bool synchronous, bool with_future = true) {
  std::shared_ptr<py::error_already_set> interrupted;
  std::function<bool()> poll;
  if (synchronous) {
    poll = [&interrupted] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      interrupted = std::make_shared<py::error_already_set>();
      return true;
    };
  }
  std::shared_ptr<rr::CpuCall> call;
  {
    py::gil_scoped_release nogil;
    call = ring.submit(tensor.value_or(at::Tensor()), output.value_or(at::Tensor()), options, synchronous,
                       std::move(poll), with_future);
  }
  if (interrupted) throw *interrupted;
  return call;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce native core: ring plan, CPU transport over c10d send/recv, CUDA+NCCL driver";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const rr::Error& e) {
      raiseAs(e.kind(), e.what());
    }
  });

  bindEnum<rr::RedOp>(m, "RedOp", rr::kNumRedOps, rr::redOpName);
  bindEnum<rr::CallKind>(m, "CallKind", rr::kNumCallKinds,
                         [](rr::CallKind k) { return rr::callKindName(static_cast<int32_t>(k)); });
  py::enum_<rr::FrameError>(m, "FrameError")
      .value("NONE", rr::FrameError::kNone)
      .value("UNSUPPORTED", rr::FrameError::kUnsupported)
      .value("NOT_A_TENSOR", rr::FrameError::kNotATensor)
      .value("SPARSE", rr::FrameError::kSparse)
      .value("DEVICE", rr::FrameError::kDevice)
      .value("OTHER", rr::FrameError::kOther);
  bindEnum<rr::DType>(m, "DType", rr::kNumDTypes, rr::dtypeName);

  py::class_<rr::CallOptions>(m, "CallOptions", "What one call asks for, on either device (csrc/core/call_options.h).")
      .def(py::init<>())
      .def_readwrite("kind", &rr::CallOptions::kind)
      .def_readwrite("op", &rr::CallOptions::op)
      .def_readwrite("accum_float32", &rr::CallOptions::accum_float32)
      .def_readwrite("accum_narrow", &rr::CallOptions::accum_narrow)
      .def_readwrite("wire_dtype", &rr::CallOptions::wire_dtype)
      .def_readwrite("wire_gather16", &rr::CallOptions::wire_gather16)
      .def_readwrite("predivide", &rr::CallOptions::predivide)
      .def_readwrite("extra_divisor", &rr::CallOptions::extra_divisor)
      .def_readwrite("local_error", &rr::CallOptions::local_error)
      .def_readwrite("ntensors", &rr::CallOptions::ntensors)
      .def_readwrite("layout_hash", &rr::CallOptions::layout_hash)
      .def_readwrite("check", &rr::CallOptions::check)
      .def_readwrite("segment_bytes", &rr::CallOptions::segment_bytes)
      .def_readwrite("num_slots", &rr::CallOptions::num_slots)
      .def_readwrite("lanes", &rr::CallOptions::lanes)
      .def_readwrite("one_shot_bytes", &rr::CallOptions::one_shot_bytes)
      .def_readwrite("timeout_ms", &rr::CallOptions::timeout_ms)
      .def_readwrite("local_size", &rr::CallOptions::local_size)
      .def_readwrite("node_order", &rr::CallOptions::node_order)
      .def_readwrite("direct", &rr::CallOptions::direct)
      .def_readwrite("one_shot", &rr::CallOptions::one_shot)
      .def_readwrite("one_node", &rr::CallOptions::one_node)
      .def_readwrite("shm", &rr::CallOptions::shm);

  py::class_<rr::CpuCall, std::shared_ptr<rr::CpuCall>>(m, "CallHandle")
      .def("wait", &rr::CpuCall::wait, py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &rr::CpuCall::isCompleted)
      .def("ok", &rr::CpuCall::ok)
      .def("raise_error", [](rr::CpuCall& h) { raiseAs(h.errorKind(), h.errorMessage()); })
      .def("timing_us",
           [](rr::CpuCall& h) { return py::make_tuple(h.timing().check_us, h.timing().ring_us); })
      .def_property_readonly("seq", &rr::CpuCall::seq)
      .def("get_future", [](const rr::CpuCall& h) {
        if (!h.future()) throw py::value_error("ringreduce: a synchronous call's handle has no future (CpuRing.run)");
        return std::make_shared<torch::jit::PythonFutureWrapper>(h.future());
      });

  // Note [A bound ring] (cpu_ops.h). Note [Synchronous calls without a handle]: a synchronous call
  // that ran on the calling thread (Note [Synchronous calls in shared memory]) is over, so run()
  // returns None or raises its error as the handle would, saving the handle and its wait; only a
  // queued call (behind an async call, or on gloo) comes back as a handle to wait for.
  py::class_<rr::CpuRing, std::shared_ptr<rr::CpuRing>>(m, "CpuRing", "The ring `members` ([] = all) of `group`.")
      .def(py::init<PG, std::string, std::vector<int>, c10::intrusive_ptr<c10d::Store>>(), py::arg("group"),
           py::arg("group_name"), py::arg("members"), py::arg("store"))
      .def(
          "run",
          [](rr::CpuRing& ring, const at::Tensor& tensor, const rr::CallOptions& options) -> py::object {
            const auto call = submitFromPython(ring, tensor, std::nullopt, options, true, /*with_future=*/false);
            if (!call->isCompleted()) return py::cast(call);
            if (!call->ok()) raiseAs(call->errorKind(), call->errorMessage());
            return py::none();
          },
          py::arg("tensor"), py::arg("options"), "A synchronous call: None once done (or raises), or its handle.")
      .def(
          "submit",
          [](rr::CpuRing& ring, const std::optional<at::Tensor>& tensor, const std::optional<at::Tensor>& output,
             const rr::CallOptions& options, bool synchronous) {
            return submitFromPython(ring, tensor, output, options, synchronous);
          },
          py::arg("tensor"), py::arg("output"), py::arg("options"), py::arg("synchronous") = false, "Queues a call.");
  m.def(
      "bytes_sent",
      [](const PG& pg, bool reset) { return rr::bytesSentOf(pg.get(), pg->getSize(), reset); },
      py::arg("group"), py::arg("reset") = false,
      "Payload bytes this process sent to each rank of the group on the CPU path (frames excluded).");
  m.def(
      "staging_bytes", [](const PG& pg) { return rr::stagingBytesOf(pg.get()); },
      py::arg("group"), "Bytes of the staging slots ringreduce holds for the group on the CPU path.");
  m.def(
      "memory_bytes", [](const PG& pg) { return rr::memoryBytesOf(pg.get()); },
      py::arg("group"), "All the memory ringreduce holds for the group on the CPU path (staging, frames, scratch).");
  m.def("cpu_ring_count", &rr::runtimeCount, "How many CPU rings (worker, staging, transport) this process holds.");
  m.def("retained_bytes", &rr::GroupRuntime::retainedBytes,
        "Bytes of failed calls' buffers that this process's CPU rings keep (Note [Failed calls keep their "
        "buffers]); a released ring frees its own (Note [Releasing a ring's buffers]).");
  m.def(
      "transport_info",
      [](const PG& pg, const std::vector<int>& members) {
        auto rt = rr::findRuntime(pg.get(), rr::ringKey(members, pg->getSize()));
        return rt ? rt->transportInfo() : std::string();
      },
      py::arg("group"), py::arg("members") = std::vector<int>{},
      "How the ring `members` of the group moves data on CPU: 'shm', 'tcp' or 'tcp (<why not shm>)'.");
  m.def(
      "interrupt_cpu",
      [](const PG& pg, const std::vector<int>& members, const std::string& reason) {
        auto rt = rr::findRuntime(pg.get(), rr::ringKey(members, pg->getSize()));
        if (rt) rt->interrupt(reason);
        return rt != nullptr;
      },
      py::arg("group"), py::arg("members"), py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
      "Ctrl-C: makes the CPU ring `members` of `group` unusable with `reason`, waking a blocked call.");
  m.def(
      "release_cpu",
      [](const PG& pg) { return rr::releaseRuntimesOf(pg.get()); },
      py::arg("group"), py::call_guard<py::gil_scoped_release>(),
      "Joins and forgets every CPU ring of `group` (its destruction); returns how many there were.");
  m.def("shutdown", &rr::shutdownAllRuntimes, py::call_guard<py::gil_scoped_release>(),
        "Finish queued calls and join every group worker (called at interpreter exit).");

  m.def("dtype_code", [](at::ScalarType t) { return static_cast<int>(rr::toDType(t)); });
  m.def("unsupported_reason", [](int dtype, int op) -> py::object {
    const char* why = rr::unsupportedReason(static_cast<rr::DType>(dtype), static_cast<rr::RedOp>(op));
    return why == nullptr ? py::none() : py::object(py::str(why));
  });
  py::class_<rr::PlanOptions>(m, "PlanOptions", "What a plan is built with (csrc/core/plan.h).")
      .def(py::init<>())
      .def_readwrite("max_segment_bytes", &rr::PlanOptions::max_segment_bytes)
      .def_readwrite("num_slots", &rr::PlanOptions::num_slots)
      .def_readwrite("accum_float32", &rr::PlanOptions::accum_float32)
      .def_readwrite("wire_dtype", &rr::PlanOptions::wire_dtype)
      .def_readwrite("wire_gather16", &rr::PlanOptions::wire_gather16)
      .def_readwrite("pre_factor", &rr::PlanOptions::pre_factor)
      .def_readwrite("post_factor", &rr::PlanOptions::post_factor)
      .def_readwrite("gather_into_data", &rr::PlanOptions::gather_into_data)
      .def_readwrite("phases", &rr::PlanOptions::phases)
      .def_readwrite("owner_shift", &rr::PlanOptions::owner_shift)
      .def_readwrite("exact_chunks", &rr::PlanOptions::exact_chunks);
  // Keywords are PlanOptions' fields (unknown ones raise AttributeError); `segment_bytes` stands for
  // max_segment_bytes and `predivide` for both factors, as the plan of a call with that factor has them.
  m.def(
      "plan_summary",
      [](int nranks, int rank, int64_t numel, int dtype, const py::kwargs& fields) {
        rr::PlanOptions o;
        py::object options = py::cast(&o, py::return_value_policy::reference);
        for (const auto& item : fields) {
          const std::string name = py::str(item.first);
          if (name == "segment_bytes") {
            options.attr("max_segment_bytes") = item.second;
          } else if (name == "predivide") {
            options.attr("pre_factor") = item.second;
            options.attr("post_factor") = item.second;
          } else {
            options.attr(name.c_str()) = item.second;
          }
        }
        return planSummary(nranks, rank, numel, dtype, o);
      },
      py::arg("nranks"), py::arg("rank"), py::arg("numel"), py::arg("dtype"),
      "The ring schedule and plan one rank would run (for tests and docs); keywords: PlanOptions' fields.");

  py::dict info;
  info["version"] = RR_VERSION;
  info["torch_built"] = RR_TORCH_VERSION;
  info["shm"] = true;  // the shared-memory transport of CPU rings on one host (csrc/cpu/shm_ring.h)
#ifdef RR_WITH_CUDA
  info["cuda"] = true;
  registerCudaBindings(m);
#else
  info["cuda"] = false;
#endif
  m.attr("native_info") = info;
}
