// ringreduce GPU: the Transport seam (csrc/core/transport.h) over an NCCL communicator, for the
// agreement frames of the GPU path (csrc/core/agreement.h's exchangeFrames, called by
// CudaRing::exchangeFrames).
//
// Note [Host messages over NCCL]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The frame all-gather is written once, over Transport, for host memory. NCCL moves device memory
// on a stream, so this transport stages each message: isend() copies the message into a pinned
// host slot, irecv() notes where the message goes, and the first wait() hands both to the GPU - a
// host-to-device copy, one grouped ncclSend/ncclRecv (NcclComm::sendRecv), a device-to-host copy -
// and polls an event until they are done, then copies the received bytes to the caller. So:
//   * at most one send and one receive are pending at a time, posted together as one NCCL group
//     (an ncclSend and an ncclRecv in separate groups could wait for each other on two ranks);
//     that is exactly one hop of the ring all-gather, which this transport asks for by answering
//     neighboursOnly() (Note [Frames around the ring] in agreement.h);
//   * a message is at most kMaxMessage bytes (a frame);
//   * tags are not sent: NCCL matches the messages of a pair of ranks in posting order, and the
//     calls of one communicator are serialized by CudaRing;
//   * a wait that takes longer than the communicator's timeout, a CUDA or NCCL failure, an abort
//     of the communicator (which lets NCCL's kernels return over garbage), or Ctrl-C (Note
//     [Interrupting a host wait on CUDA]) throws kBackend; the caller then aborts the
//     communicator, so abandon() has nothing to forget.
// A frame exchange over n ranks therefore costs n - 1 host round trips (each a hand-off, Note
// [Hand-off and queued exchanges] in nccl_comm.h, and a wait for the copies); on the GPU the check
// is opt-in (RINGREDUCE_CHECK=1).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/frame.h"
#include "../core/transport.h"
#include "nccl_comm.h"

namespace rr {

// Polls `event` until it fired; throws kBackend on a CUDA error, when `comm` was aborted (an
// event that fired because the abort let the kernels exit does not count), when `deadline`
// passes (the message names `what`), or when Ctrl-C interrupts it (then `comm` is aborted first;
// Note [Interrupting a host wait on CUDA] in host_interrupt.h).
void hostWait(cudaEvent_t event, NcclComm& comm, std::chrono::steady_clock::time_point deadline,
              const std::string& what);

class NcclFrameTransport final : public Transport {
 public:
  static constexpr size_t kMaxMessage = kFrameBytes;
  // Bytes of the device and of the pinned host staging a transport needs (one send and one
  // receive slot each).
  static constexpr size_t kStagingBytes = 2 * kMaxMessage;

  // Runs on `stream` of `comm`'s device (the caller makes that device current); `done` is an
  // event of the caller's that marks the end of each hop; `device_staging` and `host_staging`
  // (pinned) have kStagingBytes bytes each. Nothing is owned.
  NcclFrameTransport(NcclComm& comm, cudaStream_t stream, cudaEvent_t done, void* device_staging,
                     void* host_staging);

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  int64_t isend(const void* data, size_t bytes, int peer, int tag) override;
  int64_t irecv(void* data, size_t bytes, int peer, int tag) override;
  void wait(int64_t request) override;
  void abandon() override {}
  bool neighboursOnly() const override { return true; }

 private:
  char* slot(char* base, bool recv) const { return base + (recv ? kMaxMessage : 0); }
  void checkPost(size_t bytes, int peer, const char* what) const;
  void flush();

  NcclComm& comm_;
  cudaStream_t stream_;
  cudaEvent_t done_;
  char* dev_;
  char* host_;
  int64_t next_request_ = 0;
  int64_t flushed_ = 0;  // requests below this id are complete
  // The pending send and receive (peer -1: none).
  int send_peer_ = -1;
  size_t send_bytes_ = 0;
  int recv_peer_ = -1;
  size_t recv_bytes_ = 0;
  void* recv_to_ = nullptr;
};

}  // namespace rr
