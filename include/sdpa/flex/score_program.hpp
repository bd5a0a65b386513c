// A score program as the checked core holds it (sdpa/flex.hpp makes them): score and mask functions, a
// block plan and the tables the score function reads, behind one interface, so that AttentionOptions can
// carry any program and attention_backward can run the same program again. Behind the interface each
// program runs kernels instantiated for its own functions (kernels/program.hpp): nothing is called through
// a pointer per score.
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"

#include <array>

SDPA_NAMESPACE_BEGIN
enum class Kernel;  // sdpa/options.hpp
namespace kernels {
template <typename Scalar>
struct AttentionProblem;
template <typename Scalar>
struct DecodeWorkspace;
template <typename Scalar>
struct BackwardProblem;
struct BackwardStatus;
}  // namespace kernels

template <typename Scalar>
class ScoreProgram {
 public:
  using Index = Eigen::Index;
  virtual ~ScoreProgram() = default;

  // Refuses (std::invalid_argument, naming `where`) a call the program cannot serve: a plan of another
  // shape, a table that does not fit the heads, a plan in a packed call.
  virtual void check(const char* where, Index batch, Index heads, Index nq, Index nk, bool packed) const = 0;
  // The forward of a checked problem (p.program is this program): the decoding kernel where kAuto would
  // choose it (its scratch in `workspace`, or a fresh one), the tiled kernel otherwise.
  virtual void forward(const kernels::AttentionProblem<Scalar>& p, Kernel kernel, kernels::DecodeWorkspace<Scalar>* workspace,
                       const Eigen::ThreadPoolDevice* device) const = 0;
  // The tiled backward of a checked problem; the tables' gradients go to bp.d_tables.
  virtual kernels::BackwardStatus backward(const kernels::BackwardProblem<Scalar>& bp,
                                           const Eigen::ThreadPoolDevice* device) const = 0;
  // Whether the program has a block plan (ring attention, whose blocks are not the call's, refuses one).
  virtual bool has_plan() const = 0;
  // The ScoreTables the score function reads, in the order of their gradients: each one's (rows, cols).
  virtual Index table_count() const = 0;
  virtual std::array<Index, 2> table_dims(Index i) const = 0;
  // The first key position any query at `position` or later can see, for every batch entry and head (a
  // mask function's keep_from: Llama 4's chunks, a causal window); a decoding cache may drop the keys before
  // it. 0: the program cannot say, nothing is dropped.
  virtual Index keep_from(Index /*position*/) const { return 0; }
};

SDPA_NAMESPACE_END
