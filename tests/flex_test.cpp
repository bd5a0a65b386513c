// Tests of programmable attention (sdpa/flex.hpp): score and mask functions, block plans and the built-ins,
// through sdpa::attention, attention_backward and attention_varlen.
//   - against PyTorch's flex_attention (tests/fixtures/flex/*.sdpafix, scripts/fixtures/make_flex_fixtures.py; float64;
//     gradients from float64 autograd of a dense form checked against flex_attention's output, since
//     PyTorch has no flex backward on the CPU): outputs and the gradients of q, k, v and every ScoreTable,
//     for every built-in and two functions written only here, in double and float;
//   - against a plain float64 reference in this file (dense scores, the functions applied, softmax) with the
//     fixed options composed: GQA, key lengths, bias, sinks, dropout's absence, the BNHD layout;
//   - a plan gives the same bits as no plan; the analytic plans equal the exact ones (block_mask_from);
//     the fixed options equal their built-in twins (causal, windows, ALiBi, softcap);
//   - gradients are the same bits on 1 and 2 threads (tables too);
//   - refusals: a plan of another shape, a table of the wrong shape, tree parents, the reference kernel, a
//     module call, an unlisted table.
#include "sdpa/flex.hpp"
#include "sdpa/kv_cache.hpp"
#include "sdpa/paged_kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <dirent.h>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "support/fixture.hpp"
#include "support/reference.hpp"

namespace flex_test {

using Index = Eigen::Index;
using sdpa_test::expect_invalid;
template <typename S>
using T4 = Eigen::Tensor<S, 4, Eigen::RowMajor>;
namespace flex = sdpa::flex;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- A plain float64 reference ----

// Dense attention over (b, h, n, d) tensors (GQA by h / kv_heads), positions q' = q + nk - nq: s = scale q.k,
// + bias, then score(s, b, h, q', k), -inf where !visible or key_lengths hides it; softmax with an optional
// sink; a row with no visible key gives 0.
struct Dense {
  std::function<double(double, Index, Index, Index, Index)> score = [](double s, Index, Index, Index, Index) { return s; };
  std::function<bool(Index, Index, Index, Index)> visible = [](Index, Index, Index, Index) { return true; };
  std::vector<Index> key_lengths;
  const T4<double>* bias = nullptr;
  std::vector<double> sinks;

  template <typename S>
  std::vector<double> run(const T4<S>& q, const T4<S>& k, const T4<S>& v) const {
    const Index b = q.dimension(0), h = q.dimension(1), nq = q.dimension(2), d = q.dimension(3);
    const Index kvh = k.dimension(1), nk = k.dimension(2), dv = v.dimension(3);
    std::vector<double> out(static_cast<std::size_t>(b * h * nq * dv), 0.0), s(static_cast<std::size_t>(nk));
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (Index bi = 0; bi < b; ++bi)
      for (Index hi = 0; hi < h; ++hi) {
        const Index g = hi / (h / kvh);
        for (Index i = 0; i < nq; ++i) {
          const Index pos = i + nk - nq;
          double m = -kInf;
          bool seen = false;
          for (Index j = 0; j < nk; ++j) {
            double acc = 0;
            for (Index x = 0; x < d; ++x) acc += static_cast<double>(q(bi, hi, i, x)) * static_cast<double>(k(bi, g, j, x));
            acc *= scale;
            if (bias != nullptr) acc += (*bias)(bi, hi, i, j);
            const bool hidden = !visible(bi, hi, pos, j) || (!key_lengths.empty() && j >= key_lengths[static_cast<std::size_t>(bi)]);
            seen = seen || !hidden;
            s[static_cast<std::size_t>(j)] = hidden ? -kInf : score(acc, bi, hi, pos, j);
            m = std::max(m, s[static_cast<std::size_t>(j)]);
          }
          const double sink = sinks.empty() ? -kInf : sinks[static_cast<std::size_t>(hi)];
          if (!seen && sinks.empty()) continue;
          m = std::max(m, sink);
          double sum = sinks.empty() ? 0.0 : std::exp(sink - m);
          for (Index j = 0; j < nk; ++j) sum += std::exp(s[static_cast<std::size_t>(j)] - m);
          double* o = out.data() + ((bi * h + hi) * nq + i) * dv;
          for (Index j = 0; j < nk; ++j) {
            const double p = std::exp(s[static_cast<std::size_t>(j)] - m) / sum;
            if (p == 0) continue;
            for (Index x = 0; x < dv; ++x) o[x] += p * static_cast<double>(v(bi, g, j, x));
          }
        }
      }
    return out;
  }
};

template <typename S>
double max_abs_diff(const T4<S>& a, const std::vector<double>& b) {
  double e = 0;
  for (Index i = 0; i < a.size(); ++i) e = std::max(e, std::abs(static_cast<double>(a.data()[i]) - b[static_cast<std::size_t>(i)]));
  return e;
}

template <typename S>
T4<S> random4(sdpa_test::Rng& rng, Index a, Index b, Index c, Index d, double scale = 1.0) {
  T4<S> t(a, b, c, d);
  rng.fill_normal(t, scale);
  return t;
}

template <typename S>
bool same_bits(const T4<S>& a, const T4<S>& b) {
  return a.dimensions() == b.dimensions() && std::equal(a.data(), a.data() + a.size(), b.data(), [](S x, S y) {
           return std::memcmp(&x, &y, sizeof(S)) == 0;
         });
}

// ---- Against PyTorch's flex_attention ----

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  const std::string dir = std::string(SDPA_FIXTURE_DIR) + "/flex";
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 8 && n.substr(n.size() - 8) == ".sdpafix") names.push_back(n.substr(0, n.size() - 8));
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<Index> ints(const sdpa_test::Fixture& f, const std::string& name) {
  const auto& a = f.get(name);
  return std::vector<Index>(a.i64.begin(), a.i64.end());
}

