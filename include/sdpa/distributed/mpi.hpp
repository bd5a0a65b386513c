// What sdpa's distributed layers (ring_attention.hpp, head_parallel.hpp) share over MPI: the datatype of a
// Scalar, checked MPI calls, and the collective agreement that every distributed call makes before it
// exchanges anything. The agreement gathers each rank's own refusal (the message its local checks threw)
// and a list of named fields that must be equal on every rank (shapes, options); then either every rank
// throws the same std::invalid_argument, naming the first refusing rank or the first field that differs and
// its values on two ranks, or none does. A rank given bad input therefore never leaves the others waiting
// in an exchange it will not join.
//
// Part of the optional sdpa::mpi target (CMake: SDPA_MPI, AUTO like SDPA_ONEDNN): the header-only core does
// not include MPI. MPI must be initialized (MPI_Init) before any of these calls; the communicator's error
// handler is the caller's (MPI's default aborts on a failed call; with MPI_ERRORS_RETURN sdpa throws
// std::runtime_error naming the call).
#pragma once

#include "sdpa/config.hpp"

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "sdpa/error.hpp"
#include "sdpa/options.hpp"
#include "sdpa/rotary.hpp"

SDPA_NAMESPACE_BEGIN
namespace distributed {
namespace detail {

template <typename Scalar>
MPI_Datatype mpi_type() noexcept {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "sdpa's distributed layers take float or double");
  return std::is_same<Scalar, float>::value ? MPI_FLOAT : MPI_DOUBLE;
}

inline void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(::sdpa::detail::concat("sdpa: ", call, " failed: ", std::string(text, static_cast<std::size_t>(length))));
}

// The communicator's size and this process's rank; refuses (locally: there is no one to agree with) a null
// communicator or an MPI that is not running.
struct CommShape {
  int rank = 0, size = 1;
};

inline CommShape comm_shape(MPI_Comm comm, const char* where) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw std::logic_error(::sdpa::detail::concat("sdpa::", where, ": MPI is not running (call MPI_Init first, and not after MPI_Finalize)"));
  if (comm == MPI_COMM_NULL) ::sdpa::detail::throw_invalid(where, "comm", "a communicator", "MPI_COMM_NULL");
  CommShape s;
  check_mpi(MPI_Comm_rank(comm, &s.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &s.size), "MPI_Comm_size");
  return s;
}

// A value every rank must pass alike: integers as they are, reals by their bits (printed as reals), lists
// by their length and a hash of their bytes.
struct Field {
  const char* name = "";
  std::int64_t value = 0;
  enum Kind { kInteger, kReal, kHash } kind = kInteger;
};

class Fields {
 public:
  Fields& integer(const char* name, std::int64_t v) {
    list_.push_back({name, v, Field::kInteger});
    return *this;
  }
  Fields& real(const char* name, double v) {
    std::int64_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    list_.push_back({name, bits, Field::kReal});
    return *this;
  }
  // Its element count under `name`, its bytes' hash (FNV-1a) under the same name.
  template <typename T>
  Fields& list(const char* name, const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable<T>::value, "a list of plain values");
    integer(name, static_cast<std::int64_t>(v.size()));
    std::uint64_t h = 1469598103934665603ull;
    const auto* bytes = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    list_.push_back({name, static_cast<std::int64_t>(h), Field::kHash});
    return *this;
  }
  const std::vector<Field>& list() const noexcept { return list_; }

 private:
  std::vector<Field> list_;
};

