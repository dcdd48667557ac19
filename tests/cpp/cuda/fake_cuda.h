// ringreduce tests: a fake CUDA runtime and NCCL, on the host, for CudaRing and NcclComm.
//
// Note [Fake CUDA runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// fake_cuda.cpp defines the CUDA runtime and NCCL entry points that csrc/cuda/group_runtime.cpp and
// nccl_comm.cpp call, so that those files - the real ones, compiled with the host compiler - run
// here without a GPU. The model is just rich enough for the host-side logic (watchdog, work
// states, abort, shutdown, device guard, timeouts):
//   * a stream is a queue of ops run in order; an event record fires when reached; a stream wait
//     captures the event's latest record and blocks the stream until it fired; copies are memcpy
//     (device memory is host memory); launchReduce() enqueues nothing;
//   * ncclSend/ncclRecv queue tasks in the thread's group; the outermost ncclGroupEnd puts one
//     "exchange" op on the stream; for a non-blocking communicator it returns ncclInProgress and
//     the communicator's async state stays ncclInProgress until the hand-off delay passed (NCCL
//     >= 2.23's non-blocking behaviour, src/group.cc); for a blocking one it returns ncclSuccess
//     (the launch happened in the call). A nested ncclGroupEnd only decrements the depth
//     (ncclSuccess); blocking and non-blocking communicators in one group are refused
//     (ncclInvalidUsage), as NCCL does;
//   * ncclCommSplit derives a child sharing its parent's abort flag (config.splitShare), blocking
//     or not as its config says; on a non-blocking parent it returns ncclSuccess with the handle
//     still NULL, and writes the handle when the parent's state turns ncclSuccess (NCCL 2.28.9);
//   * host waits are counted: every ncclInProgress returned to the caller (init, split,
//     non-blocking ncclGroupEnd: each obliges the caller to poll before going on) and every
//     cudaStreamSynchronize;
//   * an exchange op passes when the exchange budget allows it, or once its communicator was
//     aborted (NCCL's kernels exit on abort) unless the test says otherwise;
//   * communicators created after linkRanks() (threads as ranks, one world until reset()) move
//     their messages: an exchange posts its sends to per-(communicator level, src, dst) mailboxes
//     (NCCL matches messages per communicator: a parent's never meets its child's) when it reaches the
//     front of its stream, and completes once each of its receives has a message (matched in
//     sending order); other communicators move nothing;
//   * ops run only when someone polls (event/stream queries), as a GPU would, from any thread;
//   * cudaEventQuery on a thread in global capture mode while a global capture is on returns
//     cudaErrorStreamCaptureUnsupported and invalidates the capture (CUDA's rule);
//   * a not-ready result is recorded as the thread's last error (cudaGetLastError);
//   * cudaSetDevice (and allocations) create the device's primary context; cudaGetDevice does not.
//
// Note [Fake NCCL versions and aborts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   * setNcclVersion(c) makes ncclGetVersion report c and models what differs: below 22300 (2.23)
//     a non-blocking outermost ncclGroupEnd whose peers are all connected already (per
//     communicator family, as NCCL's shared connectors) launches inline and returns ncclSuccess
//     (src/group.cc of 2.21.5); from 22400 (2.24) an ncclCommAbort inside a group sets the abort
//     flag at once and leaves its wait to the outermost ncclGroupEnd;
//   * with setAbortWaitsForKernels(true), ncclCommAbort (or that ncclGroupEnd) waits, as NCCL's
//     commDestroySync does, until no exchange of the communicator's family is left on any stream;
//     an exchange behind a wait for another communicator's stuck exchange never leaves, so after
//     2 s the wait gives up and counts a hang (abortHangs()).
#pragma once

#include <cuda_runtime_api.h>

namespace rrfake {

void reset();                       // everything back to defaults (no contexts, budget unlimited)
void setExchangeBudget(int n);      // exchanges that may still run; -1: unlimited
void allowExchanges(int n);         // budget += n
void setAbortReleases(bool on);     // default true: an abort lets held exchanges pass
void setAbortSleepMs(int ms);       // ncclCommAbort returns this long after releasing the exchanges
void setInitMs(int ms);             // ncclCommInitRankConfig's hand-off delay
void setDefaultHandoffMs(int ms);   // each outermost ncclGroupEnd's hand-off delay (-1: never)
void pushHandoffMs(int ms);         // the next outermost ncclGroupEnd's delay (queued)
void setGlobalCapture(bool on);     // another thread captures in global mode
bool captureInvalidated();
void setStreamCapturing(cudaStream_t s, bool on);
bool contextActive(int device);
int streamsDestroyed();
int streamSyncTimeouts();           // cudaStreamSynchronize calls that would have hung
int abortCalls();
int exchangesRun();                 // exchange ops that ran
int ncclTaskCalls();                // ncclSend + ncclRecv calls
bool streamValid(cudaStream_t s);
void linkRanks();                   // communicators created from now until reset() move messages
int sizeMismatches();               // linked receives whose message had another size
int messagesLeft();                 // linked messages sent but never received
int pairsUsed();                    // (level, src, dst) of linked ranks that exchanged a message
int hostWaits();                    // see the Note
int queuedGroups();                 // blocking ncclGroupEnd calls
void failQueuedGroupAt(int k);      // the k-th (0-based) blocking ncclGroupEnd fails (ncclSystemError)
// Note [Fake NCCL versions and aborts]
void setNcclVersion(int code);      // ncclGetVersion's answer and the behaviour modelled (default: nccl.h's)
void setAbortWaitsForKernels(bool on);  // default false: ncclCommAbort returns without waiting
int abortHangs();                   // aborts that would have waited for ever
int groupedAborts();                // ncclCommAbort calls inside a group (NCCL >= 2.24: deferred)
int splits();                       // ncclCommSplit calls
void failSplits(bool on);           // ncclCommSplit fails (ncclInternalError)
int liveAllocations();              // cudaMalloc/cudaMallocHost blocks not freed yet (kept across reset())

}  // namespace rrfake
