// ringreduce torch layer: the CUDA half of ringreduce._C (RR_WITH_CUDA builds), Python's side being
// ringreduce/_cuda.py. Translation only: tensors to device buffers and callbacks (csrc/cuda/cuda_ops.h
// sequences every call), the caller's stream, recordStream, CUDA-aware futures. Failures are rr::Errors,
// which bindings.cpp translates; torch's pybind11 casters, not <torch/extension.h> (Note [First-build
// time] in setup.py).
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/core/ivalue.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../core/error.h"
#include "../cuda/cuda_ops.h"
#include "../cuda/host_interrupt.h"
#include "../cuda/loopback_ring.h"
#include "../cuda/reduce_kernels.cuh"
#include "cpu_ops.h"  // rr::toDType

namespace py = pybind11;

namespace rr {
namespace {

// Handle of one CUDA call; duck-typed like the CPU CallHandle so ringreduce.Work wraps both.
struct CudaWorkHandle {
  std::shared_ptr<CudaWork> work;
  at::Tensor result;
  std::vector<at::Tensor> keep;  // every buffer of the call: alive as long as the handle
  c10::intrusive_ptr<c10::ivalue::Future> future;
};

// Runs `fn` without the GIL, its host waits asking for Ctrl-C (Note [Interrupting a host wait on
// CUDA], csrc/cuda/host_interrupt.h). When a signal handler raised, the wait that asked aborted its
// communicator and threw; `on_interrupt` (may be empty) runs without the GIL with that error's message
// (a call shuts its ring down: the watchdog is joined, every later call raises with the reason) and
// the handler's exception (KeyboardInterrupt) is raised instead of the wait's error.
template <typename Fn>
auto interruptible(Fn&& fn, const std::function<void(const std::string&)>& on_interrupt) -> decltype(fn()) {
  std::shared_ptr<py::error_already_set> raised;
  std::optional<decltype(fn())> result;
  std::string why = "interrupted";
  try {
    py::gil_scoped_release nogil;
    HostInterruptScope scope([&raised] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      raised = std::make_shared<py::error_already_set>();
      return true;
    });
    result.emplace(fn());
  } catch (const std::exception& e) {
    if (!raised) throw;
    why = e.what();
  }
  if (raised) {
    // Every wait that was told to stop threw; should one have returned anyway, the signal is still
    // not lost, and the ring is still shut down (1.4: the group is unusable after Ctrl-C).
    if (on_interrupt) {
      py::gil_scoped_release nogil;
      on_interrupt(why);
    }
    throw *raised;
  }
  return std::move(*result);
}

c10::cuda::CUDAStream wrap(cudaStream_t s, int device) {
  return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device));
}

// The write-back of a working copy runs inside the call, after the ring was enqueued: it must not
// fail there (the peers would be left in the ring). It runs below autograd (views of leaves that
// require grad) and in inference mode for inference tensors; overlapping elements are refused here.
void checkWritable(const at::Tensor& t, const char* what) {
  RR_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, kValue, "ringreduce: the ", what,
           " has elements that share memory (an expand()ed view); pass a tensor with distinct elements (clone())");
}

std::function<void()> writeBack(const at::Tensor& user, const at::Tensor& from, int device, cudaStream_t compute) {
  return [user, from, device, compute]() mutable {
    c10::cuda::CUDAStreamGuard sg(wrap(compute, device));
    at::NoGradGuard no_grad;
    c10::InferenceMode inference(user.is_inference());
    user.copy_(from.view(user.sizes()));
  };
}

