// The shared-memory transport without torch: segment agreement through a KeyValueStore (ranks as
// threads of one process), segment names and permissions, nothing left in /dev/shm, exact values of
// the all-reduce for several ring sizes and piece counts (full and split pieces), bitwise equality
// across ranks, the frames every rank sees, a silent peer raising kBackend at the timeout, and a dead one (a
// zombie forked for it) before it.
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "cpu/shm_ring.h"
#include "core/schedule.h"
#include "cpu/shm_segment.h"

using namespace rr;

namespace {

// The c10d store's part that agreeOnSegment uses, in memory.
class MemoryStore final : public KeyValueStore {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> g(mu_);
    kv_[key] = value;
  }
  bool tryGet(const std::string& key, std::string* value) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) return false;
    *value = it->second;
    return true;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> g(mu_);
    int64_t v = kv_.count(key) ? std::stoll(kv_[key]) : 0;
    v += delta;
    kv_[key] = std::to_string(v);
    return v;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> kv_;
};

// Entries of /dev/shm whose name starts with "ringreduce-<this pid>-".
std::vector<std::string> ourSegments() {
  std::vector<std::string> out;
  const std::string prefix = "ringreduce-" + std::to_string(getpid()) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) out.emplace_back(e->d_name);
    closedir(d);
  }
  return out;
}

// Every rank's mapping of one agreed segment (rank r's result in out[r]; "" = mapped).
std::vector<std::string> agree(int n, std::vector<ShmMapping>* maps, std::vector<bool> want = {}) {
  MemoryStore store;
  std::vector<std::string> why(static_cast<size_t>(n));
  maps->assign(static_cast<size_t>(n), ShmMapping{});
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      const bool w = want.empty() ? true : want[static_cast<size_t>(r)];
      why[static_cast<size_t>(r)] = agreeOnSegment(store, "ring", r, n, ShmRing::segmentBytes(n), w,
                                                   std::chrono::milliseconds(10000), &(*maps)[static_cast<size_t>(r)]);
    });
  for (auto& t : ts) t.join();
  return why;
}

Frame frameOf(int rank, int64_t numel) {
  Frame f;
  f.kind = static_cast<int32_t>(CallKind::kAllReduce);
  f.rank = rank;
  f.seq = 7;
  f.numel = numel;
  return f;
}

// Rank r, element i: a small integer (exact in float32 sums), position-dependent.
float value(int r, int64_t i) { return static_cast<float>(((i * 7 + r * 13) % 61) - 30 + r); }

// Runs body(ring, r) on n threads, ring rank r each, over the agreed mappings; returns each rank's
// error ("" when none).
std::vector<std::string> onRings(int n, std::vector<ShmMapping>& maps, const std::function<void(ShmRing&, int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        ShmRing ring(maps[static_cast<size_t>(r)], r, n);
        ring.setTimeout(std::chrono::milliseconds(20000));
        body(ring, r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

// n ranks (threads) all-reduce `numel` float32 elements with `op`; checks exact values and that every
// rank ends with the same bits.
void allReduceCase(int n, int64_t numel, RedOp op) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(n, &maps);
  for (int r = 0; r < n; ++r) CHECK_MSG(why[static_cast<size_t>(r)].empty(), why[static_cast<size_t>(r)]);
  if (!why[0].empty()) return;
  std::vector<std::vector<float>> data(static_cast<size_t>(n), std::vector<float>(static_cast<size_t>(numel)));
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < numel; ++i) data[static_cast<size_t>(r)][static_cast<size_t>(i)] = value(r, i);
  std::vector<std::vector<Frame>> seen(static_cast<size_t>(n));
  const std::vector<std::string> errors = onRings(n, maps, [&](ShmRing& ring, int r) {
    float* d = data[static_cast<size_t>(r)].data();
    // Two calls back to back: frame and buffer parities alternate.
    for (int call = 0; call < 2; ++call) {
      if (call == 1)
        for (int64_t i = 0; i < numel; ++i) d[i] = value(r, i);
      seen[static_cast<size_t>(r)] = ring.begin(frameOf(r, numel), d, numel, DType::kFloat32);
      ring.allReduce(d, numel, DType::kFloat32, op, DType::kFloat32, finalScaling(op, n, 1, 0, 0, true));
    }
  });
  for (int r = 0; r < n; ++r) CHECK_MSG(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
  for (int r = 0; r < n; ++r) {
    CHECK_EQ(seen[static_cast<size_t>(r)].size(), static_cast<size_t>(n));
    for (int p = 0; p < n && p < static_cast<int>(seen[static_cast<size_t>(r)].size()); ++p)
      CHECK_EQ(seen[static_cast<size_t>(r)][static_cast<size_t>(p)].rank, p);
  }
  int64_t wrong = 0, differ = 0;
  for (int64_t i = 0; i < numel; ++i) {
    float expect = value(0, i);
    for (int r = 1; r < n; ++r) {
      const float v = value(r, i);
      if (op == RedOp::kSum || op == RedOp::kAvg) expect += v;
      if (op == RedOp::kMax) expect = std::max(expect, v);
    }
    if (op == RedOp::kAvg) expect = expect / static_cast<float>(n);
    if (std::memcmp(&data[0][static_cast<size_t>(i)], &expect, sizeof(float)) != 0) ++wrong;
    for (int r = 1; r < n; ++r)
      if (std::memcmp(&data[0][static_cast<size_t>(i)], &data[static_cast<size_t>(r)][static_cast<size_t>(i)],
                      sizeof(float)) != 0)
        ++differ;
  }
  CHECK_MSG(wrong == 0, wrong << " wrong elements, n=" << n << " numel=" << numel);
  CHECK_MSG(differ == 0, differ << " elements differ across ranks, n=" << n << " numel=" << numel);
  for (auto& m : maps) m.unmap();
}

}  // namespace

TEST_CASE(agreement_maps_and_unlinks) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(3, &maps);
  for (const std::string& w : why) CHECK_MSG(w.empty(), w);
  // Every rank maps the same pages: a byte written by one is read by the others.
  if (why[0].empty()) {
    static_cast<char*>(maps[1].base)[ShmRing::segmentBytes(3) - 1] = 42;
    CHECK_EQ(static_cast<int>(static_cast<char*>(maps[2].base)[ShmRing::segmentBytes(3) - 1]), 42);
  }
  // Unlinked as soon as every rank mapped it: nothing of ours in /dev/shm.
  CHECK(ourSegments().empty());
  for (auto& m : maps) m.unmap();
}

