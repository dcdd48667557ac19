// ringreduce tests: the real CudaRing and NcclComm (csrc/cuda/group_runtime.cpp, nccl_comm.cpp) on the
// fake CUDA runtime and NCCL of fake_cuda.h (Note [Fake CUDA runtime]): the host-side logic of
// the GPU path - work states, watchdog, abort, shutdown, timeouts, device guard - without a GPU.
// Each case names the defect of issue 15 it guards against.
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../../csrc/core/collectives.h"
#include "../../../csrc/core/direct.h"
#include "../../../csrc/core/error.h"
#include "throws_kind.h"
#include "../../../csrc/cuda/cuda_ops.h"
#include "../../../csrc/cuda/group_runtime.h"
#include "../../../csrc/cuda/host_interrupt.h"
#include "../../../csrc/cuda/nccl_comm.h"
#include "../check.h"
#include "fake_cuda.h"

namespace {

using namespace rr;
using ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

const std::string kUid(sizeof(ncclUniqueId::internal), '\x07');

std::shared_ptr<CudaRing> makeRing(int timeout_ms, int connect_ms = 0, int nranks = 2, int rank = 0) {
  auto comm = std::make_shared<NcclComm>(kUid, nranks, rank, 0, ms(timeout_ms), "fake", ms(connect_ms));
  return std::make_shared<CudaRing>(comm);
}

// One synchronous-style flat all-reduce of `numel` floats enqueued on `caller`.
struct Call {
  std::vector<float> data;
  std::shared_ptr<CudaWork> work;
};

std::shared_ptr<CudaWork> enqueueAllReduce(CudaRing& ring, std::vector<float>& data, cudaStream_t caller) {
  const RingMembers rm = resolveRing({}, ring.size(), ring.rank());
  const int64_t numel = static_cast<int64_t>(data.size());
  const std::vector<RingStage> stages = flatRingStages(
      rm, numel, DType::kFloat32, RedOp::kSum,
      ring.planOptions(RedOp::kSum, false, rm.size(), numel, DType::kFloat32, {}));
  return ring.enqueue(stages, data.data(), nullptr, ringKey({}, ring.size()), "all-reduce", caller, false);
}

cudaStream_t newStream() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, 0);
  return s;
}

int exchangesPerCall() {
  rrfake::reset();
  auto ring = makeRing(2000);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  const int before = rrfake::exchangesRun();
  enqueueAllReduce(*ring, data, caller)->synchronize(ms(2000));
  const int k = rrfake::exchangesRun() - before;
  ring->shutdown("test");
  return k;
}

}  // namespace

// Defect 1: the watchdog's abort lets the kernels exit and the done event fire; a waiter polling
// in that window must not see success.
TEST_CASE(aborted_call_is_never_reported_as_success) {
  rrfake::reset();
  auto ring = makeRing(200);
  rrfake::setExchangeBudget(0);  // the peer never answers
  rrfake::setAbortSleepMs(300);  // ncclCommAbort returns late: the window of the defect
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  auto work = enqueueAllReduce(*ring, data, caller);
  std::string msg;
  CHECK(throwsKind([&] { work->synchronize(ms(5000)); }, ErrorKind::kBackend, &msg));
  CHECK(work->failed());
  CHECK(!work->error().empty());
  ring->shutdown("test");
}

// Defect 1 (second half): a work whose done event fires after an abort is failed, even when the
// abort did not come from the watchdog (shutdown, another thread).
TEST_CASE(done_event_after_abort_is_failure) {
  rrfake::reset();
  auto ring = makeRing(5000);
  rrfake::setExchangeBudget(0);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  auto work = enqueueAllReduce(*ring, data, caller);
  ring->comm().abort("aborted by the test");  // kernels exit, done fires; watchdog not involved
  CHECK(throwsKind([&] { work->synchronize(ms(2000)); }, ErrorKind::kBackend));
  ring->shutdown("test");
}

// Defect 1 (hostWait): the agreement check's frames arrive "complete" after an abort let the
// kernels exit; comparing those garbage frames must not happen: the check throws kBackend.
TEST_CASE(agreement_frames_after_an_abort_are_not_compared) {
  rrfake::reset();
  auto ring = makeRing(5000);
  rrfake::setExchangeBudget(0);
  std::thread aborter([&] {
    std::this_thread::sleep_for(ms(100));
    ring->comm().abort("aborted by the test");
  });
  Frame mine;
  CHECK(throwsKind([&] { ring->exchangeFrames(mine, resolveRing({}, 2, 0)); }, ErrorKind::kBackend));
  aborter.join();
  ring->shutdown("test");
}

// Defect 2: the caching allocator records events on streams a tensor was recordStream'ed on,
// after shutdown too: those streams must stay valid, and be reused, not leaked per ring.
TEST_CASE(streams_survive_shutdown_and_are_reused) {
  rrfake::reset();
  auto ring = makeRing(1000);
  cudaStream_t comm_s = ring->commStream();
  cudaStream_t compute_s = ring->computeStream();
  ring->shutdown("test");
  CHECK(rrfake::streamValid(comm_s));
  CHECK(rrfake::streamValid(compute_s));
  cudaEvent_t e = nullptr;
  cudaEventCreateWithFlags(&e, 0);
  CHECK_EQ(cudaEventRecord(e, comm_s), cudaSuccess);
  CHECK_EQ(cudaEventRecord(e, compute_s), cudaSuccess);
  CHECK_EQ(rrfake::streamsDestroyed(), 0);
  auto again = makeRing(1000);
  CHECK(again->commStream() == comm_s || again->commStream() == compute_s);
  again->shutdown("test");
}

// Defect 11: shutdown must not wait for a call blocked in NCCL's hand-off (it holds the call
// lock for up to the timeout), and must not block for ever on streams that never drain.
TEST_CASE(shutdown_does_not_wait_for_a_blocked_call) {
  rrfake::reset();
  auto ring = makeRing(4000);
  rrfake::setDefaultHandoffMs(-1);  // ncclGroupEnd never hands off
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  std::atomic<int> outcome{0};  // 1: threw kBackend
  std::thread t([&] {
    try {
      enqueueAllReduce(*ring, data, caller);
      outcome = 2;
    } catch (const Error& e) {
      outcome = e.kind() == ErrorKind::kBackend ? 1 : 3;
    }
  });
  std::this_thread::sleep_for(ms(100));
  const auto t0 = Clock::now();
  ring->shutdown("test");
  const auto took = std::chrono::duration_cast<ms>(Clock::now() - t0).count();
  t.join();
  CHECK_MSG(took < 1500, "shutdown took " << took << " ms");
  CHECK_EQ(outcome.load(), 1);
}

