// ringreduce CPU: POSIX shared-memory segments for the ranks of one host, and how the ranks of a ring
// agree to use one (torch-free; the torch glue adapts the process group's c10d store to KeyValueStore).
//
// Note [Shared-memory segments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One segment per ring. Ring index 0 creates it (O_EXCL, mode 0600), every other rank maps it and
// says so through the store, and the creator unlinks it once every rank answered: the kernel then
// frees it when the last process that maps it exits, however it exits (SIGKILL included). Rank 0
// decides from every rank's report (its host: hostname and boot_id, never an environment variable;
// and RINGREDUCE_SHM), confirmed by every rank's answer after mapping: every rank uses the segment,
// or every rank falls back to gloo point-to-point, with the reason.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace rr {

// Returns why a wait must stop now (Ctrl-C on this rank), or "" to go on.
using AbortCheck = std::function<std::string()>;

// What the ranks of a ring share to agree on a segment (the process group's c10d store).
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of `key` if it is set (false: not yet), without blocking.
  virtual bool tryGet(const std::string& key, std::string* value) = 0;
  // Waits until `key` is set (polling every millisecond); throws rr::Error(kBackend) after `timeout`
  // or with abort()'s reason (abort may be empty).
  std::string get(const std::string& key, std::chrono::milliseconds timeout, const AbortCheck& abort);
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// This host's identity: hostname and boot id. Two containers of one kernel share the boot id; they
// share /dev/shm too only in some setups, which is why every rank must also map the segment.
std::string hostIdentity();

// A mapped segment; its ShmRing unmaps it when the ring is released (a failed ring's too: its peers
// write only into their own mappings of it).
struct ShmMapping {
  void* base = nullptr;
  size_t bytes = 0;
  void unmap();
};

// Creates and maps a new zeroed segment; returns "" on success, else why not.
std::string createSegment(const std::string& name, size_t bytes, ShmMapping* out);
// Maps an existing segment; returns "" on success, else why not.
std::string openSegment(const std::string& name, size_t bytes, ShmMapping* out);
void unlinkSegment(const std::string& name);
// A fresh segment name: "/ringreduce-<pid>-<random>".
std::string newSegmentName();

// Note [Shared-memory segments]: the agreement of one ring. `prefix`: its store keys (unique per
// ring and setup); `want`: RINGREDUCE_SHM; `abort`: as KeyValueStore::get. Returns "" and the
// mapping, or the reason (the same on every rank) and no mapping.
std::string agreeOnSegment(KeyValueStore& store, const std::string& prefix, int ring_rank, int ring_size,
                           size_t bytes, bool want, std::chrono::milliseconds timeout, ShmMapping* out,
                           const AbortCheck& abort = nullptr);

}  // namespace rr
