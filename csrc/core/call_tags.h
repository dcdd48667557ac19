// ringreduce core: which tag group each call of a ring uses, and the groups that are never used
// again (Note [Retired tag groups]).
#pragma once

#include <vector>

#include "error.h"

namespace rr {

// Note [Retired tag groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring's calls take its tag groups in turn (the same group for call #k on every rank). A call
// that posted receives before its verdict (Note [Receives before the verdict] in
// csrc/cpu/group_runtime.cpp) and then failed its check leaves them posted: gloo cannot take a
// receive back, and one left on a reused tag would capture a later call's message. So that group is
// retired, on every rank alike (same frames, same verdict), and skipped from then on.
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