TEST_CASE(shutdown_is_bounded_when_streams_never_drain) {
  rrfake::reset();
  auto ring = makeRing(300);
  rrfake::setExchangeBudget(0);
  rrfake::setAbortReleases(false);  // a hung kernel that ignores the abort
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  enqueueAllReduce(*ring, data, caller);
  const auto t0 = Clock::now();
  ring->shutdown("test");
  const auto took = std::chrono::duration_cast<ms>(Clock::now() - t0).count();
  CHECK_MSG(took < 2000, "shutdown took " << took << " ms");
  CHECK_EQ(rrfake::streamSyncTimeouts(), 0);
  CHECK_EQ(rrfake::streamsDestroyed(), 0);
}

// Defect 3: no sleep before the first poll of a hand-off that completes at once.
TEST_CASE(exchanges_are_not_host_bound) {
  rrfake::reset();
  NcclComm comm(kUid, 2, 0, 0, ms(2000), "fake");
  cudaStream_t s = newStream();
  std::vector<char> a(16), b(16);
  // Without a sleep before the first poll almost every call takes a few microseconds; with one,
  // every call takes >= 50 us whatever the machine (sleep_for never returns early).
  const int calls = 1000;
  int slow = 0;
  for (int i = 0; i < calls; ++i) {
    const auto t0 = Clock::now();
    comm.sendRecv(a.data(), 16, 1, b.data(), 16, 1, s);
    slow += Clock::now() - t0 >= std::chrono::microseconds(50) ? 1 : 0;
  }
  CHECK_MSG(slow < calls / 2, slow << " of " << calls << " exchanges took >= 50 us of host time");
}

// Defect 5: communicator init and first connections get the connect timeout, not the (short)
// operation timeout; later exchanges the operation timeout.
TEST_CASE(init_and_first_contact_use_the_connect_timeout) {
  rrfake::reset();
  rrfake::setInitMs(400);
  bool ok = true;
  try {
    NcclComm comm(kUid, 2, 0, 0, ms(100), "fake", ms(3000));
    cudaStream_t s = newStream();
    std::vector<char> a(16), b(16);
    rrfake::pushHandoffMs(300);  // first exchange with peer 1: connecting
    comm.sendRecv(a.data(), 16, 1, b.data(), 16, 1, s);
    rrfake::pushHandoffMs(300);  // later: the operation timeout applies
    CHECK(throwsKind([&] { comm.sendRecv(a.data(), 16, 1, b.data(), 16, 1, s); }, ErrorKind::kBackend));
  } catch (const Error& e) {
    ok = false;
    CHECK_MSG(false, e.what());
  }
  CHECK(ok);
}

// Defect 6: a call queued behind a slow one is timed from when the comm stream reaches it.
TEST_CASE(queued_call_is_not_charged_for_its_predecessor) {
  const int k = exchangesPerCall();
  CHECK(k > 0);
  rrfake::reset();
  auto ring = makeRing(400);
  rrfake::setExchangeBudget(0);
  cudaStream_t caller = newStream();
  std::vector<float> d1(64, 1.0f), d2(64, 2.0f);
  auto a = enqueueAllReduce(*ring, d1, caller);
  auto b = enqueueAllReduce(*ring, d2, caller);
  std::this_thread::sleep_for(ms(250));
  rrfake::allowExchanges(k);  // call a finishes at ~250 ms
  std::this_thread::sleep_for(ms(250));
  rrfake::allowExchanges(k);  // call b at ~500 ms: 250 ms after it reached the comm stream
  bool ok = true;
  try {
    a->synchronize(ms(3000));
    b->synchronize(ms(3000));
  } catch (const Error& e) {
    ok = false;
    CHECK_MSG(false, e.what());
  }
  CHECK(ok);
  ring->shutdown("test");
}

// Defect 4: the watchdog's polls must not invalidate another thread's global-mode capture.
TEST_CASE(watchdog_does_not_break_a_graph_capture_elsewhere) {
  rrfake::reset();
  auto ring = makeRing(2000);
  rrfake::setExchangeBudget(0);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  auto work = enqueueAllReduce(*ring, data, caller);
  rrfake::setGlobalCapture(true);
  std::this_thread::sleep_for(ms(30));  // the watchdog polls every millisecond
  CHECK(!work->isCompleted());
  rrfake::setExchangeBudget(-1);
  std::this_thread::sleep_for(ms(30));
  CHECK(!rrfake::captureInvalidated());
  rrfake::setGlobalCapture(false);
  CHECK(!throwsKind([&] { work->synchronize(ms(2000)); }, ErrorKind::kBackend));
  CHECK(!work->failed());
  ring->shutdown("test");
}

// Defect 16: a not-ready poll must not leave cudaErrorNotReady as the thread's last error (the
// reduce kernel's launch check reads it).
TEST_CASE(not_ready_poll_clears_the_last_error) {
  rrfake::reset();
  auto ring = makeRing(2000);
  rrfake::setExchangeBudget(0);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  auto work = enqueueAllReduce(*ring, data, caller);
  CHECK(!work->isCompleted());
  CHECK_EQ(cudaGetLastError(), cudaSuccess);
  rrfake::setExchangeBudget(-1);
  work->synchronize(ms(2000));
  ring->shutdown("test");
}

// Defect 9: restoring "device 0" of a thread that never used it creates a context there.
TEST_CASE(device_guard_creates_no_context_on_the_previous_device) {
  rrfake::reset();
  bool ctx0 = true, ctx1 = false;
  int after = -1;
  std::thread t([&] {
    { DeviceGuard guard(1); }
    ctx0 = rrfake::contextActive(0);
    ctx1 = rrfake::contextActive(1);
    cudaGetDevice(&after);
  });
  t.join();
  CHECK(!ctx0);
  CHECK(ctx1);
  // With an active context on 0 the device is restored.
  std::thread u([&] {
    cudaSetDevice(0);
    { DeviceGuard guard(1); }
    cudaGetDevice(&after);
  });
  u.join();
  CHECK_EQ(after, 0);
}

// Defect 13: inside a user's ncclGroupStart our ncclGroupEnd launches nothing: refuse clearly,
// without aborting the communicator the user's group still uses.
TEST_CASE(call_inside_a_user_nccl_group_is_refused) {
  rrfake::reset();
  auto ring = makeRing(2000);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  ncclGroupStart();
  std::string msg;
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, data, caller); }, ErrorKind::kRuntime, &msg));
  CHECK_MSG(msg.find("ncclGroupStart") != std::string::npos, msg);
  CHECK_EQ(rrfake::abortCalls(), 0);
  ncclGroupEnd();  // the user's group ends and launches our first exchange
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, data, caller); }, ErrorKind::kRuntime));
  ring->shutdown("test");
}

