// sdpa's distributed layers (sdpa/distributed/) against the single-process ones, on however many ranks
// mpiexec starts (ctest runs -np 2 and -np 4): ring attention's forward and backward against sdpa::attention
// and attention_backward over the whole sequence (causal, windows, GQA with rotary, ALiBi, sinks, key
// lengths; both ring layouts; float and double), the same bits run to run; the head-parallel module
// against the whole module, forward and backward, and loaded from the whole module's file; refusals that
// every rank makes alike. Every rank builds the same whole tensors from the same seed and checks its share.
#include <gtest/gtest.h>

#include <sdpa/sdpa.hpp>
#include <sdpa/distributed/head_parallel.hpp>
#include <sdpa/distributed/ring_attention.hpp>
#ifdef SDPA_TEST_IO
#include <sdpa/distributed/head_parallel_io.hpp>
#endif

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace mpi_test {

using Index = Eigen::Index;
template <typename T>
using T4 = sdpa::Tensor4<T>;
template <typename T>
using T3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int ranks() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

template <typename Tensor>
void fill(Tensor& t, unsigned seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, scale);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<typename Tensor::Scalar>(normal(gen));
}

// max |a - b| / max(1, max |b|): the tolerance's scale is the reference's.
template <typename A, typename B>
double relative_error(const A& a, const B& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1;
  for (Index i = 0; i < std::min<Index>(a.size(), b.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b.data()[i])));
  }
  return diff / scale;
}

template <typename T>
double tolerance() {
  return std::is_same<T, float>::value ? 1e-6 : 1e-12;
}

template <typename A>
bool same_bits(const A& a, const A& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(*a.data()) * static_cast<std::size_t>(a.size())) == 0;
}

// The whole tensors of one case (the same on every rank).
template <typename T>
struct Whole {
  T4<T> q, k, v, d_out;
  Whole(Index batch, Index heads, Index kv_heads, Index n, Index d_k, Index d_v, sdpa::Layout layout = sdpa::Layout::kBHND) {
    const auto dims = [&](Index h, Index d) {
      return layout == sdpa::Layout::kBHND ? std::array<Index, 4>{batch, h, n, d} : std::array<Index, 4>{batch, n, h, d};
    };
    q = T4<T>(dims(heads, d_k));
    k = T4<T>(dims(kv_heads, d_k));
    v = T4<T>(dims(kv_heads, d_v));
    d_out = T4<T>(dims(heads, d_v));
    fill(q, 11);
    fill(k, 12);
    fill(v, 13);
    fill(d_out, 14);
  }
};

struct Case {
  const char* name;
  bool causal = false;
  Index window_left = -1, window_right = -1;
  bool gqa_rotary = false;  // 8 query heads over 2 key/value heads, rotary, ALiBi, sinks, key lengths, softcap
  Index block_rows = 0;
  sdpa::Layout layout = sdpa::Layout::kBHND;
};

const Case kCases[] = {
    {"causal", true, -1, -1, false, 0},
    {"causal, messages of 5 rows", true, -1, -1, false, 5},
    {"windowed both sides", false, 9, 4, false, 7},
    {"causal sliding window", true, 17, -1, false, 6},
    {"full (no mask)", false, -1, -1, false, 0},
    {"GQA + rotary + ALiBi + sinks + key lengths + softcap", true, -1, -1, true, 8},
    {"GQA + rotary, (batch, seq, heads, dim)", false, 20, 20, true, 0, sdpa::Layout::kBNHD},
};

