// ringreduce tests: what the GPU path does with the NCCL that runs and its environment (Note [NCCL
// versions, environment and the simplest path], csrc/cuda/nccl_comm.h) and how a ring of several
// lanes stops (Note [Stopping every lane at once]), on the fake CUDA runtime and NCCL of
// fake_cuda.h (Note [Fake NCCL versions and aborts]). Each case names the risk of the GPU review it
// guards against (docs/reliability.md, "What is guarded against real NCCL").
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../../csrc/core/collectives.h"
#include "../../../csrc/core/error.h"
#include "throws_kind.h"
#include "../../../csrc/cuda/cuda_ops.h"
#include "../../../csrc/cuda/group_runtime.h"
#include "../../../csrc/cuda/nccl_comm.h"
#include "../check.h"
#include "fake_cuda.h"

namespace {

using namespace rr;
using ms = std::chrono::milliseconds;

const std::string kUid(sizeof(ncclUniqueId::internal), '\x07');
const std::string kLaneUid(sizeof(ncclUniqueId::internal), '\x0d');

cudaStream_t newStream() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, 0);
  return s;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

NcclSetup setupWith(int version, const std::map<std::string, std::string>& vars) {
  return ncclSetupFor(version, [&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// Sets an environment variable for a scope (the tests run on one thread here).
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  const char* name_;
};

std::shared_ptr<CudaRing> ringOf(int nranks, int rank, int timeout_ms, bool two_lanes, int connect_ms = 5000) {
  auto comm = std::make_shared<NcclComm>(kUid, nranks, rank, rank, ms(timeout_ms), "fake", ms(connect_ms));
  std::vector<std::shared_ptr<NcclComm>> more;
  if (two_lanes) more.push_back(std::make_shared<NcclComm>(kLaneUid, nranks, rank, rank, ms(timeout_ms), "fake lane 1",
                                                           ms(connect_ms)));
  return std::make_shared<CudaRing>(comm, kGpuStagingBytes, kCudaMaxQueuedOps, more);
}

// A flat all-reduce of `data` on `ring` (on as many lanes as the ring's pipeline gives it).
std::shared_ptr<CudaWork> allReduce(CudaRing& ring, std::vector<float>& data, cudaStream_t caller) {
  const RingMembers rm = resolveRing({}, ring.size(), ring.rank());
  const int64_t numel = static_cast<int64_t>(data.size());
  const std::vector<RingStage> stages = flatRingStages(
      rm, numel, DType::kFloat32, RedOp::kSum,
      ring.planOptions(RedOp::kSum, false, rm.size(), numel, DType::kFloat32, {}));
  return ring.enqueue(stages, data.data(), nullptr, ringKey({}, ring.size()), "all-reduce", caller, false);
}

// Large enough for two lanes on two ranks (two segments of >= kGpuMinLaneSegmentBytes per chunk and lane).
constexpr int64_t kTwoLaneNumel = (16 << 20) / 4;

// Runs `body(rank, ring)` on one thread per rank of `rings` (linked ranks) and returns each
// rank's error ("" when none).
std::vector<std::string> onRanks(const std::vector<std::shared_ptr<CudaRing>>& rings,
                                 const std::function<void(int, CudaRing&)>& body) {
  std::vector<std::string> errors(rings.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < rings.size(); ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(static_cast<int>(r));
      try {
        body(static_cast<int>(r), *rings[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

// Risks 2 and 3: the setup read from the NCCL version and the environment, as NCCL reads it.
TEST_CASE(setup_follows_the_nccl_version_and_environment) {
  CHECK_EQ(ncclVersionString(22105), std::string("2.21.5"));
  CHECK_EQ(ncclVersionString(23007), std::string("2.30.7"));
  CHECK_EQ(ncclVersionString(2804), std::string("2.8.4"));  // the code before 2.9
  NcclSetup s = setupWith(23007, {});
  CHECK(!s.launcher && s.group_abort && !s.simple && s.warnings.empty());
  s = setupWith(22304, {});
  CHECK(!s.launcher && !s.group_abort && !s.simple);
  s = setupWith(22105, {});
  CHECK(s.launcher && !s.group_abort && s.simple);
  CHECK_MSG(has(s.why_simple, "2.21.5") && has(s.why_simple, "2.23"), s.why_simple);
  std::string msg;
  for (const char* one : {"1", "0x1", "01"}) {
    CHECK(throwsKind([&] { setupWith(23007, {{"NCCL_COMM_BLOCKING", one}}); }, ErrorKind::kValue, &msg));
    CHECK_MSG(has(msg, "NCCL_COMM_BLOCKING") && has(msg, "Unset") && has(msg, "2.30.7"), msg);
  }
  s = setupWith(23007, {{"NCCL_COMM_BLOCKING", "0"}});
  CHECK_MSG(s.simple && has(s.why_simple, "NCCL_COMM_BLOCKING=0"), s.why_simple);
  for (const char* ignored : {"", "2", "-1"}) CHECK(!setupWith(23007, {{"NCCL_COMM_BLOCKING", ignored}}).simple);
  CHECK(setupWith(23007, {{"NCCL_COMM_SPLIT_SHARE_RESOURCES", "0"}}).simple);
  CHECK(setupWith(23007, {{"NCCL_COMM_SPLIT_SHARE_RESOURCES", "2"}}).simple);  // NCCL turns it into 0
  CHECK(!setupWith(23007, {{"NCCL_COMM_SPLIT_SHARE_RESOURCES", "1"}}).simple);
  s = setupWith(23007, {{"NCCL_WORK_ARGS_BYTES", "4096"}, {"NCCL_WORK_FIFO_BYTES", "65536"}});
  CHECK(!s.simple);
  CHECK_EQ(s.warnings.size(), size_t(2));
  CHECK_MSG(has(s.warnings[0], "NCCL_WORK_ARGS_BYTES=4096") && has(s.warnings[0], "abort"), s.warnings[0]);
  CHECK(!setupWith(23007, {{"NCCL_LAUNCH_ORDER_IMPLICIT", "1"}}).simple);  // ordering only: nothing to do
  CHECK(setupWith(23007, {{"RINGREDUCE_NCCL_SIMPLE", "1"}}).simple);
  CHECK(!setupWith(23007, {{"RINGREDUCE_NCCL_SIMPLE", "0"}}).simple);
  CHECK(throwsKind([&] { setupWith(23007, {{"RINGREDUCE_NCCL_SIMPLE", "yes"}}); }, ErrorKind::kValue, &msg));
  CHECK_MSG(has(msg, "RINGREDUCE_NCCL_SIMPLE=yes") && has(msg, "0") && has(msg, "1"), msg);
}

// Risk 2, the fake itself: under NCCL 2.21 a non-blocking group whose peers are connected launches
// inline and returns ncclSuccess - what the code before this guard read as "inside the caller's
// group", refusing every call after the first.
TEST_CASE(fake_nccl_2_21_launches_connected_groups_inline) {
  rrfake::reset();
  rrfake::setNcclVersion(22105);
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  CHECK_EQ(ncclCommInitRankConfig(&comm, 2, id, 0, &config), ncclInProgress);
  cudaStream_t s = newStream();
  std::vector<char> a(16), b(16);
  std::vector<ncclResult_t> ends;
  for (int i = 0; i < 2; ++i) {
    ncclGroupStart();
    ncclSend(a.data(), 16, ncclUint8, 1, comm, s);
    ncclRecv(b.data(), 16, ncclUint8, 1, comm, s);
    ends.push_back(ncclGroupEnd());
  }
  CHECK_EQ(ends[0], ncclInProgress);  // first contact: a helper thread connects
  CHECK_EQ(ends[1], ncclSuccess);     // inline launch, indistinguishable from a nested group end
  int v = 0;
  ncclGetVersion(&v);
  CHECK_EQ(v, 22105);
  ncclCommAbort(comm);
}

// Risk 2: under NCCL 2.21 every call works (the launcher thread makes ncclSuccess mean "launched"),
// on the simplest path; a call inside the caller's own NCCL group runs instead of joining it.
TEST_CASE(nccl_2_21_runs_every_call_on_the_simplest_path) {
  rrfake::reset();
  rrfake::setNcclVersion(22105);
  rrfake::linkRanks();
  std::vector<std::shared_ptr<CudaRing>> rings = {ringOf(2, 0, 3000, true), ringOf(2, 1, 3000, true)};
  for (const auto& ring : rings) {
    CHECK(ring->comm().setup().launcher);
    CHECK(ring->comm().simplePath());
    CHECK_EQ(ring->numLanes(), 1);  // the second lane was dropped
  }
  CHECK_EQ(rrfake::splits(), 0);
  const auto errors = onRanks(rings, [](int rank, CudaRing& ring) {
    cudaStream_t caller = newStream();
    for (int call = 0; call < 3; ++call) {
      std::vector<float> data(4096, 1.0f);
      allReduce(ring, data, caller)->synchronize(ms(5000));
    }
    // Inside the caller's own (empty) NCCL group: the ring's groups come from the launcher thread.
    if (rank == 0) ncclGroupStart();
    std::vector<float> data(4096, 1.0f);
    allReduce(ring, data, caller)->synchronize(ms(5000));
    if (rank == 0) CHECK_EQ(ncclGroupEnd(), ncclSuccess);
  });
  for (const std::string& e : errors) CHECK_MSG(e.empty(), e);
  CHECK_EQ(rrfake::queuedGroups(), 0);  // no blocking child: every exchange was a hand-off
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
  for (const auto& ring : rings) ring->shutdown("test");
}

// Risk 3: NCCL_COMM_BLOCKING=1 is refused before any NCCL communicator exists; the overrides that
// break the child lead to the simplest path (no split).
TEST_CASE(environment_overrides_are_refused_or_take_the_simplest_path) {
  rrfake::reset();
  std::string msg;
  {
    ScopedEnv env("NCCL_COMM_BLOCKING", "1");
    CHECK(throwsKind([&] { NcclComm c(kUid, 2, 0, 0, ms(1000), "fake"); }, ErrorKind::kValue, &msg));
    CHECK_MSG(has(msg, "NCCL_COMM_BLOCKING"), msg);
    CHECK_EQ(rrfake::hostWaits(), 0);  // no ncclCommInitRankConfig
  }
  for (const char* var : {"NCCL_COMM_BLOCKING", "NCCL_COMM_SPLIT_SHARE_RESOURCES"}) {
    ScopedEnv env(var, "0");
    rrfake::reset();
    NcclComm c(kUid, 2, 0, 0, ms(1000), "fake");
    CHECK_MSG(c.simplePath() && has(c.setup().why_simple, var), c.setup().why_simple);
    CHECK_EQ(rrfake::splits(), 0);
  }
  rrfake::reset();
  NcclComm full(kUid, 2, 0, 0, ms(1000), "fake");
  CHECK(!full.simplePath());
  CHECK_EQ(rrfake::splits(), 1);
}

// Issue 30's fallback for a split child that fails on real NCCL: the error says what to set, and
// with it set no split is made.
TEST_CASE(a_failed_split_names_the_simplest_path) {
  rrfake::reset();
  rrfake::failSplits(true);
  std::string msg;
  CHECK(throwsKind([&] { NcclComm c(kUid, 2, 0, 0, ms(1000), "fake"); }, ErrorKind::kBackend, &msg));
  CHECK_MSG(has(msg, "ncclCommSplit") && has(msg, "RINGREDUCE_NCCL_SIMPLE=1 on every rank") && has(msg, "NCCL 2."),
            msg);
  CHECK_EQ(rrfake::abortCalls(), 1);  // the parent
  ScopedEnv env("RINGREDUCE_NCCL_SIMPLE", "1");
  NcclComm c(kUid, 2, 0, 0, ms(1000), "fake");
  CHECK(c.simplePath());
  CHECK_EQ(rrfake::splits(), 0);
}

// Issue 30's fallback: RINGREDUCE_NCCL_SIMPLE=1 runs one lane, no one-shot, no child; small and
// large all-reduces still move every byte.
TEST_CASE(the_simplest_path_runs_one_lane_without_one_shot_or_child) {
  ScopedEnv env("RINGREDUCE_NCCL_SIMPLE", "1");
  rrfake::reset();
  rrfake::linkRanks();
  std::vector<std::shared_ptr<CudaRing>> rings = {ringOf(2, 0, 5000, true), ringOf(2, 1, 5000, true)};
  CHECK_EQ(rrfake::splits(), 0);
  CHECK_EQ(rrfake::abortCalls(), 2);  // each rank's idle second lane
  std::vector<int64_t> small_hand_offs(2, -1);
  for (const auto& ring : rings) CHECK_EQ(ring->numLanes(), 1);
  const auto errors = onRanks(rings, [&small_hand_offs](int rank, CudaRing& ring) {
    for (const int64_t numel : {int64_t(64), kTwoLaneNumel}) {
      std::vector<float> data(static_cast<size_t>(numel), 1.0f);
      CudaCallBuffers buf;
      buf.data = [&](DType, int) { return static_cast<void*>(data.data()); };
      CudaCallRequest req;
      req.options.check = false;  // CallOptions checks by default; these calls opt in
      req.numel = numel;
      req.shape = {numel};
      req.caller = newStream();
      const int64_t before = ring.handOffs();
      runCudaCall(ring, req, buf)->synchronize(ms(10000));
      if (numel == 64) small_hand_offs[static_cast<size_t>(rank)] = ring.handOffs() - before;
    }
  });
  for (const std::string& e : errors) CHECK_MSG(e.empty(), e);
  // 64 floats on 2 ranks would be one one-shot hand-off; the ring hands off each of its exchanges.
  for (const int64_t h : small_hand_offs) CHECK_MSG(h >= 2, h << " hand-offs");
  CHECK_EQ(rrfake::queuedGroups(), 0);
  CHECK_EQ(rrfake::messagesLeft(), 0);
  CHECK_EQ(rrfake::sizeMismatches(), 0);
  for (const auto& ring : rings) ring->shutdown("test");
}

// Risk 1: with two calls queued on two lanes and a silent peer, stopping lane 0 alone waits for
// lane 1's kernel (the fake counts the hang); the ring stops both at once and nothing waits.
TEST_CASE(stopping_two_lanes_at_once_never_waits_for_a_lane) {
  for (const int version : {23007, 22304}) {  // grouped abort (>= 2.24), one thread per lane (older)
    for (const bool old_order : {true, false}) {
      rrfake::reset();
      rrfake::setNcclVersion(version);
      auto lane0 = std::make_shared<NcclComm>(kUid, 2, 0, 0, ms(60000), "fake", ms(5000));
      auto lane1 = std::make_shared<NcclComm>(kLaneUid, 2, 0, 0, ms(60000), "fake lane 1", ms(5000));
      auto ring = std::make_shared<CudaRing>(lane0, kGpuStagingBytes, kCudaMaxQueuedOps,
                                             std::vector<std::shared_ptr<NcclComm>>{lane1});
      CHECK_EQ(ring->planOptions(RedOp::kSum, false, 2, kTwoLaneNumel, DType::kFloat32, {}).lanes, 2);
      rrfake::setExchangeBudget(0);  // the peer never answers
      rrfake::setAbortWaitsForKernels(true);
      cudaStream_t caller = newStream();
      std::vector<float> a(static_cast<size_t>(kTwoLaneNumel), 1.0f), b(a);
      auto first = allReduce(*ring, a, caller);
      auto second = allReduce(*ring, b, caller);
      if (old_order) {  // the order before this guard: lane 0 stopped, then lane 1
        NcclComm::abortTogether({lane0.get()}, "test");
        NcclComm::abortTogether({lane1.get()}, "test");
        CHECK_MSG(rrfake::abortHangs() >= 1, "NCCL " << version << ": the old order did not wait");
      } else {
        ring->shutdown("test");
        CHECK_MSG(rrfake::abortHangs() == 0, "NCCL " << version << ": " << rrfake::abortHangs() << " waits");
        CHECK_EQ(rrfake::groupedAborts(), version >= 22400 ? 4 : 0);  // 2 parents + 2 children in one group
      }
      CHECK(throwsKind([&] { second->synchronize(ms(3000)); }, ErrorKind::kBackend));
      rrfake::setAbortWaitsForKernels(false);
      ring->shutdown("test");
    }
  }
}

// Risk 1, the watchdog's way: a call times out on a ring of two lanes with a second call queued;
// the watchdog stops both lanes at once, so the waiter gets DistBackendError, not a hang.
TEST_CASE(a_timeout_on_two_lanes_raises_instead_of_hanging) {
  rrfake::reset();
  auto ring = ringOf(2, 0, 300, true);
  CHECK_EQ(ring->numLanes(), 2);
  rrfake::setExchangeBudget(0);
  rrfake::setAbortWaitsForKernels(true);
  cudaStream_t caller = newStream();
  std::vector<float> a(static_cast<size_t>(kTwoLaneNumel), 1.0f), b(a);
  auto first = allReduce(*ring, a, caller);
  auto second = allReduce(*ring, b, caller);
  std::string msg;
  CHECK(throwsKind([&] { second->synchronize(ms(5000)); }, ErrorKind::kBackend, &msg));
  CHECK_MSG(has(msg, "did not finish within"), msg);
  CHECK(first->failed());
  ring->shutdown("test");  // joins the watchdog: its stop of the lanes is over
  CHECK_EQ(rrfake::abortHangs(), 0);
  rrfake::setAbortWaitsForKernels(false);
}

// Note [Stopping every lane at once]: an abort one lane decides alone (here: a hand-off's deadline
// on lane 1) only marks it; the ring stops every lane together when the error reaches it.
TEST_CASE(a_lane_s_own_abort_waits_for_its_ring) {
  rrfake::reset();
  auto ring = ringOf(2, 0, 200, true, 200);
  rrfake::setDefaultHandoffMs(-1);  // no hand-off ever reaches the GPU
  cudaStream_t caller = newStream();
  std::vector<float> a(static_cast<size_t>(kTwoLaneNumel), 1.0f);
  std::string msg;
  CHECK(throwsKind([&] { allReduce(*ring, a, caller); }, ErrorKind::kBackend, &msg));
  CHECK_MSG(has(msg, "did not complete within"), msg);
  CHECK(ring->aborted());
  // Both lanes' parents and children, stopped in one group by the ring (NCCL >= 2.24 here).
  CHECK_EQ(rrfake::abortCalls(), 4);
  CHECK_EQ(rrfake::groupedAborts(), 4);
  ring->shutdown("test");
}

TEST_MAIN()