// Defect 8 (CudaRing side): the capture check comes first and touches nothing.
TEST_CASE(capture_is_refused_before_anything_is_enqueued) {
  rrfake::reset();
  auto ring = makeRing(2000);
  cudaStream_t caller = newStream();
  rrfake::setStreamCapturing(caller, true);
  std::vector<float> data(64, 1.0f);
  CHECK(throwsKind([&] { ring->checkNotCapturing(caller, "all-reduce"); }, ErrorKind::kRuntime));
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, data, caller); }, ErrorKind::kRuntime));
  CHECK_EQ(rrfake::ncclTaskCalls(), 0);
  CHECK(!ring->comm().aborted());
  ring->shutdown("test");
}

// Defect 8 (the call's sequencing): with the agreement check on, a captured call is refused with
// kRuntime before the check runs (no exchange, no abort), not with an aborted communicator.
TEST_CASE(captured_call_with_agreement_check_is_refused_first) {
  rrfake::reset();
  auto ring = makeRing(2000);
  cudaStream_t caller = newStream();
  rrfake::setStreamCapturing(caller, true);
  std::vector<float> data(64, 1.0f);
  CudaCallRequest req;
  req.options.check = false;  // CallOptions checks by default; these calls opt in
  req.numel = 64;
  req.shape = {64};
  req.options.check = true;
  req.caller = caller;
  CudaCallBuffers buf;
  buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
  std::string msg;
  CHECK(throwsKind([&] { runCudaCall(*ring, req, buf); }, ErrorKind::kRuntime, &msg));
  CHECK_MSG(msg.find("CUDA graph") != std::string::npos, msg);
  CHECK_EQ(rrfake::ncclTaskCalls(), 0);
  CHECK(!ring->comm().aborted());
  ring->shutdown("test");
}

// Defect 12: every buffer is protected (recordStream) before anything is enqueued, so that a
// failure half-way through cannot return a block to the allocator while drained kernels write it.
TEST_CASE(buffers_are_protected_before_anything_is_enqueued) {
  rrfake::reset();
  auto ring = makeRing(300);
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  CudaCallRequest req;
  req.options.check = false;  // CallOptions checks by default; these calls opt in
  req.numel = 64;
  req.shape = {64};
  req.caller = caller;
  req.options.one_shot = false;  // the ring: a hand-off, then queued exchanges
  int tasks_at_protect = -1;
  CudaCallBuffers buf;
  buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
  buf.protect = [&] { tasks_at_protect = rrfake::ncclTaskCalls(); };
  rrfake::failQueuedGroupAt(0);  // the first exchange hands off, the second (queued) fails: half a ring enqueued
  CHECK(throwsKind([&] { runCudaCall(*ring, req, buf); }, ErrorKind::kBackend));
  CHECK_EQ(tasks_at_protect, 0);
  CHECK(rrfake::ncclTaskCalls() > 0);
  CHECK(ring->comm().aborted());  // the peers wait for the rest: only an abort unblocks them
  ring->shutdown("test");
}

// ---- the agreement frames over NCCL (issue 16: one frame all-gather, core/agreement.h) --------

namespace {

// Runs fn(rank) on one thread per rank of `ranks` (the others never call), each with a linked
// communicator of a world of `nranks` on its own device, and joins them; an exception on a rank
// fails the case.
void onLinkedRanks(int nranks, const std::vector<int>& ranks, const std::function<void(CudaRing&, int)>& fn) {
  std::vector<std::shared_ptr<CudaRing>> rings(static_cast<size_t>(nranks));
  for (int r : ranks) {
    auto comm = std::make_shared<NcclComm>(kUid, nranks, r, r, ms(5000), "fake", ms(5000));
    rings[static_cast<size_t>(r)] = std::make_shared<CudaRing>(comm);
  }
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(nranks));
  for (int r : ranks) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      try {
        fn(*rings[static_cast<size_t>(r)], r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r : ranks) rings[static_cast<size_t>(r)]->shutdown("test");
  for (int r : ranks) CHECK_MSG(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
}

Frame frameOf(int rank, int64_t numel) {
  Frame f;
  f.rank = rank;
  f.seq = 7;
  f.kind = static_cast<int32_t>(CallKind::kAllReduce);
  f.numel = numel;
  f.device_type = 1;
  return f;
}

}  // namespace

// CudaRing::exchangeFrames runs core's exchangeFrames over NcclFrameTransport: every rank gets
// every rank's frame, in ring order, and only ring neighbours exchange (Note [Frames around the
// ring]: direct frames would have connected all 12 ordered pairs of 4 ranks).
TEST_CASE(frames_over_nccl_reach_every_rank_around_the_ring) {
  rrfake::reset();
  rrfake::linkRanks();
  std::vector<std::vector<Frame>> got(4);
  onLinkedRanks(4, {0, 1, 2, 3}, [&](CudaRing& ring, int r) {
    got[static_cast<size_t>(r)] = ring.exchangeFrames(frameOf(r, 100 + r), resolveRing({}, 4, r));
  });
  for (int r = 0; r < 4; ++r) {
    CHECK_EQ(got[static_cast<size_t>(r)].size(), size_t(4));
    for (int i = 0; i < 4; ++i) {
      CHECK_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(i)].rank, i);
      CHECK_EQ(got[static_cast<size_t>(r)][static_cast<size_t>(i)].numel, int64_t(100 + i));
    }
  }
  CHECK_EQ(rrfake::pairsUsed(), 4);      // 0->1, 1->2, 2->3, 3->0
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
  CHECK_EQ(rrfake::ncclTaskCalls(), 4 * 3 * 2);  // 3 hops of one send and one receive per rank
}

// A ring over some ranks of the communicator (Note [Sub-rings on one communicator]): frames go
// around its members only; rank 1, not a member, never calls.
TEST_CASE(frames_over_nccl_on_a_sub_ring_stay_among_its_members) {
  rrfake::reset();
  rrfake::linkRanks();
  const std::vector<int> members = {3, 0, 2};  // ring order: 3 -> 0 -> 2 -> 3
  std::vector<std::vector<Frame>> got(4);
  onLinkedRanks(4, {0, 2, 3}, [&](CudaRing& ring, int r) {
    const RingMembers rm = resolveRing(members, 4, r);
    got[static_cast<size_t>(r)] = ring.exchangeFrames(frameOf(r, 10 * r), rm);
  });
  for (int r : {0, 2, 3}) {
    CHECK_EQ(got[static_cast<size_t>(r)].size(), size_t(3));
    for (size_t i = 0; i < members.size(); ++i) {
      CHECK_EQ(got[static_cast<size_t>(r)][i].rank, members[i]);
      CHECK_EQ(got[static_cast<size_t>(r)][i].numel, int64_t(10 * members[i]));
    }
  }
  CHECK_EQ(rrfake::pairsUsed(), 3);
  CHECK_EQ(rrfake::messagesLeft(), 0);
}

