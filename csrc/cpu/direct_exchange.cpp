#include "direct_exchange.h"

#include <cstring>

#include "../core/error.h"
#include "host_reduce.h"
#include "ring_executor.h"

namespace rr {

namespace {

// One half of the call (Note [Direct rounds on gloo]): `post` posts round g's messages, `consume`
// uses what round g received.
class Rounds {
 public:
  Rounds(const DirectPlan& plan, Transport& t) : plan_(plan), t_(t), recvs_(plan.rounds), sends_(plan.rounds) {}

  template <typename PostRecvs, typename PostSends, typename Consume>
  void run(PostRecvs&& post_recvs, PostSends&& post_sends, Consume&& consume) {
    const int rounds = plan_.rounds;
    const int depth = plan_.depth;
    for (int g = 0; g < depth && g < rounds; ++g) post_recvs(g, recvs_[g]);
    for (int g = 0; g < depth && g < rounds; ++g) post_sends(g, sends_[g]);
    for (int g = 0; g < rounds; ++g) {
      for (int64_t q : recvs_[g]) t_.wait(q);
      consume(g);
      for (int64_t q : sends_[g]) t_.wait(q);
      if (g + depth < rounds) {
        post_recvs(g + depth, recvs_[g + depth]);
        post_sends(g + depth, sends_[g + depth]);
      }
    }
  }

 private:
  const DirectPlan& plan_;
  Transport& t_;
  std::vector<std::vector<int64_t>> recvs_;
  std::vector<std::vector<int64_t>> sends_;
};

}  // namespace

void executeDirect(const DirectPlan& plan, Transport& t, const DirectBuffers& b, int scatter_tag, int gather_tag) {
  const int n = plan.nranks;
  const int r = plan.rank;
  if (n <= 1 || plan.rounds == 0) return;
  RR_CHECK(static_cast<int32_t>(b.buffers.size()) >= plan.numBuffers() && b.scratch != nullptr, kRuntime,
           "ringreduce internal error: a direct all-reduce with ", b.buffers.size(), " staging buffers, needs ",
           plan.numBuffers());
  const size_t elem = dtypeSize(plan.dtype);
  const size_t celem = dtypeSize(plan.contrib);
  const size_t gelem = dtypeSize(plan.gather);
  char* data = static_cast<char*>(b.data);
  auto at = [&](int64_t i) { return data + static_cast<size_t>(i) * elem; };
  auto buffer = [&](int k) { return static_cast<char*>(b.buffers[static_cast<size_t>(k)]); };
  auto tag = [](int base, int g) { return base + g % kTagsPerCall; };

  // Reduce-scatter: every peer's piece of this rank's chunk in, this rank's piece of theirs out.
  Rounds scatter(plan, t);
  scatter.run(
      [&](int g, std::vector<int64_t>& reqs) {
        const Range mine = plan.piece(r, g);
        if (mine.empty()) return;
        for (int k = 1; k < n; ++k) {
          const int p = (r - k + n) % n;
          reqs.push_back(t.irecv(buffer(plan.recvBuffer(g, p)), static_cast<size_t>(mine.size()) * celem, p,
                                 tag(scatter_tag, g)));
        }
      },
      [&](int g, std::vector<int64_t>& reqs) {
        for (int c = 0; plan.wire() && c < n; ++c) {  // Note [First hop]'s convert, on every piece this rank sends
          const Range pc = plan.piece(c, g);
          if (!pc.empty())
            hostConvert(at(pc.begin), plan.dtype, buffer(plan.convertBuffer(g, c)), plan.contrib, pc.size(),
                        plan.convert_predivide);
        }
        for (int k = 1; k < n; ++k) {
          const int p = (r + k) % n;
          const Range pp = plan.piece(p, g);
          if (pp.empty()) continue;
          const void* src = plan.wire() ? static_cast<const void*>(buffer(plan.convertBuffer(g, p))) : at(pp.begin);
          reqs.push_back(t.isend(src, static_cast<size_t>(pp.size()) * celem, p, tag(scatter_tag, g)));
        }
      },
      [&](int g) {
        const Range mine = plan.piece(r, g);
        if (mine.empty()) return;
        std::vector<const void*> inputs(static_cast<size_t>(n));
        for (int k = 0; k < n; ++k) {
          if (k != r) inputs[static_cast<size_t>(k)] = buffer(plan.recvBuffer(g, k));
          else inputs[static_cast<size_t>(k)] = plan.wire() ? buffer(plan.convertBuffer(g, r)) : at(mine.begin);
        }
        hostReduceInOrder(plan.reduce, inputs, at(mine.begin), mine.size(), b.scratch);
      });

  // All-gather: this rank's finished piece out to every peer, theirs in.
  Rounds gather(plan, t);
  gather.run(
      [&](int g, std::vector<int64_t>& reqs) {
        for (int k = 1; k < n; ++k) {
          const int p = (r - k + n) % n;
          const Range pp = plan.piece(p, g);
          if (!pp.empty())
            reqs.push_back(t.irecv(buffer(plan.recvBuffer(g, p)), static_cast<size_t>(pp.size()) * gelem, p,
                                   tag(gather_tag, g)));
        }
      },
      [&](int g, std::vector<int64_t>& reqs) {
        const Range mine = plan.piece(r, g);
        if (mine.empty()) return;
        const void* src = at(mine.begin);
        if (plan.gather16()) {  // Note [16-bit all-gather]: exact, the result was rounded through the wire
          hostConvert(at(mine.begin), plan.dtype, buffer(plan.convertBuffer(g, r)), plan.gather, mine.size(), 0);
          src = buffer(plan.convertBuffer(g, r));
        }
        for (int k = 1; k < n; ++k)
          reqs.push_back(t.isend(src, static_cast<size_t>(mine.size()) * gelem, (r + k) % n, tag(gather_tag, g)));
      },
      [&](int g) {
        for (int p = 0; p < n; ++p) {
          const Range pp = plan.piece(p, g);
          if (p == r || pp.empty()) continue;
          const char* got = buffer(plan.recvBuffer(g, p));
          if (plan.gather16()) hostConvert(got, plan.gather, at(pp.begin), plan.dtype, pp.size(), 0);
          else std::memcpy(at(pp.begin), got, static_cast<size_t>(pp.size()) * elem);
        }
      });
}

}  // namespace rr
