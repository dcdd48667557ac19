// The GPU ring executor (csrc/cuda/ring_executor.cpp) on simulated CUDA streams (sim_device.h), as a
// ctest: whole all-reduces with exact data, the ring halves (reduce-scatter only, all-gather
// only), a larger AVG divisor, rings over rank lists of one communicator (the NCCL peers must be
// the mapped ranks) and the hierarchical all-reduce's three stages, and deliberately broken driver
// decisions that the simulator must catch. The Python suite (tests/test_cuda_logic.py) runs the
// full dtype sweep.
#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "../../../csrc/core/plan.h"
#include "../../../csrc/cuda/ring_executor.h"
#include "../../../csrc/core/error.h"
#include "../check.h"
#include "sim_device.h"

namespace {

using rr::sim::Fault;

struct Run {
  std::string failure;
  std::vector<std::vector<std::vector<float>>> out;  // [call][rank][i]
};

float input(int call, int rank, int64_t i) { return static_cast<float>((i * 7 + rank * 5 + call) % 17) - 6; }

Run run(int n, int64_t numel, rr::RedOp op, int64_t seg, int slots, int ncalls, unsigned async_mask, uint64_t seed,
        Fault fault, bool gather_into_data) {
  Run res;
  const size_t slot_bytes = static_cast<size_t>(std::max<int64_t>(256, seg * 4));
  rr::sim::SimDevice dev(n, slots, slot_bytes, seed);
  std::vector<std::vector<float>> data(static_cast<size_t>(ncalls * n));
  std::vector<std::vector<float>> in(static_cast<size_t>(ncalls * n));
  std::vector<rr::sim::SimCall> calls(static_cast<size_t>(ncalls * n));
  res.out.assign(static_cast<size_t>(ncalls), std::vector<std::vector<float>>(static_cast<size_t>(n),
                                                                             std::vector<float>(static_cast<size_t>(numel))));
  rr::PlanOptions o = rr::gpuPlanOptions(op, false, seg, slots, static_cast<int64_t>(slot_bytes));
  o.gather_into_data = gather_into_data;
  const size_t bytes = static_cast<size_t>(numel) * 4;
  for (int c = 0; c < ncalls; ++c) {
    for (int r = 0; r < n; ++r) {
      const size_t i = static_cast<size_t>(c * n + r);
      in[i].resize(static_cast<size_t>(numel));
      for (int64_t k = 0; k < numel; ++k) in[i][static_cast<size_t>(k)] = input(c, r, k);
      data[i].assign(static_cast<size_t>(numel), -999.0f);
      float* t = data[i].data();
      const float* src = in[i].data();
      dev.callerOp(r, "producer", {}, {{t, bytes}}, [t, src, bytes] { std::memcpy(t, src, bytes); });
      const rr::Plan plan = rr::buildPlan(n, r, numel, rr::DType::kFloat32, o);
      rr::DeviceBuffers b;
      b.data = t;
      b.slot_bytes = slot_bytes;
      for (auto& s : dev.rank(r).slots) b.slots.push_back(s.data());
      {
        auto be = dev.backend(r, rr::DType::kFloat32, fault, &calls[i]);
        rr::enqueueRingCall(plan, op, b, *be, !((async_mask >> c) & 1u));
      }
      if (!((async_mask >> c) & 1u)) {
        float* dst = res.out[static_cast<size_t>(c)][static_cast<size_t>(r)].data();
        dev.callerOp(r, "consumer", {{t, bytes}}, {}, [t, dst, bytes] { std::memcpy(dst, t, bytes); });
      }
    }
  }
  for (int c = 0; c < ncalls; ++c) {
    if (!((async_mask >> c) & 1u)) continue;
    for (int r = 0; r < n; ++r) {
      const size_t i = static_cast<size_t>(c * n + r);
      float* t = data[i].data();
      float* dst = res.out[static_cast<size_t>(c)][static_cast<size_t>(r)].data();
      dev.callerWait(r, calls[i]);
      dev.callerOp(r, "consumer", {{t, bytes}}, {}, [t, dst, bytes] { std::memcpy(dst, t, bytes); });
    }
  }
  res.failure = dev.run();
  return res;
}

bool correct(const Run& res, int n, rr::RedOp op) {
  for (size_t c = 0; c < res.out.size(); ++c)
    for (const auto& rank_out : res.out[c])
      for (size_t k = 0; k < rank_out.size(); ++k) {
        float s = 0;
        for (int r = 0; r < n; ++r) s += input(static_cast<int>(c), r, static_cast<int64_t>(k));
        if (op == rr::RedOp::kAvg) s = s / static_cast<float>(n);
        if (rank_out[k] != s) return false;
      }
  return true;
}

}  // namespace