// The whole GPU check path (runCudaCall with check on, sendCudaRefusal) over the core agreement:
// a call whose ranks agree runs; a rank with another numel, and a rank that refused, make every
// rank raise the verdict (kRuntime) before anything is enqueued, and the communicator stays usable.
TEST_CASE(gpu_agreement_check_verdicts_over_nccl) {
  rrfake::reset();
  rrfake::linkRanks();
  std::vector<std::string> verdict(3), refusal(3);
  std::vector<int> ran(3, 0), usable(3, 0);
  onLinkedRanks(3, {0, 1, 2}, [&](CudaRing& ring, int r) {
    cudaStream_t caller = newStream();
    std::vector<float> data(64, 1.0f);
    CudaCallBuffers buf;
    buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
    CudaCallRequest req;
    req.options.check = false;  // CallOptions checks by default; these calls opt in
    req.numel = 64;
    req.shape = {64};
    req.options.check = true;
    req.group_name = "fake";
    req.caller = caller;
    auto work = runCudaCall(ring, req, buf);  // agreed: runs
    if (work) {
      work->synchronize(ms(5000));
      ran[static_cast<size_t>(r)] = 1;
    }
    req.numel = r == 2 ? 32 : 64;  // rank 2 disagrees
    req.shape = {req.numel};
    (void)throwsKind([&] { runCudaCall(ring, req, buf); }, ErrorKind::kRuntime, &verdict[static_cast<size_t>(r)]);
    if (r == 1) {
      (void)throwsKind([&] { sendCudaRefusal(ring, CallKind::kAllReduce, 3, RedOp::kSum, "fake", {}); },
                       ErrorKind::kRuntime, &refusal[static_cast<size_t>(r)]);
    } else {
      req.numel = 64;
      req.shape = {64};
      (void)throwsKind([&] { runCudaCall(ring, req, buf); }, ErrorKind::kRuntime, &refusal[static_cast<size_t>(r)]);
    }
    usable[static_cast<size_t>(r)] = ring.comm().aborted() ? 0 : 1;
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_EQ(ran[static_cast<size_t>(r)], 1);
    CHECK_EQ(usable[static_cast<size_t>(r)], 1);
    CHECK_MSG(verdict[static_cast<size_t>(r)].find("disagree on call #1") != std::string::npos &&
                  verdict[static_cast<size_t>(r)].find("numel") != std::string::npos,
              verdict[static_cast<size_t>(r)]);
    CHECK_MSG(refusal[static_cast<size_t>(r)].find("a rank refused the call") != std::string::npos,
              refusal[static_cast<size_t>(r)]);
  }
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// Issue 24: no host round trip inside a call. A 64 MiB all-reduce in 1 MiB segments runs 64
// exchanges per rank; only the first hands off to the non-blocking communicator (a host wait), the
// other 63 are queued on its blocking child (Note [Hand-off and queued exchanges]). Before, every
// exchange was a hand-off: 64 host waits per rank and call.
TEST_CASE(a_large_call_waits_on_the_host_once) {
  rrfake::reset();
  rrfake::linkRanks();
  const int64_t numel = (64 << 20) / 4;
  std::vector<int> waits(2, -1), queued(2, -1), nsegs(2, -1);
  std::vector<int> ran(2, 0);
  std::vector<int64_t> hand_offs(2, -1);
  std::mutex mu;
  onLinkedRanks(2, {0, 1}, [&](CudaRing& ring, int r) {
    cudaStream_t caller = newStream();
    std::vector<float> data(static_cast<size_t>(numel), 1.0f + static_cast<float>(r));
    const RingMembers rm = resolveRing({}, ring.size(), ring.rank());
    GpuKnobs knobs;
    knobs.segment_bytes = 1 << 20;
    const std::vector<RingStage> stages = flatRingStages(
        rm, numel, DType::kFloat32, RedOp::kSum,
        ring.planOptions(RedOp::kSum, false, 2, numel, DType::kFloat32, knobs));
    nsegs[static_cast<size_t>(r)] = stages[0].plan.sched.nsegs;  // checked after the join (CHECK is not thread-safe)
    std::shared_ptr<CudaWork> work;
    int w0 = 0, q0 = 0;
    {
      std::lock_guard<std::mutex> lock(mu);  // the counters are global: one rank enqueues at a time
      w0 = rrfake::hostWaits();
      q0 = rrfake::queuedGroups();
      work = ring.enqueue(stages, data.data(), nullptr, ringKey({}, ring.size()), "all-reduce", caller, false);
      waits[static_cast<size_t>(r)] = rrfake::hostWaits() - w0;
      queued[static_cast<size_t>(r)] = rrfake::queuedGroups() - q0;
    }
    work->synchronize(ms(20000));
    ran[static_cast<size_t>(r)] = 1;
    hand_offs[static_cast<size_t>(r)] = ring.comm().handOffs();
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(ran[static_cast<size_t>(r)], 1);
    CHECK_EQ(nsegs[static_cast<size_t>(r)], 32);
    CHECK_EQ(hand_offs[static_cast<size_t>(r)], int64_t(1));
    CHECK_EQ(waits[static_cast<size_t>(r)], 1);    // the call's first exchange
    CHECK_EQ(queued[static_cast<size_t>(r)], 63);  // 2 steps x 32 segments, less the hand-off
  }
  CHECK_EQ(rrfake::exchangesRun(), 2 * 64);
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// A ring whose chunks are not all filled (numel < n) hands every exchange off (Note [Which
// exchanges hand off]): a rank whose first exchange carries nothing must not reach a peer first
// through the queued communicator. Messages still pair up per communicator.
TEST_CASE(a_ring_with_empty_chunks_hands_every_exchange_off) {
  rrfake::reset();
  rrfake::linkRanks();
  std::vector<int64_t> hand_offs(3, -1);
  onLinkedRanks(3, {0, 1, 2}, [&](CudaRing& ring, int r) {
    cudaStream_t caller = newStream();
    std::vector<float> data(2, 1.0f);  // 2 elements on 3 ranks: chunk 2 is empty
    enqueueAllReduce(ring, data, caller)->synchronize(ms(5000));
    hand_offs[static_cast<size_t>(r)] = ring.comm().handOffs();
  });
  CHECK_EQ(rrfake::queuedGroups(), 0);
  for (int r = 0; r < 3; ++r) CHECK(hand_offs[static_cast<size_t>(r)] >= 1);
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// Note [GPU one-shot all-reduce]: a small flat all-reduce is one hand-off group with every peer
// (every pair of ranks exchanges one message, each rank waits once on the host) and one kernel;
// with the agreement check, a rank that takes the ring instead (algorithm="ring" there) makes
// every rank raise the verdict before anything moves.
TEST_CASE(small_all_reduce_is_one_group_with_every_peer) {
  rrfake::reset();
  rrfake::linkRanks();
  std::vector<int64_t> hand_offs(3, -1);
  std::vector<std::string> verdict(3);
  onLinkedRanks(3, {0, 1, 2}, [&](CudaRing& ring, int r) {
    cudaStream_t caller = newStream();
    std::vector<float> data(1000, 1.0f);
    CudaCallBuffers buf;
    buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
    CudaCallRequest req;
    req.options.check = false;  // CallOptions checks by default; these calls opt in
    req.numel = 1000;
    req.shape = {1000};
    req.group_name = "fake";
    req.caller = caller;
    auto work = runCudaCall(ring, req, buf);
    work->synchronize(ms(5000));
    hand_offs[static_cast<size_t>(r)] = ring.comm().handOffs();
    req.options.check = true;
    req.options.one_shot = r != 1;  // rank 1 asks for the ring
    (void)throwsKind([&] { runCudaCall(ring, req, buf); }, ErrorKind::kRuntime, &verdict[static_cast<size_t>(r)]);
  });
  CHECK_EQ(rrfake::queuedGroups(), 0);
  CHECK_EQ(rrfake::pairsUsed(), 6);  // the one-shot: all 6 ordered pairs (the frames go around the ring)
  for (int r = 0; r < 3; ++r) {
    CHECK_EQ(hand_offs[static_cast<size_t>(r)], int64_t(1));
    CHECK_MSG(verdict[static_cast<size_t>(r)].find("algorithm") != std::string::npos, verdict[static_cast<size_t>(r)]);
  }
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// Note [Direct all-reduce] (csrc/core/direct.h) through runCudaCall: one group per round with every
// peer, the first a hand-off (each rank waits on the host once), the others queued on the child;
// every ordered pair exchanges, every message is received with its size. With the agreement check, a
// rank that asks for the ring instead makes every rank raise before anything moves; the direct
// one-shot is one hand-off group and its frame differs from the ring one-shot's too.
TEST_CASE(direct_all_reduce_is_one_group_per_round_with_every_peer) {
  rrfake::reset();
  rrfake::linkRanks();
  const int64_t numel = 3 << 20;  // 6 MiB of bfloat16: several rounds in 16 MiB of staging
  std::vector<int64_t> hand_offs(3, -1), one_shot_hand_offs(3, -1);
  std::vector<int> rounds(3, 0), queued(3, -1);
  std::vector<std::string> verdict(3), one_shot_verdict(3);
  std::mutex mu;
  onLinkedRanks(3, {0, 1, 2}, [&](CudaRing& ring, int r) {
    cudaStream_t caller = newStream();
    std::vector<uint16_t> data(static_cast<size_t>(numel), 0x3f80);
    CudaCallBuffers buf;
    buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
    CudaCallRequest req;
    req.options.check = false;
    req.options.direct = true;
    req.options.one_shot = false;
    req.options.op = RedOp::kAvg;
    req.dtype = DType::kBFloat16;
    req.numel = numel;
    req.shape = {numel};
    req.group_name = "fake";
    req.caller = caller;
    rounds[static_cast<size_t>(r)] =
        buildDirectPlan(3, r, numel, DType::kBFloat16, ring.directOptions(req.options.directOptions(DType::kBFloat16), 0))
            .rounds;
    std::shared_ptr<CudaWork> work;
    {
      std::lock_guard<std::mutex> lock(mu);  // the counters are global: one rank enqueues at a time
      const int q0 = rrfake::queuedGroups();
      work = runCudaCall(ring, req, buf);
      queued[static_cast<size_t>(r)] = rrfake::queuedGroups() - q0;
    }
    work->synchronize(ms(20000));
    hand_offs[static_cast<size_t>(r)] = ring.comm().handOffs();
    req.options.check = true;
    req.options.direct = r != 1;  // rank 1 asks for the ring
    (void)throwsKind([&] { runCudaCall(ring, req, buf); }, ErrorKind::kRuntime, &verdict[static_cast<size_t>(r)]);
    // The direct one-shot: one hand-off group; a rank on the ring's one-shot makes every rank raise.
    req.options.check = false;
    req.options.direct = true;
    req.options.one_shot = true;
    req.numel = 1000;
    req.shape = {1000};
    const int64_t before = ring.comm().handOffs();
    runCudaCall(ring, req, buf)->synchronize(ms(5000));
    one_shot_hand_offs[static_cast<size_t>(r)] = ring.comm().handOffs() - before;
    req.options.check = true;
    req.options.direct = r != 2;
    (void)throwsKind([&] { runCudaCall(ring, req, buf); }, ErrorKind::kRuntime,
                     &one_shot_verdict[static_cast<size_t>(r)]);
  });
  CHECK_EQ(rrfake::pairsUsed(), 12);  // all 6 ordered pairs, on the parent (hand-off) and the child (queued)
  for (int r = 0; r < 3; ++r) {
    const size_t i = static_cast<size_t>(r);
    CHECK_MSG(rounds[i] >= 2, "rounds " << rounds[i]);
    CHECK_EQ(hand_offs[i], int64_t(1));
    CHECK_EQ(queued[i], 2 * rounds[i] - 1);  // both halves, one group per round, less the hand-off
    CHECK_EQ(one_shot_hand_offs[i], int64_t(1));
    CHECK_MSG(verdict[i].find("algorithm=direct") != std::string::npos, verdict[i]);
    CHECK_MSG(one_shot_verdict[i].find("algorithm=direct (GPU one-shot)") != std::string::npos, one_shot_verdict[i]);
  }
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// Note [Lanes]: a ring of two lanes (a second communicator from its own unique id, its own streams)
// runs a large all-reduce as two rings side by side: each lane hands off once, its messages stay on
// its own communicators, and an abort (here: a lane whose peer never answers) takes down every lane.
TEST_CASE(two_lanes_each_hand_off_once_and_abort_together) {
  rrfake::reset();
  rrfake::linkRanks();
  const std::string lane_uid(sizeof(ncclUniqueId::internal), '\x09');
  const int64_t numel = (16 << 20) / 4;
  std::vector<int64_t> hand_offs(2, -1);
  std::vector<int> lanes_used(2, 0);
  std::vector<std::shared_ptr<CudaRing>> rings(2);
  for (int r = 0; r < 2; ++r) {
    auto comm = std::make_shared<NcclComm>(kUid, 2, r, r, ms(800), "fake", ms(5000));
    auto lane1 = std::make_shared<NcclComm>(lane_uid, 2, r, r, ms(800), "fake lane 1", ms(5000));
    rings[static_cast<size_t>(r)] = std::make_shared<CudaRing>(comm, kGpuStagingBytes, kCudaMaxQueuedOps,
                                                               std::vector<std::shared_ptr<NcclComm>>{lane1});
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      CudaRing& ring = *rings[static_cast<size_t>(r)];
      cudaStream_t caller = newStream();
      std::vector<float> data(static_cast<size_t>(numel), 1.0f);
      const RingMembers rm = resolveRing({}, 2, r);
      const std::vector<RingStage> stages = flatRingStages(
          rm, numel, DType::kFloat32, RedOp::kSum, ring.planOptions(RedOp::kSum, false, 2, numel, DType::kFloat32, {}));
      lanes_used[static_cast<size_t>(r)] = static_cast<int>(stages.size());
      ring.enqueue(stages, data.data(), nullptr, ringKey({}, 2), "all-reduce", caller, false)->synchronize(ms(10000));
      hand_offs[static_cast<size_t>(r)] = ring.handOffs();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(lanes_used[static_cast<size_t>(r)], 2);
    CHECK_EQ(hand_offs[static_cast<size_t>(r)], int64_t(2));
    CHECK_EQ(rings[static_cast<size_t>(r)]->streams().size(), size_t(4));
  }
  CHECK_EQ(rrfake::pairsUsed(), 2 * 2 * 2);  // 2 lanes x (hand-off, queued) x 2 directions
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
  // Rank 1 is gone: rank 0's call times out, and both of its lanes are aborted.
  rings[1]->shutdown("test");
  rrfake::setAbortReleases(false);
  std::vector<float> data(static_cast<size_t>(numel), 1.0f);
  CudaRing& ring = *rings[0];
  const RingMembers rm = resolveRing({}, 2, 0);
  auto c = ring.enqueue(flatRingStages(rm, numel, DType::kFloat32, RedOp::kSum,
                                       ring.planOptions(RedOp::kSum, false, 2, numel, DType::kFloat32, {})),
                        data.data(), nullptr, ringKey({}, 2), "all-reduce", newStream(), false);
  CHECK(throwsKind([&] { c->synchronize(ms(8000)); }, ErrorKind::kBackend));
  // Failed before aborted (Note [Ordering, lifetime, failure]): the watchdog fails the call, then
  // aborts the lanes, so the abort may land just after synchronize() threw.
  for (const auto until = Clock::now() + ms(5000); !ring.aborted() && Clock::now() < until;)
    std::this_thread::sleep_for(ms(1));
  CHECK(ring.aborted());
  rrfake::setAbortReleases(true);
  ring.shutdown("test");
}

// runCudaCall on rings of two lanes with float32 partials (bfloat16, accum_dtype=float32, 3 ranks):
// the lanes share the call's partials buffer, which must therefore exist.
TEST_CASE(lanes_share_the_float32_partials) {
  rrfake::reset();
  rrfake::linkRanks();
  const std::string lane_uid(sizeof(ncclUniqueId::internal), '\x0b');
  const int64_t numel = (16 << 20) / 2;
  std::vector<std::shared_ptr<CudaRing>> rings(3);
  for (int r = 0; r < 3; ++r) {
    auto comm = std::make_shared<NcclComm>(kUid, 3, r, r, ms(2000), "fake", ms(5000));
    auto lane1 = std::make_shared<NcclComm>(lane_uid, 3, r, r, ms(2000), "fake lane 1", ms(5000));
    rings[static_cast<size_t>(r)] = std::make_shared<CudaRing>(comm, kGpuStagingBytes, kCudaMaxQueuedOps,
                                                               std::vector<std::shared_ptr<NcclComm>>{lane1});
  }
  std::vector<int64_t> accum_asked(3, -1);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      std::vector<uint16_t> data(static_cast<size_t>(numel), 0x3f80);  // bfloat16 1.0
      std::vector<float> partials;
      CudaCallBuffers buf;
      buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
      buf.accum = [&](int64_t elems) {
        accum_asked[static_cast<size_t>(r)] = elems;
        partials.assign(static_cast<size_t>(elems), 0.0f);
        return static_cast<void*>(partials.data());
      };
      CudaCallRequest req;
      req.options.check = false;  // CallOptions checks by default; these calls opt in
      req.dtype = DType::kBFloat16;
      req.numel = numel;
      req.shape = {numel};
      req.options.accum_float32 = true;
      req.caller = newStream();
      try {
        runCudaCall(*rings[static_cast<size_t>(r)], req, buf)->synchronize(ms(10000));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    CHECK_MSG(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
    CHECK(accum_asked[static_cast<size_t>(r)] > 0);
    CHECK_EQ(rings[static_cast<size_t>(r)]->handOffs(), int64_t(2));  // both lanes ran
    rings[static_cast<size_t>(r)]->shutdown("test");
  }
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
}

// Note [Bounded launch queue]: a ring keeps at most max_queued_ops stream operations of unfinished
// calls; the next call waits on the host until older ones finish, and when they never do (a dead
// peer), the watchdog's timeout ends the wait with DistBackendError instead of a hang.
TEST_CASE(enqueue_waits_when_the_launch_queue_is_full) {
  rrfake::reset();
  auto comm = std::make_shared<NcclComm>(kUid, 2, 0, 0, ms(400), "fake", ms(0));
  auto ring = std::make_shared<CudaRing>(comm, kGpuStagingBytes, /*max_queued_ops=*/40);
  cudaStream_t caller = newStream();
  std::vector<float> d1(64, 1.0f), d2(64, 2.0f), d3(64, 3.0f);
  rrfake::setExchangeBudget(0);  // nothing finishes until the test says so
  auto a = enqueueAllReduce(*ring, d1, caller);
  std::thread release([] {
    std::this_thread::sleep_for(ms(150));
    rrfake::setExchangeBudget(-1);
  });
  const auto t0 = Clock::now();
  std::shared_ptr<CudaWork> b;
  try {
    b = enqueueAllReduce(*ring, d2, caller);  // does not fit beside a: waits for it
  } catch (...) {
    release.join();  // a joinable thread must not be destroyed (std::terminate)
    throw;
  }
  const auto waited = std::chrono::duration_cast<ms>(Clock::now() - t0).count();
  release.join();
  CHECK_MSG(waited >= 100, "the second call was enqueued after " << waited << " ms, beside an unfinished first");
  CHECK(a->isCompleted());
  b->synchronize(ms(2000));
  // A peer that never answers: the wait ends when the watchdog fails the oldest call and aborts.
  rrfake::setExchangeBudget(0);
  auto c = enqueueAllReduce(*ring, d3, caller);
  std::string msg;
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, d1, caller); }, ErrorKind::kBackend, &msg));
  CHECK(c->failed());
  ring->shutdown("test");
}

// ---- Ctrl-C (Note [Interrupting a host wait on CUDA], csrc/cuda/host_interrupt.h) ------------------
//
// Each host wait that a silent peer can stretch to a timeout (30 s or more here) must end soon after
// the calling thread's scope says stop - the torch layer's scope says so once Python's SIGINT handler
// raised KeyboardInterrupt - with the communicator aborted and every later call refused with the
// reason. The bounds below are a tenth of those timeouts: they tell an interrupted wait from one that
// ran out, not how fast it was (tests/gpu and tests/test_interrupt.py assert the 1 s).

namespace {

// What the torch layer's scope does on Ctrl-C: a poll that says stop from `after` on (counting the
// times it was asked).
struct CtrlC {
  explicit CtrlC(ms after) : at(Clock::now() + after), scope([this] {
                                ++asks;
                                return Clock::now() >= at;
                              }) {}
  Clock::time_point at;
  int asks = 0;
  HostInterruptScope scope;
};

int64_t msSince(Clock::time_point t0) { return std::chrono::duration_cast<ms>(Clock::now() - t0).count(); }

bool saysInterrupted(const std::string& msg) {
  return msg.find("interrupted on this rank") != std::string::npos && msg.find("unusable") != std::string::npos;
}

}  // namespace

// (b) of issue 23's follow-up: the first exchange of a call hands off to NCCL, which connects to the
// peer inside ncclGroupEnd; a silent peer keeps it in progress for the connect timeout (60 s here).
TEST_CASE(ctrl_c_interrupts_a_first_contact_hand_off) {
  rrfake::reset();
  auto ring = makeRing(/*timeout_ms=*/30000, /*connect_ms=*/60000);
  rrfake::setDefaultHandoffMs(-1);  // the hand-off never completes: the peer never connects
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  std::string msg;
  const auto t0 = Clock::now();
  {
    CtrlC ctrl_c(ms(100));
    CHECK(throwsKind([&] { enqueueAllReduce(*ring, data, caller); }, ErrorKind::kBackend, &msg));
    CHECK(ctrl_c.scope.interrupted());
  }
  const int64_t took = msSince(t0);
  CHECK_MSG(took < 3000, "the interrupted hand-off returned after " << took << " ms");
  CHECK_MSG(saysInterrupted(msg) && msg.find("ncclGroupEnd") != std::string::npos, msg);
  CHECK(ring->aborted());
  CHECK(rrfake::abortCalls() >= 2);  // every lane's parent and child
  rrfake::setDefaultHandoffMs(0);
  std::string later;
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, data, caller); }, ErrorKind::kBackend, &later));
  CHECK_MSG(saysInterrupted(later), later);
  ring->shutdown("test");
}