// The program of a fixture's kind (scripts/fixtures/make_flex_fixtures.py's numbering), its table (when it has one)
// loaded into `table`.
template <typename S>
std::shared_ptr<const sdpa::ScoreProgram<S>> fixture_program(const sdpa_test::Fixture& f, flex::ScoreTable<S>& table,
                                                              bool with_plan) {
  const Index kind = f.integer("kind"), batch = f.integer("batch"), heads = f.integer("heads"), nq = f.integer("nq"),
              nk = f.integer("nk");
  if (f.has("table")) {
    const auto& t = f.real("table", 2);
    table = flex::ScoreTable<S>(t.dims[0], t.dims[1]);
    for (Index i = 0; i < table.size(); ++i) table.values().data()[i] = static_cast<S>(t.f64[static_cast<std::size_t>(i)]);
  }
  const auto make = [&](auto score, auto mask) {
    sdpa::BlockMask plan;
    if constexpr (!std::is_same<decltype(mask), flex::all_visible>::value) {
      if (with_plan) plan = mask.plan(batch, heads, nq, nk, 16, 8);
    }
    return flex::program<S>(score, mask, plan);
  };
  const flex::noop_score none;
  switch (kind) {
    case 1: return make(none, flex::causal{});
    case 2: return make(none, flex::sliding_window{f.integer("left"), f.integer("right")});
    case 3: return make(none, flex::chunked{f.integer("chunk")});
    case 4: return make(none, flex::document(ints(f, "doc_ids"), batch));
    case 5: return make(none, flex::and_masks(flex::document(ints(f, "doc_ids"), batch), flex::causal{}));
    case 6: return make(none, flex::prefix_lm(ints(f, "prefix")));
    case 7: return make(none, flex::tree(ints(f, "parents"), nk - nq, batch));
    case 8: return make(flex::t5_buckets<S>{&table, true, f.integer("num_buckets"), f.integer("max_distance")}, flex::all_visible{});
    case 9: return make(flex::t5_buckets<S>{&table, false, f.integer("num_buckets"), f.integer("max_distance")}, flex::causal{});
    case 10: {
      const auto& sl = f.real("slopes", 1);
      return make(flex::alibi<S>(std::vector<S>(sl.f64.begin(), sl.f64.end())), flex::causal{});
    }
    case 11: return make(flex::softcap<S>{static_cast<S>(f.get("softcap").f64[0])}, flex::all_visible{});
    case 12: return make(flex::distance_bias<S>{&table, f.integer("radius")}, flex::causal{});
    case 13: {
      // Written only here: a sigmoid-gated distance penalty.
      const auto gated = [](auto s, Index, Index, Index q, Index k) {
        const Index d = q - k;
        return s - flex::sigmoid(s) * (static_cast<double>(d < 0 ? -d : d) / 8.0);
      };
      return flex::program<S>(gated);
    }
    case 14: {
      // Written only here: every 4th key and the query's own, causal; its plan evaluated exactly.
      const auto fourth = [](Index, Index, Index q, Index k) { return k <= q && (k % 4 == 0 || k == q); };
      return flex::program<S>(flex::noop_score{}, fourth,
                              with_plan ? sdpa::block_mask_from(fourth, 1, 1, nq, nk, 16, 8) : sdpa::BlockMask{});
    }
    case 15: {
      const auto before = [](Index, Index, Index q, Index k) { return k < q; };
      return flex::program<S>(flex::noop_score{}, before,
                              with_plan ? sdpa::block_mask_from(before, 1, 1, nq, nk, 16, 8) : sdpa::BlockMask{});
    }
  }
  ADD_FAILURE() << "unknown kind " << kind;
  return nullptr;
}

template <typename S>
double max_error(const T4<S>& a, const sdpa_test::Array& b) {
  double e = 0;
  for (Index i = 0; i < a.size(); ++i)
    e = std::max(e, std::abs(static_cast<double>(a.data()[i]) - b.f64[static_cast<std::size_t>(i)]));
  return e;
}

template <typename S>
void check_fixture(const std::string& name, bool with_plan, double tol) {
  SCOPED_TRACE(name + (with_plan ? " (plan)" : " (no plan)"));
  const auto f = sdpa_test::Fixture::load(std::string(SDPA_FIXTURE_DIR) + "/flex/" + name + ".sdpafix");
  const auto q = sdpa_test::to_tensor<S, 4>(f, "q"), k = sdpa_test::to_tensor<S, 4>(f, "k"),
             v = sdpa_test::to_tensor<S, 4>(f, "v"), d_out = sdpa_test::to_tensor<S, 4>(f, "d_out");
  flex::ScoreTable<S> table;
  sdpa::AttentionOptions<S> o;
  o.program = fixture_program<S>(f, table, with_plan);
  ASSERT_NE(o.program, nullptr);
  sdpa::AttentionState<S> state;
  const T4<S> out = sdpa::attention(q, k, v, o, state);
  const auto g = sdpa::attention_backward(d_out, state);
  EXPECT_LE(max_error(out, f.real("out", 4)), tol);
  EXPECT_LE(max_error(g.q, f.real("d_q", 4)), tol);
  EXPECT_LE(max_error(g.k, f.real("d_k", 4)), tol);
  EXPECT_LE(max_error(g.v, f.real("d_v", 4)), tol);
  if (f.has("d_table")) {
    ASSERT_EQ(g.tables.size(), 1u);
    const auto& want = f.real("d_table", 2);
    ASSERT_EQ(g.tables[0].size(), static_cast<Index>(want.f64.size()));
    double e = 0;
    for (Index i = 0; i < g.tables[0].size(); ++i)
      e = std::max(e, std::abs(static_cast<double>(g.tables[0].data()[i]) - want.f64[static_cast<std::size_t>(i)]));
    EXPECT_LE(e, tol) << "d_table";
  } else {
    EXPECT_TRUE(g.tables.empty());
  }
}

TEST(FlexFixtures, EveryCaseInDoubleAndFloat) {
  const auto names = fixture_names();
  ASSERT_GE(names.size(), 20u) << "tests/fixtures/flex: scripts/fixtures/make_flex_fixtures.py writes them";
  for (const auto& name : names) {
    check_fixture<double>(name, false, 1e-12);
    check_fixture<double>(name, true, 1e-12);
    check_fixture<float>(name, true, 2e-5);
  }
}

// ---- Plans ----

// exact: the analytic plan equals the evaluated one; otherwise it is sound (none and full where it says so,
// "partly" anywhere), as the tree's is (it does not follow the parents).
template <typename Mask>
void expect_exact_plan(const char* name, const Mask& mask, Index batch, Index nq, Index nk, Index qb, Index kb,
                       bool exact_plan = true) {
  SCOPED_TRACE(name);
  const sdpa::BlockMask analytic = mask.plan(batch, 1, nq, nk, qb, kb);
  const sdpa::BlockMask exact = sdpa::block_mask_from(mask, analytic.batch(), 1, nq, nk, qb, kb);
  if (exact_plan) {
    EXPECT_TRUE(analytic == exact) << "nq " << nq << " nk " << nk << " blocks " << qb << "x" << kb;
    return;
  }
  for (Index b = 0; b < exact.batch(); ++b)
    for (Index i = 0; i < exact.q_blocks(); ++i)
      for (Index j = 0; j < exact.k_blocks(); ++j) {
        const sdpa::BlockState a = analytic.at(b, 0, i, j);
        if (a != sdpa::BlockState::kPartial) {
          EXPECT_EQ(a, exact.at(b, 0, i, j)) << "block " << i << ", " << j;
        }
      }
}

