#include "inproc_transport.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "cpu/ring_executor.h"

namespace rr {

using Clock = std::chrono::steady_clock;

InprocHub::InprocHub(int nranks, InprocOptions options)
    : nranks_(nranks), options_(options), rng_(options.seed) {
  RR_CHECK(nranks >= 1, kValue, "inproc transport: need at least one rank, got ", nranks);
  requests_.resize(static_cast<size_t>(nranks));
  next_id_.assign(static_cast<size_t>(nranks), 0);
}

int64_t InprocHub::post(int rank, bool is_send, void* data, size_t bytes, int peer, int tag) {
  RR_CHECK(peer >= 0 && peer < nranks_, kValue, "inproc transport: rank ", rank, " names peer ", peer,
           " outside [0, ", nranks_, ")");
  std::lock_guard<std::mutex> lk(mu_);
  auto req = std::make_shared<Request>();
  req->owner = rank;
  req->is_send = is_send;
  req->data = data;
  req->bytes = bytes;
  req->peer = peer;
  req->tag = tag;
  const int64_t id = next_id_[rank]++;
  requests_[rank][id] = req;
  Channel& ch = channels_[is_send ? ChannelKey{rank, peer, tag} : ChannelKey{peer, rank, tag}];
  (is_send ? ch.sends : ch.recvs).push_back(req);
  matchLocked(ch);
  return id;
}

void InprocHub::matchLocked(Channel& ch) {
  while (!ch.sends.empty() && !ch.recvs.empty()) {
    std::shared_ptr<Request> s = ch.sends.front();
    std::shared_ptr<Request> r = ch.recvs.front();
    ch.sends.pop_front();
    ch.recvs.pop_front();
    if (s->bytes > r->bytes || (s->bytes < r->bytes && !options_.short_messages)) {
      // gloo aborts the process here; a test transport reports it on both sides instead.
      const std::string what = detail::concat("inproc transport: message size mismatch: rank ", s->owner,
                                              " sends ", s->bytes, " bytes to rank ", r->owner,
                                              ", which receives ", r->bytes, " (tag ", s->tag, ")");
      s->error = what;
      r->error = what;
      continue;
    }
    auto d = std::make_shared<Delivery>();
    d->send = s;
    d->recv = r;
    d->src = s->data;
    d->dst = r->data;
    d->bytes = s->bytes;
    int64_t us = 0;
    if (options_.max_delay_us > 0)
      us = static_cast<int64_t>(rng_() % static_cast<uint64_t>(options_.max_delay_us + 1));
    d->ready = Clock::now() + std::chrono::microseconds(us);
    s->delivery = d;
    r->delivery = d;
    if (options_.eager) {
      // Under the hub's lock: both buffers are alive (their owners are posting or waiting).
      if (d->bytes > 0) std::memcpy(d->dst, d->src, d->bytes);
      d->state = Delivery::kDone;
      s->done = true;
      r->done = true;
    }
  }
  cv_.notify_all();
}

void InprocHub::deliver(std::unique_lock<std::mutex>& lk, Delivery& d) {
  d.state = Delivery::kCopying;
  // The owners keep both buffers alive until their requests complete (or forever after abandon()).
  lk.unlock();
  if (d.bytes > 0) std::memcpy(d.dst, d.src, d.bytes);
  lk.lock();
  d.state = Delivery::kDone;
  if (auto s = d.send.lock()) s->done = true;
  if (auto r = d.recv.lock()) r->done = true;
  cv_.notify_all();
}

void InprocHub::wait(int rank, int64_t id) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_[rank].find(id);
  RR_CHECK(it != requests_[rank].end(), kBackend, "inproc transport: rank ", rank,
           " waits on request ", id, ", which is unknown or was abandoned");
  const std::shared_ptr<Request> req = it->second;
  const auto deadline = Clock::now() + options_.timeout;
  for (;;) {
    if (!req->error.empty()) RR_THROW(kBackend, req->error);
    if (req->done) return;
    const auto now = Clock::now();
    const std::shared_ptr<Delivery> keep = req->delivery;
    Delivery* d = keep.get();
    if (d && d->state == Delivery::kPending && now >= d->ready) {
      deliver(lk, *d);
      continue;
    }
    if (now >= deadline) {
      RR_THROW(kBackend, "inproc transport: rank ", rank, " timed out after ", options_.timeout.count(),
               " ms waiting for a ", req->is_send ? "send of " : "receive of ", req->bytes,
               " bytes ", req->is_send ? "to" : "from", " rank ", req->peer, " (tag ", req->tag, ")");
    }
    auto wake = deadline;
    if (d && d->state == Delivery::kPending) wake = std::min(wake, d->ready);
    cv_.wait_until(lk, wake);
  }
}

