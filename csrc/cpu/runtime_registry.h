// ringreduce CPU: every ring's GroupRuntime, by owner (a process group, as an opaque pointer) and ring
// key (csrc/core/collectives.h ringKey), created on first use and destroyed by releaseRuntimesOf()
// (the group's release) or shutdownAllRuntimes() (interpreter exit). Torch-free: the bindings pass
// `pg.get()` as the owner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "group_runtime.h"

namespace rr {

// The runtime of (owner, key); `make` creates it when there is none (under the registry's lock).
std::shared_ptr<GroupRuntime> runtimeFor(const void* owner, const std::vector<int>& key,
                                         const std::function<std::shared_ptr<GroupRuntime>()>& make);
// The runtime of (owner, key), or null before its first call.
std::shared_ptr<GroupRuntime> findRuntime(const void* owner, const std::vector<int>& key);
// Finishes queued calls and joins every worker; the registry is empty afterwards.
void shutdownAllRuntimes();
// Removes every ring of `owner` (a process group being destroyed) from the registry, finishes their
// queued calls and joins their workers; returns how many there were. A later runtimeFor() with the
// same address (a new group allocated where the old one was) creates a fresh runtime.
int releaseRuntimesOf(const void* owner);

// Sums over every ring of `owner`: staging bytes, all memory held, and payload bytes sent to each of
// the owner's `size` ranks (Note [Traffic counters]; `reset` zeroes the counters).
int64_t stagingBytesOf(const void* owner);
int64_t memoryBytesOf(const void* owner);
std::vector<int64_t> bytesSentOf(const void* owner, int size, bool reset);

}  // namespace rr