// One call: the torch side of runCudaCall() (csrc/cuda/cuda_ops.h). `user_out`: the tensors the
// epilogue writes; `result`: the future's value.
py::object launch(CudaRing& ring, const CudaCallRequest& req, CudaCallBuffers& buf, std::vector<at::Tensor>& bufs,
                  const std::vector<at::Tensor>& user_out, const at::Tensor& result) {
  const int device = ring.device();
  const c10::cuda::CUDAStream compute_s = wrap(ring.computeStream(), device);
  buf.protect = [&]() {
    // The caching allocator must not hand these blocks out again before the internal streams (every
    // lane's) are done with them, even if Python drops the tensor right after the call (or the
    // enqueue fails).
    for (cudaStream_t s : ring.streams())
      for (const at::Tensor& t : bufs) t.record_stream(wrap(s, device));
    for (const at::Tensor& t : user_out) t.record_stream(compute_s);
  };
  // Without the GIL, also while waiting for the ring's call lock; Ctrl-C ends its host waits.
  const std::shared_ptr<CudaWork> work =
      interruptible([&] { return runCudaCall(ring, req, buf); }, [&](const std::string& why) { ring.shutdown(why); });
  if (!req.async_op || !work) return py::none();
  // CUDA-aware future: completed now (at enqueue), with its event recorded on the reduce stream
  // after the whole call, so that waiting on it (or .then()) synchronizes streams, not the host.
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{result.device()});
  {
    c10::cuda::CUDAStreamGuard sg(compute_s);
    future->markCompleted(c10::IValue(c10::List<at::Tensor>({result})));
  }
  return py::cast(std::make_shared<CudaWorkHandle>(CudaWorkHandle{work, result, bufs, future}));
}

CudaCallRequest request(const CudaRing& ring, const at::Tensor& t, const CallOptions& options, bool async_op,
                        const std::string& group_name, const std::vector<int>& members) {
  CudaCallRequest req;
  req.options = options;
  req.dtype = toDType(t.scalar_type());
  req.numel = t.numel();
  req.shape.assign(t.sizes().begin(), t.sizes().end());
  req.async_op = async_op;
  req.group_name = group_name;
  req.members = members;
  req.caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ring.device())).stream();
  return req;
}

// all_reduce of a CUDA tensor in place (the sequencing: runCudaCall). A tensor that is not
// row-major contiguous (views, transposes, channels_last, conj/neg views) is reduced in a
// row-major working copy made on the caller's stream and written back on the reduce stream.
py::object cudaAllReduce(const std::shared_ptr<CudaRing>& ring, const at::Tensor& tensor, const CallOptions& options,
                         bool async_op, const std::string& group_name, const std::vector<int>& members) {
  RR_CHECK(options.allReduce(), kValue, "ringreduce: cuda_all_reduce runs all-reduces, got call kind ",
           static_cast<int>(options.kind));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ring->device()));
  const CudaCallRequest req = request(*ring, tensor, options, async_op, group_name, members);
  const bool plain = tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg();
  if (!plain) checkWritable(tensor, "tensor");
  std::vector<at::Tensor> bufs, user_out;
  CudaCallBuffers buf;
  buf.data = [&](DType wdtype, int) {
    if (plain && wdtype == req.dtype) {
      bufs.push_back(tensor);
      return tensor.data_ptr();
    }
    const at::ScalarType wtype = wdtype == req.dtype ? tensor.scalar_type() : at::kFloat;
    at::Tensor w = at::empty(tensor.sizes(), tensor.options().dtype(wtype));
    w.copy_(tensor);
    bufs.push_back(w);
    user_out.push_back(tensor);
    buf.epilogue = writeBack(tensor, w, ring->device(), ring->computeStream());
    return w.data_ptr();
  };
  buf.accum = [&](int64_t elems) {  // float32 elements: room for the partials of either width
    bufs.push_back(at::empty({elems}, tensor.options().dtype(at::kFloat)));
    return bufs.back().data_ptr();
  };
  return launch(*ring, req, buf, bufs, user_out, tensor);
}

