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
//                   group_name, members=[], local_size=0) -> CudaWorkHandle | None
//   cuda_ring_half(comm, input, output, op, segment_bytes, async_op, check, kind, group_name,
//                  members=[]) -> CudaWorkHandle | None     (kind 3 reduce_scatter, 4 all_gather)
//   cuda_refuse(comm, kind, error, op, group_name, members=[])   (agreement frame of a local refusal)
// `members`: the ring's ranks as ranks of the communicator's process group, in ring order (empty:
// all of them); a sub-ring runs over the group's one communicator (Note [Sub-rings on one
// communicator], csrc/cuda/ring_driver.h).
//   CudaWorkHandle: wait(timeout_ms=-1) -> bool, is_completed(), ok(), error_kind(),
//       error_message(), raise_error(), synchronize(timeout_ms=-1), get_future(), seq
//   cuda_build_info() -> dict, cuda_group_timeout_ms(pg) -> int
//   _cuda_loopback_all_reduce(tensors, op, accum_float32, segment_bytes, num_slots, phases=3,
//       local_size=0, order=[])  (test hook: the whole driver on one GPU, ranks as threads, no
//       NCCL; loopback_ring.h)
// Every failure is an rr::Error, which bindings.cpp translates (kBackend -> DistBackendError).
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../core/error.h"
#include "../core/frame.h"
#include "../cuda/cuda_ring.h"
#include "../cuda/loopback_ring.h"
#include "../cuda/nccl_comm.h"
#include "../cuda/ring_driver.h"
#include "cpu_ops.h"  // rr::toDType

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
    return e.empty() ? e : "ringreduce: CUDA " + work_->what() + " #" + std::to_string(work_->seq()) + " failed: " + e;
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

Frame makeCudaFrame(const at::Tensor* t, RedOp op, bool accum_float32, int kind, int error, int rank, uint64_t seq,
                    int local_size) {
  Frame f;
  f.rank = rank;
  f.seq = seq;
  f.kind = kind;
  f.op = static_cast<int32_t>(op);
  f.error = error;
  f.accum_float32 = accum_float32 ? 1 : 0;
  f.device_type = 1;
  f.algorithm = local_size;  // 0: the flat ring; L: hierarchical with L ranks per node (as on CPU)
  if (t != nullptr && error == 0) {
    f.dtype = static_cast<int32_t>(toDType(t->scalar_type()));
    f.numel = t->numel();
    std::vector<int64_t> dims(t->sizes().begin(), t->sizes().end());
    setShape(f, dims.data(), static_cast<int>(dims.size()));
  }
  return f;
}

// The agreement check around `ring` (a sub-ring's frames never leave it).
void agree(CudaRing& ring, const Frame& mine, const RingMembers& members, const std::string& group_name) {
  std::vector<Frame> frames;
  {
    py::gil_scoped_release nogil;
    frames = ring.exchangeFrames(mine, members);
  }
  const std::string verdict = compareFrames(frames, group_name);
  if (!verdict.empty()) throw Error(ErrorKind::kRuntime, verdict);
}

c10::cuda::CUDAStream wrap(cudaStream_t s, int device) {
  return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device));
}

void checkOnRing(const at::Tensor& t, const CudaRing& ring, const char* what) {
  RR_CHECK(t.is_cuda(), kValue, "ringreduce: ", what, " must be a CUDA tensor, got one on ", t.device());
  RR_CHECK(t.layout() == at::kStrided, kValue, "ringreduce: only dense (strided) tensors are supported");
  RR_CHECK(t.get_device() == ring.device(), kValue, "ringreduce: the ", what, " is on cuda:", t.get_device(),
           " but this group's NCCL communicator is on cuda:", ring.device());
}

// One call, ready to enqueue: its stages over `data` and what the internal streams touch.
struct CudaCall {
  std::vector<RingStage> stages;
  at::Tensor data;                      // contiguous: what the stages run on
  at::Tensor accum;                     // float32 partials of a flat ring, or undefined
  std::vector<int> ring_key;
  std::string what;
  std::function<void()> epilogue;       // on the reduce stream, inside the call
  std::vector<at::Tensor> epilogue_out; // tensors the epilogue writes (user tensors)
  std::vector<at::Tensor> keep;         // private buffers the handle keeps alive
  at::Tensor result;                    // the future's value
};