TEST(FlexPlans, AnalyticPlansAreExact) {
  for (const auto& [nq, nk] : {std::pair<Index, Index>{64, 64}, {37, 100}, {100, 37}, {1, 77}})
    for (const auto& [qb, kb] : {std::pair<Index, Index>{16, 16}, {8, 32}, {32, 8}, {7, 5}}) {
      expect_exact_plan("flex::causal{}", flex::causal{}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::sliding_window{5", flex::sliding_window{5, 0}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::sliding_window{3", flex::sliding_window{3, 9}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::sliding_window{-1", flex::sliding_window{-1, 2}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::chunked{8}", flex::chunked{8}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::chunked{13}", flex::chunked{13}, 1, nq, nk, qb, kb);
      expect_exact_plan("flex::prefix_lm({5", flex::prefix_lm({5, 40}), 2, nq, nk, qb, kb);
      std::vector<Index> ids;
      for (Index b = 0; b < 2; ++b)
        for (Index j = 0; j < nk; ++j) ids.push_back(b == 0 ? j / 11 : (j * j) % 5);  // sorted runs; scattered ids
      expect_exact_plan("flex::document(ids", flex::document(ids, 2), 2, nq, nk, qb, kb);
      expect_exact_plan("flex::and_masks(flex::document(ids", flex::and_masks(flex::document(ids, 2), flex::causal{}), 2, nq, nk, qb, kb);
      expect_exact_plan("flex::or_masks(flex::sliding_window{2", flex::or_masks(flex::sliding_window{2, 0}, flex::prefix_lm({4})), 1, nq, nk, qb, kb);
      if (nq <= nk) {
        std::vector<Index> parents(static_cast<std::size_t>(nq));
        for (Index i = 0; i < nq; ++i) parents[static_cast<std::size_t>(i)] = i == 0 ? -1 : (i * 7) % i - (i % 3 == 0 ? 1 : 0);
        expect_exact_plan("flex::tree(parents, nk - nq)", flex::tree(parents, nk - nq), 1, nq, nk, qb, kb, false);
      }
    }
}

// narrow(b, h, q, lo, hi) keeps every key the mask keeps inside [lo, hi), and when it says exact, the mask
// keeps every key of what it returns.
template <typename Mask>
void expect_sound_interval(const char* name, const Mask& m, Index batch, Index nq, Index nk) {
  SCOPED_TRACE(testing::Message() << name << " nq " << nq << " nk " << nk);
  for (Index b = 0; b < batch; ++b)
    for (Index qi = -2; qi < nq + 2; ++qi)
      for (const auto& [lo0, hi0] : {std::pair<Index, Index>{0, nk}, {3, nk - 2}}) {
        const Index q = qi + nk - nq;
        Index lo = lo0, hi = hi0;
        const bool exact = m.narrow(b, 0, q, lo, hi);
        for (Index k = lo0; k < hi0; ++k) {
          const bool inside = k >= lo && k < hi;
          const bool kept = m(b, 0, q, k);
          EXPECT_TRUE(!kept || inside) << "b " << b << " q " << q << " k " << k << " outside [" << lo << ", " << hi << ")";
          EXPECT_TRUE(!(exact && inside) || kept) << "b " << b << " q " << q << " k " << k << " hidden in an exact interval";
        }
      }
}

TEST(FlexPlans, IntervalsHoldEveryKeyTheMaskKeeps) {
  std::vector<Index> ids;
  for (Index b = 0; b < 2; ++b)
    for (Index j = 0; j < 60; ++j) ids.push_back(b == 0 ? j / 11 : (j * j) % 5);  // runs (exact); scattered ids
  std::vector<Index> parents{-1, 0, 0, 1, -1, 4, 3, 6};
  for (const auto& [nq, nk] : {std::pair<Index, Index>{60, 60}, {8, 60}, {1, 60}}) {
    expect_sound_interval("causal", flex::causal{}, 1, nq, nk);
    expect_sound_interval("sliding_window{5, 0}", flex::sliding_window{5, 0}, 1, nq, nk);
    expect_sound_interval("sliding_window{3, 9}", flex::sliding_window{3, 9}, 1, nq, nk);
    expect_sound_interval("sliding_window{-1, 2}", flex::sliding_window{-1, 2}, 1, nq, nk);
    expect_sound_interval("chunked{8}", flex::chunked{8}, 1, nq, nk);
    expect_sound_interval("prefix_lm({5, 40})", flex::prefix_lm({5, 40}), 2, nq, nk);
    expect_sound_interval("document", flex::document(ids, 2), 3, nq, nk);
    expect_sound_interval("document & causal", flex::and_masks(flex::document(ids, 2), flex::causal{}), 2, nq, nk);
    expect_sound_interval("window | prefix", flex::or_masks(flex::sliding_window{2, 0}, flex::prefix_lm({4})), 1, nq, nk);
    expect_sound_interval("window | window, apart", flex::or_masks(flex::sliding_window{0, 0}, flex::sliding_window{-1, -1}), 1, nq, nk);
    expect_sound_interval("chunk | document", flex::or_masks(flex::chunked{16}, flex::document(ids, 2)), 2, nq, nk);
    if (nq <= 8) expect_sound_interval("tree", flex::tree(std::vector<Index>(parents.begin(), parents.begin() + nq), nk - nq), 1, nq, nk);
  }
  // Scattered ids: the span of an id's positions, not exact; one run per id: exact.
  const flex::document d(ids, 2);
  Index lo = 0, hi = 60;
  EXPECT_TRUE(d.narrow(0, 0, 12, lo, hi));
  EXPECT_EQ(lo, 11);
  EXPECT_EQ(hi, 22);
  lo = 0;
  hi = 60;
  EXPECT_FALSE(d.narrow(1, 0, 12, lo, hi));
}

// A mask of one's own with an interval: the kernels use it as a range and ask the function nothing inside
// an exact one; the same mask without it is asked for every key of its rows. Both equal the dense
// reference, forward and backward.
struct BandWithInterval {
  Index width = 9;
  std::shared_ptr<std::atomic<long>> calls = std::make_shared<std::atomic<long>>(0);
  bool operator()(Index, Index, Index q, Index k) const noexcept {
    calls->fetch_add(1, std::memory_order_relaxed);
    return k <= q && k > q - width;
  }
  bool narrow(Index, Index, Index q, Index& lo, Index& hi) const noexcept {
    lo = std::max(lo, q - width + 1);
    hi = std::min(hi, q + 1);
    return true;
  }
};

TEST(FlexPlans, AMaskOfOnesOwnMayOfferItsInterval) {
  sdpa_test::Rng rng(17);
  const Index b = 1, h = 2, n = 300, d = 16;
  const T4<double> q = random4<double>(rng, b, h, n, d), k = random4<double>(rng, b, h, n, d), v = random4<double>(rng, b, h, n, d);
  const T4<double> d_out = random4<double>(rng, b, h, n, d);
  const BandWithInterval band;
  const auto lambda = [band](Index bb, Index hh, Index qq, Index kk) { return band(bb, hh, qq, kk); };
  sdpa::AttentionState<double> s0, s1;
  const sdpa::AttentionOptions<double> o;
  const T4<double> a = sdpa::attention(q, k, v, o, flex::noop_score{}, band, nullptr, s0);
  EXPECT_EQ(band.calls->load(), 0);
  const T4<double> c = sdpa::attention(q, k, v, o, flex::noop_score{}, lambda, nullptr, s1);
  EXPECT_GE(band.calls->load(), h * n * band.width);
  Dense ref;
  ref.visible = [](Index, Index, Index qq, Index kk) { return kk <= qq && kk > qq - 9; };
  const std::vector<double> r = ref.run(q, k, v);
  EXPECT_LE(max_abs_diff(a, r), 1e-12);
  EXPECT_LE(max_abs_diff(c, r), 1e-12);
  const auto ga = sdpa::attention_backward(d_out, s0), gc = sdpa::attention_backward(d_out, s1);
  const auto flat = [](const T4<double>& t) { return std::vector<double>(t.data(), t.data() + t.size()); };
  EXPECT_LE(max_abs_diff(ga.q, flat(gc.q)), 1e-12);
  EXPECT_LE(max_abs_diff(ga.k, flat(gc.k)), 1e-12);
  EXPECT_LE(max_abs_diff(ga.v, flat(gc.v)), 1e-12);
}

// A score function's row form gives what it gives per key, bit for bit, on either side of its reach.
TEST(FlexScores, RowFormsEqualTheFunctionPerKey) {
  sdpa_test::Rng rng(23);
  flex::ScoreTable<float> buckets(3, 32), distances(3, 2 * 20 + 1);
  for (Index i = 0; i < buckets.size(); ++i) buckets.values().data()[i] = static_cast<float>(rng.normal());
  for (Index i = 0; i < distances.size(); ++i) distances.values().data()[i] = static_cast<float>(rng.normal());
  const flex::t5_buckets<float> t5(&buckets, true, 32, 128), causal_t5(&buckets, false, 32, 128);
  const flex::distance_bias<float> bias{&distances, 20};
  std::vector<float> x(700), row(700), key(700);
  for (Index h = 0; h < 3; ++h)
    for (const Index q : {Index{0}, Index{5}, Index{300}, Index{1000}})
      for (const auto& [k0, m] : {std::pair<Index, Index>{0, 700}, {250, 100}, {290, 21}, {900, 1}, {0, 0}}) {
        for (float& e : x) e = static_cast<float>(rng.normal());
        const auto expect_row = [&](const char* name, const auto& f) {
          row = x;
          f.row(row.data(), m, 0, h, q, k0);
          for (Index j = 0; j < m; ++j) key[static_cast<std::size_t>(j)] = f(x[static_cast<std::size_t>(j)], 0, h, q, k0 + j);
          EXPECT_TRUE(std::equal(row.begin(), row.begin() + m, key.begin(), [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }))
              << name << " h " << h << " q " << q << " k0 " << k0 << " m " << m;
          EXPECT_TRUE(std::equal(row.begin() + m, row.end(), x.begin() + m)) << name << ": wrote past its row";
        };
        expect_row("t5_buckets", t5);
        expect_row("t5_buckets (causal)", causal_t5);
        expect_row("distance_bias", bias);
      }
}

TEST(FlexPlans, APlanGivesTheBitsOfNoPlan) {
  sdpa_test::Rng rng(7);
  const Index b = 2, h = 3, nq = 150, nk = 170, d = 24;
  const T4<float> q = random4<float>(rng, b, h, nq, d), k = random4<float>(rng, b, h, nk, d), v = random4<float>(rng, b, h, nk, d);
  const T4<float> d_out = random4<float>(rng, b, h, nq, d);
  std::vector<Index> ids;
  for (Index bi = 0; bi < b; ++bi)
    for (Index j = 0; j < nk; ++j) ids.push_back(bi == 0 ? j / 40 : j / 23);
  const auto mask = flex::and_masks(flex::document(ids, b), flex::causal{});
  for (const auto& [qb, kb] : {std::pair<Index, Index>{128, 128}, {16, 16}, {9, 31}}) {
    SCOPED_TRACE(testing::Message() << "plan blocks " << qb << "x" << kb);
    const sdpa::BlockMask plan = mask.plan(b, h, nq, nk, qb, kb);
    sdpa::AttentionState<float> s0, s1;
    const sdpa::AttentionOptions<float> o;
    const T4<float> a = sdpa::attention(q, k, v, o, flex::noop_score{}, mask, nullptr, s0);
    const T4<float> c = sdpa::attention(q, k, v, o, flex::noop_score{}, mask, &plan, s1);
    EXPECT_TRUE(same_bits(a, c));
    const auto ga = sdpa::attention_backward(d_out, s0), gc = sdpa::attention_backward(d_out, s1);
    EXPECT_TRUE(same_bits(ga.q, gc.q));
    EXPECT_TRUE(same_bits(ga.k, gc.k));
    EXPECT_TRUE(same_bits(ga.v, gc.v));
    Dense ref;
    ref.visible = mask;
    EXPECT_LE(max_abs_diff(a, ref.run(q, k, v)), 2e-6);
  }
}

// ---- The fixed options and their built-in twins ----

TEST(FlexTwins, FixedOptionsEqualTheirBuiltIns) {
  sdpa_test::Rng rng(11);
  const Index b = 2, h = 4, nq = 70, nk = 90, d = 16;
  const T4<double> q = random4<double>(rng, b, h, nq, d, 2.0), k = random4<double>(rng, b, 2, nk, d, 2.0),
                   v = random4<double>(rng, b, 2, nk, d);
  const auto close = [](const T4<double>& x, const T4<double>& y) {
    double e = 0;
    for (Index i = 0; i < x.size(); ++i) e = std::max(e, std::abs(x.data()[i] - y.data()[i]));
    return e;
  };
  sdpa::AttentionOptions<double> fixed;
  fixed.causal = true;
  EXPECT_LE(close(sdpa::attention(q, k, v, fixed), sdpa::attention(q, k, v, {}, flex::noop_score{}, flex::causal{})), 1e-14);
  fixed = {};
  fixed.causal = true;
  fixed.window_left = 6;
  EXPECT_LE(close(sdpa::attention(q, k, v, fixed), sdpa::attention(q, k, v, {}, flex::noop_score{}, flex::sliding_window{6, 0})),
            1e-14);
  fixed = {};
  fixed.window_left = 3;
  fixed.window_right = 5;
  EXPECT_LE(close(sdpa::attention(q, k, v, fixed), sdpa::attention(q, k, v, {}, flex::noop_score{}, flex::sliding_window{3, 5})),
            1e-14);
  fixed = {};
  fixed.alibi_slopes = sdpa::alibi_slopes<double>(h);
  EXPECT_LE(close(sdpa::attention(q, k, v, fixed),
                  sdpa::attention(q, k, v, {}, flex::alibi<double>(sdpa::alibi_slopes<double>(h)), flex::all_visible{})),
            1e-14);
  fixed = {};
  fixed.softcap = 3.0;
  EXPECT_LE(close(sdpa::attention(q, k, v, fixed), sdpa::attention(q, k, v, {}, flex::softcap<double>{3.0}, flex::all_visible{})),
            1e-14);
}

// Dropout and the probabilities: a program's causal mask draws and reports what options.causal does.
TEST(FlexTwins, DropoutAndProbabilitiesFollowTheProgram) {
  sdpa_test::Rng rng(41);
  const Index b = 1, h = 2, n = 150, d = 16;
  const T4<double> q = random4<double>(rng, b, h, n, d), k = random4<double>(rng, b, h, n, d), v = random4<double>(rng, b, h, n, d),
                   d_out = random4<double>(rng, b, h, n, d);
  T4<double> p_fixed, p_flex;
  sdpa::AttentionOptions<double> fixed;
  fixed.causal = true;
  fixed.dropout = 0.3;
  fixed.dropout_seed = 9;
  fixed.probabilities = &p_fixed;
  sdpa::AttentionOptions<double> programmed = fixed;
  programmed.causal = false;
  programmed.probabilities = &p_flex;
  programmed.program = flex::program<double>(flex::noop_score{}, flex::causal{});
  sdpa::AttentionState<double> s0, s1;
  const T4<double> a = sdpa::attention(q, k, v, fixed, s0), c = sdpa::attention(q, k, v, programmed, s1);
  double e = 0, ep = 0;
  for (Index i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a.data()[i] - c.data()[i]));
  for (Index i = 0; i < p_fixed.size(); ++i) ep = std::max(ep, std::abs(p_fixed.data()[i] - p_flex.data()[i]));
  EXPECT_LE(e, 1e-14);
  EXPECT_LE(ep, 1e-15);
  const auto ga = sdpa::attention_backward(d_out, s0), gc = sdpa::attention_backward(d_out, s1);
  double eg = 0;
  for (Index i = 0; i < ga.q.size(); ++i) eg = std::max(eg, std::abs(ga.q.data()[i] - gc.q.data()[i]));
  EXPECT_LE(eg, 1e-13);
}

// A key the mask function hides passes nothing, not even a NaN in its value or key row.
TEST(FlexTwins, HiddenNonFiniteRowsPassNothing) {
  sdpa_test::Rng rng(43);
  const Index n = 70, d = 8;
  T4<float> q = random4<float>(rng, 1, 1, n, d), k = random4<float>(rng, 1, 1, n, d), v = random4<float>(rng, 1, 1, n, d);
  const T4<float> d_out = random4<float>(rng, 1, 1, n, d);
  for (Index x = 0; x < d; ++x) {
    v(0, 0, 5, x) = std::numeric_limits<float>::quiet_NaN();
    k(0, 0, 33, x) = std::numeric_limits<float>::infinity();
  }
  const auto skip = [](Index, Index, Index qq, Index kk) { return kk <= qq && kk != 5 && kk != 33; };
  sdpa::AttentionState<float> state;
  const T4<float> out = sdpa::attention(q, k, v, {}, flex::noop_score{}, skip, nullptr, state);
  const auto g = sdpa::attention_backward(d_out, state);
  for (Index i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out.data()[i])) << i;
  for (Index i = 0; i < g.q.size(); ++i) ASSERT_TRUE(std::isfinite(g.q.data()[i])) << i;
}

// A few queries run the decoding kernel (kAuto), many the tiled one: the same program, the same results
// (to rounding), probabilities and the mask's holes included, with and without a plan.
TEST(FlexTwins, DecodingAndTiledKernelsAgree) {
  sdpa_test::Rng rng(47);
  const Index b = 2, h = 4, nq = 3, nk = 700, d = 16;
  const T4<double> q = random4<double>(rng, b, h, nq, d), k = random4<double>(rng, b, 2, nk, d), v = random4<double>(rng, b, 2, nk, d);
  const auto mask = [](Index bb, Index hh, Index qq, Index kk) { return kk <= qq && ((kk + bb + hh) % 5 != 0 || kk > qq - 3); };
  const auto score = [](auto s, Index, Index hh, Index qq, Index kk) { return s + 0.01 * static_cast<double>((qq - kk) % 7 - hh); };
  const sdpa::BlockMask plan = sdpa::block_mask_from(mask, b, h, nq, nk, 2, 64);
  for (const sdpa::BlockMask* pl : {static_cast<const sdpa::BlockMask*>(nullptr), &plan}) {
    T4<double> p_auto, p_tiled;
    sdpa::AttentionOptions<double> o;
    o.probabilities = &p_auto;
    const T4<double> a = sdpa::attention(q, k, v, o, score, mask, pl);
    o.kernel = sdpa::Kernel::kTiled;
    o.probabilities = &p_tiled;
    const T4<double> t = sdpa::attention(q, k, v, o, score, mask, pl);
    double e = 0, ep = 0;
    for (Index i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a.data()[i] - t.data()[i]));
    for (Index i = 0; i < p_auto.size(); ++i) ep = std::max(ep, std::abs(p_auto.data()[i] - p_tiled.data()[i]));
    EXPECT_LE(e, 1e-14);
    EXPECT_LE(ep, 1e-15);
    Dense ref;
    ref.visible = mask;
    ref.score = [&](double s, Index bb, Index hh, Index qq, Index kk) { return score(s, bb, hh, qq, kk); };
    EXPECT_LE(max_abs_diff(a, ref.run(q, k, v)), 1e-13);
  }
}

