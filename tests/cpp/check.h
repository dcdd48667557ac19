// A tiny test harness for the C++ unit tests: TEST cases registered at static-init time, CHECK
// macros that report file:line and keep going, and a main() that runs every case (or the ones
// whose name contains argv[1]) and returns non-zero when any check failed.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace rrtest {

// Sanitizer builds (RR_SANITIZE) run thinner sweeps: they look for memory, UB and thread bugs in
// the same code paths, not for more parameter combinations.
#if defined(RR_TEST_SANITIZED)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}
inline int& failures() {
  static int count = 0;
  return count;
}
inline int& checks() {
  static int count = 0;
  return count;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline void report(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  std::fflush(stderr);
}

template <typename A, typename B>
std::string pairText(const char* ea, const char* eb, const A& a, const B& b) {
  std::ostringstream os;
  os << ea << " == " << eb << " (" << a << " vs " << b << ")";
  return os.str();
}

// argv[1]: a substring of the case names to run, or --shard=K/N to run cases K, K+N, K+2N, ...
// (ctest runs the shards of one executable in parallel).
inline int runAll(int argc, char** argv) {
  const char* filter = argc > 1 ? argv[1] : nullptr;
  int shard = 0, nshards = 1;
  if (filter && std::sscanf(filter, "--shard=%d/%d", &shard, &nshards) == 2) filter = nullptr;
  int ran = 0, index = -1;
  for (const Case& c : cases()) {
    ++index;
    if (nshards > 1 && index % nshards != shard) continue;
    if (filter && !std::strstr(c.name, filter)) continue;
    const int before = failures();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.fn();
    } catch (const std::exception& e) {
      report(__FILE__, __LINE__, std::string("uncaught exception in ") + c.name + ": " + e.what());
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[%s] %s (%.0f ms)\n", failures() == before ? " OK " : "FAIL", c.name, ms);
    std::fflush(stdout);
    ++ran;
  }
  std::printf("%d cases, %d checks, %d failures\n", ran, checks(), failures());
  if (ran == 0) {
    std::fprintf(stderr, "no test case matched\n");
    return 2;
  }
  return failures() == 0 ? 0 : 1;
}

}  // namespace rrtest

#define RR_TEST_CAT2(a, b) a##b
#define RR_TEST_CAT(a, b) RR_TEST_CAT2(a, b)
#define TEST_CASE(name)                                                                  \
  static void name();                                                                    \
  static ::rrtest::Register RR_TEST_CAT(rr_register_, name)(#name, name);                \
  static void name()

#define CHECK(cond)                                                     \
  do {                                                                  \
    ++::rrtest::checks();                                               \
    if (!(cond)) ::rrtest::report(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CHECK_MSG(cond, msg)                                                                  \
  do {                                                                                        \
    ++::rrtest::checks();                                                                     \
    if (!(cond)) {                                                                            \
      std::ostringstream rr_os_;                                                              \
      rr_os_ << "CHECK(" #cond ") " << msg;                                                   \
      ::rrtest::report(__FILE__, __LINE__, rr_os_.str());                                     \
    }                                                                                         \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    ++::rrtest::checks();                                                                  \
    const auto rr_a_ = (a);                                                               \
    const auto rr_b_ = (b);                                                               \
    if (!(rr_a_ == rr_b_)) ::rrtest::report(__FILE__, __LINE__, ::rrtest::pairText(#a, #b, rr_a_, rr_b_)); \
  } while (0)

#define TEST_MAIN() \
  int main(int argc, char** argv) { return ::rrtest::runAll(argc, argv); }
