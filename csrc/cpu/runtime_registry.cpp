#include "runtime_registry.h"

#include <map>
#include <mutex>
#include <utility>

namespace rr {

namespace {

std::mutex g_mu;
using Key = std::pair<const void*, std::vector<int>>;
std::map<Key, std::shared_ptr<GroupRuntime>>& registry() {
  static auto* r = new std::map<Key, std::shared_ptr<GroupRuntime>>();
  return *r;  // leaked on purpose: never destroyed from a static destructor (workers are joined
              // by shutdownAllRuntimes(), called from Python's atexit)
}

std::vector<std::shared_ptr<GroupRuntime>> runtimesOf(const void* owner) {
  std::vector<std::shared_ptr<GroupRuntime>> out;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& kv : registry())
    if (kv.first.first == owner) out.push_back(kv.second);
  return out;
}

}  // namespace

std::shared_ptr<GroupRuntime> runtimeFor(const void* owner, const std::vector<int>& key,
                                         const std::function<std::shared_ptr<GroupRuntime>()>& make) {
  std::lock_guard<std::mutex> g(g_mu);
  auto& reg = registry();
  auto it = reg.find({owner, key});
  if (it != reg.end()) return it->second;
  std::shared_ptr<GroupRuntime> rt = make();
  reg.emplace(Key(owner, key), rt);
  return rt;
}

std::shared_ptr<GroupRuntime> findRuntime(const void* owner, const std::vector<int>& key) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = registry().find({owner, key});
  return it == registry().end() ? nullptr : it->second;
}

void shutdownAllRuntimes() {
  std::vector<std::shared_ptr<GroupRuntime>> all;
  {
    std::lock_guard<std::mutex> g(g_mu);
    for (auto& kv : registry()) all.push_back(kv.second);
    registry().clear();
  }
  for (auto& rt : all) rt->shutdown();
}

int releaseRuntimesOf(const void* owner) {
  std::vector<std::shared_ptr<GroupRuntime>> released;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto& reg = registry();
    for (auto it = reg.begin(); it != reg.end();) {
      if (it->first.first == owner) {
        released.push_back(it->second);
        it = reg.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& rt : released) rt->shutdown();  // outside the lock: a worker may be finishing a call
  return static_cast<int>(released.size());
}

int runtimeCount() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<int>(registry().size());
}

int64_t stagingBytesOf(const void* owner) {
  int64_t total = 0;
  for (auto& rt : runtimesOf(owner)) total += rt->stagingBytes();
  return total;
}

int64_t memoryBytesOf(const void* owner) {
  int64_t total = 0;
  for (auto& rt : runtimesOf(owner)) total += rt->memoryBytes();
  return total;
}

std::vector<int64_t> bytesSentOf(const void* owner, int size, bool reset) {
  std::vector<int64_t> out(static_cast<size_t>(size), 0);
  for (auto& rt : runtimesOf(owner)) {
    const std::vector<int64_t> v = rt->bytesSent(reset);
    for (size_t i = 0; i < out.size() && i < v.size(); ++i) out[i] += v[i];
  }
  return out;
}

}  // namespace rr
