// ringreduce core: which tag group each call of a ring uses, and the groups that are never used
// again (Note [Retired tag groups]).
#pragma once

#include <cstdint>
#include <vector>

#include "error.h"

namespace rr {

// Note [Retired tag groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring's calls take its tag groups in turn, wrapping around after the last. Every rank of the
// ring makes the same calls in the same order, so all of them give call #k the same group. A call
// that posted receives before it knew the call could go ahead (Note [Receives before the verdict]
// in csrc/cpu/group_runtime.cpp) and then failed its agreement check leaves those receives posted:
// gloo cannot take a receive back, and one left on a tag that a later call reuses would capture
// that call's message. Such a call's group is retired: every rank reaches the same verdict from
// the same frames, so every rank retires the same group, and the turn skips it from then on.
class CallTagGroups {
 public:
  explicit CallTagGroups(int groups) : retired_(static_cast<size_t>(groups), 0) {
    RR_CHECK(groups > 0, kRuntime, "ringreduce internal error: no tag groups");
  }

  int size() const { return static_cast<int>(retired_.size()); }
  int retired() const { return retired_count_; }

  // The group of the next call. Throws once every group is retired.
  int next() {
    const int n = size();
    for (int i = 0; i < n; ++i) {
      const int g = cursor_;
      cursor_ = (cursor_ + 1) % n;
      if (!retired_[static_cast<size_t>(g)]) return g;
    }
    RR_THROW(kRuntime, "ringreduce: all ", n, " tag groups of this ring are retired, one per call that failed "
             "its agreement check after posting receives. Create a new process group");
  }

  void retire(int g) {
    RR_CHECK(g >= 0 && g < size(), kRuntime, "ringreduce internal error: tag group ", g, " out of range");
    if (!retired_[static_cast<size_t>(g)]) ++retired_count_;
    retired_[static_cast<size_t>(g)] = 1;
  }

 private:
  std::vector<char> retired_;
  int cursor_ = 0;
  int retired_count_ = 0;
};

}  // namespace rr