TEST_CASE(segments_are_private_and_named_ringreduce) {
  const std::string name = newSegmentName();
  CHECK(name.rfind("/ringreduce-", 0) == 0);
  ShmMapping m;
  const std::string why = createSegment(name, 4096, &m);
  CHECK_MSG(why.empty(), why);
  struct stat st;
  CHECK(stat(("/dev/shm" + name).c_str(), &st) == 0);
  CHECK_EQ(static_cast<int>(st.st_mode & 0777), 0600);
  unlinkSegment(name);
  m.unmap();
  CHECK(ourSegments().empty());
}

TEST_CASE(one_rank_saying_no_means_no_segment_anywhere) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(3, &maps, {true, false, true});
  for (int r = 0; r < 3; ++r) {
    CHECK_MSG(why[static_cast<size_t>(r)].find("RINGREDUCE_SHM=0 on ring rank 1") != std::string::npos,
              why[static_cast<size_t>(r)]);
    CHECK(maps[static_cast<size_t>(r)].base == nullptr);
  }
  CHECK(ourSegments().empty());
}

TEST_CASE(all_reduce_exact_values) {
  // Counts: fewer than the ranks, uneven, one piece, several pieces (kShmBufferBytes = 1 MiB of
  // float32 = 262144), large pieces split between ranks when n > 2.
  const int64_t counts[] = {1, 5, 1000, 262144, 262144 * 2 + 77};
  for (int n : {2, 3, 4}) {
    for (int64_t numel : counts) {
      if (rrtest::kSanitized && numel > 300000) continue;
      allReduceCase(n, numel, RedOp::kSum);
    }
  }
  allReduceCase(3, 262144 + 5, RedOp::kAvg);
  allReduceCase(5, 333, RedOp::kMax);
}