TEST_CASE(driver_exact_sum_and_avg) {
  for (int n = 2; n <= 5; ++n)
    for (int64_t numel : {int64_t{1}, int64_t{n - 1}, int64_t{n + 1}, int64_t{97}, int64_t{1003}})
      for (rr::RedOp op : {rr::RedOp::kSum, rr::RedOp::kAvg})
        for (bool gather : {true, false}) {
          if (numel <= 0) continue;
          const Run res = run(n, numel, op, 32, 1 + static_cast<int>(numel % 4), 2, 0b10, 17 * n + numel, Fault::kNone,
                              gather);
          CHECK_MSG(res.failure.empty(), "n=" << n << " numel=" << numel << ": " << res.failure);
          CHECK_MSG(correct(res, n, op), "n=" << n << " numel=" << numel << " wrong result");
        }
}

TEST_CASE(driver_random_schedules) {
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const Run res = run(3, 257, rr::RedOp::kSum, 16, 2, 3, 0b101, seed, Fault::kNone, seed % 2 == 0);
    CHECK_MSG(res.failure.empty(), "seed " << seed << ": " << res.failure);
    CHECK(correct(res, 3, rr::RedOp::kSum));
  }
}

TEST_CASE(simulator_catches_broken_driver) {
  for (Fault f : {Fault::kSkipPrevCallWait, Fault::kSkipCallerStart, Fault::kDropFirstPlanWait, Fault::kShiftReduce,
                  Fault::kSkipCallerDone}) {
    for (uint64_t seed = 0; seed < 4; ++seed) {
      const bool prev = f == Fault::kSkipPrevCallWait;
      // the previous-call wait matters for plans that read staging in the all-gather
      const Run res = run(3, 97, rr::RedOp::kSum, 16, 2, 2, prev ? 0b11u : 0u, seed, f, !prev);
      CHECK_MSG(!res.failure.empty() || !correct(res, 3, rr::RedOp::kSum),
                "fault " << static_cast<int>(f) << " seed " << seed << " went unnoticed");
    }
  }
}

