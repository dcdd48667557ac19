// ringreduce torch layer: the CUDA half of ringreduce._C (compiled only with RR_WITH_CUDA).
//
// The only CUDA-side translation unit that sees torch. It turns tensors into raw device pointers
// for CudaRing (csrc/cuda/cuda_ring.h), takes the caller's current stream, protects every tensor
// the internal streams touch from the caching allocator (recordStream), makes a contiguous working
// copy of non-contiguous tensors (written back on the reduce stream, inside the call), and builds
// CUDA-aware futures. Python sees (ringreduce/_cuda.py):
//
//   nccl_unique_id() -> bytes
//   NcclComm(unique_id: bytes, nranks, rank, device, timeout_ms, name, num_slots=4)   .abort(reason) .aborted()
//       .rank .size .device .next_seq .staging_bytes .abort_reason()
//   cuda_all_reduce(comm, tensor, op, accum_float32, segment_bytes, async_op, check, kind,
//                   group_name) -> CudaWorkHandle | None
//   cuda_refuse(comm, kind, error, op, group_name)   (agreement frame of a local refusal)
//   CudaWorkHandle: wait(timeout_ms=-1) -> bool, is_completed(), ok(), error_kind(),
//       error_message(), raise_error(), synchronize(timeout_ms=-1), get_future(), seq
//   cuda_build_info() -> dict, cuda_group_timeout_ms(pg) -> int
//   _cuda_loopback_all_reduce(tensors, op, accum_float32, segment_bytes, num_slots)  (test hook:
//       the whole driver on one GPU, ranks as threads, no NCCL; loopback_ring.h)
// Every failure is an rr::Error, which bindings.cpp translates (kBackend -> DistBackendError).
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../core/error.h"
#include "../core/frame.h"
#include "../cuda/cuda_ring.h"
#include "../cuda/loopback_ring.h"
#include "../cuda/nccl_comm.h"
#include "cpu_group.h"  // rr::toDType

namespace py = pybind11;

namespace rr {
namespace {

// Handle of one CUDA call; duck-typed like the CPU CallHandle so ringreduce.Work wraps both.
class CudaWorkHandle {
 public:
  CudaWorkHandle(std::shared_ptr<CudaWork> work, at::Tensor result, std::vector<at::Tensor> keep,
                 c10::intrusive_ptr<c10::ivalue::Future> future)
      : work_(std::move(work)), result_(std::move(result)), keep_(std::move(keep)), future_(std::move(future)) {}

  // torch.distributed semantics for NCCL: the *current stream* waits for the call; the host does
  // not. With timeout_ms >= 0 the host also waits, up to timeout_ms (False on timeout).
  bool wait(int64_t timeout_ms) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(work_->device()));
    work_->streamWait(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(work_->device())).stream());
    if (timeout_ms >= 0) {
      try {
        work_->synchronize(std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 1));
      } catch (const Error& e) {
        if (!work_->isCompleted()) return false;  // still running: the caller reports the timeout
        throw;
      }
    }
    return true;
  }
  bool isCompleted() { return work_->isCompleted(); }
  bool ok() const { return work_->error().empty(); }
  int errorKind() const { return static_cast<int>(ErrorKind::kBackend); }
  std::string errorMessage() const {
    const std::string e = work_->error();
    return e.empty() ? e : "ringreduce: CUDA all-reduce #" + std::to_string(work_->seq()) + " failed: " + e;
  }
  void synchronize(int64_t timeout_ms) { work_->synchronize(std::chrono::milliseconds(timeout_ms)); }
  uint64_t seq() const { return work_->seq(); }
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }

 private:
  std::shared_ptr<CudaWork> work_;
  at::Tensor result_;
  std::vector<at::Tensor> keep_;  // working copy / accum buffer: alive as long as the handle
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

Frame makeCudaFrame(const at::Tensor* t, RedOp op, bool accum_float32, int kind, int error, int rank, uint64_t seq) {
  Frame f;
  f.rank = rank;
  f.seq = seq;
  f.kind = kind;
  f.op = static_cast<int32_t>(op);
  f.error = error;
  f.accum_float32 = accum_float32 ? 1 : 0;
  f.device_type = 1;
  if (t != nullptr && error == 0) {
    f.dtype = static_cast<int32_t>(toDType(t->scalar_type()));
    f.numel = t->numel();
    std::vector<int64_t> dims(t->sizes().begin(), t->sizes().end());
    setShape(f, dims.data(), static_cast<int>(dims.size()));
  }
  return f;
}

void agree(CudaRing& ring, const Frame& mine, const std::string& group_name) {
  std::vector<Frame> frames;
  {
    py::gil_scoped_release nogil;
    frames = ring.exchangeFrames(mine);
  }
  const std::string verdict = compareFrames(frames, group_name);
  if (!verdict.empty()) throw Error(ErrorKind::kRuntime, verdict);
}