// Note [Shared-memory 16-bit wire]: the ring in the segment gives allReduce's emulation of the same
// hops bit for bit (random-looking non-integer data, so every 16-bit rounding matters), on every
// rank, over one and several rounds and uneven chunks; two calls back to back alternate parities.
TEST_CASE(sixteen_bit_wire_ring_equals_the_emulation) {
  for (int n : {2, 3, 4}) {
    for (int64_t numel : {int64_t(70000), int64_t(262144 * 2 + 77), int64_t(1 << 20) + 3}) {
      if (rrtest::kSanitized && numel > 300000) continue;
      for (DType wire : {DType::kBFloat16, DType::kFloat16}) {
        const RedOp op = wire == DType::kBFloat16 ? RedOp::kAvg : RedOp::kSum;
        const Scaling final = finalScaling(op, n, 1, wire == DType::kFloat16 ? 3.0 : 0.0,
                                           wire == DType::kFloat16 ? 3.0 : 0.0, true);
        std::vector<ShmMapping> maps;
        const std::vector<std::string> why = agree(n, &maps);
        if (!why[0].empty()) {
          CHECK_MSG(false, why[0]);
          return;
        }
        CHECK(ShmRing::wireRingPays(numel));  // the runtime takes the ring at this size
        auto input = [](int r, int64_t i) { return value(r, i) * 1.0009765625f + 0.0078125f * static_cast<float>(r); };
        std::vector<std::vector<float>> ring(static_cast<size_t>(n)), emulated(static_cast<size_t>(n));
        const std::vector<std::string> errors = onRings(n, maps, [&](ShmRing& sr, int r) {
          for (int call = 0; call < 2; ++call) {
            std::vector<float> d(static_cast<size_t>(numel));
            for (int64_t i = 0; i < numel; ++i) d[static_cast<size_t>(i)] = input(r, i);
            if (call == 0) {
              sr.begin(frameOf(r, numel), nullptr, numel, DType::kFloat32);
              sr.allReduceWire(d.data(), numel, op, wire, final);
              ring[static_cast<size_t>(r)] = d;
            } else {
              sr.begin(frameOf(r, numel), d.data(), numel, DType::kFloat32);
              sr.allReduce(d.data(), numel, DType::kFloat32, op, wire, final);
              emulated[static_cast<size_t>(r)] = d;
            }
          }
        });
        for (int r = 0; r < n; ++r) CHECK_MSG(errors[static_cast<size_t>(r)].empty(), errors[static_cast<size_t>(r)]);
        for (int r = 0; r < n; ++r) {
          CHECK_MSG(std::memcmp(ring[static_cast<size_t>(r)].data(), emulated[0].data(),
                                static_cast<size_t>(numel) * sizeof(float)) == 0,
                    "n=" << n << " numel=" << numel << " " << dtypeName(wire) << ": rank " << r
                         << "'s ring result differs from the emulation");
        }
      }
    }
  }
  CHECK(ourSegments().empty());
}

TEST_CASE(silent_peer_raises_backend_error_at_the_timeout) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(2, &maps);
  CHECK(why[0].empty() && why[1].empty());
  if (!why[0].empty()) return;
  ShmRing ring(maps[0], 0, 2);
  ShmRing silent(maps[1], 1, 2);  // maps the segment (its pid is alive) but never calls
  ring.setTimeout(std::chrono::milliseconds(300));
  std::vector<float> d(16, 1.0f);
  ErrorKind kind = static_cast<ErrorKind>(-1);
  std::string what;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ring.begin(frameOf(0, 16), d.data(), 16, DType::kFloat32);
  } catch (const Error& e) {
    kind = e.kind();
    what = e.what();
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK(kind == ErrorKind::kBackend);
  CHECK_MSG(what.find("never arrived") != std::string::npos, what);
  CHECK_MSG(ms >= 300 && ms < 5000, ms);
  for (auto& m : maps) m.unmap();
}

// A peer that was killed but not reaped yet (its parent waits for another child first) is a zombie,
// which kill(pid, 0) still finds: the wait ends as soon as the liveness poll reads its state, not at
// the timeout.
TEST_CASE(an_unreaped_dead_peer_is_noticed_before_the_timeout) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(2, &maps);
  CHECK(why[0].empty() && why[1].empty());
  if (!why[0].empty()) return;
  const pid_t child = fork();
  if (child == 0) {  // ring rank 1: records its pid in the segment, then dies without leaving
    ShmRing peer(maps[1], 1, 2);
    _exit(0);
  }
  CHECK(child > 0);
  if (child <= 0) return;
  // Until the child has exited (a zombie now: nothing reaps it), rank 1's pid may still be unset.
  for (int i = 0; i < 500; ++i) {
    char path[32];
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(child));
    std::string stat;
    if (FILE* f = std::fopen(path, "r")) {
      char buf[256] = {};
      stat.assign(buf, std::fread(buf, 1, sizeof buf - 1, f));
      std::fclose(f);
    }
    const size_t close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z') break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ShmRing ring(maps[0], 0, 2);
  ring.setTimeout(std::chrono::milliseconds(20000));
  std::vector<float> d(16, 1.0f);
  std::string what;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ring.begin(frameOf(0, 16), d.data(), 16, DType::kFloat32);
  } catch (const Error& e) {
    what = e.what();
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK_MSG(what.find("(pid " + std::to_string(child) + ") exited while") != std::string::npos, what);
  CHECK_MSG(ms < 10000, ms);
  waitpid(child, nullptr, 0);
  for (auto& m : maps) m.unmap();
}