namespace {

// ---- stages over rank lists of one communicator ------------------------------------------------

// Which collective a ring runs (the stage builders of ring_executor.h).
enum class Mode { kFlat, kReduceScatter, kAllGather, kHierarchical };

struct RingsRun {
  std::string failure;
  std::vector<std::vector<float>> out;  // [communicator rank][i] (idle ranks: empty)
  std::vector<std::vector<rr::sim::SimDevice::PeerUse>> peers;
  std::vector<int> hand_offs;  // per communicator rank, over all calls
};

// Input of ring index `index` of ring `ring` in call `call`.
float ringInput(int call, int ring, int index, int64_t i) {
  return static_cast<float>((i * 7 + index * 5 + ring * 3 + call) % 17) - 6;
}

// `rings`: disjoint rank lists of a communicator of `comm_size` ranks, all run concurrently, each
// `ncalls` synchronous calls. For kAllGather every rank's tensor holds its own block and garbage.
RingsRun runRings(int comm_size, const std::vector<std::vector<int>>& rings, Mode mode, int local_size, int64_t numel,
                  rr::RedOp op, int avg_divisor, int64_t seg, int slots, int ncalls, uint64_t seed, Fault fault,
                  int lanes = 1) {
  RingsRun res;
  const size_t slot_bytes = static_cast<size_t>(std::max<int64_t>(256, seg * 4));
  rr::sim::SimDevice dev(comm_size, slots * lanes, slot_bytes, seed);
  rr::PlanOptions base = rr::gpuPlanOptions(op, false, seg, slots, static_cast<int64_t>(slot_bytes));
  base.avg_divisor = avg_divisor;
  base.lanes = lanes;
  const size_t bytes = static_cast<size_t>(numel) * 4;
  std::vector<std::vector<float>> tensors(static_cast<size_t>(comm_size)), inputs, outputs;
  std::vector<rr::sim::SimCall> calls(static_cast<size_t>(ncalls * comm_size));
  res.out.assign(static_cast<size_t>(comm_size), {});
  inputs.reserve(static_cast<size_t>(ncalls * comm_size));
  outputs.assign(static_cast<size_t>(ncalls * comm_size), std::vector<float>(static_cast<size_t>(numel)));
  for (int c = 0; c < ncalls; ++c) {
    for (size_t k = 0; k < rings.size(); ++k) {
      const int m = static_cast<int>(rings[k].size());
      for (int idx = 0; idx < m; ++idx) {
        const int r = rings[k][static_cast<size_t>(idx)];
        const rr::RingMembers ring = rr::resolveRing(rings[k], comm_size, r);
        std::vector<rr::RingStage> stages;
        switch (mode) {
          case Mode::kFlat: stages = rr::flatRingStages(ring, numel, rr::DType::kFloat32, op, base); break;
          case Mode::kReduceScatter:
            stages = rr::ringHalfStages(ring, numel, rr::DType::kFloat32, op, base, rr::kPhaseReduceScatter);
            break;
          case Mode::kAllGather:
            stages = rr::ringHalfStages(ring, numel, rr::DType::kFloat32, op, base, rr::kPhaseAllGather);
            break;
          case Mode::kHierarchical:
            stages = rr::hierarchicalStages(ring, local_size, numel, rr::DType::kFloat32, op, base);
            break;
        }
        std::vector<float> in(static_cast<size_t>(numel));
        const int64_t blk = numel / m;
        for (int64_t i = 0; i < numel; ++i) {
          const bool garbage = mode == Mode::kAllGather && (i < idx * blk || i >= (idx + 1) * blk);
          in[static_cast<size_t>(i)] = garbage ? -777.0f : ringInput(c, static_cast<int>(k), idx, i);
        }
        inputs.push_back(std::move(in));
        std::vector<float>& t = tensors[static_cast<size_t>(r)];
        t.assign(static_cast<size_t>(numel), -999.0f);
        const size_t slot = static_cast<size_t>(c * comm_size + r);
        rr::sim::enqueueSyncCall(dev, r, rr::DType::kFloat32, stages, t.data(), bytes, inputs.back().data(),
                                 outputs[slot].data(), nullptr, fault, &calls[slot]);
      }
    }
  }
  res.failure = dev.run();
  for (int r = 0; r < comm_size; ++r) {
    res.peers.push_back(dev.peersUsed(r));
    res.hand_offs.push_back(dev.handOffs(r));
    bool member = false;
    for (const auto& ring : rings) member = member || std::find(ring.begin(), ring.end(), r) != ring.end();
    if (member) res.out[static_cast<size_t>(r)] = outputs[static_cast<size_t>((ncalls - 1) * comm_size + r)];
  }
  return res;
}

// Checks the last call's results of every ring; "" or what is wrong.
std::string checkRings(const RingsRun& res, const std::vector<std::vector<int>>& rings, Mode mode, int64_t numel,
                       rr::RedOp op, int avg_divisor, int ncalls) {
  const int c = ncalls - 1;
  for (size_t k = 0; k < rings.size(); ++k) {
    const int m = static_cast<int>(rings[k].size());
    const int64_t blk = numel / m;
    for (int idx = 0; idx < m; ++idx) {
      const std::vector<float>& got = res.out[static_cast<size_t>(rings[k][static_cast<size_t>(idx)])];
      for (int64_t i = 0; i < numel; ++i) {
        if (mode == Mode::kReduceScatter && (i < idx * blk || i >= (idx + 1) * blk)) continue;  // partials
        float want = 0;
        if (mode == Mode::kAllGather) {
          want = ringInput(c, static_cast<int>(k), static_cast<int>(i / blk), i);
        } else {
          for (int j = 0; j < m; ++j) {
            const float v = ringInput(c, static_cast<int>(k), j, i);
            want = j == 0 ? v : op == rr::RedOp::kMax ? std::max(want, v) : want + v;
          }
          if (op == rr::RedOp::kAvg) want = want / static_cast<float>(avg_divisor > 0 ? avg_divisor : m);
        }
        if (got[static_cast<size_t>(i)] != want) {
          return "ring " + std::to_string(k) + " index " + std::to_string(idx) + " element " + std::to_string(i) +
                 ": got " + std::to_string(got[static_cast<size_t>(i)]) + ", want " + std::to_string(want);
        }
      }
    }
  }
  return "";
}

// Every exchange of ring index idx must name its ring neighbours as communicator ranks; `extra`
// adds the neighbours of further rings the rank runs (the hierarchical stages).
std::string checkPeers(const RingsRun& res, int r, const std::set<int>& sends, const std::set<int>& recvs) {
  if (res.peers[static_cast<size_t>(r)].empty()) return "rank " + std::to_string(r) + " exchanged nothing";
  for (const auto& p : res.peers[static_cast<size_t>(r)]) {
    if (p.send_peer >= 0 && !sends.count(p.send_peer))
      return "rank " + std::to_string(r) + " sent to " + std::to_string(p.send_peer);
    if (p.recv_peer >= 0 && !recvs.count(p.recv_peer))
      return "rank " + std::to_string(r) + " received from " + std::to_string(p.recv_peer);
  }
  return "";
}

std::vector<std::vector<int>> identityRing(int n) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(i);
  return {v};
}

}  // namespace