// (a): with RINGREDUCE_CHECK=1 the call waits on the host for the peers' agreement frames; a silent
// peer's never come (timeout 30 s). Nothing of the payload was enqueued.
TEST_CASE(ctrl_c_interrupts_the_agreement_check) {
  rrfake::reset();
  auto ring = makeRing(30000);
  rrfake::setExchangeBudget(0);  // the frame exchange never completes
  cudaStream_t caller = newStream();
  std::vector<float> data(64, 1.0f);
  CudaCallRequest req;
  req.options.check = false;  // CallOptions checks by default; these calls opt in
  req.numel = 64;
  req.shape = {64};
  req.options.check = true;
  req.group_name = "fake";
  req.caller = caller;
  CudaCallBuffers buf;
  bool payload = false;
  buf.data = [&](DType, int) {
    payload = true;
    return static_cast<void*>(data.data());
  };
  std::string msg;
  const auto t0 = Clock::now();
  {
    CtrlC ctrl_c(ms(100));
    CHECK(throwsKind([&] { runCudaCall(*ring, req, buf); }, ErrorKind::kBackend, &msg));
  }
  const int64_t took = msSince(t0);
  CHECK_MSG(took < 3000, "the interrupted agreement check returned after " << took << " ms");
  CHECK_MSG(saysInterrupted(msg) && msg.find("agreement check") != std::string::npos, msg);
  CHECK(!payload);
  CHECK_EQ(rrfake::ncclTaskCalls(), 2);  // the frame hop's send and receive, nothing else
  CHECK(ring->aborted());
  rrfake::setExchangeBudget(-1);
  std::string later;
  CHECK(throwsKind([&] { runCudaCall(*ring, req, buf); }, ErrorKind::kBackend, &later));
  CHECK_MSG(saysInterrupted(later), later);
  ring->shutdown("test");
}