void InprocHub::abandon(int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  // Unmatched requests of this rank leave the mailbox: nothing will ever be delivered into them.
  // Matched ones may still be delivered by the peer's wait; their buffers stay alive (contract).
  for (auto& kv : channels_) {
    const int src = std::get<0>(kv.first);
    const int dst = std::get<1>(kv.first);
    if (src == rank) kv.second.sends.clear();
    if (dst == rank) kv.second.recvs.clear();
  }
  requests_[rank].clear();
  cv_.notify_all();
}

InprocTransport::InprocTransport(std::shared_ptr<InprocHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {
  RR_CHECK(hub_ != nullptr, kValue, "inproc transport: no hub");
  RR_CHECK(rank >= 0 && rank < hub_->size(), kValue, "inproc transport: rank ", rank, " outside [0, ",
           hub_->size(), ")");
}

int64_t InprocTransport::isend(const void* data, size_t bytes, int peer, int tag) {
  // The hub never writes through a send's pointer.
  return hub_->post(rank_, true, const_cast<void*>(data), bytes, peer, tag);
}

int64_t InprocTransport::irecv(void* data, size_t bytes, int peer, int tag) {
  return hub_->post(rank_, false, data, bytes, peer, tag);
}

void InprocTransport::wait(int64_t request) { hub_->wait(rank_, request); }

void InprocTransport::abandon() { hub_->abandon(rank_); }

// ------------------------------------------------------------------------------------------------

std::vector<InprocRankResult> runInprocAllReduce(int nranks, int64_t numel, DType dtype, RedOp op,
                                                 std::vector<std::vector<uint8_t>>& data,
                                                 const InprocRunOptions& options) {
  RR_CHECK(static_cast<int>(data.size()) == nranks, kValue, "runInprocAllReduce: ", data.size(),
           " buffers for ", nranks, " ranks");
  const size_t bytes = static_cast<size_t>(numel) * dtypeSize(dtype);
  for (const auto& d : data)
    RR_CHECK(d.size() == bytes, kValue, "runInprocAllReduce: a buffer holds ", d.size(), " bytes, not ", bytes);

  auto hub = std::make_shared<InprocHub>(nranks, options.transport);
  struct Staging {  // per rank; outlives the rank's thread (late messages may land here)
    std::vector<float> accum;
    std::vector<std::vector<uint64_t>> slots;  // uint64_t for alignment of every element type
  };
  std::vector<Staging> staging(static_cast<size_t>(nranks));
  std::vector<InprocRankResult> results(static_cast<size_t>(nranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) {
    if (std::find(options.absent.begin(), options.absent.end(), r) != options.absent.end()) continue;
    threads.emplace_back([&, r] {
      InprocRankResult& res = results[static_cast<size_t>(r)];
      InprocTransport transport(hub, r);
      const auto t0 = Clock::now();
      try {
        checkSupported(dtype, op);
        PlanOptions po = options.plan;
        po.average = op == RedOp::kAvg;
        const Plan plan = buildPlan(nranks, r, numel, dtype, po);
        Staging& st = staging[static_cast<size_t>(r)];
        RingBuffers buffers;
        buffers.data = data[static_cast<size_t>(r)].data();
        st.accum.assign(static_cast<size_t>(plan.accum_elems), 0.0f);
        buffers.accum = st.accum.empty() ? nullptr : st.accum.data();
        const int64_t slot_bytes =
            std::max(plan.num_slots > 0 ? plan.stagingBytes() / plan.num_slots : 0, options.lead_room);
        st.slots.resize(static_cast<size_t>(plan.num_slots));
        for (auto& s : st.slots) {
          s.assign(static_cast<size_t>((slot_bytes + 7) / 8), 0);
          buffers.slots.push_back(s.data());
        }
        buffers.slot_room.assign(st.slots.size(), static_cast<int64_t>((slot_bytes + 7) / 8 * 8));
        PlanRun run(plan, op, transport, buffers, options.tag);
        if (options.lead_room > 0) {
          run.postLeading(static_cast<size_t>(options.lead_room), static_cast<size_t>(options.lead_max_send));
          std::this_thread::yield();  // let the other ranks' leading messages meet these
        }
        run.run();
      } catch (const Error& e) {
        res.error = e.what();
        res.is_rr_error = true;
        res.kind = e.kind();
        transport.abandon();
      } catch (const std::exception& e) {
        res.error = e.what();
        transport.abandon();
      }
      res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace rr