TEST_CASE(driver_reduce_scatter_and_all_gather_only) {
  for (int n = 2; n <= 5; ++n)
    for (int64_t blk : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{40}})
      for (Mode mode : {Mode::kReduceScatter, Mode::kAllGather})
        for (rr::RedOp op : {rr::RedOp::kSum, rr::RedOp::kAvg}) {
          if (mode == Mode::kAllGather && op == rr::RedOp::kAvg) continue;
          const auto rings = identityRing(n);
          const RingsRun res = runRings(n, rings, mode, 0, n * blk, op, 0, 16, 2, 2, 31 * n + blk, Fault::kNone);
          CHECK_MSG(res.failure.empty(), "n=" << n << " blk=" << blk << ": " << res.failure);
          const std::string bad = checkRings(res, rings, mode, n * blk, op, 0, 2);
          CHECK_MSG(bad.empty(), "n=" << n << " blk=" << blk << " mode " << static_cast<int>(mode) << ": " << bad);
        }
}

TEST_CASE(driver_avg_divisor) {
  for (int n = 2; n <= 4; ++n)
    for (int64_t numel : {int64_t{1}, int64_t{n + 1}, int64_t{203}}) {
      const auto rings = identityRing(n);
      const RingsRun res = runRings(n, rings, Mode::kFlat, 0, numel, rr::RedOp::kAvg, 3 * n + 1, 16, 3, 1, numel,
                                    Fault::kNone);
      CHECK_MSG(res.failure.empty(), res.failure);
      const std::string bad = checkRings(res, rings, Mode::kFlat, numel, rr::RedOp::kAvg, 3 * n + 1, 1);
      CHECK_MSG(bad.empty(), "n=" << n << " numel=" << numel << ": " << bad);
    }
}

TEST_CASE(driver_rank_mapped_rings_use_mapped_peers) {
  // Two rings side by side on one communicator of 7 ranks, in scrambled order.
  const std::vector<std::vector<int>> rings = {{4, 1, 6}, {0, 5, 2, 3}};
  for (Mode mode : {Mode::kFlat, Mode::kReduceScatter, Mode::kAllGather})
    for (uint64_t seed = 0; seed < 6; ++seed) {
      const int64_t numel = 12 * (1 + static_cast<int64_t>(seed % 3));  // a multiple of both ring sizes
      const RingsRun res = runRings(7, rings, mode, 0, numel, rr::RedOp::kSum, 0, 16, 2, 2, seed, Fault::kNone);
      CHECK_MSG(res.failure.empty(), "seed " << seed << ": " << res.failure);
      const std::string bad = checkRings(res, rings, mode, numel, rr::RedOp::kSum, 0, 2);
      CHECK_MSG(bad.empty(), "seed " << seed << ": " << bad);
      for (const auto& ring : rings) {
        const int m = static_cast<int>(ring.size());
        for (int i = 0; i < m; ++i) {
          const std::string p = checkPeers(res, ring[static_cast<size_t>(i)], {ring[static_cast<size_t>((i + 1) % m)]},
                                           {ring[static_cast<size_t>((i + m - 1) % m)]});
          CHECK_MSG(p.empty(), "mode " << static_cast<int>(mode) << ": " << p);
        }
      }
    }
  // A driver that ignored the members (peers r +- 1 of the communicator) must not pass.
  for (uint64_t seed = 0; seed < 4; ++seed) {
    RingsRun res;
    try {
      res = runRings(7, rings, Mode::kFlat, 0, 24, rr::RedOp::kSum, 0, 16, 2, 1, seed, Fault::kUnmappedPeers);
    } catch (const std::exception& e) {
      res.failure = e.what();
    }
    CHECK_MSG(!res.failure.empty() || !checkRings(res, rings, Mode::kFlat, 24, rr::RedOp::kSum, 0, 1).empty(),
              "unmapped peers went unnoticed (seed " << seed << ")");
  }
}