// Enqueues `call` ordered after `caller`, protects every tensor the internal streams touch from
// the caching allocator, and returns None (synchronous: the caller's stream waits) or a handle
// with a CUDA-aware future.
py::object launch(CudaRing& ring, CudaCall& call, const c10::cuda::CUDAStream& caller, bool async_op) {
  const int device = ring.device();
  const c10::cuda::CUDAStream comm_s = wrap(ring.commStream(), device);
  const c10::cuda::CUDAStream compute_s = wrap(ring.computeStream(), device);
  std::function<void()> epilogue;
  if (call.epilogue) {
    epilogue = [&]() {
      c10::cuda::CUDAStreamGuard sg(compute_s);
      call.epilogue();
    };
  }
  std::shared_ptr<CudaWork> work;
  {
    py::gil_scoped_release nogil;
    work = ring.enqueue(call.stages, call.data.data_ptr(), call.accum.defined() ? call.accum.data_ptr() : nullptr,
                        call.ring_key, call.what, caller.stream(), !async_op, epilogue);
  }
  // The caching allocator must not hand these blocks out again before the internal streams are
  // done with them, even if Python drops the tensor right after the call.
  for (const at::Tensor* t : {&call.data, &call.accum}) {
    if (!t->defined()) continue;
    t->record_stream(comm_s);
    t->record_stream(compute_s);
  }
  for (const at::Tensor& t : call.epilogue_out) t.record_stream(compute_s);
  if (!async_op) return py::none();

  // CUDA-aware future: completed now, with its event recorded on the reduce stream after the
  // whole call, so that waiting on it (or .then()) synchronizes streams, not the host.
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{call.result.device()});
  {
    c10::cuda::CUDAStreamGuard sg(compute_s);
    c10::List<at::Tensor> value;
    value.push_back(call.result);
    future->markCompleted(c10::IValue(value));
  }
  std::vector<at::Tensor> keep = call.keep;
  if (call.accum.defined()) keep.push_back(call.accum);
  return py::cast(std::make_shared<CudaWorkHandle>(work, call.result, std::move(keep), future));
}

// all_reduce of a CUDA tensor in place: the flat ring over `members` (ranks of the group; empty:
// all), or with local_size > 1 the hierarchical all-reduce over `members` ordered node by node
// (Note [Hierarchical all-reduce] in cpu_group.cpp; ring_driver.h hierarchicalStages).
py::object cudaAllReduce(const std::shared_ptr<CudaRing>& ring, const at::Tensor& tensor, int op_code,
                         bool accum_float32, int64_t segment_bytes, bool async_op, bool check, int kind,
                         const std::string& group_name, const std::vector<int>& members, int local_size) {
  checkOnRing(tensor, *ring, "tensor");
  const int device = ring->device();
  const RedOp op = static_cast<RedOp>(op_code);
  const DType dtype = toDType(tensor.scalar_type());
  checkSupported(dtype, op);
  const RingMembers rm = resolveRing(members, ring->size(), ring->rank());
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));

  CudaCall call;
  call.ring_key = ringKey(members, ring->size());
  call.what = local_size > 1 ? "hierarchical all-reduce" : "all-reduce";
  if (check) {
    agree(*ring, makeCudaFrame(&tensor, op, accum_float32, kind, 0, ring->rank(), ring->nextSeq(call.ring_key),
                               local_size),
          rm, group_name);
  }
  if (tensor.numel() == 0 || rm.size() == 1) return py::none();

  const bool hier = local_size > 1 && local_size < rm.size();
  RR_CHECK(!hier || rm.size() % local_size == 0, kValue, "ringreduce: hierarchical all-reduce over ", rm.size(),
           " ranks needs equal nodes, got ", local_size, " ranks per node");
  // Hierarchical with float32 accumulation for half types: the whole reduction runs on a float32
  // copy, so partials are rounded once, at the end, as the flat ring's accum mode promises.
  const bool upcast = hier && accum_float32 && isHalfType(dtype);
  // Elements are matched by logical index: a tensor that is not row-major contiguous (views,
  // transposes, channels_last, conj/neg views) is reduced in a row-major working copy (made on the
  // caller's stream, so it is ordered before the call's start event) and written back on the
  // reduce stream before the call's done event.
  const bool direct = !upcast && tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg();
  call.data = tensor;
  if (!direct) {
    call.data = at::empty(tensor.sizes(), tensor.options().dtype(upcast ? at::kFloat : tensor.scalar_type()));
    call.data.copy_(tensor);
    call.keep.push_back(call.data);
    call.epilogue_out.push_back(tensor);
    const at::Tensor user = tensor;
    const at::Tensor work_t = call.data;
    call.epilogue = [user, work_t]() mutable { user.copy_(work_t); };
  }
  const DType wdtype = toDType(call.data.scalar_type());
  const PlanOptions base = ring->planOptions(op, accum_float32 && !hier, segment_bytes);
  call.stages = hier ? hierarchicalStages(rm, local_size, tensor.numel(), wdtype, op, base)
                     : flatRingStages(rm, tensor.numel(), wdtype, op, base);
  const int64_t accum_elems = call.stages.size() == 1 ? call.stages[0].plan.accum_elems : 0;
  if (accum_elems > 0) call.accum = at::empty({accum_elems}, tensor.options().dtype(at::kFloat));
  call.result = tensor;
  return launch(*ring, call, caller, async_op);
}