// ---- Composition with the fixed options, against the dense reference ----

TEST(FlexCompose, OptionsComposeWithFunctions) {
  sdpa_test::Rng rng(3);
  const Index b = 2, h = 4, kvh = 2, nq = 33, nk = 65, d = 8;
  const T4<double> q = random4<double>(rng, b, h, nq, d), k = random4<double>(rng, b, kvh, nk, d), v = random4<double>(rng, b, kvh, nk, d);
  const T4<double> bias = random4<double>(rng, b, h, nq, nk);
  const auto score = [](auto s, Index bb, Index hh, Index qq, Index kk) {
    return s * 0.5 + flex::tanh(s) + 0.01 * static_cast<double>((qq - kk) * (hh + 1) + bb);
  };
  const auto mask = [](Index bb, Index hh, Index qq, Index kk) { return (kk + hh + bb) % 3 != 0 || kk == qq; };
  Dense ref;
  ref.score = [&](double s, Index bb, Index hh, Index qq, Index kk) { return score(s, bb, hh, qq, kk); };
  ref.visible = mask;
  ref.key_lengths = {50, 65};
  ref.bias = &bias;
  ref.sinks = {0.5, -1.0, 2.0, 0.0};
  sdpa::AttentionOptions<double> o;
  o.key_lengths = ref.key_lengths;
  o.attention_bias = &bias;
  o.sinks = ref.sinks;
  const T4<double> out = sdpa::attention(q, k, v, o, score, mask);
  EXPECT_LE(max_abs_diff(out, ref.run(q, k, v)), 1e-13);
  // The same in the (batch, seq, heads, dim) layout.
  const Eigen::array<Index, 4> swap{0, 2, 1, 3};
  T4<double> qt = q.shuffle(swap), kt = k.shuffle(swap), vt = v.shuffle(swap);
  o.layout = sdpa::Layout::kBNHD;
  const T4<double> out_t = sdpa::attention(qt, kt, vt, o, score, mask);
  const T4<double> back = out_t.shuffle(swap);
  EXPECT_LE(max_abs_diff(back, ref.run(q, k, v)), 1e-13);
}

