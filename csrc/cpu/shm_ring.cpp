#include "shm_ring.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "../core/collectives.h"
#include "../core/error.h"
#include "../core/schedule.h"
#include "host_reduce.h"

namespace rr {

namespace {

// Whether process `pid` has exited: gone (ESRCH), or a zombie that its parent has not reaped yet (a
// launcher that waits for its children one by one leaves a killed rank so until the rank before it
// ends), which kill(pid, 0) still finds. /proc/<pid>/stat's state, the field after the name's ')',
// is Z (zombie) or X (dead) then.
bool processExited(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  char buf[512];
  const size_t got = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[got] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

// The segment's layout (Note [Shared-memory all-reduce]). Atomics of 4 and 8 bytes are lock-free
// and address-free, so they work across processes that map the same pages.
struct alignas(64) Header {
  std::atomic<uint32_t> bell;      // futex word: bumped by every arrival
  std::atomic<int32_t> sleepers;   // ranks asleep on `bell`
};
struct alignas(64) RankState {
  std::atomic<uint64_t> arrived;   // the last barrier generation this rank reached
  std::atomic<int32_t> pid;
  std::atomic<int32_t> gone;       // 1 once this rank left the ring after a failure
  std::atomic<int32_t> cpu;        // the core this rank ran on when it last arrived at a barrier
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

constexpr size_t kFrameSlot = (kFrameBytes + 63) / 64 * 64;
// How long a waiter spins before it sleeps: long enough to cover a peer's Python between two calls
// when every rank has a core of its own, short when ranks share cores (the spin takes a peer's core).
bool ranksShareCores(int ranks) {
  static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return ranks > cpus;
}
std::chrono::microseconds spinFor(int ranks) { return std::chrono::microseconds(ranksShareCores(ranks) ? 10 : 200); }

// Note [Barrier wait rule]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A waiter checks where each missing peer last arrived (RankState::cpu). While all ran on other
// cores it spins, up to spinFor (such a peer arrives within microseconds; sleeping would cost a
// futex wake-up per call). A missing peer that last ran on the waiter's own core cannot arrive while
// the waiter holds it: the waiter yields the core (sched_yield, no wake-up needed) for at most
// kYieldFor (a few scheduler hand-offs), then sleeps on the bell. After spinFor every waiter sleeps.
constexpr std::chrono::microseconds kYieldFor{50};

size_t ranksOffset() { return sizeof(Header); }
size_t framesOffset(int n) { return ranksOffset() + sizeof(RankState) * static_cast<size_t>(n); }
size_t buffersOffset(int n) { return (framesOffset(n) + 2 * static_cast<size_t>(n) * kFrameSlot + 4095) / 4096 * 4096; }

Header* header(const ShmMapping& m) { return static_cast<Header*>(m.base); }
RankState* rankState(const ShmMapping& m, int r) {
  return reinterpret_cast<RankState*>(static_cast<char*>(m.base) + ranksOffset()) + r;
}

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds slice) {
  timespec ts{static_cast<time_t>(slice.count() / 1000000), static_cast<long>((slice.count() % 1000000) * 1000)};
  (void)syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futexWakeAll(std::atomic<uint32_t>* word) {
  (void)syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

size_t ShmRing::segmentBytes(int size) {
  return buffersOffset(size) + 2 * static_cast<size_t>(size) * kShmBufferBytes;
}

ShmRing::ShmRing(ShmMapping mapping, int rank, int size, bool owns_mapping)
    : map_(mapping), owns_mapping_(owns_mapping), rank_(rank), size_(size) {
  RR_CHECK(map_.base != nullptr && map_.bytes >= segmentBytes(size), kRuntime,
           "ringreduce internal error: a shared-memory segment too small for ", size, " ranks");
  rankState(map_, rank_)->cpu.store(-1, std::memory_order_relaxed);
  rankState(map_, rank_)->pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  scratch_.resize(kReduceInOrderScratchBytes);
}

ShmRing::~ShmRing() {
  if (!owns_mapping_) return;
  // A peer still waiting in a barrier raises at its next liveness poll instead of at its timeout.
  rankState(map_, rank_)->gone.store(1, std::memory_order_release);
  Header* h = header(map_);
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(&h->bell);
  map_.unmap();
}

char* ShmRing::buffer(int rank, int parity) const {
  return static_cast<char*>(map_.base) + buffersOffset(size_) +
         (2 * static_cast<size_t>(rank) + static_cast<size_t>(parity)) * kShmBufferBytes;
}

Frame* ShmRing::frameSlot(int rank, int parity) const {
  return reinterpret_cast<Frame*>(static_cast<char*>(map_.base) + framesOffset(size_) +
                                  (2 * static_cast<size_t>(rank) + static_cast<size_t>(parity)) * kFrameSlot);
}

void ShmRing::barrier() {
  const uint64_t g = ++generation_;
  Header* h = header(map_);
  const int32_t cpu = sched_getcpu();
  rankState(map_, rank_)->cpu.store(cpu, std::memory_order_relaxed);
  rankState(map_, rank_)->arrived.store(g, std::memory_order_release);
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futexWakeAll(&h->bell);
  auto everyone = [&] {
    for (int p = 0; p < size_; ++p)
      if (rankState(map_, p)->arrived.load(std::memory_order_acquire) < g) return false;
    return true;
  };
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  auto missingPeerHere = [&] {
    for (int p = 0; p < size_ && cpu >= 0; ++p) {
      const RankState* st = rankState(map_, p);
      const bool missing = st->arrived.load(std::memory_order_acquire) < g;
      if (missing && st->cpu.load(std::memory_order_relaxed) == cpu) return true;
    }
    return false;
  };
  // Note [Barrier wait rule]
  const std::chrono::microseconds spin = std::min(spinFor(size_), spin_cap_);
  while (Clock::now() - start < spin) {
    if (missingPeerHere()) {
      const Clock::time_point yielded = Clock::now();
      while (Clock::now() - yielded < kYieldFor) {
        if (everyone()) return;
        sched_yield();
      }
      break;
    }
    for (int i = 0; i < 64; ++i) {
      if (everyone()) return;
      cpuRelax();
    }
  }
  Clock::time_point next_check = start + kShmLivenessPoll;
  Clock::time_point next_abort_check = start + kShmAbortPoll;
  for (;;) {
    // Read the bell before looking: an arrival after the look changes it, and the wait returns.
    const uint32_t v = h->bell.load(std::memory_order_seq_cst);
    if (everyone()) return;
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    futexWait(&h->bell, v, std::chrono::microseconds(2000));
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    const Clock::time_point now = Clock::now();
    if (abort_ && now >= next_abort_check) {
      next_abort_check = now + kShmAbortPoll;
      const std::string why = abort_();
      if (!why.empty()) leave(why);
    }
    if (now < next_check) continue;
    next_check = now + kShmLivenessPoll;
    for (int p = 0; p < size_; ++p) {
      RankState* st = rankState(map_, p);
      // A rank that left (even after arriving here) will never arrive at a later barrier.
      if (st->gone.load(std::memory_order_acquire) != 0) {
        leave("ringreduce: ring rank " + std::to_string(p) + " left the shared-memory ring (after a failure: a dead "
              "or silent peer, Ctrl-C, an abort; or its group was released) while ring rank " + std::to_string(rank_) +
              " waited in it");
      }
      if (st->arrived.load(std::memory_order_acquire) >= g) continue;
      const int32_t pid = st->pid.load(std::memory_order_acquire);
      if (pid > 0 && processExited(pid)) {
        leave("ringreduce: ring rank " + std::to_string(p) + " (pid " + std::to_string(pid) + ") exited while ring rank " +
              std::to_string(rank_) + " waited for it in shared memory");
      }
    }
    if (now - start > timeout_) {
      leave("ringreduce: shared-memory barrier: ring rank " + std::to_string(rank_) + " waited " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
            " ms (the timeout) for ranks that never arrived");
    }
  }
}

void ShmRing::leave(const std::string& why) {
  rankState(map_, rank_)->gone.store(1, std::memory_order_release);
  Header* h = header(map_);
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(&h->bell);
  RR_THROW(kBackend, why);
}

std::vector<Frame> ShmRing::begin(const Frame& mine, const void* data, int64_t numel, DType dtype) {
  const int parity = static_cast<int>(calls_++ % 2);
  std::memcpy(static_cast<void*>(frameSlot(rank_, parity)), &mine, kFrameBytes);
  first_piece_ = 0;
  if (data != nullptr && numel > 0) {
    const size_t elem = dtypeSize(dtype);
    first_piece_ = std::min<int64_t>(numel, static_cast<int64_t>(kShmBufferBytes / elem));
    std::memcpy(buffer(rank_, static_cast<int>(pieces_ % 2)), data, static_cast<size_t>(first_piece_) * elem);
  }
  barrier();
  std::vector<Frame> frames(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) std::memcpy(&frames[static_cast<size_t>(p)], frameSlot(p, parity), kFrameBytes);
  return frames;
}

// Elements [begin, end) of the piece that starts at element `piece_offset` of the tensor, combined
// over the ranks' buffers of `parity` in the ring's order of their chunk, into dst (dst[0] is the
// piece's element 0).
void ShmRing::reducePart(int64_t begin, int64_t end, int64_t piece_offset, int parity, void* dst,
                         const InOrderReduce& how, bool rank_order, const RingSchedule& sched) {
  const size_t elem = dtypeSize(how.dtype);
  std::vector<const void*> inputs(static_cast<size_t>(size_));
  if (rank_order) {
    const size_t off = static_cast<size_t>(begin) * elem;
    for (int j = 0; j < size_; ++j) inputs[static_cast<size_t>(j)] = buffer(j, parity) + off;
    if (end > begin) hostReduceInOrder(how, inputs, static_cast<char*>(dst) + off, end - begin, scratch_.data());
    return;
  }
  int64_t lo = begin;
  while (lo < end) {
    const int64_t global = piece_offset + lo;
    const int c = static_cast<int>(std::min<int64_t>(global / sched.chunk, sched.nranks - 1));
    const int64_t hi = std::min(end, sched.chunkRange(c).end - piece_offset);
    const size_t off = static_cast<size_t>(lo) * elem;
    // Chunk c starts at the rank after its owner (ownedChunk(r) = r + 1 + shift): c - shift.
    const int first = ((c - sched.shift) % size_ + size_) % size_;
    for (int j = 0; j < size_; ++j) inputs[static_cast<size_t>(j)] = buffer((first + j) % size_, parity) + off;
    hostReduceInOrder(how, inputs, static_cast<char*>(dst) + off, hi - lo, scratch_.data());
    lo = hi;
  }
}

void ShmRing::allReduce(void* data, int64_t numel, DType dtype, RedOp op, DType partial, const Scaling& final) {
  InOrderReduce how;
  how.dtype = how.round_to = how.dst = dtype;
  how.partial = partial;
  how.op = op;
  how.scaling = final;
  allReduce(data, numel, how, /*rank_order=*/false);
}

void ShmRing::allReduce(void* data, int64_t numel, const InOrderReduce& how, bool rank_order) {
  if (numel <= 0) return;
  const DType dtype = how.dtype;
  const DType partial = how.partial;
  const size_t elem = dtypeSize(dtype);
  const int64_t per_piece = static_cast<int64_t>(kShmBufferBytes / elem);
  RR_CHECK(first_piece_ == std::min(numel, per_piece), kRuntime,
           "ringreduce internal error: allReduce after a begin() of another tensor");
  // The ring's chunks (Note [One-shot all-reduce] in group_runtime.h): bounds from (n, numel, sizes).
  const RingSchedule sched = makeRingSchedule(size_, numel, static_cast<int64_t>(elem),
                                              static_cast<int64_t>(std::max(elem, dtypeSize(partial))), 1 << 20);
  char* out = static_cast<char*>(data);
  const size_t full_bytes = ranksShareCores(size_) ? kShmSharedCoresFullPieceBytes : kShmFullPieceBytes;
  for (int64_t offset = 0; offset < numel; offset += per_piece) {
    const int64_t len = std::min(per_piece, numel - offset);
    const int parity = static_cast<int>(pieces_++ % 2);
    if (offset > 0) {  // the first piece was copied in by begin(), before its barrier
      std::memcpy(buffer(rank_, parity), out + static_cast<size_t>(offset) * elem, static_cast<size_t>(len) * elem);
      barrier();
    }
    if (size_ == 2 || static_cast<size_t>(len) * elem <= full_bytes) {
      // Full: every rank reduces the whole piece into its own tensor.
      reducePart(0, len, offset, parity, out + static_cast<size_t>(offset) * elem, how, rank_order, sched);
      continue;
    }
    // Split: rank r reduces part r into its buffer; after the barrier everyone copies every part out.
    const int64_t part = (len + size_ - 1) / size_;
    const int64_t mine_lo = std::min(len, part * rank_);
    const int64_t mine_hi = std::min(len, mine_lo + part);
    reducePart(mine_lo, mine_hi, offset, parity, buffer(rank_, parity), how, rank_order, sched);
    barrier();
    for (int p = 0; p < size_; ++p) {
      const int64_t lo = std::min(len, part * p);
      const int64_t hi = std::min(len, lo + part);
      if (hi > lo)
        std::memcpy(out + static_cast<size_t>(offset + lo) * elem, buffer(p, parity) + static_cast<size_t>(lo) * elem,
                    static_cast<size_t>(hi - lo) * elem);
    }
  }
}

bool ShmRing::wireRingPays(int64_t numel) {
  return static_cast<size_t>(numel) * sizeof(float) > kShmFullPieceBytes;
}

void ShmRing::allReduceWire(float* data, int64_t numel, RedOp op, DType partial, const Scaling& final) {
  if (numel <= 0) return;
  RR_CHECK(first_piece_ == 0 && isHalfType(partial) && (op == RedOp::kSum || op == RedOp::kAvg), kRuntime,
           "ringreduce internal error: allReduceWire of ", redOpName(op), " with ", dtypeName(partial),
           " partials, or after a begin() with data");
  const int n = size_;
  // The ring's chunks (never moved by the segment size); a round's segment fits a buffer as float32.
  RingSchedule sched = makeRingSchedule(n, numel, 4, 4, static_cast<int64_t>(kShmBufferBytes));
  // As few rounds as the buffers allow (each costs n barriers), of equal segments.
  const int64_t cap = static_cast<int64_t>(kShmBufferBytes / sizeof(float));
  const int64_t want_rounds = ceilDiv(sched.chunk, cap);
  sched.segment = std::min(cap, roundUp(ceilDiv(sched.chunk, want_rounds), sched.align));
  sched.nsegs = static_cast<int32_t>(ceilDiv(sched.chunk, sched.segment));
  const int rounds = sched.nsegs;
  const int prev = (rank_ + n - 1) % n;
  Scaling hop;
  hop.predivide = final.predivide;
  auto range = [&](int chunk, int g) { return sched.segmentRange(modRing(chunk, n), g); };
  // A round's all-gather: every other rank's finished segment, from its buffer of `parity`.
  auto gather = [&](int g, int parity) {
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      const Range r = range(p + 1, g);
      if (!r.empty())
        std::memcpy(data + r.begin, buffer(p, parity), static_cast<size_t>(r.size()) * sizeof(float));
    }
  };
  int pending = -1;  // the round whose all-gather is still to copy out, and its buffer parity
  int pending_parity = 0;
  for (int g = 0; g < rounds; ++g) {
    for (int s = 0; s < n; ++s) {
      const int parity = static_cast<int>(pieces_++ % 2);
      const Range r = range(rank_ - s, g);
      char* mine = buffer(rank_, parity);
      const char* from_prev = buffer(prev, 1 - parity);  // prev's step s - 1 of this round
      if (!r.empty()) {
        float* x = data + r.begin;
        if (s == 0) {
          hostConvert(x, DType::kFloat32, mine, partial, r.size(), final.predivide);
        } else if (s < n - 1) {
          hostReduce(op, x, DType::kFloat32, from_prev, partial, mine, partial, r.size(), hop);
        } else {
          hostReduce(op, x, DType::kFloat32, from_prev, partial, x, DType::kFloat32, r.size(), final);
          std::memcpy(mine, x, static_cast<size_t>(r.size()) * sizeof(float));
        }
      }
      if (s == 0 && pending >= 0) gather(pending, pending_parity);
      barrier();
      if (s == n - 1) {
        pending = g;
        pending_parity = parity;
      }
    }
  }
  // The last round's all-gather needs no barrier after it: the next call writes the other parity
  // first, and meets the others before it writes this one (Note [Shared-memory all-reduce]).
  if (pending >= 0) gather(pending, pending_parity);
}

// Piece by piece: every rank copies the piece in, the ranks meet, and each reduces the part of its
// owned chunk inside it from every rank's copy (the next barrier protects the buffers, as in allReduce).
void ShmRing::reduceScatter(void* data, DType dtype, RedOp op, const RingSchedule& sched, const Scaling& final) {
  const int64_t numel = sched.numel;
  if (numel <= 0) return;
  const size_t elem = dtypeSize(dtype);
  const int64_t per_piece = static_cast<int64_t>(kShmBufferBytes / elem);
  const Range mine = sched.chunkRange(sched.ownedChunk(rank_));
  char* out = static_cast<char*>(data);
  for (int64_t offset = 0; offset < numel; offset += per_piece) {
    const int64_t len = std::min(per_piece, numel - offset);
    const int parity = static_cast<int>(pieces_++ % 2);
    std::memcpy(buffer(rank_, parity), out + static_cast<size_t>(offset) * elem, static_cast<size_t>(len) * elem);
    barrier();
    const int64_t lo = std::max<int64_t>(mine.begin, offset) - offset;
    const int64_t hi = std::min<int64_t>(mine.end, offset + len) - offset;
    if (hi > lo) {
      InOrderReduce how;
      how.dtype = how.round_to = how.partial = how.dst = dtype;
      how.op = op;
      how.scaling = final;
      reducePart(lo, hi, offset, parity, out + static_cast<size_t>(offset) * elem, how, /*rank_order=*/false, sched);
    }
  }
}

// Piece by piece: every rank copies its owned part into its buffer, the ranks meet, and each copies
// the others' parts out.
void ShmRing::allGather(void* data, DType dtype, const RingSchedule& sched) {
  const int64_t numel = sched.numel;
  if (numel <= 0) return;
  const size_t elem = dtypeSize(dtype);
  const int64_t per_piece = static_cast<int64_t>(kShmBufferBytes / elem);
  char* out = static_cast<char*>(data);
  auto part = [&](int r, int64_t offset, int64_t len) {
    const Range owned = sched.chunkRange(sched.ownedChunk(r));
    return Range{std::max<int64_t>(owned.begin, offset), std::min<int64_t>(owned.end, offset + len)};
  };
  for (int64_t offset = 0; offset < numel; offset += per_piece) {
    const int64_t len = std::min(per_piece, numel - offset);
    const int parity = static_cast<int>(pieces_++ % 2);
    const Range own = part(rank_, offset, len);
    if (!own.empty())
      std::memcpy(buffer(rank_, parity) + static_cast<size_t>(own.begin - offset) * elem,
                  out + static_cast<size_t>(own.begin) * elem, static_cast<size_t>(own.size()) * elem);
    barrier();
    for (int p = 0; p < size_; ++p) {
      const Range r = part(p, offset, len);
      if (p == rank_ || r.empty()) continue;
      std::memcpy(out + static_cast<size_t>(r.begin) * elem, buffer(p, parity) + static_cast<size_t>(r.begin - offset) * elem,
                  static_cast<size_t>(r.size()) * elem);
    }
  }
}

void ShmRing::runHalf(const RingStage& st, void* data, bool reduce_scatter) {
  if (reduce_scatter) reduceScatter(data, st.plan.dtype, st.op, st.plan.sched, st.plan.finalScaling(st.op));
  else allGather(data, st.plan.dtype, st.plan.sched);
}

}  // namespace rr
