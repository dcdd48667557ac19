#include "nccl_frame_transport.h"

#include <cstring>
#include <thread>

#include "cuda_check.h"
#include "host_interrupt.h"

namespace rr {

namespace {
constexpr auto kHostPoll = std::chrono::microseconds(20);
}  // namespace

void hostWait(cudaEvent_t event, NcclComm& comm, std::chrono::steady_clock::time_point deadline,
              const std::string& what) {
  InterruptCheck interrupt;  // Note [Interrupting a host wait on CUDA]
  while (true) {
    if (eventFired(event)) {
      comm.checkUsable();  // fired because an abort let the kernels exit: the data is garbage
      return;
    }
    comm.checkUsable();
    if (interrupt.requested()) {
      const std::string reason = interruptedReason(comm.name(), what);
      comm.abort(reason);
      RR_THROW(kBackend, reason);
    }
    RR_CHECK(std::chrono::steady_clock::now() <= deadline, kBackend, "ringreduce: ", what, " on ", comm.name(),
             " (rank ", comm.rank(), " of ", comm.size(), ") did not finish within ", comm.timeout().count(), " ms");
    std::this_thread::sleep_for(kHostPoll);
  }
}

NcclFrameTransport::NcclFrameTransport(NcclComm& comm, cudaStream_t stream, cudaEvent_t done, void* device_staging,
                                       void* host_staging)
    : comm_(comm),
      stream_(stream),
      done_(done),
      dev_(static_cast<char*>(device_staging)),
      host_(static_cast<char*>(host_staging)) {}

void NcclFrameTransport::checkPost(size_t bytes, int peer, const char* what) const {
  RR_CHECK(peer >= 0 && peer < size() && peer != rank(), kRuntime, "ringreduce internal error: ", what, " to rank ",
           peer, " of ", size(), " from rank ", rank());
  RR_CHECK(bytes <= kMaxMessage, kRuntime, "ringreduce internal error: a ", bytes, "-byte ", what,
           " over NCCL, which carries messages of at most ", kMaxMessage, " bytes here");
}

int64_t NcclFrameTransport::isend(const void* data, size_t bytes, int peer, int /*tag*/) {
  checkPost(bytes, peer, "send");
  RR_CHECK(send_peer_ < 0, kRuntime,
           "ringreduce internal error: two sends pending on the NCCL frame transport (Note [Host messages over NCCL])");
  std::memcpy(slot(host_, false), data, bytes);
  send_peer_ = peer;
  send_bytes_ = bytes;
  return next_request_++;
}

int64_t NcclFrameTransport::irecv(void* data, size_t bytes, int peer, int /*tag*/) {
  checkPost(bytes, peer, "receive");
  RR_CHECK(recv_peer_ < 0, kRuntime,
           "ringreduce internal error: two receives pending on the NCCL frame transport (Note [Host messages over "
           "NCCL])");
  recv_peer_ = peer;
  recv_bytes_ = bytes;
  recv_to_ = data;
  return next_request_++;
}

void NcclFrameTransport::wait(int64_t request) {
  RR_CHECK(request >= 0 && request < next_request_, kRuntime, "ringreduce internal error: request ", request,
           " was never posted on the NCCL frame transport");
  if (request < flushed_) return;
  flush();
}

void NcclFrameTransport::flush() {
  const bool send = send_peer_ >= 0;
  const bool recv = recv_peer_ >= 0;
  // Forget the pending pair first: after a failure here the communicator is aborted anyway.
  const int send_peer = send_peer_, recv_peer = recv_peer_;
  send_peer_ = recv_peer_ = -1;
  flushed_ = next_request_;
  if (send) {
    RR_CUDA_CHECK(cudaMemcpyAsync(slot(dev_, false), slot(host_, false), send_bytes_, cudaMemcpyHostToDevice, stream_));
  }
  comm_.sendRecv(slot(dev_, false), send ? send_bytes_ : 0, send_peer, slot(dev_, true), recv ? recv_bytes_ : 0,
                 recv_peer, stream_);
  if (recv) {
    RR_CUDA_CHECK(cudaMemcpyAsync(slot(host_, true), slot(dev_, true), recv_bytes_, cudaMemcpyDeviceToHost, stream_));
  }
  RR_CUDA_CHECK(cudaEventRecord(done_, stream_));
  hostWait(done_, comm_, std::chrono::steady_clock::now() + comm_.timeout(), "the agreement check");
  if (recv) std::memcpy(recv_to_, slot(host_, true), recv_bytes_);
}

}  // namespace rr