// A mask that hides whole rows: the MaskedRows policy, as a mask tensor's.
TEST(FlexCompose, RowsTheMaskHidesFollowThePolicy) {
  sdpa_test::Rng rng(5);
  const T4<double> q = random4<double>(rng, 1, 2, 20, 8), k = random4<double>(rng, 1, 2, 20, 8), v = random4<double>(rng, 1, 2, 20, 8);
  const auto odd_rows_blind = [](Index, Index, Index qq, Index kk) { return qq % 2 == 0 && kk <= qq; };
  sdpa::AttentionOptions<double> o;
  o.masked_rows = sdpa::MaskedRows::kNaN;
  const T4<double> out = sdpa::attention(q, k, v, o, flex::noop_score{}, odd_rows_blind);
  for (Index i = 0; i < 20; ++i) EXPECT_EQ(std::isnan(out(0, 1, i, 3)), i % 2 == 1) << i;
  o.masked_rows = sdpa::MaskedRows::kZero;
  const T4<double> zero = sdpa::attention(q, k, v, o, flex::noop_score{}, odd_rows_blind);
  for (Index i = 1; i < 20; i += 2) EXPECT_EQ(zero(0, 0, i, 0), 0.0);
}

// Packed sequences: the functions see each sequence as batch entry s, with its own positions.
TEST(FlexCompose, PackedSequencesAreBatchEntries) {
  sdpa_test::Rng rng(9);
  const std::vector<Index> lq{5, 17, 9}, lk{12, 17, 30};
  const Index h = 2, d = 8, tq = 31, tk = 59;
  Eigen::Tensor<double, 3, Eigen::RowMajor> q(tq, h, d), k(tk, h, d), v(tk, h, d);
  rng.fill_normal(q);
  rng.fill_normal(k);
  rng.fill_normal(v);
  sdpa::AttentionOptions<double> o;
  o.cu_seqlens_q = {0, 5, 22, 31};
  o.cu_seqlens_k = {0, 12, 29, 59};
  const auto score = [](auto s, Index b, Index, Index qq, Index kk) { return s + 0.1 * static_cast<double>(b * (qq - kk)); };
  const auto mask = [](Index b, Index, Index qq, Index kk) { return kk <= qq && kk >= qq - 4 * (b + 1); };
  o.program = flex::program<double>(score, mask);
  const auto out = sdpa::attention_varlen(q, k, v, o);
  for (std::size_t s = 0; s < 3; ++s) {
    const Index q0 = o.cu_seqlens_q[s], k0 = o.cu_seqlens_k[s], nq = lq[s], nk = lk[s];
    T4<double> qs(1, h, nq, d), ks(1, h, nk, d), vs(1, h, nk, d);
    for (Index i = 0; i < nq; ++i)
      for (Index hh = 0; hh < h; ++hh)
        for (Index x = 0; x < d; ++x) qs(0, hh, i, x) = q(q0 + i, hh, x);
    for (Index j = 0; j < nk; ++j)
      for (Index hh = 0; hh < h; ++hh)
        for (Index x = 0; x < d; ++x) {
          ks(0, hh, j, x) = k(k0 + j, hh, x);
          vs(0, hh, j, x) = v(k0 + j, hh, x);
        }
    Dense ref;
    const Index seq = static_cast<Index>(s);
    ref.score = [&](double sc, Index, Index hh, Index qq, Index kk) { return score(sc, seq, hh, qq, kk); };
    ref.visible = [&](Index, Index hh, Index qq, Index kk) { return mask(seq, hh, qq, kk); };
    const auto want = ref.run(qs, ks, vs);
    double e = 0;
    for (Index hh = 0; hh < h; ++hh)
      for (Index i = 0; i < nq; ++i)
        for (Index x = 0; x < d; ++x)
          e = std::max(e, std::abs(out(q0 + i, hh, x) - want[static_cast<std::size_t>((hh * nq + i) * d + x)]));
    EXPECT_LE(e, 1e-13) << "sequence " << s;
  }
}