c10::cuda::CUDAStream wrap(cudaStream_t s, int device) {
  return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device));
}

py::object cudaAllReduce(const std::shared_ptr<CudaRing>& ring, const at::Tensor& tensor, int op_code,
                         bool accum_float32, int64_t segment_bytes, bool async_op, bool check, int kind,
                         const std::string& group_name) {
  RR_CHECK(tensor.is_cuda(), kValue, "ringreduce: cuda_all_reduce needs a CUDA tensor, got ", tensor.device());
  RR_CHECK(tensor.layout() == at::kStrided, kValue, "ringreduce: only dense (strided) tensors are supported");
  const int device = ring->device();
  RR_CHECK(tensor.get_device() == device, kValue, "ringreduce: the tensor is on cuda:", tensor.get_device(),
           " but this group's NCCL communicator is on cuda:", device);
  const RedOp op = static_cast<RedOp>(op_code);
  const DType dtype = toDType(tensor.scalar_type());
  checkSupported(dtype, op);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));

  if (check) agree(*ring, makeCudaFrame(&tensor, op, accum_float32, kind, 0, ring->rank(), ring->nextSeq()), group_name);
  if (tensor.numel() == 0 || ring->size() == 1) return py::none();

  // Elements are matched by logical index: a non-contiguous tensor is reduced in a row-major
  // working copy (made on the caller's stream, so it is ordered before the call's start event)
  // and written back on the reduce stream before the call's done event.
  const bool contiguous = tensor.is_contiguous();
  at::Tensor work_t = contiguous ? tensor : tensor.contiguous();
  const Plan plan = ring->makePlan(tensor.numel(), dtype, op, accum_float32, segment_bytes);
  at::Tensor accum;
  if (plan.accum_elems > 0) accum = at::empty({plan.accum_elems}, tensor.options().dtype(at::kFloat));

  const c10::cuda::CUDAStream comm_s = wrap(ring->commStream(), device);
  const c10::cuda::CUDAStream compute_s = wrap(ring->computeStream(), device);
  std::function<void()> epilogue;
  if (!contiguous) {
    epilogue = [&]() {
      c10::cuda::CUDAStreamGuard sg(compute_s);
      tensor.copy_(work_t);
    };
  }

  std::shared_ptr<CudaWork> work;
  {
    py::gil_scoped_release nogil;
    work = ring->enqueue(plan, op, work_t.data_ptr(), accum.defined() ? accum.data_ptr() : nullptr,
                         caller.stream(), !async_op, epilogue);
  }
  // The caching allocator must not hand these blocks out again before the internal streams are
  // done with them, even if Python drops the tensor right after the call.
  for (const at::Tensor* t : {&work_t, &accum}) {
    if (!t->defined()) continue;
    t->record_stream(comm_s);
    t->record_stream(compute_s);
  }
  if (!contiguous) tensor.record_stream(compute_s);
  if (!async_op) return py::none();

  // CUDA-aware future: completed now, with its event recorded on the reduce stream after the
  // whole call, so that waiting on it (or .then()) synchronizes streams, not the host.
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{tensor.device()});
  {
    c10::cuda::CUDAStreamGuard sg(compute_s);
    c10::List<at::Tensor> value;
    value.push_back(tensor);
    future->markCompleted(c10::IValue(value));
  }
  std::vector<at::Tensor> keep;
  if (!contiguous) keep.push_back(work_t);
  if (accum.defined()) keep.push_back(accum);
  return py::cast(std::make_shared<CudaWorkHandle>(work, tensor, std::move(keep), future));
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

py::dict cudaBuildInfo() {
  py::dict d;
  const int compiled = NcclComm::compiledVersion();
  auto fmt = [](int v) {
    // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before).
    const int major = v >= 10000 ? v / 10000 : v / 1000;
    const int minor = v >= 10000 ? (v / 100) % 100 : (v / 100) % 10;
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
  };
  d["nccl_version"] = fmt(compiled);
  d["nccl_version_code"] = compiled;
  try {
    const int runtime = NcclComm::runtimeVersion();
    d["nccl_runtime_version"] = fmt(runtime);
    d["nccl_runtime_version_code"] = runtime;
  } catch (const Error&) {
    d["nccl_runtime_version"] = py::none();
    d["nccl_runtime_version_code"] = py::none();
  }
  py::list archs;
#ifdef RR_CUDA_ARCHS
  std::string s = RR_CUDA_ARCHS;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string a = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!a.empty()) archs.append(a);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