// reduce_scatter (kind 3) and all_gather (kind 4) over `members` (Note [Ring halves]): ring index
// r owns block r. reduce_scatter reduces a private copy of `input` (left untouched) and copies
// block r into `output`; all_gather places `input` as block r of `output` (contiguous, n blocks)
// and receives every other block straight into it.
py::object cudaRingHalf(const std::shared_ptr<CudaRing>& ring, const at::Tensor& input, const at::Tensor& output,
                        int op_code, int64_t segment_bytes, bool async_op, bool check, int kind,
                        const std::string& group_name, const std::vector<int>& members) {
  const bool scatter = kind == static_cast<int>(CallKind::kReduceScatter);
  RR_CHECK(scatter || kind == static_cast<int>(CallKind::kAllGather), kValue,
           "ringreduce: cuda_ring_half runs reduce_scatter (kind 3) or all_gather (kind 4), got kind ", kind);
  checkOnRing(input, *ring, "input");
  checkOnRing(output, *ring, "output");
  RR_CHECK(input.scalar_type() == output.scalar_type(), kType, "ringreduce: output (", output.scalar_type(),
           ") and input (", input.scalar_type(), ") must have one dtype");
  const int device = ring->device();
  const RedOp op = scatter ? static_cast<RedOp>(op_code) : RedOp::kSum;
  const DType dtype = toDType(input.scalar_type());
  checkSupported(dtype, op);
  const RingMembers rm = resolveRing(members, ring->size(), ring->rank());
  const int64_t n = rm.size();
  if (scatter) {
    RR_CHECK(input.numel() == output.numel() * n, kValue, "ringreduce.reduce_scatter: input has ", input.numel(),
             " elements, but ", n, " ranks x output's ", output.numel(), " = ", output.numel() * n);
  } else {
    RR_CHECK(output.numel() == input.numel() * n, kValue, "ringreduce.all_gather: output has ", output.numel(),
             " elements, but ", n, " ranks x input's ", input.numel(), " = ", input.numel() * n);
    RR_CHECK(output.is_contiguous() && !output.is_conj() && !output.is_neg(), kValue,
             "ringreduce.all_gather: the output must be a plain contiguous tensor");
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));

  CudaCall call;
  call.ring_key = ringKey(members, ring->size());
  call.what = scatter ? "reduce-scatter" : "all-gather";
  if (check) {
    agree(*ring, makeCudaFrame(&input, op, false, kind, 0, ring->rank(), ring->nextSeq(call.ring_key), 0), rm,
          group_name);
  }
  if (input.numel() == 0 || n == 1) {
    if (input.numel() > 0) output.copy_(input.reshape(output.sizes()));
    return py::none();
  }

  const PlanOptions base = ring->planOptions(op, false, segment_bytes);
  if (scatter) {
    // The input stays untouched (as torch's reduce_scatter_tensor): reduce a private row-major copy.
    call.data = at::empty({input.numel()}, input.options());
    call.data.view(input.sizes()).copy_(input);
    call.keep.push_back(call.data);
    call.stages = ringHalfStages(rm, input.numel(), dtype, op, base, kPhaseReduceScatter);
    const int64_t m = output.numel();
    const at::Tensor block = call.data.narrow(0, rm.index * m, m);
    const at::Tensor out = output;
    call.epilogue = [out, block]() mutable { out.copy_(block.view(out.sizes())); };
    call.epilogue_out.push_back(output);
  } else {
    // Our own block goes in first, on the caller's stream (before the call's start event).
    const int64_t m = input.numel();
    output.view({-1}).narrow(0, rm.index * m, m).copy_(input.reshape({-1}));
    call.data = output;
    call.stages = ringHalfStages(rm, output.numel(), dtype, RedOp::kSum, base, kPhaseAllGather);
  }
  call.result = output;
  return launch(*ring, call, caller, async_op);
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
      .def_property_readonly("next_seq", [](const CudaRing& r) { return r.nextSeq(); })
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
        py::arg("group_name"), py::arg("members") = std::vector<int>{}, py::arg("local_size") = 0,
        "Ring all-reduce of a CUDA tensor in place on `comm`, ordered after the current stream: the flat ring over "
        "`members` (ranks of the group, empty: all), hierarchical with local_size > 1. Returns a CudaWorkHandle "
        "when async_op, else None (the current stream then waits).");
  m.def("cuda_ring_half", &cudaRingHalf, py::arg("comm"), py::arg("input"), py::arg("output"), py::arg("op"),
        py::arg("segment_bytes"), py::arg("async_op"), py::arg("check"), py::arg("kind"), py::arg("group_name"),
        py::arg("members") = std::vector<int>{},
        "reduce_scatter (kind 3: output = block r of the reduced input, input untouched) or all_gather (kind 4: "
        "output, contiguous, gets every rank's input) over `members`, ordered after the current stream. Returns "
        "a CudaWorkHandle whose future holds [output] when async_op, else None.");
  m.def(
      "_cuda_loopback_all_reduce",
      [](const std::vector<at::Tensor>& tensors, int op, bool accum_float32, int64_t segment_bytes, int num_slots,
         int phases, int local_size, const std::vector<int>& order) {
        RR_CHECK(!tensors.empty(), kValue, "ringreduce: need at least one tensor");
        RR_CHECK(phases >= 1 && phases <= 3, kValue, "ringreduce loopback: phases must be 1, 2 or 3");
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
        LoopbackShape shape;
        shape.phases = static_cast<uint8_t>(phases);
        shape.local_size = local_size;
        shape.order = order;
        py::gil_scoped_release nogil;
        loopbackAllReduce(device, ptrs, t0.numel(), toDType(t0.scalar_type()), static_cast<RedOp>(op), accum_float32,
                          segment_bytes, num_slots, kCudaStagingBytes / num_slots / 256 * 256, caller, shape);
      },
      py::arg("tensors"), py::arg("op"), py::arg("accum_float32") = false, py::arg("segment_bytes") = 0,
      py::arg("num_slots") = kCudaStagingSlots, py::arg("phases") = 3, py::arg("local_size") = 0,
      py::arg("order") = std::vector<int>{},
      "Test hook: run `tensors` (one per simulated rank, one GPU) through the GPU driver, with cudaMemcpyAsync + "
      "events in place of NCCL: the all-reduce (phases 3), reduce-scatter only (1: block r of tensor r is the "
      "result), all-gather only (2), hierarchical (local_size > 1), over the ring `order`. Synchronizes the "
      "current stream.");
  m.def(
      "cuda_refuse",
      [](const std::shared_ptr<CudaRing>& ring, int kind, int error, int op, const std::string& group_name,
         const std::vector<int>& members) {
        const RingMembers rm = resolveRing(members, ring->size(), ring->rank());
        const std::vector<int> key = ringKey(members, ring->size());
        agree(*ring,
              makeCudaFrame(nullptr, static_cast<RedOp>(op), false, kind, error, ring->rank(), ring->nextSeq(key), 0),
              rm, group_name);
      },
      py::arg("comm"), py::arg("kind"), py::arg("error"), py::arg("op"), py::arg("group_name"),
      py::arg("members") = std::vector<int>{},
      "Sends this rank's refusal frame (RINGREDUCE_CHECK=1) around the ring `members` so that the other ranks "
      "raise at once.");
}