template <typename T>
void run_case(const Case& c, sdpa::RingLayout ring_layout) {
  SCOPED_TRACE(std::string(c.name) + (ring_layout == sdpa::RingLayout::kZigZag ? ", zigzag" : ", contiguous"));
  const Index heads = c.gqa_rotary ? 8 : 4, kv_heads = c.gqa_rotary ? 2 : 4, n = 96, batch = 2;
  const Whole<T> w(batch, heads, kv_heads, n, 16, 12, c.layout);
  sdpa::AttentionOptions<T> o;
  o.layout = c.layout;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  sdpa::Rotary rotary;
  rotary.theta = 500;
  if (c.gqa_rotary) {
    o.rotary = &rotary;
    o.alibi_slopes = sdpa::alibi_slopes<T>(heads);
    o.sinks = {T(0.5), T(-1), T(0.25), T(2), T(0), T(-0.5), T(1), T(-2)};
    o.key_lengths = {n - 5, 41};
    o.softcap = T(5);
  }
  sdpa::AttentionState<T> whole_state;
  const T4<T> out = sdpa::attention(w.q, w.k, w.v, o, whole_state);
  const sdpa::AttentionGradients<T> grads = sdpa::attention_backward(w.d_out, whole_state);

  const int r = rank(), p = ranks();
  const auto shard = [&](const T4<T>& t) { return sdpa::ring_shard(t, ring_layout, r, p, c.layout); };
  sdpa::RingOptions ro;
  ro.layout = ring_layout;
  ro.block_rows = c.block_rows;
  sdpa::RingStats stats;
  ro.stats = &stats;
  sdpa::RingState<T> state;
  const T4<T> q = shard(w.q), k = shard(w.k), v = shard(w.v), d_out = shard(w.d_out);
  const T4<T> mine = sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD, ro, state);
  EXPECT_LE(relative_error(mine, shard(out)), tolerance<T>());
  if (p > 1) {
    EXPECT_GT(stats.messages, 0);
    EXPECT_GT(stats.bytes, 0);
  }
  const sdpa::AttentionGradients<T> g = sdpa::ring_attention_backward(d_out, state, MPI_COMM_WORLD);
  EXPECT_LE(relative_error(g.q, shard(grads.q)), tolerance<T>());
  EXPECT_LE(relative_error(g.k, shard(grads.k)), tolerance<T>());
  EXPECT_LE(relative_error(g.v, shard(grads.v)), tolerance<T>());
  ASSERT_EQ(g.sinks.size(), grads.sinks.size());
  // A sink's gradient is one sum over every query row of the batch, which the ring adds in another order
  // (each rank's rows, then across ranks): its rounding grows as the square root of the rows (float:
  // 1.2e-6 of 0.22 over 192 rows on an AVX2 machine, past a flat 1e-6).
  const double sink_tolerance = tolerance<T>() * std::sqrt(double(batch * n));
  for (std::size_t h = 0; h < g.sinks.size(); ++h)
    EXPECT_NEAR(g.sinks[h], grads.sinks[h], sink_tolerance * std::max<double>(1, std::abs(grads.sinks[h]))) << "head " << h;

  // Run to run: the same bits.
  sdpa::RingState<T> again_state;
  const T4<T> again = sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD, ro, again_state);
  EXPECT_TRUE(same_bits(again, mine));
  const sdpa::AttentionGradients<T> g2 = sdpa::ring_attention_backward(d_out, again_state, MPI_COMM_WORLD);
  EXPECT_TRUE(same_bits(g2.q, g.q));
  EXPECT_TRUE(same_bits(g2.k, g.k));
  EXPECT_TRUE(same_bits(g2.v, g.v));
}

TEST(RingAttention, MatchesTheWholeSequenceDouble) {
  for (const Case& c : kCases)
    for (auto layout : {sdpa::RingLayout::kContiguous, sdpa::RingLayout::kZigZag}) run_case<double>(c, layout);
}

TEST(RingAttention, MatchesTheWholeSequenceFloat) {
  for (const Case& c : kCases)
    for (auto layout : {sdpa::RingLayout::kContiguous, sdpa::RingLayout::kZigZag}) run_case<float>(c, layout);
}

// A score program over the ring: its functions see global positions (a T5 bucket table and a mask that
// keeps every 3rd key and the query's own, causal), and the table's gradient sums every rank's share.
TEST(RingAttention, ScoreProgramsSeeGlobalPositions) {
  const Index heads = 4, n = 96, batch = 2;
  const Whole<double> w(batch, heads, 2, n, 16, 12);
  sdpa::flex::ScoreTable<double> table(heads, 8);
  fill(table.values(), 15);
  const auto mask = [](Index, Index, Index q, Index k) { return k <= q && (k % 3 == 0 || k == q); };
  sdpa::AttentionOptions<double> o;
  o.program = sdpa::flex::program<double>(sdpa::flex::t5_buckets<double>{&table, false, 8, 40}, mask);
  sdpa::AttentionState<double> whole_state;
  const T4<double> out = sdpa::attention(w.q, w.k, w.v, o, whole_state);
  const auto grads = sdpa::attention_backward(w.d_out, whole_state);
  for (auto layout : {sdpa::RingLayout::kContiguous, sdpa::RingLayout::kZigZag}) {
    const auto shard = [&](const T4<double>& t) { return sdpa::ring_shard(t, layout, rank(), ranks()); };
    sdpa::RingOptions ro;
    ro.layout = layout;
    ro.block_rows = 7;
    sdpa::RingState<double> state;
    const T4<double> mine = sdpa::ring_attention(shard(w.q), shard(w.k), shard(w.v), o, MPI_COMM_WORLD, ro, state);
    EXPECT_LE(relative_error(mine, shard(out)), 1e-12);
    const auto g = sdpa::ring_attention_backward(shard(w.d_out), state, MPI_COMM_WORLD);
    EXPECT_LE(relative_error(g.q, shard(grads.q)), 1e-12);
    EXPECT_LE(relative_error(g.k, shard(grads.k)), 1e-12);
    ASSERT_EQ(g.tables.size(), 1u);
    EXPECT_LE(relative_error(g.tables[0], grads.tables[0]), 1e-12);
  }
  // A plan is refused: its blocks are not the ring's.
  o.program = sdpa::flex::program<double>(sdpa::flex::noop_score{}, sdpa::flex::causal{},
                                          sdpa::flex::causal{}.plan(1, 1, n, n));
  sdpa::RingState<double> state;
  EXPECT_THROW(sdpa::ring_attention(sdpa::ring_shard(w.q, sdpa::RingLayout::kContiguous, rank(), ranks()),
                                    sdpa::ring_shard(w.k, sdpa::RingLayout::kContiguous, rank(), ranks()),
                                    sdpa::ring_shard(w.v, sdpa::RingLayout::kContiguous, rank(), ranks()), o, MPI_COMM_WORLD,
                                    sdpa::RingOptions{}, state),
               std::invalid_argument);
}

