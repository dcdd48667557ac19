// Note [Where an error was thrown] (csrc/core/error.h): a message users act on carries no C++ source
// location; an internal error ends in " [csrc/<file>:<line>]"; where() holds the location always.
#include <functional>
#include <string>

#include "check.h"
#include "core/error.h"

using namespace rr;

namespace {

Error thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "nothing was thrown");
}

bool endsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

TEST_CASE(user_errors_have_no_source_location) {
  const int line = __LINE__ + 1;
  const Error r = thrown([] { RR_CHECK(1 + 1 == 3, kRuntime, "ringreduce: call #", 3, " differs"); });
  CHECK(r.kind() == ErrorKind::kRuntime);
  CHECK_EQ(std::string(r.what()), std::string("ringreduce: call #3 differs"));
  CHECK_MSG(endsWith(r.where(), "test_error.cpp:" + std::to_string(line)), r.where());
  const Error t = thrown([] { RR_THROW(kType, "ringreduce: op AVG is not supported for int32"); });
  CHECK(t.kind() == ErrorKind::kType && std::string(t.what()) == "ringreduce: op AVG is not supported for int32");
  const Error v = thrown([] { RR_THROW(kValue, "ringreduce: bad segment size ", -1); });
  CHECK(v.kind() == ErrorKind::kValue && std::string(v.what()) == "ringreduce: bad segment size -1");
  const Error b = thrown([] { RR_THROW(kBackend, "ringreduce: rank 1 exited"); });
  CHECK(b.kind() == ErrorKind::kBackend && std::string(b.what()) == "ringreduce: rank 1 exited");
  CHECK(!b.where().empty());
}

TEST_CASE(internal_errors_keep_file_and_line) {
  const int line = __LINE__ + 1;
  const Error e = thrown([] { RR_CHECK(1 + 1 == 3, kRuntime, "ringreduce internal error: ", 2, " slots"); });
  CHECK_MSG(endsWith(e.where(), "test_error.cpp:" + std::to_string(line)), e.where());
  CHECK_MSG(endsWith(e.what(), "ringreduce internal error: 2 slots [" + e.where() + "]"), e.what());
  // Paths inside csrc/ are shortened to start there.
  CHECK_EQ(detail::location("/home/u/ringreduce/csrc/cpu/group_runtime.cpp", 419),
           std::string("csrc/cpu/group_runtime.cpp:419"));
}

TEST_CASE(errors_built_by_hand_are_kept_as_given) {
  const Error e(ErrorKind::kRuntime, "ringreduce: verdict");
  CHECK_EQ(std::string(e.what()), std::string("ringreduce: verdict"));
  CHECK(e.where().empty());
}

TEST_MAIN()
