#include "loopback_ring.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "../core/plan.h"
#include "cuda_check.h"
#include "nccl_comm.h"  // DeviceGuard
#include "reduce_kernels.cuh"
#include "ring_executor.h"

namespace rr {

namespace {

struct Post {
  const void* ptr = nullptr;
  size_t bytes = 0;
  cudaEvent_t ready = nullptr;
  cudaEvent_t consumed = nullptr;  // set by the receiver
  bool taken = false;
};

// Everything the rank threads share. All host waits also wake up on `failed`.
struct Shared {
  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  // Posts per (sender, receiver) pair, matched in posting order as NCCL matches p2p messages.
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Post>>> edges;
  std::map<std::pair<int, int>, size_t> taken;
  std::vector<cudaEvent_t> all_events;                   // destroyed at the end

  cudaEvent_t newEvent() {
    cudaEvent_t e = nullptr;
    RR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(mu);
    all_events.push_back(e);
    return e;
  }
  template <typename Pred>
  void waitFor(std::unique_lock<std::mutex>& lock, Pred pred) {
    cv.wait(lock, [&] { return failed || pred(); });
    RR_CHECK(!failed, kRuntime, "ringreduce loopback: another rank failed");
  }
};

struct RankState {
  int rank = 0;
  cudaStream_t comm = nullptr;
  cudaStream_t compute = nullptr;
  std::vector<void*> slots;
  void* accum = nullptr;
  std::vector<cudaEvent_t> plan_events;
  cudaEvent_t start = nullptr;
  cudaEvent_t done = nullptr;
  cudaEvent_t stage = nullptr;
};

class LoopbackBackend final : public DeviceBackend {
 public:
  LoopbackBackend(Shared& sh, RankState& st, cudaStream_t caller) : sh_(sh), st_(st), caller_(caller) {}

  void setLane(int32_t lane) override {
    RR_CHECK(lane == 0, kRuntime, "ringreduce loopback: the loopback driver runs one lane");
  }

  void prepare(int32_t num_events, int32_t lanes) override {
    RR_CHECK(lanes == 1, kRuntime, "ringreduce loopback: the loopback driver runs one lane");
    while (static_cast<int32_t>(st_.plan_events.size()) < num_events) st_.plan_events.push_back(sh_.newEvent());
  }

  void exchange(const void* send, size_t send_bytes, int send_peer, void* recv, size_t recv_bytes,
                int recv_peer, Launch /*launch: no NCCL here*/) override {
    std::shared_ptr<Post> mine;
    if (send_bytes > 0) {
      mine = std::make_shared<Post>();
      mine->ptr = send;
      mine->bytes = send_bytes;
      mine->ready = sh_.newEvent();
      RR_CUDA_CHECK(cudaEventRecord(mine->ready, st_.comm));
      std::lock_guard<std::mutex> lock(sh_.mu);
      sh_.edges[std::make_pair(st_.rank, send_peer)].push_back(mine);
      sh_.cv.notify_all();
    }
    if (recv_bytes > 0) {
      std::shared_ptr<Post> in;
      {
        std::unique_lock<std::mutex> lock(sh_.mu);
        const auto key = std::make_pair(recv_peer, st_.rank);
        auto& edge = sh_.edges[key];
        size_t& k = sh_.taken[key];
        sh_.waitFor(lock, [&] { return edge.size() > k; });
        in = edge[k++];
      }
      RR_CHECK(in->bytes == recv_bytes, kRuntime, "ringreduce loopback: rank ", st_.rank, " expects ", recv_bytes,
               " bytes, rank ", recv_peer, " sent ", in->bytes);
      RR_CUDA_CHECK(cudaStreamWaitEvent(st_.comm, in->ready, 0));
      RR_CUDA_CHECK(cudaMemcpyAsync(recv, in->ptr, recv_bytes, cudaMemcpyDeviceToDevice, st_.comm));
      cudaEvent_t consumed = sh_.newEvent();
      RR_CUDA_CHECK(cudaEventRecord(consumed, st_.comm));
      std::lock_guard<std::mutex> lock(sh_.mu);
      in->consumed = consumed;
      in->taken = true;
      sh_.cv.notify_all();
    }
    if (mine) {
      cudaEvent_t consumed = nullptr;
      {
        std::unique_lock<std::mutex> lock(sh_.mu);
        sh_.waitFor(lock, [&] { return mine->taken; });
        consumed = mine->consumed;
      }
      RR_CUDA_CHECK(cudaStreamWaitEvent(st_.comm, consumed, 0));
    }
  }

  void group(const std::vector<PeerOp>&, Launch) override {
    RR_THROW(kRuntime, "ringreduce loopback: the loopback driver runs ring stages only, not the one-shot");
  }

  void reduceInOrder(const OneShotLaunch&) override {
    RR_THROW(kRuntime, "ringreduce loopback: the loopback driver runs ring stages only, not the one-shot");
  }

  void reduce(const ReduceLaunch& l) override {
    launchReduce(l, st_.compute);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    RR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st_.compute));
  }

  void record(Stream s, int32_t event) override { RR_CUDA_CHECK(cudaEventRecord(eventOf(event), streamOf(s))); }