#endif
  d["cuda_archs"] = archs;
  int runtime_cuda = 0;
  d["cuda_runtime_version"] = cudaRuntimeGetVersion(&runtime_cuda) == cudaSuccess ? py::cast(runtime_cuda) : py::none();
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

  py::class_<CudaRing, std::shared_ptr<CudaRing>>(m, "NcclComm")
      .def(py::init([](const py::bytes& unique_id, int nranks, int rank, int device, int64_t timeout_ms,
                       const std::string& name, int num_slots) {
             const std::string id = unique_id;
             std::shared_ptr<NcclComm> comm;
             {
               py::gil_scoped_release nogil;  // init polls until every rank joined
               comm = std::make_shared<NcclComm>(id, nranks, rank, device, std::chrono::milliseconds(timeout_ms), name);
             }
             return std::make_shared<CudaRing>(comm, num_slots, kCudaStagingBytes);
           }),
           py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("device"), py::arg("timeout_ms"),
           py::arg("name"), py::arg("num_slots") = kCudaStagingSlots)
      .def_property_readonly("rank", &CudaRing::rank)
      .def_property_readonly("size", &CudaRing::size)
      .def_property_readonly("device", &CudaRing::device)
      .def_property_readonly("next_seq", &CudaRing::nextSeq)
      .def_property_readonly("staging_bytes", [](const CudaRing& r) { return r.slotBytes() * r.numSlots(); })
      .def("aborted", [](CudaRing& r) { return r.isShutdown() || r.comm().aborted(); })
      .def("abort_reason", [](CudaRing& r) { return r.comm().abortReason(); })
      .def("abort", [](CudaRing& r, const std::string& reason) { r.shutdown(reason); }, py::arg("reason"),
           py::call_guard<py::gil_scoped_release>(),
           "Stop the watchdog, abort the NCCL communicator and free the staging (idempotent).");

  py::class_<CudaWorkHandle, std::shared_ptr<CudaWorkHandle>>(m, "CudaWorkHandle")
      .def("wait", &CudaWorkHandle::wait, py::arg("timeout_ms") = -1, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &CudaWorkHandle::isCompleted)
      .def("ok", &CudaWorkHandle::ok)
      .def("error_kind", &CudaWorkHandle::errorKind)
      .def("error_message", &CudaWorkHandle::errorMessage)
      .def("raise_error",
           [](const CudaWorkHandle& h) {
             if (!h.ok()) throw Error(ErrorKind::kBackend, h.errorMessage());
           })
      .def("synchronize", &CudaWorkHandle::synchronize, py::arg("timeout_ms") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seq", &CudaWorkHandle::seq)
      .def("get_future",
           [](const CudaWorkHandle& h) { return std::make_shared<torch::jit::PythonFutureWrapper>(h.future()); });

  m.def("cuda_all_reduce", &cudaAllReduce, py::arg("comm"), py::arg("tensor"), py::arg("op"),
        py::arg("accum_float32"), py::arg("segment_bytes"), py::arg("async_op"), py::arg("check"), py::arg("kind"),
        py::arg("group_name"),
        "Ring all-reduce of a CUDA tensor in place on `comm`, ordered after the current stream. "
        "Returns a CudaWorkHandle when async_op, else None (the current stream then waits).");
  m.def(
      "_cuda_loopback_all_reduce",
      [](const std::vector<at::Tensor>& tensors, int op, bool accum_float32, int64_t segment_bytes, int num_slots) {
        RR_CHECK(!tensors.empty(), kValue, "ringreduce: need at least one tensor");
        const at::Tensor& t0 = tensors[0];
        std::vector<void*> ptrs;
        for (const at::Tensor& t : tensors) {
          RR_CHECK(t.is_cuda() && t.is_contiguous() && t.device() == t0.device() && t.scalar_type() == t0.scalar_type() &&
                       t.numel() == t0.numel(),
                   kValue, "ringreduce loopback: tensors must be contiguous, on one device, of one dtype and size");
          ptrs.push_back(t.data_ptr());
        }
        const int device = t0.get_device();
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        cudaStream_t caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        py::gil_scoped_release nogil;
        loopbackAllReduce(device, ptrs, t0.numel(), toDType(t0.scalar_type()), static_cast<RedOp>(op), accum_float32,
                          segment_bytes, num_slots, kCudaStagingBytes / num_slots / 256 * 256, caller);
      },
      py::arg("tensors"), py::arg("op"), py::arg("accum_float32") = false, py::arg("segment_bytes") = 0,
      py::arg("num_slots") = kCudaStagingSlots,
      "Test hook: all-reduce `tensors` (one per simulated rank, one GPU) through the GPU driver, "
      "with cudaMemcpyAsync + events in place of NCCL. Synchronizes the current stream.");
  m.def(
      "cuda_refuse",
      [](const std::shared_ptr<CudaRing>& ring, int kind, int error, int op, const std::string& group_name) {
        agree(*ring, makeCudaFrame(nullptr, static_cast<RedOp>(op), false, kind, error, ring->rank(), ring->nextSeq()),
              group_name);
      },
      py::arg("comm"), py::arg("kind"), py::arg("error"), py::arg("op"), py::arg("group_name"),
      "Sends this rank's refusal frame (RINGREDUCE_CHECK=1) so that the other ranks raise at once.");
}
