// ringreduce GPU: the Transport seam (csrc/core/transport.h) over an NCCL communicator, for the
// agreement frames of the GPU path (CudaRing::exchangeFrames).
//
// Note [Host messages over NCCL]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// isend() copies the message into a pinned host slot, irecv() notes where it goes, and the first
// wait() enqueues a host-to-device copy, one grouped ncclSend/ncclRecv (a hand-off) and a
// device-to-host copy, and polls an event until they are done. So at most one send and one receive
// are pending, posted as one NCCL group (in separate groups they could wait for each other on two
// ranks): one hop, as neighboursOnly() asks (Note [Frames around the ring] in agreement.h). Tags are
// not sent: NCCL matches a pair's messages in posting order, and CudaRing serializes the calls of one
// communicator. Any failure throws kBackend and the caller aborts the communicator, so abandon() has
// nothing to forget. n - 1 host round trips per exchange: hence opt-in (RINGREDUCE_CHECK=1).
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

// Polls `event` until it fired; throws kBackend on a CUDA error, once `comm` is aborted (an event
// fired by the abort does not count), at `deadline` (naming `what`), or on Ctrl-C (aborting `comm`).
void hostWait(cudaEvent_t event, NcclComm& comm, std::chrono::steady_clock::time_point deadline,
              const std::string& what);

class NcclFrameTransport final : public Transport {
 public:
  static constexpr size_t kMaxMessage = kFrameBytes;
  // Bytes of device and of pinned host staging (one send and one receive slot each).
  static constexpr size_t kStagingBytes = 2 * kMaxMessage;

  // On `stream` of `comm`'s device (current); `done` marks the end of each hop; both stagings have
  // kStagingBytes. Nothing is owned.
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