  void wait(Stream s, int32_t event) override {
    if (event == kPrevCallDoneEvent) return;  // one call per loopback run
    RR_CUDA_CHECK(cudaStreamWaitEvent(streamOf(s), eventOf(event), 0));
  }

 private:
  cudaStream_t streamOf(Stream s) const {
    return s == Stream::kComm ? st_.comm : s == Stream::kCompute ? st_.compute : caller_;
  }
  cudaEvent_t eventOf(int32_t e) const {
    if (e == kCallStartEvent) return st_.start;
    if (e == kCallDoneEvent) return st_.done;
    if (e == kStageDoneEvent) return st_.stage;
    RR_CHECK(e >= 0 && static_cast<size_t>(e) < st_.plan_events.size(), kRuntime,
             "ringreduce loopback: event ", e, " outside the pool");
    return st_.plan_events[static_cast<size_t>(e)];
  }

  Shared& sh_;
  RankState& st_;
  cudaStream_t caller_;
};

}  // namespace

void loopbackAllReduce(int device, const std::vector<void*>& data, int64_t numel, DType dtype, RedOp op,
                       bool accum_float32, const GpuKnobs& knobs, cudaStream_t caller, const LoopbackShape& shape) {
  const int n = static_cast<int>(data.size());
  RR_CHECK(n >= 1, kValue, "ringreduce loopback: need at least one rank");
  RR_CHECK(shape.phases >= 1 && shape.phases <= 3, kValue, "ringreduce loopback: phases must be 1, 2 or 3");
  const GpuPipeline pipe = gpuPipeline(n, numel, dtype, accum_float32, kGpuStagingBytes, knobs, /*max_lanes=*/1);
  checkSupported(dtype, op);
  DeviceGuard guard(device);
  Shared sh;
  std::vector<RankState> ranks(static_cast<size_t>(n));
  // Every rank's stages, exactly as CudaRing's callers build them (ring_executor.h).
  std::vector<std::vector<RingStage>> stages;
  const bool hier = shape.phases == kPhaseBoth && shape.local_size > 1;
  RR_CHECK(!(hier && accum_float32), kValue,
           "ringreduce loopback: the hierarchical all-reduce reduces a float32 copy instead of accum_float32");
  const PlanOptions opts = gpuPlanOptions(op, accum_float32, pipe.max_segment_bytes, pipe.slots, pipe.slot_bytes);
  for (int r = 0; r < n; ++r) {
    const RingMembers ring = resolveRing(shape.order, n, r);
    RR_CHECK(ring.size() == n, kValue, "ringreduce loopback: the ring must hold every rank");
    if (shape.phases != kPhaseBoth) {
      stages.push_back(ringHalfStages(ring, numel, dtype, op, opts, shape.phases));
    } else if (hier) {
      stages.push_back(hierarchicalStages(ring, shape.local_size, numel, dtype, op, opts));
    } else {
      stages.push_back(flatRingStages(ring, numel, dtype, op, opts));
    }
  }

  auto cleanup = [&]() noexcept {
    for (RankState& st : ranks) {
      if (st.comm) (void)cudaStreamSynchronize(st.comm);
      if (st.compute) (void)cudaStreamSynchronize(st.compute);
    }
    for (RankState& st : ranks) {
      for (void* s : st.slots) (void)cudaFree(s);
      if (st.accum) (void)cudaFree(st.accum);
      if (st.comm) (void)cudaStreamDestroy(st.comm);
      if (st.compute) (void)cudaStreamDestroy(st.compute);
    }
    for (cudaEvent_t e : sh.all_events) (void)cudaEventDestroy(e);
  };

  try {
    for (int r = 0; r < n; ++r) {
      RankState& st = ranks[static_cast<size_t>(r)];
      st.rank = r;
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&st.comm, cudaStreamNonBlocking));
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&st.compute, cudaStreamNonBlocking));
      for (int32_t k = 0; k < pipe.slots; ++k) {
        void* p = nullptr;
        RR_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(pipe.slot_bytes)));
        st.slots.push_back(p);
      }
      const int64_t accum_elems = stages[static_cast<size_t>(r)][0].plan.accum_elems;
      if (accum_elems > 0) RR_CUDA_CHECK(cudaMalloc(&st.accum, static_cast<size_t>(accum_elems) * 4));
      st.start = sh.newEvent();
      st.done = sh.newEvent();
      st.stage = sh.newEvent();
    }
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r]() {
        try {
          DeviceGuard tg(device);
          RankState& st = ranks[static_cast<size_t>(r)];
          DeviceBuffers b;
          b.data = data[static_cast<size_t>(r)];
          b.accum = st.accum;
          b.slots = st.slots;
          b.slot_bytes = static_cast<size_t>(pipe.slot_bytes);
          LoopbackBackend be(sh, st, caller);
          enqueueRingStages(stages[static_cast<size_t>(r)], b, be, /*caller_waits=*/true);
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
          std::lock_guard<std::mutex> lock(sh.mu);
          sh.failed = true;
          sh.cv.notify_all();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    // The caller stream waits for every rank's done event; the staging must outlive the GPU work.
    RR_CUDA_CHECK(cudaStreamSynchronize(caller));
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
}

}  // namespace rr