// ---- Gradients: the same bits on 1 and 2 threads ----

TEST(FlexBackward, DeterministicAcrossThreads) {
  sdpa_test::Rng rng(13);
  const Index b = 2, h = 4, nq = 200, nk = 200, d = 32;
  const T4<float> q = random4<float>(rng, b, h, nq, d), k = random4<float>(rng, b, 2, nk, d), v = random4<float>(rng, b, 2, nk, d),
                  d_out = random4<float>(rng, b, h, nq, d);
  flex::ScoreTable<float> table(h, 16);
  for (Index i = 0; i < table.size(); ++i) table.values().data()[i] = static_cast<float>(rng.normal());
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice two(&pool, 2);
  std::vector<sdpa::AttentionGradients<float>> grads;
  const std::vector<const Eigen::ThreadPoolDevice*> devices{nullptr, &two};
  for (const Eigen::ThreadPoolDevice* device : devices) {
    sdpa::AttentionOptions<float> o;
    o.device = device;
    o.program = flex::program<float>(flex::t5_buckets<float>{&table, false, 16, 64}, flex::chunked{48});
    sdpa::AttentionState<float> state;
    sdpa::attention(q, k, v, o, state);
    grads.push_back(sdpa::attention_backward(d_out, state));
  }
  EXPECT_TRUE(same_bits(grads[0].q, grads[1].q));
  EXPECT_TRUE(same_bits(grads[0].k, grads[1].k));
  EXPECT_TRUE(same_bits(grads[0].v, grads[1].v));
  ASSERT_EQ(grads[0].tables.size(), 1u);
  const auto& t0 = grads[0].tables[0];
  const auto& t1 = grads[1].tables[0];
  EXPECT_TRUE(std::equal(t0.data(), t0.data() + t0.size(), t1.data()));
  double norm = 0;
  for (Index i = 0; i < t0.size(); ++i) norm += std::abs(t0.data()[i]);
  EXPECT_GT(norm, 0.0);
}

// ---- The module and its caches ----

using Module = sdpa::ScaledDotProductAttention<double>;
using T3 = Eigen::Tensor<double, 3, Eigen::RowMajor>;

Module make_module(sdpa_test::Rng& rng, Eigen::Index kv_heads = 0) {
  Module m(32, 8, 8, 4, 0.0, kv_heads);
  sdpa_test::randomize_module(m, rng);
  m.eval();
  return m;
}