// (c): communicator creation waits in ncclCommInitRankConfig for every rank to join (the connect
// timeout, 60 s here); the communicator being created aborts itself.
TEST_CASE(ctrl_c_interrupts_communicator_creation) {
  rrfake::reset();
  rrfake::setInitMs(60000);  // a rank never joins
  std::string msg;
  const auto t0 = Clock::now();
  {
    CtrlC ctrl_c(ms(100));
    CHECK(throwsKind([&] { NcclComm comm(kUid, 2, 0, 0, ms(30000), "fake", ms(60000)); }, ErrorKind::kBackend,
                     &msg));
  }
  const int64_t took = msSince(t0);
  CHECK_MSG(took < 3000, "the interrupted init returned after " << took << " ms");
  CHECK_MSG(saysInterrupted(msg) && msg.find("ncclCommInitRankConfig") != std::string::npos, msg);
  CHECK_EQ(rrfake::abortCalls(), 1);
}

// (c): Note [Bounded launch queue] - a call waits on the host for room while the oldest call waits
// for a silent peer (until the watchdog's timeout, 30 s here).
TEST_CASE(ctrl_c_interrupts_a_wait_for_the_launch_queue) {
  rrfake::reset();
  auto comm = std::make_shared<NcclComm>(kUid, 2, 0, 0, ms(30000), "fake", ms(0));
  auto ring = std::make_shared<CudaRing>(comm, kGpuStagingBytes, /*max_queued_ops=*/40);
  cudaStream_t caller = newStream();
  std::vector<float> d1(64, 1.0f), d2(64, 2.0f);
  rrfake::setExchangeBudget(0);
  auto first = enqueueAllReduce(*ring, d1, caller);
  std::string msg;
  const auto t0 = Clock::now();
  {
    CtrlC ctrl_c(ms(100));
    CHECK(throwsKind([&] { enqueueAllReduce(*ring, d2, caller); }, ErrorKind::kBackend, &msg));
  }
  const int64_t took = msSince(t0);
  CHECK_MSG(took < 3000, "the interrupted wait for room returned after " << took << " ms");
  CHECK_MSG(saysInterrupted(msg) && msg.find("launch queue") != std::string::npos, msg);
  CHECK(first->failed());  // failed before aborted (Note [Ordering, lifetime, failure])
  CHECK(ring->aborted());
  std::string later;
  CHECK(throwsKind([&] { enqueueAllReduce(*ring, d1, caller); }, ErrorKind::kBackend, &later));
  CHECK_MSG(saysInterrupted(later), later);
  ring->shutdown("test");
}