// The fields of the options that every rank must pass alike (the tensors by their shapes).
template <typename Scalar>
void add_option_fields(Fields& f, const AttentionOptions<Scalar>& o) {
  f.integer("the scalar type's size", static_cast<std::int64_t>(sizeof(Scalar)))
      .integer("options.layout", static_cast<std::int64_t>(o.layout))
      .integer("causal", o.causal ? 1 : 0)
      .integer("window_left", o.window_left)
      .integer("window_right", o.window_right)
      .list("key_lengths", o.key_lengths)
      .list("alibi_slopes", o.alibi_slopes)
      .real("scale", static_cast<double>(o.scale))
      .real("softcap", static_cast<double>(o.softcap))
      .list("sinks", o.sinks)
      .integer("kernel", static_cast<std::int64_t>(o.kernel))
      .integer("masked_rows", static_cast<std::int64_t>(o.masked_rows))
      .real("dropout", static_cast<double>(o.dropout))
      .list("cu_seqlens_q", o.cu_seqlens_q)
      .list("cu_seqlens_k", o.cu_seqlens_k)
      .integer("probabilities (set or not)", o.probabilities != nullptr ? 1 : 0);
  const auto shape = [&f](const char* name, const auto* t) {
    for (std::size_t i = 0; i < 4; ++i) f.integer(name, t != nullptr ? t->dimension(i) : -1);
  };
  shape("attention_mask's shape", o.attention_mask);
  shape("attention_weights' shape", o.attention_weights);
  shape("attention_bias' shape", o.attention_bias);
  const Rotary none;
  const Rotary& r = o.rotary != nullptr ? *o.rotary : none;
  f.integer("rotary (set or not)", o.rotary != nullptr ? 1 : 0)
      .integer("rotary.dim", r.dim)
      .integer("rotary.interleaved", r.interleaved ? 1 : 0)
      .real("rotary.theta", r.theta)
      .list("rotary.inv_freq", r.inv_freq)
      .real("rotary.attention_factor", r.attention_factor)
      .list("rotary.long_inv_freq", r.long_inv_freq)
      .integer("rotary.long_after", r.long_after);
}

inline std::string field_text(const Field& f, std::int64_t value) {
  if (f.kind == Field::kReal) {
    double v = 0;
    std::memcpy(&v, &value, sizeof v);
    return ::sdpa::detail::concat(v);
  }
  if (f.kind == Field::kHash) return "(other values)";
  return ::sdpa::detail::concat(value);
}

// The agreement (see the header comment): the message every rank must throw, or "" when every rank passed
// and the fields agree. `refusal` is this rank's own message ("" when its checks passed). Collective: every
// rank of comm calls it with the same fields (in number and order).
inline std::string agreed_refusal(MPI_Comm comm, const CommShape& cs, const char* where, const std::string& refusal,
                                  const Fields& fields) {
  const std::vector<Field>& f = fields.list();
  const std::size_t n = f.size() + 2;
  std::vector<std::int64_t> mine(n), all(n * static_cast<std::size_t>(cs.size));
  mine[0] = static_cast<std::int64_t>(refusal.size());
  mine[1] = static_cast<std::int64_t>(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) mine[i + 2] = f[i].value;
  check_mpi(MPI_Allgather(mine.data(), static_cast<int>(n), MPI_INT64_T, all.data(), static_cast<int>(n), MPI_INT64_T, comm),
            "MPI_Allgather");
  const auto at = [&](int rank, std::size_t i) { return all[static_cast<std::size_t>(rank) * n + i]; };
  for (int r = 0; r < cs.size; ++r) {
    if (at(r, 0) == 0) continue;
    // The first refusing rank's message, to every rank.
    std::string text = refusal;
    text.resize(static_cast<std::size_t>(at(r, 0)));
    check_mpi(MPI_Bcast(&text[0], static_cast<int>(text.size()), MPI_CHAR, r, comm), "MPI_Bcast");
    return ::sdpa::detail::concat(text, " (rank ", r, " of ", cs.size, "; every rank refuses)");
  }
  for (int r = 1; r < cs.size; ++r) {
    if (at(r, 1) != at(0, 1))
      return ::sdpa::detail::concat("sdpa::", where, ": ranks 0 and ", r, " checked different argument lists (different sdpa builds?)");
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (at(r, i + 2) == at(0, i + 2)) continue;
      return ::sdpa::detail::concat("sdpa::", where, ": ", f[i].name, " must be the same on every rank, but is ",
                                    field_text(f[i], at(0, i + 2)), " on rank 0 and ", field_text(f[i], at(r, i + 2)), " on rank ", r);
    }
  }
  return std::string();
}

inline void agree(MPI_Comm comm, const CommShape& cs, const char* where, const std::string& refusal, const Fields& fields) {
  const std::string message = agreed_refusal(comm, cs, where, refusal, fields);
  if (!message.empty()) throw std::invalid_argument(message);
}

// Runs `check` (this rank's own checks, which throw std::invalid_argument or another std::logic_error) and
// agrees on its outcome and on `fields` with every rank: every rank returns, or every rank throws.
template <typename Check>
void checked_collectively(MPI_Comm comm, const CommShape& cs, const char* where, Check&& check, const Fields& fields) {
  std::string refusal;
  try {
    check();
  } catch (const std::logic_error& e) {  // std::invalid_argument included
    refusal = e.what();
  }
  agree(comm, cs, where, refusal, fields);
}

}  // namespace detail
}  // namespace distributed
SDPA_NAMESPACE_END
