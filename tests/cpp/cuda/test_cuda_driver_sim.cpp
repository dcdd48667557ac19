// The GPU ring driver (csrc/cuda/ring_driver.cpp) on simulated CUDA streams (sim_device.h), as a
// ctest: whole all-reduces with exact data, and deliberately broken driver decisions that the
// simulator must catch. The Python suite (tests/test_cuda_logic.py) runs the full dtype sweep.
#include <cstring>
#include <string>
#include <vector>

#include "../../../csrc/core/plan.h"
#include "../../../csrc/cuda/ring_driver.h"
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
        auto be = dev.backend(r, rr::DType::kFloat32, op, fault, &calls[i]);
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

TEST_MAIN()