// reduce_scatter (kind 3: a private copy of `input` is reduced, block r copied into `output`) and
// all_gather (kind 4: `input` placed as block r of the contiguous `output`, the others received).
py::object cudaRingHalf(const std::shared_ptr<CudaRing>& ring, const at::Tensor& input, const at::Tensor& output,
                        const CallOptions& options, bool async_op, const std::string& group_name,
                        const std::vector<int>& members) {
  const bool scatter = options.kind == CallKind::kReduceScatter;
  RR_CHECK(scatter || options.kind == CallKind::kAllGather, kValue,
           "ringreduce: cuda_ring_half runs reduce_scatter (kind 3) or all_gather (kind 4), got kind ",
           static_cast<int>(options.kind));
  if (scatter) checkWritable(output, "output");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ring->device()));
  CudaCallRequest req = request(*ring, input, options, async_op, group_name, members);
  req.out_numel = output.numel();
  std::vector<at::Tensor> bufs, user_out;
  CudaCallBuffers buf;
  buf.trivial = [&]() { output.copy_(input.reshape(output.sizes())); };
  buf.data = [&](DType, int index) {
    if (scatter) {
      at::Tensor w = at::empty({input.numel()}, input.options());
      w.view(input.sizes()).copy_(input);
      bufs.push_back(w);
      user_out.push_back(output);
      const int64_t m = output.numel();
      buf.epilogue = writeBack(output, w.narrow(0, index * m, m), ring->device(), ring->computeStream());
      return w.data_ptr();
    }
    const int64_t m = input.numel();
    output.view({-1}).narrow(0, index * m, m).copy_(input.reshape({-1}));  // on the caller's stream
    bufs.push_back(output);
    return output.data_ptr();
  };
  return launch(*ring, req, buf, bufs, user_out, output);
}

int64_t groupTimeoutMs(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  for (const auto type : {c10::DeviceType::CUDA, c10::DeviceType::CPU}) {
    try {
      const auto backend = pg->getBackend(type);
      if (backend) return static_cast<int64_t>(backend->getBackendOptions()->timeout.count());
    } catch (const std::exception&) {
      // this group has no backend for `type`: try the next one
    }
  }
  return 10 * 60 * 1000;  // torch's default NCCL timeout
}

// What build_info() reports of the GPU part (None: unknown).
py::dict cudaBuildInfo() {
  int nccl_rt = -1;
  try {
    nccl_rt = NcclComm::runtimeVersion();
  } catch (const Error&) {
    // no loadable NCCL: None
  }
  std::vector<std::string> archs;
#ifdef RR_CUDA_ARCHS
  std::stringstream list(RR_CUDA_ARCHS);  // comma-separated (setup.py)
  for (std::string a; std::getline(list, a, ',');)
    if (!a.empty()) archs.push_back(a);
#endif
  int cuda_rt = 0;
  const bool cuda_rt_known = cudaRuntimeGetVersion(&cuda_rt) == cudaSuccess;
  py::dict d;
  d["nccl_version"] = ncclVersionString(NcclComm::compiledVersion());
  d["nccl_version_code"] = NcclComm::compiledVersion();
  d["nccl_runtime_version"] = nccl_rt >= 0 ? py::cast(ncclVersionString(nccl_rt)) : py::none();
  d["nccl_runtime_version_code"] = nccl_rt >= 0 ? py::cast(nccl_rt) : py::none();
  d["cuda_archs"] = archs;
  d["cuda_runtime_version"] = cuda_rt_known ? py::cast(cuda_rt) : py::none();
  d["cuda_compiled_version"] = CUDART_VERSION;
  return d;
}

}  // namespace
}  // namespace rr

