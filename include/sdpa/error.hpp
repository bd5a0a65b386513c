// Error reporting shared by every header: messages that name the argument, what was expected and what
// was given, so that a caller can act on them without reading the source. Arguments are refused with
// std::invalid_argument; file problems (see io/) use std::runtime_error.
#pragma once

#include "sdpa/config.hpp"

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>

SDPA_NAMESPACE_BEGIN
namespace detail {

// "(2, 3, 4)" for any container of integers, or a raw pointer + count.
template <typename Int>
std::string shape_string(const Int* dims, std::size_t rank) {
  std::ostringstream os;
  os << '(';
  for (std::size_t i = 0; i < rank; ++i) {
    if (i) os << ", ";
    os << dims[i];
  }
  if (rank == 1) os << ',';
  os << ')';
  return os.str();
}

template <typename Dims>
std::string shape_string(const Dims& dims) {
  return shape_string(&dims[0], static_cast<std::size_t>(dims.size()));
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// Throws std::invalid_argument("<where>: <argument> must be <expected>, but is <actual>").
template <typename Expected, typename Actual>
[[noreturn]] void throw_invalid(const char* where, const std::string& argument, const Expected& expected,
                                const Actual& actual) {
  throw std::invalid_argument(
      concat("sdpa::", where, ": ", argument, " must be ", expected, ", but is ", actual));
}

}  // namespace detail
SDPA_NAMESPACE_END
