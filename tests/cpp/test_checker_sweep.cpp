// The plan checker accepts every plan buildPlan() makes: world sizes 1..16, awkward counts, every
// dtype (float32 partials on half types included), both all-gather destinations, 1..5 staging
// slots and automatic slots, segment caps from 16 bytes to 1 MiB.
#include <vector>

#include "check.h"
#include "core/dtype.h"
#include "core/plan.h"
#include "support/plan_checker.h"

using namespace rr;

namespace {

struct Config {
  DType dtype;
  bool accum;
  int wire = -1;   // a 16-bit wire's DType code (Note [First hop] in plan.h), -1: none
  double pre = 0;  // predivide factor, 0: none
};
constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
constexpr int kF16 = static_cast<int>(DType::kFloat16);

const Config kConfigs[] = {
    {DType::kFloat32, false},  {DType::kFloat64, false},  {DType::kFloat16, false}, {DType::kFloat16, true},
    {DType::kBFloat16, false}, {DType::kBFloat16, true},  {DType::kInt8, false},    {DType::kInt16, false},
    {DType::kInt32, false},    {DType::kInt64, false},    {DType::kUInt8, false},   {DType::kBool, false},
    {DType::kComplex64, false}, {DType::kComplex128, false},
    {DType::kFloat32, false, kBf16}, {DType::kFloat32, false, kF16, 3.0}, {DType::kFloat32, false, -1, 2.0},
    {DType::kFloat16, true, -1, 0.5}, {DType::kFloat64, false, -1, 4.0}, {DType::kComplex64, false, -1, 2.0},
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
const int64_t kSegBytes[] = {16, 32, 48, 64, 256, 4096, 1 << 20};

void expectOk(int n, int64_t numel, const Config& c, int slots, int64_t seg, bool gather, bool avg,
              uint64_t seed, int trials) {
  PlanOptions o;
  o.max_segment_bytes = seg;
  o.num_slots = slots;
  o.accum_float32 = c.accum;
  o.gather_into_data = gather;
  o.average = avg && isFloatingType(c.dtype);
  if (c.wire >= 0) o.wire_dtype = static_cast<DType>(c.wire);
  o.pre_factor = o.post_factor = c.pre;
  const std::string err = checkPlans(n, numel, c.dtype, o, seed, trials);
  CHECK_MSG(err.empty(), err);
}

}  // namespace

TEST_CASE(full_cross_product_small_rings) {
  // Everything against everything for n = 2..4 and a few awkward counts.
  for (int n = 2; n <= (rrtest::kSanitized ? 3 : 4); ++n)
    for (int64_t numel : {int64_t(1), int64_t(n + 1), int64_t(37), int64_t(131)})
      for (int ci = 0; ci < kNumConfigs; ++ci)
        for (int slots = kAutoSlots; slots <= 5; ++slots)  // kAutoSlots: Note [Staging slots]
          for (bool gather : {false, true})
            expectOk(n, numel, kConfigs[ci], slots, slots % 2 ? 16 : 48, gather, true, 11 * n + slots, 1);
}

// For each (n, count), several configurations chosen to rotate through every option.
static void worldSizes(int n_lo, int n_hi) {
  uint64_t seed = static_cast<uint64_t>(n_lo) * 1000;
  for (int n = n_lo; n <= n_hi; ++n) {
    std::vector<int64_t> counts = {0, 1, n > 1 ? n - 1 : 2, n + 1, 7, 61, 257, 1021};
    if (n <= 8) counts.push_back(4099);
    for (int64_t numel : counts) {
      const int k_max = rrtest::kSanitized ? 2 : (n <= 8 ? 6 : 3);
      for (int k = 0; k < k_max; ++k) {
        const Config& c = kConfigs[(k * 5 + n + static_cast<int>(numel)) % kNumConfigs];
        const int slots = (k + n) % 6;  // 0: kAutoSlots
        int64_t seg = kSegBytes[(k * 3 + n) % 7];
        // Keep the number of exchanges modest: tiny segments only for modest counts.
        if (numel * static_cast<int64_t>(dtypeSize(c.dtype)) / seg > 512 * 16) seg = 4096;
        expectOk(n, numel, c, slots, seg, k % 2 == 1, k % 3 != 2, ++seed, 1);
      }
    }
  }
}

TEST_CASE(world_sizes_1_to_8) { worldSizes(1, 8); }
TEST_CASE(world_sizes_9_to_16) { worldSizes(9, 16); }

TEST_CASE(large_counts) {
  // 2**20 + 3 elements: ownership and tails on a big tensor, with large and medium segments.
  const int64_t big = (1 << 20) + 3;
  expectOk(2, big, {DType::kFloat32, false}, 4, 1 << 20, false, true, 3, 1);
  expectOk(3, big, {DType::kBFloat16, true}, 2, 1 << 18, true, true, 4, 1);
  if (rrtest::kSanitized) return;
  expectOk(4, big, {DType::kInt8, false}, 3, 1 << 16, false, false, 5, 1);
  expectOk(5, 100003, {DType::kFloat16, true}, 5, 4096, true, true, 6, 1);
}

TEST_CASE(wire_and_predivide_halves_and_rings) {
  // The reduce-scatter half alone, and a full ring with an extra divisor, with a 16-bit wire.
  for (int n : {2, 3, 5}) {
    for (uint8_t phases : {uint8_t(kPhaseReduceScatter), uint8_t(kPhaseBoth)}) {
      PlanOptions o;
      o.max_segment_bytes = 32;
      o.num_slots = 3;
      o.phases = phases;
      o.average = true;
      o.wire_dtype = DType::kBFloat16;
      o.pre_factor = o.post_factor = 2.0;
      o.extra_divisor = phases == kPhaseBoth ? 4 : 1;
      const std::string err = checkPlans(n, 203, DType::kFloat32, o, 7 + n, 2);
      CHECK_MSG(err.empty(), err);
    }
  }
}

TEST_CASE(many_trials_random_timing) {
  // The same plans under many random completion orders.
  for (int n : {2, 3, 5})
    for (int slots : {1, 2, 4})
      expectOk(n, 1000, {DType::kFloat16, true}, slots, 32, slots == 2, true, 99 + n, 12);
}

TEST_MAIN()
