// ringreduce core: the one family of error macros.
//
// Every failure is thrown as rr::Error carrying a kind and a message ending in file:line. The torch
// binding layer maps the kind to the Python exception users expect (TypeError for dtype/op problems,
// ValueError for bad arguments, RuntimeError for cross-rank mismatches, DistBackendError for transport
// failures and timeouts). Nothing in ringreduce calls abort(), exit() or assert(false).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace rr {

enum class ErrorKind : int {
  kType = 0,      // unsupported dtype/op pair, non-tensor argument          -> TypeError
  kValue = 1,     // bad argument value (device, layout, group)              -> ValueError
  kRuntime = 2,   // cross-rank disagreement, misuse                         -> RuntimeError
  kBackend = 3,   // transport failure, dead peer, timeout, poisoned group   -> DistBackendError
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void streamAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void streamAll(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  streamAll(os, rest...);
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  streamAll(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace rr

#define RR_THROW(kind, ...)                                                                   \
  throw ::rr::Error(::rr::ErrorKind::kind,                                                    \
                    ::rr::detail::concat(__VA_ARGS__, " [", __FILE__, ":", __LINE__, "]"))

#define RR_CHECK(cond, kind, ...) \
  do {                            \
    if (!(cond)) {                \
      RR_THROW(kind, __VA_ARGS__); \
    }                             \
  } while (0)