double max_diff3(const T3& a, const T3& b) {
  double e = 0;
  for (Index i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a.data()[i] - b.data()[i]));
  return e;
}

// A program's forward and backward through the module equal the fixed options they copy; a table's
// gradient equals the finite difference of the loss.
TEST(FlexModule, ForwardBackwardAndTableGradients) {
  sdpa_test::Rng rng(21);
  const Module m = make_module(rng, 2);
  T3 x(2, 13, 32), y(2, 17, 32), d_out(2, 13, 32);
  rng.fill_normal(x);
  rng.fill_normal(y);
  rng.fill_normal(d_out);
  sdpa::AttentionOptions<double> fixed;
  fixed.causal = true;
  fixed.alibi_slopes = sdpa::alibi_slopes<double>(4);
  sdpa::AttentionOptions<double> programmed;
  programmed.program = flex::program<double>(flex::alibi<double>(sdpa::alibi_slopes<double>(4)), flex::causal{});
  sdpa::ForwardState<double> s0, s1;
  const T3 a = m.forward(x, y, y, fixed, s0), b = m.forward(x, y, y, programmed, s1);
  EXPECT_LE(max_diff3(a, b), 1e-13);
  const auto ga = m.backward(d_out, s0), gb = m.backward(d_out, s1);
  EXPECT_LE(max_diff3(ga.queries, gb.queries), 1e-12);
  EXPECT_LE(max_diff3(ga.keys, gb.keys), 1e-12);
  double e = 0;
  for (Index i = 0; i < ga.fc_k.weight.size(); ++i) e = std::max(e, std::abs(ga.fc_k.weight.data()[i] - gb.fc_k.weight.data()[i]));
  EXPECT_LE(e, 1e-12);

  // T5 buckets: d loss / d table against central differences of loss = sum(out * d_out).
  flex::ScoreTable<double> table(4, 8);
  for (Index i = 0; i < table.size(); ++i) table.values().data()[i] = rng.normal();
  sdpa::AttentionOptions<double> t5;
  t5.program = flex::program<double>(flex::t5_buckets<double>{&table, true, 8, 12}, flex::all_visible{});
  sdpa::ForwardState<double> st;
  m.forward(x, y, y, t5, st);
  const auto g = m.backward(d_out, st);
  ASSERT_EQ(g.tables.size(), 1u);
  const auto loss = [&] {
    const T3 o = m.forward(x, y, y, t5);
    double l = 0;
    for (Index i = 0; i < o.size(); ++i) l += o.data()[i] * d_out.data()[i];
    return l;
  };
  for (const auto& [r, c] : {std::pair<Index, Index>{0, 0}, {1, 3}, {3, 7}, {2, 5}}) {
    const double keep = table(r, c), step = 1e-5;
    table(r, c) = keep + step;
    const double up = loss();
    table(r, c) = keep - step;
    const double down = loss();
    table(r, c) = keep;
    EXPECT_NEAR(g.tables[0](r, c), (up - down) / (2 * step), 1e-7) << "table(" << r << ", " << c << ")";
  }
}

// Cache steps give a program absolute positions, also after a window dropped the first entries: the rows
// of one forward over the whole sequence.
TEST(FlexModule, CacheStepsSeeAbsolutePositions) {
  sdpa_test::Rng rng(23);
  const Module m = make_module(rng, 2);
  const Index n = 40;
  T3 x(2, n, 32);
  rng.fill_normal(x);
  const auto mask = [](Index b, Index, Index q, Index k) { return k % 3 != 1 || k == q || b == 1; };
  const auto score = [](auto s, Index, Index h, Index q, Index k) { return s - 0.05 * static_cast<double>((h + 1) * (q - k)); };
  sdpa::AttentionOptions<double> o;
  o.causal = true;
  o.window_left = 9;  // the cache keeps at most 10 entries
  o.program = flex::program<double>(score, mask);
  const T3 whole = m.forward(x, x, x, o);
  sdpa::KVCache<double> cache(m, 2, 64);
  const std::vector<Index> chunks{1, 5, 16, 1, 3, 14};
  Index at = 0;
  for (Index c : chunks) {
    const Eigen::array<Index, 3> off{0, at, 0}, ext{2, c, 32};
    const T3 part = x.slice(off, ext);
    const T3 out = m.step(part, cache, o);
    T3 want = whole.slice(off, ext);
    EXPECT_LE(max_diff3(out, want), 1e-12) << "chunk at " << at;
    at += c;
  }
  EXPECT_GT(cache.first_position(), 0);
}

// A tree of 16 drafts verified in one step equals decoding each draft's path token by token.
TEST(FlexModule, TreeStepEqualsDecodingEachPath) {
  sdpa_test::Rng rng(29);
  const Module m = make_module(rng);
  const Index prefix = 23, drafts = 16;
  T3 x(1, prefix, 32), d(1, drafts, 32);
  rng.fill_normal(x);
  rng.fill_normal(d);
  const std::vector<Index> parents{-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 9, 4, 2, 7, 13, 0};
  sdpa::KVCache<double> cache(m, 1, 64);
  m.step(x, cache);
  sdpa::AttentionOptions<double> o;
  o.program = flex::program<double>(flex::noop_score{}, flex::tree(parents, prefix));
  const T3 verified = m.step(d, cache, o);
  for (Index i = 0; i < drafts; ++i) {
    std::vector<Index> path;
    for (Index j = i; j >= 0; j = parents[static_cast<std::size_t>(j)]) path.insert(path.begin(), j);
    cache.truncate(prefix);
    T3 out;
    for (Index j : path) {
      const Eigen::array<Index, 3> off{0, j, 0}, ext{1, 1, 32};
      const T3 token = d.slice(off, ext);
      out = m.step(token, cache);
    }
    double e = 0;
    for (Index c = 0; c < 32; ++c) e = std::max(e, std::abs(out(0, 0, c) - verified(0, i, c)));
    EXPECT_LE(e, 1e-12) << "draft " << i;
  }
}