// Every rank catches the call's exception; the messages are gathered so that each rank can check that all
// are the same.
template <typename F>
std::vector<std::string> messages_of(F&& call) {
  std::string mine = "(no exception)";
  try {
    call();
  } catch (const std::invalid_argument& e) {
    mine = e.what();
  } catch (const std::exception& e) {
    mine = std::string("(another exception) ") + e.what();
  }
  const int p = ranks();
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<std::size_t>(p)), offsets(static_cast<std::size_t>(p));
  MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int i = 0; i < p; ++i) {
    offsets[static_cast<std::size_t>(i)] = total;
    total += lengths[static_cast<std::size_t>(i)];
  }
  std::string all(static_cast<std::size_t>(total), ' ');
  MPI_Allgatherv(mine.data(), length, MPI_CHAR, &all[0], lengths.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int i = 0; i < p; ++i)
    out.push_back(all.substr(static_cast<std::size_t>(offsets[static_cast<std::size_t>(i)]),
                             static_cast<std::size_t>(lengths[static_cast<std::size_t>(i)])));
  return out;
}

void expect_everywhere(const std::vector<std::string>& messages, const std::vector<std::string>& parts) {
  for (std::size_t i = 0; i < messages.size(); ++i) {
    EXPECT_EQ(messages[i], messages[0]) << "rank " << i;
    for (const std::string& part : parts) EXPECT_NE(messages[i].find(part), std::string::npos) << messages[i] << " lacks " << part;
  }
}

TEST(RingAttention, AWrongShapeOnOneRankIsRefusedOnEveryRank) {
  const int r = rank(), last = ranks() - 1;
  const Whole<float> w(1, 2, 2, 16, 8, 8);
  const auto shard = [&](const T4<float>& t) { return sdpa::ring_shard(t, sdpa::RingLayout::kContiguous, r, ranks()); };
  T4<float> q = shard(w.q), k = shard(w.k), v = shard(w.v);
  if (r == last) k = T4<float>(k.dimension(0), k.dimension(1), k.dimension(2), 6);  // d_k 6 against q's 8
  k.setConstant(0.5f);
  sdpa::AttentionOptions<float> o;
  o.causal = true;
  const auto messages = messages_of([&] { sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD); });
  expect_everywhere(messages, {"sdpa::ring_attention: k dimension 3 (d_k) must be 8, the d_k of q, but is 6",
                               "rank " + std::to_string(last) + " of " + std::to_string(ranks())});
}

TEST(RingAttention, OptionsThatDifferBetweenRanksAreRefusedOnEveryRank) {
  if (ranks() < 2) GTEST_SKIP() << "needs two ranks";
  const int r = rank();
  const Whole<double> w(1, 2, 2, 16, 8, 8);
  const auto shard = [&](const T4<double>& t) { return sdpa::ring_shard(t, sdpa::RingLayout::kContiguous, r, ranks()); };
  const T4<double> q = shard(w.q), k = shard(w.k), v = shard(w.v);
  sdpa::AttentionOptions<double> o;
  o.causal = r != 1;
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q, k, v, o, MPI_COMM_WORLD); }),
                    {"sdpa::ring_attention: causal must be the same on every rank, but is 1 on rank 0 and 0 on rank 1"});
  // Local rows that differ: each rank's tensors agree with each other, not with the other ranks'.
  const Index rows = r == 1 ? 6 : 8;
  T4<double> q2(1, 2, rows, 8), k2(1, 2, rows, 8), v2(1, 2, rows, 8);
  q2.setConstant(1);
  k2.setConstant(1);
  v2.setConstant(1);
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q2, k2, v2, sdpa::AttentionOptions<double>{}, MPI_COMM_WORLD); }),
                    {"the local sequence rows of q must be the same on every rank, but is 8 on rank 0 and 6 on rank 1"});
}