// The poll costs the GIL: hand-offs that complete at once (every exchange of a healthy ring) must
// not ask it. A thread without a scope (the watchdog, C++ callers) never asks at all.
TEST_CASE(a_prompt_hand_off_does_not_ask_for_ctrl_c) {
  rrfake::reset();
  NcclComm comm(kUid, 2, 0, 0, ms(2000), "fake");
  cudaStream_t s = newStream();
  std::vector<char> a(16), b(16);
  int asks = 0;
  HostInterruptScope scope([&asks] {
    ++asks;
    return false;
  });
  for (int i = 0; i < 100; ++i) comm.sendRecv(a.data(), 16, 1, b.data(), 16, 1, s);
  // A wait asks only after kInterruptPoll (50 ms); a loaded machine may stretch one or two.
  CHECK_MSG(asks < 5, asks << " of 100 prompt hand-offs asked for Ctrl-C");
  CHECK(!scope.interrupted());
}

static int threadCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Issue 47 (torchft): every ProcessGroupRingreduce.configure() makes a new "ringreduce" group, whose
// CUDA ring is a new communicator from a new unique id (ringreduce/_rings/cuda.py, the new store
// prefix), and abort() shuts the old ring down (RingreduceProcessGroup.abort -> _rings.release_group
// -> CudaRing::shutdown). On the fake NCCL, cycles of what that does on two ranks: a new
// communicator pair, the ring formed by a first all-reduce of both ranks, then rank 0's call waiting
// on its silent peer (rank 1 never calls: a dead replica); the abort returns within a second, fails
// that call (kBackend) and leaves its tensor unwritten; the next cycle's communicator works. After
// the cycles no thread, staging buffer or message of an old ring is left.
TEST_CASE(torchft_abort_then_a_new_communicator_per_configure) {
  const int threads_before = threadCount();
  const int allocations_before = rrfake::liveAllocations();
  constexpr int kCycles = 20;
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    rrfake::reset();
    rrfake::linkRanks();
    std::string uid(sizeof(ncclUniqueId::internal), '\x01');
    uid[0] = static_cast<char>(cycle + 1);  // each configure's rendezvous publishes a new id
    std::vector<std::shared_ptr<CudaRing>> rings;
    for (int r = 0; r < 2; ++r)
      rings.push_back(std::make_shared<CudaRing>(
          std::make_shared<NcclComm>(uid, 2, r, r, ms(10000), "torchft configure", ms(5000))));
    // configure() forms the ring: one all-reduce of every rank (Note [Rings formed at configure])
    std::vector<std::vector<float>> data(2, std::vector<float>(64, 1.0f));
    std::vector<std::string> errors(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        cudaSetDevice(r);
        try {
          enqueueAllReduce(*rings[static_cast<size_t>(r)], data[static_cast<size_t>(r)], newStream())
              ->synchronize(ms(5000));
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
    for (const std::string& e : errors) CHECK_MSG(e.empty(), "cycle " << cycle << ": " << e);
    CHECK_EQ(rrfake::messagesLeft(), 0);
    CHECK(rrfake::liveAllocations() > allocations_before);  // the rings' staging and frames, freed below
    // rank 1 dies; rank 0's next call waits for it
    std::vector<float> user(64);
    for (size_t i = 0; i < user.size(); ++i) user[i] = static_cast<float>(i);
    const std::vector<float> before = user;
    std::atomic<int> outcome{0};  // 1: failed with kBackend
    std::thread waiter([&] {
      cudaSetDevice(0);
      try {
        enqueueAllReduce(*rings[0], user, newStream())->synchronize(ms(8000));
        outcome = 2;
      } catch (const Error& e) {
        outcome = e.kind() == ErrorKind::kBackend ? 1 : 3;
      }
    });
    std::this_thread::sleep_for(ms(100));
    const auto t0 = Clock::now();
    rings[0]->shutdown("ProcessGroupRingreduce.abort()");  // what torchft's abort() reaches on rank 0
    const auto took = std::chrono::duration_cast<ms>(Clock::now() - t0).count();
    waiter.join();
    CHECK_MSG(took < 1000, "cycle " << cycle << ": the abort took " << took << " ms");
    CHECK_EQ(outcome.load(), 1);
    // rank 0's communicators (the ring's and the child it splits off), aborted by the shutdown
    const int rank0_aborts = rrfake::abortCalls();
    CHECK_MSG(rank0_aborts == 1 + rrfake::splits() / 2, rank0_aborts << " aborts, " << rrfake::splits() << " splits");
    std::this_thread::sleep_for(ms(20));
    CHECK(user == before);  // nothing wrote the user's tensor, during the abort or after it
    rings[1]->shutdown("the replica died");
    CHECK_EQ(rrfake::abortCalls(), 2 * rank0_aborts);  // and rank 1's: no communicator of this configure is left
    rings.clear();
  }
  rrfake::reset();
  CHECK_EQ(rrfake::liveAllocations(), allocations_before);  // every ring's staging and frames freed
  CHECK_EQ(threadCount(), threads_before);                    // every watchdog joined
}

TEST_MAIN()