// reduce_scatter then all_gather over the ring halves' schedule (exact blocks, rank r owns block r):
// after reduceScatter rank r's block is the sum of every rank's block r (other blocks untouched);
// after allGather every rank holds every block's sum.
TEST_CASE(ring_halves_exact_values) {
  for (int n : {2, 3, 4}) {
    for (int64_t block : {int64_t{1}, int64_t{7}, int64_t{100000}}) {
      const int64_t numel = block * n;
      std::vector<ShmMapping> maps;
      const std::vector<std::string> why = agree(n, &maps);
      CHECK(why[0].empty());
      if (!why[0].empty()) return;
      const RingSchedule sched = makeRingSchedule(n, numel, 4, 4, 1 << 20, /*exact_chunks=*/true, /*shift=*/-1);
      std::vector<std::vector<float>> data(static_cast<size_t>(n), std::vector<float>(static_cast<size_t>(numel)));
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < numel; ++i) data[static_cast<size_t>(r)][static_cast<size_t>(i)] = value(r, i);
      std::vector<std::vector<float>> after_rs(static_cast<size_t>(n));
      const std::vector<std::string> errors = onRings(n, maps, [&](ShmRing& ring, int r) {
        float* d = data[static_cast<size_t>(r)].data();
        ring.begin(frameOf(r, numel), nullptr, numel, DType::kFloat32);
        ring.reduceScatter(d, DType::kFloat32, RedOp::kSum, sched, Scaling{});
        after_rs[static_cast<size_t>(r)] = data[static_cast<size_t>(r)];
        ring.begin(frameOf(r, numel), nullptr, numel, DType::kFloat32);
        ring.allGather(d, DType::kFloat32, sched);
      });
      for (const std::string& e : errors) CHECK_MSG(e.empty(), e);
      int64_t wrong_rs = 0, wrong_ag = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < numel; ++i) {
          float sum = 0;
          for (int p = 0; p < n; ++p) sum += value(p, i);
          const bool owned = i / block == r;
          if (after_rs[static_cast<size_t>(r)][static_cast<size_t>(i)] != (owned ? sum : value(r, i))) ++wrong_rs;
          if (data[static_cast<size_t>(r)][static_cast<size_t>(i)] != sum) ++wrong_ag;
        }
      }
      CHECK_MSG(wrong_rs == 0 && wrong_ag == 0, "n=" << n << " block=" << block << ": " << wrong_rs
                                                     << " wrong after reduceScatter, " << wrong_ag << " after allGather");
      for (auto& m : maps) m.unmap();
    }
  }
}

// Note [Interrupting a wait]: an abort check that says so ends a barrier with kBackend and its
// reason within kShmAbortPoll, and the peer waiting for this rank raises at its next liveness poll
// (long before its timeout), naming the rank that left.
TEST_CASE(abort_check_ends_a_wait_and_the_peer_follows) {
  std::vector<ShmMapping> maps;
  const std::vector<std::string> why = agree(3, &maps);
  CHECK(why[0].empty());
  if (!why[0].empty()) return;
  std::atomic<bool> stop{false};
  std::vector<std::string> errors(3);
  std::vector<long long> ms(3, -1);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)  // ring rank 2 never calls; ranks 0 and 1 wait for it
    ts.emplace_back([&, r] {
      ShmRing ring(maps[static_cast<size_t>(r)], r, 3);
      ring.setTimeout(std::chrono::milliseconds(30000));
      if (r == 0) ring.setAbortCheck([&] { return stop.load() ? std::string("interrupted by the test") : std::string(); });
      std::vector<float> d(8, 1.0f);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        ring.begin(frameOf(r, 8), d.data(), 8, DType::kFloat32);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.kind() == ErrorKind::kBackend ? e.what() : "wrong kind";
      }
      ms[static_cast<size_t>(r)] =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  stop = true;
  for (auto& t : ts) t.join();
  CHECK_MSG(errors[0].find("interrupted by the test") != std::string::npos, errors[0]);
  CHECK_MSG(errors[1].find("ring rank 0 left the shared-memory ring") != std::string::npos, errors[1]);
  CHECK_MSG(ms[0] < 200 + 1000 && ms[1] < 200 + 2000, ms[0] << " " << ms[1]);
  for (auto& m : maps) m.unmap();
}

// The agreement's store waits ask the abort check too (Ctrl-C during a ring's first call).
TEST_CASE(abort_check_ends_the_agreement) {
  MemoryStore store;
  ShmMapping m;
  std::string what;
  try {
    agreeOnSegment(store, "lonely", 0, 2, ShmRing::segmentBytes(2), true, std::chrono::milliseconds(30000), &m,
                   [] { return std::string("stop now"); });
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK_MSG(what.find("stop now") != std::string::npos, what);
  CHECK(m.base == nullptr);
  CHECK(ourSegments().empty());
}

int main(int argc, char** argv) { return rrtest::runAll(argc, argv); }