void registerCudaBindings(pybind11::module& m) {
  using namespace rr;

  m.def("nccl_unique_id", []() { return py::bytes(NcclComm::newUniqueId()); },
        "A fresh NCCL unique id (bytes) for rank 0 to publish.");
  m.def("cuda_build_info", &cudaBuildInfo);
  m.def("cuda_group_timeout_ms", &groupTimeoutMs, py::arg("group"),
        "The timeout of the group's CUDA backend (else its CPU backend, else 10 minutes), in ms.");

  py::class_<CudaRing, std::shared_ptr<CudaRing>>(m, "CudaRing")
      .def(py::init([](const py::bytes& unique_id, int nranks, int rank, int device, int64_t timeout_ms,
                       const std::string& name, int64_t staging_bytes, int64_t connect_timeout_ms,
                       const std::vector<py::bytes>& lane_ids) {
             const std::string id = unique_id;
             const std::vector<std::string> more(lane_ids.begin(), lane_ids.end());
             // Without the GIL until every rank joined; Ctrl-C ends the wait (a communicator being
             // created aborts itself).
             return interruptible(
                 [&] {
                   return connectCudaRing(id, more, nranks, rank, device, std::chrono::milliseconds(timeout_ms),
                                          std::chrono::milliseconds(connect_timeout_ms), name, staging_bytes);
                 },
                 {});
           }),
           py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("device"), py::arg("timeout_ms"),
           py::arg("name"), py::arg("staging_bytes") = 0, py::arg("connect_timeout_ms") = 0,
           py::arg("lane_ids") = std::vector<py::bytes>{})
      .def_property_readonly("rank", &CudaRing::rank)
      .def_property_readonly("size", &CudaRing::size)
      .def_property_readonly("device", &CudaRing::device)
      .def_property_readonly("next_seq", [](const CudaRing& r) { py::gil_scoped_release g; return r.nextSeq(); })
      .def_property_readonly("staging_bytes", &CudaRing::stagingBytes)
      .def_property_readonly("hand_offs", &CudaRing::handOffs)
      .def_property_readonly("lanes", &CudaRing::numLanes)
      .def("aborted", [](CudaRing& r) { return r.isShutdown() || r.aborted(); })
      .def("abort_reason", [](CudaRing& r) { return r.comm().abortReason(); },
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &CudaRing::shutdown, py::arg("reason"), py::arg("at_exit") = false,
           py::call_guard<py::gil_scoped_release>(), "CudaRing::shutdown (idempotent).");

  py::class_<CudaWorkHandle, std::shared_ptr<CudaWorkHandle>>(m, "CudaWorkHandle")
      .def(
          "wait",
          [](const CudaWorkHandle& h, int64_t timeout_ms) {  // on the current stream of the work's device
            const auto dev = static_cast<c10::DeviceIndex>(h.work->device());
            c10::cuda::CUDAGuard guard(dev);
            return h.work->wait(c10::cuda::getCurrentCUDAStream(dev).stream(), timeout_ms);
          },
          py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", [](const CudaWorkHandle& h) { return h.work->isCompleted(); })
      .def("ok", [](const CudaWorkHandle& h) { return h.work->error().empty(); })
      .def("error_kind", [](const CudaWorkHandle&) { return static_cast<int>(ErrorKind::kBackend); })
      .def("error_message", [](const CudaWorkHandle& h) { return h.work->errorMessage(); })
      .def("raise_error",
           [](const CudaWorkHandle& h) {
             if (!h.work->error().empty()) throw Error(ErrorKind::kBackend, h.work->errorMessage());
           })
      .def(
          "synchronize",
          [](const CudaWorkHandle& h, int64_t timeout_ms) { h.work->synchronize(std::chrono::milliseconds(timeout_ms)); },
          py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seq", [](const CudaWorkHandle& h) { return h.work->seq(); })
      .def("get_future",
           [](const CudaWorkHandle& h) { return std::make_shared<torch::jit::PythonFutureWrapper>(h.future); });

  m.def("cuda_all_reduce", &cudaAllReduce, py::arg("comm"), py::arg("tensor"), py::arg("options"),
        py::arg("async_op"), py::arg("group_name"), py::arg("members") = std::vector<int>{},
        "ringreduce._cuda.cuda_all_reduce's native half: `options` is the call's CallOptions.");
  m.def("cuda_ring_half", &cudaRingHalf, py::arg("comm"), py::arg("input"), py::arg("output"), py::arg("options"),
        py::arg("async_op"), py::arg("group_name"), py::arg("members") = std::vector<int>{},
        "ringreduce._cuda.cuda_ring_half's native half (options.kind: reduce_scatter or all_gather).");
  m.def(
      "_cuda_loopback_all_reduce",
      [](const std::vector<at::Tensor>& tensors, int op, bool accum_float32, int64_t segment_bytes, int num_slots,
         int phases, int local_size, const std::vector<int>& order) {
        RR_CHECK(!tensors.empty(), kValue, "ringreduce: need at least one tensor");
        const at::Tensor& t0 = tensors[0];
        std::vector<void*> ptrs;
        for (const at::Tensor& t : tensors) {
          RR_CHECK(t.is_cuda() && t.is_contiguous() && t.device() == t0.device() &&
                       t.scalar_type() == t0.scalar_type() && t.numel() == t0.numel(),
                   kValue, "ringreduce loopback: tensors must be contiguous, on one device, of one dtype and size");
          ptrs.push_back(t.data_ptr());
        }
        const int device = t0.get_device();
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        cudaStream_t caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        const LoopbackShape shape{static_cast<uint8_t>(phases), local_size, order};
        const GpuKnobs knobs{segment_bytes, num_slots};
        py::gil_scoped_release nogil;
        loopbackAllReduce(device, ptrs, t0.numel(), toDType(t0.scalar_type()), static_cast<RedOp>(op), accum_float32,
                          knobs, caller, shape);
      },
      py::arg("tensors"), py::arg("op"), py::arg("accum_float32") = false, py::arg("segment_bytes") = 0,
      py::arg("num_slots") = 0, py::arg("phases") = 3, py::arg("local_size") = 0,
      py::arg("order") = std::vector<int>{},
      "Test hook: loopbackAllReduce (csrc/cuda/loopback_ring.h) on `tensors`, one per simulated rank; "
      "segment_bytes/num_slots 0: the pipeline rule's (csrc/cuda/gpu_pipeline.h).");
  m.def(
      "_cuda_reduce",
      [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int op, int divisor) {
        for (const at::Tensor* t : {&a, &b, &out})
          RR_CHECK(t->is_cuda() && t->is_contiguous() && t->device() == a.device() && t->numel() == a.numel() &&
                       t->scalar_type() == a.scalar_type(), kValue,
                   "ringreduce._cuda_reduce: a, b, out must be contiguous CUDA tensors of one device, dtype, size");
        c10::cuda::CUDAGuard guard(a.device());
        const DType t = toDType(a.scalar_type());
        Scaling sc;
        sc.divisor = static_cast<RedOp>(op) == RedOp::kAvg ? divisor : 0;
        sc.round_sum = true;
        const ReduceLaunch launch{a.data_ptr(), t, b.data_ptr(), t, out.data_ptr(), t, a.numel(), sc,
                                  static_cast<RedOp>(op)};
        launchReduce(launch, c10::cuda::getCurrentCUDAStream().stream());
      },
      py::arg("a"), py::arg("b"), py::arg("out"), py::arg("op"), py::arg("divisor") = 0,
      "Test hook: the ring's reduce kernel, out = op(a, b) (/ divisor), on the current stream.");
  m.def(
      "cuda_refuse",
      [](const std::shared_ptr<CudaRing>& ring, int kind, int error, int op, const std::string& group_name,
         const std::vector<int>& members) {
        interruptible(
            [&] {
              sendCudaRefusal(*ring, static_cast<CallKind>(kind), error, static_cast<RedOp>(op), group_name, members);
              return true;
            },
            [&](const std::string& why) { ring->shutdown(why); });
      },
      py::arg("comm"), py::arg("kind"), py::arg("error"), py::arg("op"), py::arg("group_name"),
      py::arg("members") = std::vector<int>{},
      "sendCudaRefusal (csrc/cuda/cuda_ops.h).");
}
