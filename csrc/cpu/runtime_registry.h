// ringreduce CPU: every ring's GroupRuntime, by owner (the process group's pointer) and ringKey,
// created on first use and destroyed by releaseRuntimesOf() or shutdownAllRuntimes() (exit).
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
// Removes every ring of `owner` (a group being destroyed), finishes their queued calls and joins their
// workers; returns how many. A new group at the same address then gets fresh runtimes.
int releaseRuntimesOf(const void* owner);

// How many rings (GroupRuntimes) the registry holds, every owner's.
int runtimeCount();

// Sums over every ring of `owner`: staging bytes, all memory held, and payload bytes sent to each of
// the owner's `size` ranks (Note [Traffic counters]; `reset` zeroes the counters).
int64_t stagingBytesOf(const void* owner);
int64_t memoryBytesOf(const void* owner);
std::vector<int64_t> bytesSentOf(const void* owner, int size, bool reset);

}  // namespace rr
