// Shared helpers for the Nereus C++ core.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace nereus {

// Error raised when a caller breaks a documented precondition. pybind11 maps
// std::invalid_argument to Python's ValueError, so user errors surface as
// ValueError with the file and line where the check failed.
class CallerError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace nereus

// NEREUS_CHECK(cond, msg-stream): raise ValueError "<file>:<line>: expected <cond>: <msg>".
#define NEREUS_CHECK(cond, msg)                                                           \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::ostringstream nereus_check_os_;                                                \
      nereus_check_os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << msg; \
      throw ::nereus::CallerError(nereus_check_os_.str());                                \
    }                                                                                     \
  } while (0)