TEST(RingAttention, OptionsWithoutARingFormAreRefused) {
  const int r = rank();
  const Whole<double> w(1, 2, 2, 16, 8, 8);
  const auto shard = [&](const T4<double>& t) { return sdpa::ring_shard(t, sdpa::RingLayout::kZigZag, r, ranks()); };
  const T4<double> q = shard(w.q), k = shard(w.k), v = shard(w.v);
  sdpa::RingOptions ro;
  ro.layout = sdpa::RingLayout::kZigZag;
  sdpa::AttentionOptions<double> dropout;
  dropout.dropout = 0.1;
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q, k, v, dropout, MPI_COMM_WORLD, ro); }),
                    {"sdpa::ring_attention: dropout must be 0 in ring attention, but is 0.1"});
  Eigen::Tensor<bool, 4, Eigen::RowMajor> mask(1, 1, 16, 16);
  mask.setConstant(false);
  sdpa::AttentionOptions<double> masked;
  masked.attention_mask = &mask;
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q, k, v, masked, MPI_COMM_WORLD, ro); }),
                    {"attention_mask must be unset in ring attention"});
  sdpa::AttentionOptions<double> nan_rows;
  nan_rows.masked_rows = sdpa::MaskedRows::kNaN;
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q, k, v, nan_rows, MPI_COMM_WORLD, ro); }), {"masked_rows"});
  // A key length past the whole sequence (16 rows), not past the local rows.
  sdpa::AttentionOptions<double> lengths;
  lengths.key_lengths = {17};
  expect_everywhere(messages_of([&] { sdpa::ring_attention(q, k, v, lengths, MPI_COMM_WORLD, ro); }),
                    {"key_lengths[0] must be in [0, 16], but is 17"});
  sdpa::RingState<double> empty;
  expect_everywhere(messages_of([&] { sdpa::ring_attention_backward(q, empty, MPI_COMM_WORLD); }), {"the state is empty"});
}

TEST(RingAttention, ZigZagShardsAreChunksRAnd2PMinus1MinusR) {
  const int p = ranks();
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(sdpa::ring_position(sdpa::RingLayout::kZigZag, r, p, 4, 0), 2 * r);
    EXPECT_EQ(sdpa::ring_position(sdpa::RingLayout::kZigZag, r, p, 4, 2), 2 * (2 * p - 1 - r));
    EXPECT_EQ(sdpa::ring_position(sdpa::RingLayout::kContiguous, r, p, 4, 3), 4 * r + 3);
  }
  const T4<float> t(1, 1, 6, 1);
  EXPECT_THROW(sdpa::ring_shard(t, sdpa::RingLayout::kZigZag, 0, 4), std::invalid_argument);  // 6 rows, 8 chunks
}

// ---- Head-parallel modules ----

template <typename T>
sdpa::ScaledDotProductAttention<T> whole_module(Index heads, Index kv_heads) {
  sdpa::ScaledDotProductAttention<T> m(24, 8, 6, heads, T(0), kv_heads);
  unsigned seed = 40;
  for (auto& p : m.named_parameters()) {
    Eigen::TensorMap<Eigen::Tensor<T, 1, Eigen::RowMajor>> values(p.data, p.size());
    fill(values, seed++, 0.3);
  }
  m.eval();
  return m;
}

