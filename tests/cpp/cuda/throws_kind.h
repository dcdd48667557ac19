// The fake-runtime tests' check that a call throws ringreduce's Error of a given kind.
#pragma once

#include <functional>
#include <string>

#include "../../../csrc/core/error.h"

namespace rr {

// Whether fn() throws an Error of `kind`; its message goes to *msg when given.
inline bool throwsKind(const std::function<void()>& fn, ErrorKind kind, std::string* msg = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (msg) *msg = e.what();
    return e.kind() == kind;
  }
  return false;
}

}  // namespace rr
