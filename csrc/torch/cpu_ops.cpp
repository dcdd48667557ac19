#include "cpu_ops.h"

#include <c10/core/ScalarType.h>

#include "../core/collectives.h"
#include "../cpu/c10d_transport.h"
#include "../cpu/runtime_registry.h"

namespace rr {

namespace {

// Elements are matched by logical index: a tensor that is not row-major contiguous (views,
// transposes, channels_last, conj/neg views) is reduced through one contiguous copy.
at::Tensor contiguousCopy(const at::Tensor& t) { return t.resolve_conj().resolve_neg().contiguous(); }

}  // namespace

DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kBool: return DType::kBool;
    case at::kComplexFloat: return DType::kComplex64;
    case at::kComplexDouble: return DType::kComplex128;
    default: break;
  }
  RR_THROW(kType, "ringreduce: dtype ", c10::toString(t),
           " is not supported (supported: float32, float64, float16, bfloat16, int8, int16, int32, "
           "int64, uint8, bool, complex64, complex128)");
}

CpuCall::CpuCall(at::Tensor tensor, at::Tensor output, CallOptions opt, bool with_future)
    : tensor_(std::move(tensor)), output_(std::move(output)), opt_(std::move(opt)) {
  if (with_future) future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

Frame CpuCall::frame() const {
  Frame f = callFrame(opt_, opt_.cpuSegmentBytes(), opt_.cpuFrameAlgorithm());
  if (tensor_.defined() && opt_.local_error == FrameError::kNone) {
    const at::IntArrayRef sizes = tensor_.sizes();  // no vector: no allocation per call
    describeTensor(f, toDType(tensor_.scalar_type()), tensor_.numel(), sizes.data(), static_cast<int>(sizes.size()),
                   tensor_.is_cuda() ? 1 : 0);
  }
  return f;
}

CallBuffer CpuCall::prepare(int ring_rank, int ring_size) {
  at::Tensor buf;
  switch (opt_.kind) {
    case CallKind::kReduceScatter:
      // The input is left untouched (as torch's reduce_scatter_tensor): reduce a private copy.
      work_ = contiguousCopy(tensor_);
      if (work_.data_ptr() == tensor_.data_ptr()) work_ = work_.clone();
      buf = work_;
      break;
    case CallKind::kAllGather: {
      // The output is the contiguous concatenation, allocated by the caller: our block goes in first.
      const int64_t m = tensor_.numel();
      output_.reshape({-1}).narrow(0, ring_rank * m, m).copy_(tensor_.resolve_conj().resolve_neg().reshape({-1}));
      buf = output_;
      break;
    }
    default: {
      // A working copy in the stages' dtype when it differs from the tensor's (stagesDType, core/collectives.h).
      const DType dtype = toDType(tensor_.scalar_type());
      if (stagesDType(dtype, opt_.hierarchical(ring_size), opt_.accum_float32) != dtype) {
        work_ = tensor_.to(at::kFloat).contiguous();
      }
      else if (!tensor_.is_contiguous() || tensor_.is_conj() || tensor_.is_neg()) work_ = contiguousCopy(tensor_);
      buf = work_.defined() ? work_ : tensor_;
      break;
    }
  }
  return CallBuffer{buf.data_ptr(), buf.numel(), toDType(buf.scalar_type())};
}

void CpuCall::finish(int ring_rank, int /*ring_size*/) {
  if (opt_.kind == CallKind::kReduceScatter) {
    const int64_t m = output_.numel();
    output_.copy_(work_.reshape({-1}).narrow(0, ring_rank * m, m).view(output_.sizes()));
  } else if (opt_.kind != CallKind::kAllGather && work_.defined()) {
    tensor_.copy_(work_);
  }
  work_ = at::Tensor();
}

void CpuCall::complete(bool ok, ErrorKind kind, const std::string& message, const CallTiming& timing) {
  work_ = at::Tensor();
  // The future first (its callbacks may run Python: no lock held), then the waiters, so that a
  // returned wait() always sees a completed future.
  if (future_ && ok) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{output_.defined() ? output_ : tensor_}));
  } else if (future_) {
    future_->setError(std::make_exception_ptr(std::runtime_error(message)));
  }
  setDone(ok, kind, message, timing);
}

CpuRing::CpuRing(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string name, std::vector<int> members,
                 c10::intrusive_ptr<c10d::Store> store)
    : pg_(std::move(pg)), name_(std::move(name)), members_(std::move(members)), store_(std::move(store)) {}

std::shared_ptr<GroupRuntime> CpuRing::runtime() {
  std::lock_guard<std::mutex> g(mu_);
  std::shared_ptr<GroupRuntime> rt = rt_.lock();
  if (rt) return rt;
  const std::vector<int> key = ringKey(members_, pg_->getSize());
  rt_ = rt = runtimeFor(pg_.get(), key, [&] {
    c10::intrusive_ptr<c10d::Backend> backend;
    try {
      backend = pg_->getBackend(c10::DeviceType::CPU);
    } catch (const std::exception&) {
      RR_THROW(kValue, "ringreduce: ", name_, " has no CPU backend (it was created with backend=",
               pg_->getBackendName(), "), so CPU tensors cannot be reduced on it. Create the group with "
               "backend=\"gloo\" (or \"cpu:gloo,cuda:nccl\"), or move the tensor to the GPU");
    }
    auto transport = std::make_unique<C10dTransport>(backend, pg_->getRank(), pg_->getSize(), name_);
    const std::chrono::milliseconds timeout = transport->defaultTimeout();
    std::shared_ptr<KeyValueStore> kv;
    if (store_) kv = std::make_shared<C10dKeyValue>(store_);
    return std::make_shared<GroupRuntime>(std::move(transport), timeout, name_, key, std::move(kv));
  });
  return rt;
}

std::shared_ptr<CpuCall> CpuRing::submit(const at::Tensor& tensor, const at::Tensor& output, const CallOptions& opt,
                                         bool synchronous, std::function<bool()> interrupted, bool with_future) {
  std::shared_ptr<GroupRuntime> rt = runtime();
  auto call = std::make_shared<CpuCall>(tensor, output, opt, with_future);
  call->seq_ = rt->submit(call, opt, synchronous, std::move(interrupted));
  return call;
}

}  // namespace rr

// Note [First-build time] (setup.py): the c10d transport is compiled in this translation unit, the
// other one that parses c10d's headers (about 15 s of CPU per translation unit), not in one of its
// own; setup.py leaves csrc/cpu/c10d_transport.cpp out of its source list.
#include "../cpu/c10d_transport.cpp"  // NOLINT(bugprone-suspicious-include)
