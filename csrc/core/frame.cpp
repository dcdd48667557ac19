#include "frame.h"

#include <cstdio>
#include <sstream>

#include "direct.h"
#include "dtype.h"

namespace rr {

const char* callKindName(int32_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::kAllReduce: return "all_reduce";
    case CallKind::kAllReduceAvg: return "all_reduce_avg";
    case CallKind::kAllReduceCoalesced: return "all_reduce_coalesced";
    case CallKind::kReduceScatter: return "reduce_scatter";
    case CallKind::kAllGather: return "all_gather";
  }
  return "unknown-call";
}

const char* frameErrorName(int32_t error) {
  switch (static_cast<FrameError>(error)) {
    case FrameError::kNone: return "none";
    case FrameError::kUnsupported: return "unsupported dtype/op";
    case FrameError::kNotATensor: return "argument is not a tensor";
    case FrameError::kSparse: return "sparse tensor";
    case FrameError::kDevice: return "tensor on an unsupported device";
    case FrameError::kOther: return "invalid arguments";
  }
  return "unknown error";
}

uint64_t hashShape(const int64_t* dims, int ndim) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the dims
  for (int i = 0; i < ndim; ++i) {
    uint64_t v = static_cast<uint64_t>(dims[i]);
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h ^ static_cast<uint64_t>(ndim);
}

void setShape(Frame& f, const int64_t* dims, int ndim) {
  f.ndim = ndim;
  for (int i = 0; i < kFrameMaxDims; ++i) f.dims[i] = i < ndim ? dims[i] : 0;
  f.shape_hash = hashShape(dims, ndim);
}

namespace {
std::string shapeString(const Frame& f) {
  std::ostringstream os;
  os << "[";
  const int shown = f.ndim < kFrameMaxDims ? f.ndim : kFrameMaxDims;
  for (int i = 0; i < shown; ++i) os << (i ? ", " : "") << f.dims[i];
  if (f.ndim > kFrameMaxDims) os << ", ...";
  os << "]";
  return os.str();
}
}  // namespace

std::string describeFrame(const Frame& f) {
  std::ostringstream os;
  os << callKindName(f.kind);
  if (f.error != 0) {
    os << " refused locally (" << frameErrorName(f.error) << ")";
    return os.str();
  }
  os << "(op=" << redOpName(static_cast<RedOp>(f.op)) << ", dtype=" << dtypeName(static_cast<DType>(f.dtype))
     << ", numel=" << f.numel << ", shape=" << shapeString(f)
     << ", device=" << (f.device_type == 1 ? "cuda" : "cpu");
  if (f.algorithm > 0) os << ", algorithm=hierarchical (" << f.algorithm << " ranks per node)";
  if (f.algorithm == -1) os << ", algorithm=ring (GPU one-shot)";
  if (f.algorithm == kFrameAlgorithmDirect) os << ", algorithm=direct";
  if (f.algorithm == kFrameAlgorithmDirectOneShot) os << ", algorithm=direct (GPU one-shot)";
  if (f.accum_float32 == 1) os << ", accum_dtype=float32";
  if (f.accum_float32 == 2) os << ", accum_dtype=" << dtypeName(static_cast<DType>(f.dtype));
  if (f.wire_dtype >= 0) {
    os << ", wire_dtype=" << dtypeName(static_cast<DType>(f.wire_dtype & ~kFrameWireGather16));
    if (f.wire_dtype & kFrameWireGather16) os << ", wire_gather=16";
  }
  if (f.predivide != 0) os << ", predivide_factor=" << f.predivide;
  if (f.extra_divisor != 1) os << ", accumulation_steps=" << f.extra_divisor;
  if (f.ntensors != 1) os << ", tensors=" << f.ntensors;
  if (f.layout_hash != 0) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(f.layout_hash));
    os << ", list layout #" << std::string(hex, 8);
  }
  os << ")";
  return os.str();
}