template <typename T>
void head_parallel_case() {
  const int p = ranks();
  const Index heads = 2 * p, kv_heads = p;  // two query heads per key/value head, P of them
  sdpa::ScaledDotProductAttention<T> whole = whole_module<T>(heads, kv_heads);
  sdpa::Rotary rotary;
  whole.set_rotary(rotary);
  T3<T> x(2, 10, 24), y(2, 13, 24), d_out(2, 10, 24);
  fill(x, 1);
  fill(y, 2);
  fill(d_out, 3);
  sdpa::AttentionOptions<T> o;
  o.alibi_slopes = sdpa::alibi_slopes<T>(heads);
  for (Index h = 0; h < heads; ++h) o.sinks.push_back(T(0.25) * static_cast<T>(h) - T(0.5));
  Eigen::Tensor<T, 4, Eigen::RowMajor> bias(1, heads, 10, 13);
  fill(bias, 4);
  o.attention_bias = &bias;
  sdpa::ForwardState<T> whole_state;
  const T3<T> want = whole.forward(x, y, y, o, whole_state);
  const sdpa::Gradients<T> want_grads = whole.backward(d_out, whole_state);

  sdpa::HeadParallelAttention<T> hp = sdpa::HeadParallelAttention<T>::slice_of(whole, MPI_COMM_WORLD);
  EXPECT_EQ(hp.local().h(), heads / p);
  EXPECT_EQ(hp.local().kv_heads(), kv_heads / p);
  sdpa::ForwardState<T> state;
  const T3<T> got = hp.forward(x, y, y, o, state);
  EXPECT_LE(relative_error(got, want), tolerance<T>());
  EXPECT_TRUE(same_bits(hp.forward(x, y, y, o), got));
  const sdpa::Gradients<T> g = hp.backward(d_out, state);
  EXPECT_LE(relative_error(g.queries, want_grads.queries), tolerance<T>());
  // keys and values are one tensor here: their gradients add up in the whole module's as in the slices'.
  T3<T> kv = g.keys + g.values, want_kv = want_grads.keys + want_grads.values;
  EXPECT_LE(relative_error(kv, want_kv), tolerance<T>());
  // This rank's parameter gradients are its slices of the whole module's.
  const Index first = hp.first_head() * 8, rows = heads / p * 8;
  double diff = 0;
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < 24; ++j) diff = std::max(diff, std::abs(double(g.fc_q.weight(i, j) - want_grads.fc_q.weight(first + i, j))));
  EXPECT_LE(diff, tolerance<T>() * 10);
}

TEST(HeadParallel, MatchesTheWholeModuleDouble) { head_parallel_case<double>(); }
TEST(HeadParallel, MatchesTheWholeModuleFloat) { head_parallel_case<float>(); }

TEST(HeadParallel, HeadsThatDoNotDivideAmongTheRanksAreRefusedOnEveryRank) {
  if (ranks() < 2) GTEST_SKIP() << "needs two ranks";
  const Index heads = ranks() + 1;
  expect_everywhere(messages_of([&] { sdpa::HeadParallelAttention<float> hp(MPI_COMM_WORLD, 16, 4, 4, heads, 0.0f); }),
                    {"sdpa::HeadParallelAttention: h must be a multiple of the ranks (" + std::to_string(ranks()) + ")"});
  // A rank whose input has the wrong width: every rank refuses with its message.
  sdpa::HeadParallelAttention<float> hp = sdpa::HeadParallelAttention<float>::slice_of(whole_module<float>(2 * ranks(), ranks()), MPI_COMM_WORLD);
  T3<float> x(1, 5, rank() == 1 ? 23 : 24);
  x.setConstant(1);
  const auto messages = messages_of([&] { hp.forward(x, x, x); });
  expect_everywhere(messages, {"rank 1 of"});
}

#ifdef SDPA_TEST_IO
TEST(HeadParallel, LoadsItsSliceOfTheWholeModulesFile) {
  const int p = ranks();
  const sdpa::ScaledDotProductAttention<float> whole = whole_module<float>(2 * p, p);
  // One file for every rank: rank 0 names and writes it.
  char name[64] = {};
  if (rank() == 0) std::snprintf(name, sizeof name, "/tmp/sdpa_mpi_test_%d.safetensors", static_cast<int>(::getpid()));
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (rank() == 0) sdpa::save_safetensors(whole, name, "layer.");
  MPI_Barrier(MPI_COMM_WORLD);
  sdpa::HeadParallelAttention<float> hp(MPI_COMM_WORLD, 24, 8, 6, 2 * p, 0.0f, p);
  hp.local().eval();
  sdpa::load_safetensors_slice(hp, name, "layer.");
  T3<float> x(2, 7, 24);
  fill(x, 9);
  EXPECT_LE(relative_error(hp.forward(x, x, x), whole.forward(x, x, x, sdpa::AttentionOptions<float>{})), 1e-6);
  // A prefix the file does not have: every rank refuses, naming the tensor.
  const auto messages = messages_of([&] { sdpa::load_safetensors_slice(hp, name, "other."); });
  expect_everywhere(messages, {"(another exception)", "has no tensor \"other.fc_q.weight\""});
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(name);
}
#endif

}  // namespace mpi_test

// Every rank runs every test; rank 0 prints the usual report, the others only their failures.
namespace {
class FailuresOnly : public testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() != nullptr ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  if (mpi_test::rank() != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(mpi_test::rank()));
  }
  const int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