TEST_CASE(driver_hierarchical_stages) {
  // Node-ordered members (node k: members[k*L .. k*L+L-1]) in a scrambled communicator order.
  const std::vector<int> members = {3, 0, 5, 1, 4, 2};
  for (int L : {2, 3})
    for (int64_t numel : {int64_t{1}, int64_t{5}, int64_t{97}, int64_t{1003}})
      for (rr::RedOp op : {rr::RedOp::kSum, rr::RedOp::kAvg, rr::RedOp::kMax}) {
        const std::vector<std::vector<int>> rings = {members};
        const RingsRun res =
            runRings(6, rings, Mode::kHierarchical, L, numel, op, 0, 32, 2, 2, 7 * L + numel, Fault::kNone);
        CHECK_MSG(res.failure.empty(), "L=" << L << " numel=" << numel << ": " << res.failure);
        const std::string bad = checkRings(res, rings, Mode::kHierarchical, numel, op, 0, 2);
        CHECK_MSG(bad.empty(), "L=" << L << " numel=" << numel << " op " << static_cast<int>(op) << ": " << bad);
        const int n = 6, M = n / L;
        for (int i = 0; i < n; ++i) {
          const int node = i / L, local = i % L;
          auto at = [&](int j) { return members[static_cast<size_t>(j)]; };
          const std::set<int> sends = {at(node * L + (local + 1) % L), at(((node + 1) % M) * L + local)};
          const std::set<int> recvs = {at(node * L + (local + L - 1) % L), at(((node + M - 1) % M) * L + local)};
          if (numel < n) continue;  // tiny tensors leave some rings without elements
          const std::string p = checkPeers(res, at(i), sends, recvs);
          CHECK_MSG(p.empty(), "L=" << L << " numel=" << numel << ": " << p);
        }
      }
  // Without the wait between stages the next stage's sends race the previous stage's reduces.
  int caught = 0;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const std::vector<std::vector<int>> rings = {members};
    const RingsRun res = runRings(6, rings, Mode::kHierarchical, 2, 97, rr::RedOp::kSum, 0, 32, 2, 1, seed,
                                  Fault::kSkipStageWait);
    caught += !res.failure.empty() || !checkRings(res, rings, Mode::kHierarchical, 97, rr::RedOp::kSum, 0, 1).empty();
  }
  CHECK_MSG(caught == 4, "a missing stage wait went unnoticed in " << 4 - caught << " of 4 schedules");
}

