// ringreduce core: the one family of error macros.
//
// Every failure is thrown as rr::Error with a kind, which the bindings map to a Python exception (see
// ErrorKind). Nothing in ringreduce calls abort(), exit() or assert(false).
//
// Note [Where an error was thrown]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A message is the user's to act on, and its C++ line tells a user nothing, so what() is the message
// alone, except for an internal error (a message starting "ringreduce internal error": a bug to
// report), whose what() ends in " [csrc/<file>:<line>]". where() always holds the location.
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

namespace detail {
inline constexpr char kInternalPrefix[] = "ringreduce internal error";

inline bool isInternal(const std::string& message) { return message.rfind(kInternalPrefix, 0) == 0; }

// "csrc/cpu/group_runtime.cpp:419" from __FILE__ (an absolute path in most builds) and __LINE__.
inline std::string location(const char* file, int line) {
  std::string f = file;
  const size_t csrc = f.rfind("csrc/");
  if (csrc != std::string::npos) f.erase(0, csrc);
  return f + ":" + std::to_string(line);
}
}  // namespace detail

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  // Note [Where an error was thrown]: the location is part of what() for internal errors only.
  Error(ErrorKind kind, const std::string& message, const char* file, int line)
      : std::runtime_error(detail::isInternal(message) ? message + " [" + detail::location(file, line) + "]"
                                                       : message),
        kind_(kind),
        where_(detail::location(file, line)) {}
  ErrorKind kind() const { return kind_; }
  // "csrc/<file>:<line>" of the RR_THROW or RR_CHECK, or "" for an Error built without one.
  const std::string& where() const { return where_; }

 private:
  ErrorKind kind_;
  std::string where_;
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

#define RR_THROW(kind, ...) \
  throw ::rr::Error(::rr::ErrorKind::kind, ::rr::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

#define RR_CHECK(cond, kind, ...) \
  do {                            \
    if (!(cond)) {                \
      RR_THROW(kind, __VA_ARGS__); \
    }                             \
  } while (0)