// The paged ragged step: each sequence as batch entry i of the step, at its own absolute positions.
TEST(FlexModule, PagedStepEqualsOneCachePerSequence) {
  sdpa_test::Rng rng(31);
  const Module m = make_module(rng, 2);
  const auto mask = [](Index b, Index, Index q, Index k) { return (k + b) % 4 != 2 || k == q; };
  sdpa::AttentionOptions<double> o;
  o.program = flex::program<double>(flex::noop_score{}, mask);
  sdpa::PagedKVCache<double> paged(m, 16, 32);
  const auto sa = paged.add_sequence(), sb = paged.add_sequence();
  std::vector<sdpa::KVCache<double>> own;
  own.emplace_back(m, 1, 64);
  own.emplace_back(m, 1, 64);
  T3 first(1, 11, 32);
  rng.fill_normal(first);
  m.step(first, paged, {sa}, o);  // sequence a is 11 tokens ahead (and batch entry 0 of that step)
  sdpa::AttentionOptions<double> as_entry0;
  as_entry0.program = flex::program<double>(flex::noop_score{}, [&](Index, Index h, Index q, Index k) { return mask(0, h, q, k); });
  m.step(first, own[0], as_entry0);
  for (int round = 0; round < 3; ++round) {
    T3 x(2, 3, 32);
    rng.fill_normal(x);
    const T3 out = m.step(x, paged, {sa, sb}, o);
    for (Index i = 0; i < 2; ++i) {
      const Eigen::array<Index, 3> off{i, 0, 0}, ext{1, 3, 32};
      const T3 xi = x.slice(off, ext);
      sdpa::AttentionOptions<double> oi;
      oi.program = flex::program<double>(flex::noop_score{}, [&, i](Index, Index h, Index q, Index k) { return mask(i, h, q, k); });
      const T3 want = m.step(xi, own[static_cast<std::size_t>(i)], oi);
      const T3 got = out.slice(off, ext);
      EXPECT_LE(max_diff3(got, want), 1e-12) << "round " << round << " sequence " << i;
    }
  }
}

// ---- Refusals ----

TEST(FlexRefusals, NameWhatIsWrong) {
  sdpa_test::Rng rng(17);
  const T4<float> q = random4<float>(rng, 1, 2, 10, 8), k = random4<float>(rng, 1, 2, 12, 8), v = random4<float>(rng, 1, 2, 12, 8);
  const sdpa::BlockMask wrong = flex::causal{}.plan(1, 2, 10, 11, 4, 4);
  expect_invalid([&] { sdpa::attention(q, k, v, {}, flex::noop_score{}, flex::causal{}, &wrong); },
                 {"BlockMask's nk", "the call's keys 12", "11"});
  const sdpa::BlockMask heads3(1, 3, 10, 12);
  expect_invalid([&] { sdpa::attention(q, k, v, {}, flex::noop_score{}, flex::causal{}, &heads3); }, {"BlockMask's heads", "3"});
  flex::ScoreTable<float> table(3, 8);
  expect_invalid([&] { sdpa::attention(q, k, v, {}, flex::t5_buckets<float>{&table, true, 8, 16}, flex::all_visible{}); },
                 {"t5_buckets' table", "(2, 8)", "(3, 8)"});
  expect_invalid([&] { flex::tree({-1, 0, 2}, 9); }, {"parents[2]", "-1 or a draft before 2", "2"});
  expect_invalid([&] { flex::tree({-1, -2}, 9); }, {"parents[1]"});
  sdpa::AttentionOptions<float> o;
  o.kernel = sdpa::Kernel::kReference;
  expect_invalid([&] { sdpa::attention(q, k, v, o, flex::noop_score{}, flex::causal{}); }, {"kernel", "Kernel::kReference"});
  expect_invalid([&] { flex::causal{}.plan(1, 1, 10, 10, 4, 4) & flex::causal{}.plan(1, 1, 10, 10, 4, 8); },
                 {"blocks", "(4, 4)", "(4, 8)"});
  // A table the function reads but the program does not list: the backward refuses.
  flex::ScoreTable<float> hidden_table(2, 4, 0.5f);
  const auto reads = [&hidden_table](auto s, Index, Index hh, Index, Index) { return s + hidden_table.at(s, hh, 1); };
  sdpa::AttentionState<float> state;
  sdpa::attention(q, k, v, {}, reads, flex::all_visible{}, nullptr, state);
  const T4<float> d_out = random4<float>(rng, 1, 2, 10, 8);
  expect_invalid([&] { sdpa::attention_backward(d_out, state); }, {"tables", "missing one the function read"});
  // Listed, it has its gradient.
  sdpa::AttentionOptions<float> listed;
  listed.program = flex::program<float>(reads, flex::all_visible{}, sdpa::BlockMask{}, {&hidden_table});
  sdpa::attention(q, k, v, listed, state);
  const auto g = sdpa::attention_backward(d_out, state);
  ASSERT_EQ(g.tables.size(), 1u);
  EXPECT_EQ(g.tables[0].dimension(0), 2);
  // A refused cache step leaves the cache as it was.
  sdpa::ScaledDotProductAttention<float> m(16, 8, 8, 2);
  m.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 5, 16);
  rng.fill_normal(x);
  sdpa::KVCache<float> cache(m, 1, 16);
  m.step(x, cache);
  sdpa::AttentionOptions<float> mo;
  mo.program = flex::program<float>(flex::noop_score{}, flex::tree({-1, 0}, 5));
  expect_invalid([&] { m.step(x, cache, mo); }, {"the call's queries", "at most the tree's drafts 2", "5"});
  EXPECT_EQ(cache.size(), 5);
  EXPECT_EQ(cache.position(), 5);
}

// keep_from(p) is sound (no query at p or later sees a key before it) and, for chunks and causal windows,
// tight; through a program it lets a decoding cache drop what no later query sees, with the same outputs.
TEST(FlexKeepFrom, ChunksAndWindowsDropWhatNoLaterQuerySees) {
  const flex::chunked chunk{5};
  const flex::sliding_window window{3, 0};
  const auto both = flex::and_masks(flex::causal{}, flex::sliding_window{6, -1});
  for (Index p = 0; p < 40; ++p) {
    for (Index q = p; q < p + 30; ++q)
      for (Index k = 0; k < q + 1; ++k) {
        if (chunk(0, 0, q, k)) {
          EXPECT_GE(k, chunk.keep_from(p));
        }
        if (window(0, 0, q, k)) {
          EXPECT_GE(k, window.keep_from(p));
        }
        if (both(0, 0, q, k)) {
          EXPECT_GE(k, both.keep_from(p));
        }
      }
    EXPECT_TRUE(chunk(0, 0, p, chunk.keep_from(p)));
    EXPECT_TRUE(window(0, 0, p, window.keep_from(p)));
  }
  Module m(16, 4, 4, 2, 0.0, 1);
  m.eval();
  T3 x(1, 23, 16);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.3 * static_cast<double>(i));
  sdpa::AttentionOptions<double> o;
  o.program = flex::program<double>(flex::noop_score{}, flex::chunked{5});
  o.causal = true;
  const T3 full = m(x, x, x, o);
  sdpa::KVCache<double> cache(m, 1);
  for (Index t = 0; t < 23; ++t) {
    const T3 xt = x.slice(std::array<Index, 3>{0, t, 0}, std::array<Index, 3>{1, 1, 16});
    const T3 y = m.step(xt, cache, o);
    for (Index c = 0; c < 16; ++c) EXPECT_NEAR(y(0, 0, c), full(0, t, c), 1e-14);
    EXPECT_LE(cache.size(), 10);  // the current chunk, and at most as many older entries again
  }
  EXPECT_EQ(cache.position(), 23);
  EXPECT_GT(cache.first_position(), 0);
}

}  // namespace flex_test