// Note [Which exchanges hand off]: one hand-off per stage of a call when every chunk has elements
// (the host waits once per stage, whatever the tensor's size), every exchange when some chunk is
// empty; both ends of every message agree (the simulator matches messages per communicator and
// fails a queued exchange that reaches a peer first), and a rank that launches one exchange on the
// other communicator is caught.
TEST_CASE(hand_offs_once_per_stage_and_agreed_by_both_ends) {
  const std::vector<int> members = {3, 0, 5, 1, 4, 2};
  struct Shape {
    Mode mode;
    int local;
    int64_t numel;
  };
  for (const Shape& sh : {Shape{Mode::kFlat, 0, 1003}, Shape{Mode::kFlat, 0, 5}, Shape{Mode::kReduceScatter, 0, 96},
                          Shape{Mode::kAllGather, 0, 96}, Shape{Mode::kHierarchical, 2, 1003},
                          Shape{Mode::kHierarchical, 3, 97}})
    for (uint64_t seed = 0; seed < 3; ++seed) {
      const std::vector<std::vector<int>> rings = {members};
      const RingsRun res = runRings(6, rings, sh.mode, sh.local, sh.numel, rr::RedOp::kSum, 0, 32, 2, 2, seed,
                                    Fault::kNone);
      CHECK_MSG(res.failure.empty(), "mode " << static_cast<int>(sh.mode) << " numel " << sh.numel << ": "
                                             << res.failure);
      CHECK(checkRings(res, rings, sh.mode, sh.numel, rr::RedOp::kSum, 0, 2).empty());
      for (int r = 0; r < 6; ++r) {
        const rr::RingMembers ring = rr::resolveRing(members, 6, r);
        std::vector<rr::RingStage> stages;
        const rr::PlanOptions base = rr::gpuPlanOptions(rr::RedOp::kSum, false, 32, 2, 256);
        switch (sh.mode) {
          case Mode::kFlat:
            stages = rr::flatRingStages(ring, sh.numel, rr::DType::kFloat32, rr::RedOp::kSum, base);
            break;
          case Mode::kReduceScatter:
            stages = rr::ringHalfStages(ring, sh.numel, rr::DType::kFloat32, rr::RedOp::kSum, base,
                                        rr::kPhaseReduceScatter);
            break;
          case Mode::kAllGather:
            stages = rr::ringHalfStages(ring, sh.numel, rr::DType::kFloat32, rr::RedOp::kSum, base,
                                        rr::kPhaseAllGather);
            break;
          case Mode::kHierarchical:
            stages = rr::hierarchicalStages(ring, sh.local, sh.numel, rr::DType::kFloat32, rr::RedOp::kSum, base);
            break;
        }
        int want = 0;  // per call
        for (const rr::RingStage& st : stages) {
          int issued = 0;
          for (const rr::Op& o : st.plan.ops) issued += o.kind == rr::OpKind::kExchange ? 1 : 0;
          want += rr::handsOffEveryExchange(st.plan) ? issued : (issued > 0 ? 1 : 0);
        }
        CHECK_MSG(res.hand_offs[static_cast<size_t>(r)] == 2 * want,
                  "mode " << static_cast<int>(sh.mode) << " numel " << sh.numel << " rank " << r << ": "
                          << res.hand_offs[static_cast<size_t>(r)] << " hand-offs in 2 calls, want " << 2 * want);
      }
    }
  // 1003 elements on 6 ranks fill every chunk: a flat call hands off once, the hierarchical one
  // once per stage.
  CHECK(!rr::handsOffEveryExchange(rr::buildPlan(6, 0, 1003, rr::DType::kFloat32,
                                                 rr::gpuPlanOptions(rr::RedOp::kSum, false, 32, 2, 256))));
  CHECK(rr::handsOffEveryExchange(rr::buildPlan(6, 0, 5, rr::DType::kFloat32,
                                                rr::gpuPlanOptions(rr::RedOp::kSum, false, 32, 2, 256))));
  int caught = 0;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const Run res = run(3, 257, rr::RedOp::kSum, 16, 2, 1, 0, seed, Fault::kWrongLaunch, true);
    caught += !res.failure.empty() || !correct(res, 3, rr::RedOp::kSum);
  }
  CHECK_MSG(caught == 4, "an exchange launched on the other communicator went unnoticed in " << 4 - caught << " of 4");
}

// Note [Lanes]: 2-4 lanes, each on its own simulated streams and communicator, for the flat ring and
// both halves over a scrambled rank list: exact results, one hand-off per lane and call (each lane's
// first exchange), and a driver that does not join the lanes before the call's end is caught.
TEST_CASE(lanes_run_side_by_side) {
  const std::vector<std::vector<int>> rings = {{2, 0, 3, 1}};
  for (int lanes : {2, 3, 4})
    for (Mode mode : {Mode::kFlat, Mode::kReduceScatter, Mode::kAllGather})
      for (uint64_t seed = 0; seed < 3; ++seed) {
        const int64_t numel = 4 * 257;
        const RingsRun res =
            runRings(4, rings, mode, 0, numel, rr::RedOp::kSum, 0, 32, 2, 2, seed, Fault::kNone, lanes);
        CHECK_MSG(res.failure.empty(), lanes << " lanes, mode " << static_cast<int>(mode) << ": " << res.failure);
        const std::string bad = checkRings(res, rings, mode, numel, rr::RedOp::kSum, 0, 2);
        CHECK_MSG(bad.empty(), lanes << " lanes, mode " << static_cast<int>(mode) << ": " << bad);
        for (int r = 0; r < 4; ++r) CHECK_EQ(res.hand_offs[static_cast<size_t>(r)], 2 * lanes);
      }
  int caught = 0;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const RingsRun res = runRings(4, rings, Mode::kFlat, 0, 4 * 257, rr::RedOp::kSum, 0, 32, 2, 1, seed,
                                  Fault::kSkipLaneJoin, 2);
    caught += !res.failure.empty() || !checkRings(res, rings, Mode::kFlat, 4 * 257, rr::RedOp::kSum, 0, 1).empty();
  }
  CHECK_MSG(caught == 4, "a missing lane join went unnoticed in " << 4 - caught << " of 4 schedules");
}

