#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "../core/error.h"

namespace rr {

namespace {

std::string errnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// Maps `bytes` of the open segment `fd` and closes it; on failure unlinks `unlink_name` (when not empty).
std::string mapSegment(int fd, size_t bytes, ShmMapping* out, const std::string& unlink_name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (!unlink_name.empty()) shm_unlink(unlink_name.c_str());
    errno = err;
    return errnoText("mmap");
  }
  out->base = p;
  out->bytes = bytes;
  return "";
}

}  // namespace

std::string KeyValueStore::get(const std::string& key, std::chrono::milliseconds timeout, const AbortCheck& abort) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::string value;
    try {
      if (tryGet(key, &value)) return value;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      RR_THROW(kBackend, "ringreduce: setting up shared memory: the store failed while waiting for ", key, " (",
               e.what(), ")");
    }
    if (abort) {
      const std::string why = abort();
      RR_CHECK(why.empty(), kBackend, why);
    }
    RR_CHECK(std::chrono::steady_clock::now() < deadline, kBackend, "ringreduce: setting up shared memory: timed out after ",
             timeout.count(), " ms (the timeout) waiting for ", key, " (a rank of the ring did not make the call)");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string hostIdentity() {
  char host[256] = {0};
  (void)gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return std::string(host) + "/" + boot;
}

void ShmMapping::unmap() {
  if (base != nullptr) (void)munmap(base, bytes);
  base = nullptr;
  bytes = 0;
}

std::string newSegmentName() {
  std::random_device rd;
  std::ostringstream os;
  os << "/ringreduce-" << getpid() << "-" << std::hex << ((static_cast<uint64_t>(rd()) << 32) | rd());
  return os.str();
}

std::string createSegment(const std::string& name, size_t bytes, ShmMapping* out) {
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (avail < bytes + (bytes >> 3)) {
      std::ostringstream os;
      os << "/dev/shm has " << (avail >> 20) << " MiB free, the segment needs " << ((bytes + (1 << 20) - 1) >> 20)
         << " MiB (a container's default is 64 MB: enlarge it with --shm-size)";
      return os.str();
    }
  }
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return errnoText("shm_open");
  // Reserve the pages now: tmpfs allocates lazily, and a full /dev/shm would otherwise be a SIGBUS
  // at the first touch instead of an error here.
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return std::string("reserving the segment failed: ") + std::strerror(rc);
  }
  return mapSegment(fd, bytes, out, name);
}

std::string openSegment(const std::string& name, size_t bytes, ShmMapping* out) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return errnoText("shm_open");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    return "the segment is smaller than expected";
  }
  return mapSegment(fd, bytes, out, "");
}

void unlinkSegment(const std::string& name) { (void)shm_unlink(name.c_str()); }

std::string agreeOnSegment(KeyValueStore& store, const std::string& prefix, int ring_rank, int ring_size,
                           size_t bytes, bool want, std::chrono::milliseconds timeout, ShmMapping* out,
                           const AbortCheck& abort) {
  store.set(prefix + "/host/" + std::to_string(ring_rank), std::string(want ? "1" : "0") + hostIdentity());
  std::string decision;
  std::string name;
  if (ring_rank == 0) {
    const std::string mine = hostIdentity();
    for (int r = 0; r < ring_size && decision.empty(); ++r) {
      const std::string v = store.get(prefix + "/host/" + std::to_string(r), timeout, abort);
      if (v.empty() || v[0] != '1') decision = "RINGREDUCE_SHM=0 on ring rank " + std::to_string(r);
      else if (v.substr(1) != mine) decision = "the ring's ranks are on more than one host";
    }
    if (decision.empty()) {
      name = newSegmentName();
      decision = createSegment(name, bytes, out);
      if (!decision.empty()) decision = "could not create a shared-memory segment: " + decision;
    }
    store.set(prefix + "/decision", decision.empty() ? "+" + name : "-" + decision);
  } else {
    const std::string v = store.get(prefix + "/decision", timeout, abort);
    if (v.empty() || v[0] != '+') return v.empty() ? "no decision" : v.substr(1);
    name = v.substr(1);
    const std::string why = openSegment(name, bytes, out);
    store.set(prefix + "/ack/" + std::to_string(ring_rank), why.empty() ? "+" : "-" + why);
    const std::string fin = store.get(prefix + "/final", timeout, abort);
    if (fin != "+") {
      out->unmap();
      return fin.substr(1);
    }
    return "";
  }
  if (!decision.empty()) return decision;
  // Rank 0: every rank has answered (mapped or not); the name is not needed any more.
  std::string fin;
  try {
    for (int r = 1; r < ring_size && fin.empty(); ++r) {
      const std::string v = store.get(prefix + "/ack/" + std::to_string(r), timeout, abort);
      if (v != "+") fin = "ring rank " + std::to_string(r) + " could not map the segment: " + v.substr(1);
    }
  } catch (...) {
    unlinkSegment(name);
    out->unmap();
    throw;
  }
  unlinkSegment(name);
  store.set(prefix + "/final", fin.empty() ? "+" : "-" + fin);
  if (!fin.empty()) out->unmap();
  return fin;
}

}  // namespace rr