std::string compareFrames(const std::vector<Frame>& frames, const std::string& group) {
  if (frames.empty()) return "";
  auto unreadable = [](const Frame& f) { return f.magic != kFrameMagic || f.version != kFrameVersion; };
  // The reference: the first rank that did not refuse (a refusal frame carries its call's kind and
  // number, not its arguments, so only those are compared with it).
  const Frame* first = &frames[0];
  for (const Frame& f : frames) {
    if (!unreadable(f) && f.error == 0) {
      first = &f;
      break;
    }
  }
  const Frame& ref = *first;
  bool bad = false, err = false, kind = false, op = false, dt = false, numel = false, shape = false, acc = false,
       dev = false, seq = false, nt = false, layout = false, alg = false, segb = false, wire = false, pre = false,
       steps = false;
  for (const Frame& f : frames) {
    bad = bad || unreadable(f);
    err = err || f.error != 0;
    kind = kind || f.kind != ref.kind;
    seq = seq || f.seq != ref.seq;
    if (f.error != 0 || ref.error != 0) continue;
    op = op || f.op != ref.op;
    dt = dt || f.dtype != ref.dtype;
    numel = numel || f.numel != ref.numel;
    shape = shape || f.ndim != ref.ndim || f.shape_hash != ref.shape_hash;
    acc = acc || f.accum_float32 != ref.accum_float32;
    dev = dev || f.device_type != ref.device_type;
    nt = nt || f.ntensors != ref.ntensors;
    layout = layout || f.layout_hash != ref.layout_hash;
    alg = alg || f.algorithm != ref.algorithm;
    segb = segb || f.segment_bytes != ref.segment_bytes;
    wire = wire || f.wire_dtype != ref.wire_dtype;
    pre = pre || f.predivide != ref.predivide;
    steps = steps || f.extra_divisor != ref.extra_divisor;
  }
  // The agreeing case (every call) builds no message (a stream costs about a microsecond).
  if (!(bad || err || kind || op || dt || numel || shape || acc || dev || seq || nt || layout || alg || segb || wire ||
        pre || steps))
    return "";
  std::ostringstream os;
  // Corrupt or foreign frames first: they mean the ranks are not even running the same protocol.
  for (size_t r = 0; r < frames.size(); ++r) {
    if (unreadable(frames[r])) {
      os << "\n  rank " << r << " sent an unreadable agreement frame (another ringreduce version, "
         << "or another library using the same tags)";
    }
  }

  std::ostringstream head;
  head << "ringreduce: ranks of " << group << " disagree on call #" << ref.seq << " ("
       << callKindName(ref.kind) << "); every rank raises this error and no tensor was modified. "
       << "What each rank passed:";
  for (size_t r = 0; r < frames.size(); ++r) {
    os << "\n  rank " << r << ": " << describeFrame(frames[r]);
    if (frames[r].seq != ref.seq) os << " as call #" << frames[r].seq;
    if (segb && frames[r].error == 0) os << " with segment_bytes=" << frames[r].segment_bytes;
  }
  // A one-line summary of which fields differ, for people who read only the first line.
  std::ostringstream what;
  const char* sep = "";
  auto note = [&](bool cond, const char* name) {
    if (cond) {
      what << sep << name;
      sep = ", ";
    }
  };
  note(err, "a rank refused the call");
  note(kind, "collective");
  note(op, "op");
  note(dt, "dtype");
  note(numel, "numel");
  note(shape, "shape");
  note(acc, "accum_dtype");
  note(dev, "device");
  note(seq, "call sequence (a rank skipped or added a call)");
  note(nt, "number of tensors");
  note(layout && !nt, "the list's dtypes, shapes or order");
  note(alg, "algorithm");
  note(wire, "wire_dtype or its all-gather width (RINGREDUCE_WIRE_GATHER)");
  note(pre, "predivide_factor");
  note(steps, "accumulation_steps");
  note(segb && !err, "segment size (RINGREDUCE_SEGMENT_BYTES)");
  return head.str() + " [differs: " + what.str() + "]" + os.str();
}

}  // namespace rr