// Note [GPU pipeline rule]: a slot must hold a segment of the plan's widest element. A 16-bit wire
// plan's reduce-scatter receives 16-bit partials but its all-gather float32 elements; staging sized
// for the partials alone is refused before anything is enqueued (an internal error), staging of the
// plan's slotBytes() is enqueued (not run: one rank alone). The same for float32 partials of a
// bfloat16 tensor.
TEST_CASE(driver_refuses_slots_narrower_than_the_widest_element) {
  const int n = 3;
  const int64_t numel = 301;
  for (rr::DType dtype : {rr::DType::kFloat32, rr::DType::kBFloat16}) {
    const bool wire = dtype == rr::DType::kFloat32;
    rr::PlanOptions o = rr::gpuPlanOptions(rr::RedOp::kSum, !wire, 64, 2, 256);
    if (wire) o.wire_dtype = rr::DType::kBFloat16;
    const rr::Plan plan = rr::buildPlan(n, 0, numel, dtype, o);
    CHECK_EQ(plan.slotBytes(), plan.slot_elems * 4);  // float32: the all-gather's, or the partials'
    for (size_t slot_bytes : {static_cast<size_t>(plan.slot_elems * 2), static_cast<size_t>(plan.slotBytes())}) {
      rr::sim::SimDevice dev(n, 2, slot_bytes, 1);
      std::vector<float> tensor(static_cast<size_t>(numel), 1.0f), accum(static_cast<size_t>(plan.accum_elems) + 1);
      rr::DeviceBuffers b;
      b.data = tensor.data();
      b.accum = accum.data();
      b.slot_bytes = slot_bytes;
      for (auto& sl : dev.rank(0).slots) b.slots.push_back(sl.data());
      std::string what;
      rr::sim::SimCall call;
      try {
        auto be = dev.backend(0, dtype, Fault::kNone, &call);
        rr::enqueueRingCall(plan, rr::RedOp::kSum, b, *be, true);
      } catch (const rr::Error& e) {
        what = e.what();
      }
      if (slot_bytes < static_cast<size_t>(plan.slotBytes())) {
        CHECK_MSG(what.find("internal error: staging slots of") != std::string::npos, what);
      } else {
        CHECK_MSG(what.empty(), what);
      }
    }
  }
}

TEST_CASE(stage_builders_refuse_bad_rings) {
  auto throws = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const rr::Error& e) {
      return e.kind() == rr::ErrorKind::kValue;
    }
    return false;
  };
  CHECK(throws([] { rr::resolveRing({0, 2}, 4, 1); }));     // not a member
  CHECK(throws([] { rr::resolveRing({0, 0, 1}, 4, 0); }));  // duplicate
  CHECK(throws([] { rr::resolveRing({0, 4}, 4, 0); }));     // out of range
  CHECK(rr::resolveRing({}, 3, 2).index == 2);
  CHECK(rr::resolveRing({5, 2, 7}, 8, 7).index == 2);
  CHECK(rr::ringKey({0, 1, 2}, 3).empty());
  CHECK(rr::ringKey({0, 1}, 3).size() == 2);
  CHECK(rr::ringKey({1, 0, 2}, 3).size() == 3);
  const rr::RingMembers six = rr::resolveRing({}, 6, 0);
  const rr::PlanOptions base = rr::gpuPlanOptions(rr::RedOp::kSum, false, 64, 2, 256);
  CHECK(throws([&] { rr::hierarchicalStages(six, 4, 100, rr::DType::kFloat32, rr::RedOp::kSum, base); }));
  CHECK(rr::hierarchicalStages(six, 6, 100, rr::DType::kFloat32, rr::RedOp::kSum, base).size() == 1);
  CHECK(rr::hierarchicalStages(six, 3, 100, rr::DType::kFloat32, rr::RedOp::kSum, base).size() == 3);
  CHECK(throws([&] { rr::ringHalfStages(six, 100, rr::DType::kFloat32, rr::RedOp::kSum, base, rr::kPhaseAllGather); }));
}

TEST_MAIN()
