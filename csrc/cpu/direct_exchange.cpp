#include "direct_exchange.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "../core/error.h"
#include "host_reduce.h"
#include "ring_executor.h"

namespace rr {

namespace {

// One half of the call (Note [Direct rounds on gloo]): `post_recvs` and `post_sends` post round g's
// messages, `consume` uses what round g received. Round 0's requests posted before run() (Note
// [Direct before the verdict]) are handed in with preposted().
class Rounds {
 public:
  Rounds(const DirectPlan& plan, Transport& t) : plan_(plan), t_(t), recvs_(plan.rounds), sends_(plan.rounds) {}

  void preposted(std::vector<int64_t> recvs, std::vector<int64_t> sends) {
    recvs_[0] = std::move(recvs);
    sends_[0] = std::move(sends);
    recvs_posted_ = true;
  }

  template <typename PostRecvs, typename PostSends, typename Consume>
  void run(PostRecvs&& post_recvs, PostSends&& post_sends, Consume&& consume) {
    const int rounds = plan_.rounds;
    const int depth = plan_.depth;
    for (int g = recvs_posted_ ? 1 : 0; g < depth && g < rounds; ++g) post_recvs(g, recvs_[g]);
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
  bool recvs_posted_ = false;
};

int scatterTag(int base, int g) { return base + (g + 1) % kTagsPerCall; }
int gatherTag(int base, int g) { return base + g % kTagsPerCall; }

}  // namespace

DirectRun::DirectRun(const DirectPlan& plan, Transport& transport, const DirectBuffers& buffers, int scatter_tag,
                     int gather_tag)
    : plan_(plan), t_(transport), b_(buffers), scatter_tag_(scatter_tag), gather_tag_(gather_tag),
      sent0_(static_cast<size_t>(std::max(plan.nranks, 1)), 0) {}

bool DirectRun::postsLeadingReceives() const {
  return plan_.nranks > 1 && plan_.rounds > 0 && !plan_.wire() && !plan_.piece(plan_.rank, 0).empty();
}

std::vector<int32_t> DirectRun::leadingBuffers() const {
  std::vector<int32_t> out;
  if (!postsLeadingReceives()) return out;
  for (int p = 0; p < plan_.nranks; ++p)
    if (p != plan_.rank) out.push_back(plan_.recvBuffer(0, p));
  return out;
}

void DirectRun::postScatterRecvs(int g, std::vector<int64_t>& reqs, Part part) {
  const int n = plan_.nranks;
  const int r = plan_.rank;
  const Range mine = plan_.piece(r, g);
  if (mine.empty()) return;
  const size_t bytes = static_cast<size_t>(mine.size()) * dtypeSize(plan_.contrib);
  const size_t room = static_cast<size_t>(directLeadRoom(n));
  // The leading part: `room` bytes (the whole piece or its first room bytes); the rest: what follows.
  const size_t offset = part == Part::kRest ? room : 0;
  const size_t size = part == Part::kLead ? room : part == Part::kRest ? bytes - std::min(bytes, room) : bytes;
  if (size == 0) return;
  for (int k = 1; k < n; ++k) {
    const int p = (r - k + n) % n;
    const int32_t buf = plan_.recvBuffer(g, p);
    const int64_t held = b_.room.empty() ? plan_.buffer_bytes : b_.room[static_cast<size_t>(buf)];
    RR_CHECK(static_cast<int64_t>(offset + size) <= held, kRuntime, "ringreduce internal error: a direct receive of ",
             offset + size, " bytes into a staging buffer of ", held);
    reqs.push_back(t_.irecv(static_cast<char*>(b_.buffers[static_cast<size_t>(buf)]) + offset, size, p,
                            scatterTag(scatter_tag_, g)));
  }
}

void DirectRun::postScatterSends(int g, std::vector<int64_t>& reqs, size_t max_bytes, bool leading) {
  const int n = plan_.nranks;
  const int r = plan_.rank;
  const size_t elem = dtypeSize(plan_.dtype);
  const size_t celem = dtypeSize(plan_.contrib);
  char* data = static_cast<char*>(b_.data);
  auto buffer = [&](int k) { return static_cast<char*>(b_.buffers[static_cast<size_t>(k)]); };
  for (int c = 0; plan_.wire() && c < n; ++c) {  // Note [First hop]'s convert, on every piece this rank sends
    const Range pc = plan_.piece(c, g);
    if (!pc.empty())
      hostConvert(data + static_cast<size_t>(pc.begin) * elem, plan_.dtype, buffer(plan_.convertBuffer(g, c)),
                  plan_.contrib, pc.size(), plan_.convert_predivide);
  }
  for (int k = 1; k < n; ++k) {
    const int p = (r + k) % n;
    const Range pp = plan_.piece(p, g);
    const size_t bytes = static_cast<size_t>(pp.size()) * celem;
    const size_t sent = g == 0 ? sent0_[static_cast<size_t>(p)] : 0;  // round 0: its leading part
    if (pp.empty() || sent >= bytes) continue;
    const size_t len = std::min(bytes - sent, max_bytes);
    const char* src = plan_.wire() ? buffer(plan_.convertBuffer(g, p)) : data + static_cast<size_t>(pp.begin) * elem;
    const int64_t id = t_.isend(src + sent, len, p, scatterTag(scatter_tag_, g));
    reqs.push_back(id);
    if (g == 0) sent0_[static_cast<size_t>(p)] = sent + len;
    if (leading) lead_send_[static_cast<size_t>(p)] = id;
  }
}

void DirectRun::postLeading() {
  if (leading_ || plan_.nranks <= 1 || plan_.rounds == 0 || plan_.wire()) return;
  leading_ = true;
  const size_t room = static_cast<size_t>(directLeadRoom(plan_.nranks));  // the leading sends' largest
  if (postsLeadingReceives()) postScatterRecvs(0, lead_recvs_, Part::kLead);
  lead_send_.assign(static_cast<size_t>(plan_.nranks), -1);
  std::vector<int64_t> sends;  // recorded per peer in lead_send_
  postScatterSends(0, sends, room, true);
}

void DirectRun::run() {
  const int n = plan_.nranks;
  const int r = plan_.rank;
  if (n <= 1 || plan_.rounds == 0) return;
  const DirectPlan& plan = plan_;
  const DirectBuffers& b = b_;
  Transport& t = t_;
  RR_CHECK(static_cast<int32_t>(b.buffers.size()) >= plan.numBuffers() && b.scratch != nullptr, kRuntime,
           "ringreduce internal error: a direct all-reduce with ", b.buffers.size(), " staging buffers, needs ",
           plan.numBuffers());
  const size_t elem = dtypeSize(plan.dtype);
  const size_t gelem = dtypeSize(plan.gather);
  char* data = static_cast<char*>(b.data);
  auto at = [&](int64_t i) { return data + static_cast<size_t>(i) * elem; };
  auto buffer = [&](int k) { return static_cast<char*>(b.buffers[static_cast<size_t>(k)]); };

  // Reduce-scatter: every peer's piece of this rank's chunk in, this rank's piece of theirs out.
  Rounds scatter(plan, t);
  // Round 0's leading parts (postLeading), then the rest of each of its pieces.
  if (leading_) {
    postScatterRecvs(0, lead_recvs_, Part::kRest);
    std::vector<int64_t> sends;
    for (int64_t q : lead_send_)
      if (q >= 0) sends.push_back(q);
    scatter.preposted(std::move(lead_recvs_), std::move(sends));
  }
  scatter.run([&](int g, std::vector<int64_t>& reqs) { postScatterRecvs(g, reqs, Part::kWhole); },
              [&](int g, std::vector<int64_t>& reqs) { postScatterSends(g, reqs, SIZE_MAX, false); },
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
                                   gatherTag(gather_tag_, g)));
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
          reqs.push_back(
              t.isend(src, static_cast<size_t>(mine.size()) * gelem, (r + k) % n, gatherTag(gather_tag_, g)));
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

void executeDirect(const DirectPlan& plan, Transport& t, const DirectBuffers& b, int scatter_tag, int gather_tag) {
  DirectRun(plan, t, b, scatter_tag, gather_tag).run();
}

}  // namespace rr
