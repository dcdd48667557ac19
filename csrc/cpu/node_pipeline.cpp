// ringreduce CPU runtime: the pipelined hierarchical all-reduce, GroupRuntime's node stages in shared
// memory overlapped with its cross-node ring (the rest of GroupRuntime: group_runtime.cpp).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "group_runtime.h"
#include "ring_executor.h"
#include "shm_ring.h"

namespace rr {

// Note [Pipelined hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Run in sequence, the node stages (shared-memory copies and reduces) add their time to the
// cross-node ring's, during which the cores mostly wait for the link. So a large call is cut into
// pieces, each a hierarchical all-reduce of its element range: a helper thread runs stage 2 of
// piece p while the calling thread runs stage 1 of piece p + 1, then stage 3 of piece p - 1. The node
// stages are collectives of the node's ranks, so their order is fixed, the same on every rank:
// S1(0), S1(1), S3(0), S1(2), S3(1), ..., S3(P-1). The pieces depend on (numel, dtype) alone (never
// on the segment size), and stage 2's pieces run in order on the call's stage-2 tag, so messages
// pair in order and results are bitwise identical on every rank. A failure of either thread
// interrupts the transport (the group is unusable anyway), the other stops, the first error raises.
int64_t GroupRuntime::nodePieces(const CallBuffer& buf) {
  const int64_t bytes = buf.numel * static_cast<int64_t>(dtypeSize(buf.dtype));
  return std::max<int64_t>(1, std::min<int64_t>(kMaxNodePieces, bytes / kNodePieceBytes));
}

void GroupRuntime::runNodePieces(const Call& call, const CallBuffer& buf, int64_t pieces, ShmRing* node,
                                 int tag_group) {
  const int64_t esize = static_cast<int64_t>(dtypeSize(buf.dtype));
  const int64_t each = (buf.numel + pieces - 1) / pieces;
  std::vector<CallBuffer> bufs;
  std::vector<std::vector<RingStage>> stages;
  for (int64_t b = 0; b < buf.numel; b += each) {
    bufs.push_back(CallBuffer{static_cast<char*>(buf.data) + b * esize, std::min(each, buf.numel - b), buf.dtype});
    stages.push_back(stagesFor(call.opt, bufs.back()));
    RR_CHECK(stages.back().size() == 3, kRuntime, "ringreduce internal error: a hierarchical piece without 3 stages");
  }
  const size_t n = bufs.size();
  std::mutex m;
  std::condition_variable cv;
  size_t ready = 0;    // pieces whose stage 1 is done
  size_t crossed = 0;  // pieces whose stage 2 is done
  bool stop = false;
  std::exception_ptr failed;
  std::thread cross([&] {
    try {
      for (size_t p = 0; p < n; ++p) {
        {
          std::unique_lock<std::mutex> lk(m);
          cv.wait(lk, [&] { return stop || ready > p; });
          if (stop) return;
        }
        runRing(stages[p][1], bufs[p].data, payloadTag(tag_group, 1));
        {
          std::lock_guard<std::mutex> lk(m);
          crossed = p + 1;
        }
        cv.notify_all();
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(m);
        failed = std::current_exception();
      }
      cv.notify_all();
    }
  });
  auto first = [&](size_t p) {
    node->runHalf(stages[p][0], bufs[p].data, true);
    {
      std::lock_guard<std::mutex> lk(m);
      ready = p + 1;
    }
    cv.notify_all();
  };
  auto third = [&](size_t p) {
    {
      std::unique_lock<std::mutex> lk(m);
      // Ctrl-C on an inline call is polled by shared-memory waits (abortReason); here too, so that
      // interrupt() stops the helper's transfers.
      while (crossed <= p && !failed) {
        if (cv.wait_for(lk, std::chrono::milliseconds(50)) == std::cv_status::timeout) {
          lk.unlock();
          (void)abortReason();
          lk.lock();
        }
      }
      if (failed) std::rethrow_exception(failed);
    }
    node->runHalf(stages[p][2], bufs[p].data, false);
  };
  try {
    first(0);
    for (size_t p = 0; p < n; ++p) {
      if (p + 1 < n) first(p + 1);
      third(p);
    }
  } catch (...) {  // any exception: the helper is joined before it leaves
    {
      std::lock_guard<std::mutex> lk(m);
      stop = true;
    }
    cv.notify_all();
    std::string why = "ringreduce: " + name_ + ": a pipelined hierarchical all-reduce failed";
    try {
      throw;
    } catch (const std::exception& e) {
      why += std::string(": ") + e.what();
    } catch (...) {
    }
    transport_->interrupt(why);
    cross.join();
    throw;
  }
  cross.join();
}

}  // namespace rr
