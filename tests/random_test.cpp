// Tests of sdpa/random.hpp: Philox4x32-10 against the Random123 known-answer vectors, the generator's
// stream/discard semantics, the dropout sampler's rate and independence from evaluation order, and the
// process-wide seed sequence (sdpa::manual_seed, sdpa::next_seed).
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <thread>
#include <vector>

#include "sdpa/random.hpp"

namespace random_test {

// Known-answer tests from Random123's kat_vectors (philox4x32 10 rounds), published with the algorithm.
TEST(Philox, KnownAnswerZero) {
  const sdpa::PhiloxCounter out = sdpa::philox4x32_10({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(out[0], 0x6627e8d5u);
  EXPECT_EQ(out[1], 0xe169c58du);
  EXPECT_EQ(out[2], 0xbc57ac4cu);
  EXPECT_EQ(out[3], 0x9b00dbd8u);
}

TEST(Philox, KnownAnswerOnes) {
  const sdpa::PhiloxCounter out =
      sdpa::philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(out[0], 0x408f276du);
  EXPECT_EQ(out[1], 0x41c83b0eu);
  EXPECT_EQ(out[2], 0xa20bc7c6u);
  EXPECT_EQ(out[3], 0x6d5451fdu);
}

TEST(Philox, KnownAnswerPi) {
  const sdpa::PhiloxCounter out =
      sdpa::philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(out[0], 0xd16cfe09u);
  EXPECT_EQ(out[1], 0x94fdccebu);
  EXPECT_EQ(out[2], 0x5001e420u);
  EXPECT_EQ(out[3], 0x24126ea1u);
}

TEST(Philox, GeneratorIsReproducibleAndSeedDependent) {
  sdpa::Philox a(42), b(42), c(43), d(42, 1);
  bool differs_seed = false, differs_stream = false;
  for (int i = 0; i < 64; ++i) {
    const auto x = a();
    EXPECT_EQ(x, b());
    differs_seed |= x != c();
    differs_stream |= x != d();
  }
  EXPECT_TRUE(differs_seed);
  EXPECT_TRUE(differs_stream);
}

TEST(Philox, DiscardSkipsExactly) {
  for (unsigned long long skip : {0ull, 1ull, 3ull, 4ull, 5ull, 13ull, 100ull}) {
    sdpa::Philox a(7), b(7);
    b();  // start mid-block too
    a();
    for (unsigned long long i = 0; i < skip; ++i) a();
    b.discard(skip);
    for (int i = 0; i < 9; ++i) EXPECT_EQ(a(), b()) << "skip " << skip;
  }
}

TEST(Philox, UniformAndNormalMoments) {
  sdpa::Philox gen(1);
  const int n = 200000;
  double su = 0, sn = 0, sn2 = 0, umin = 1, umax = 0;
  for (int i = 0; i < n; ++i) {
    const double u = sdpa::uniform_double(gen);
    umin = std::min(umin, u);
    umax = std::max(umax, u);
    su += u;
    const double z = sdpa::normal_double(gen);
    sn += z;
    sn2 += z * z;
  }
  EXPECT_GE(umin, 0.0);
  EXPECT_LT(umax, 1.0);
  EXPECT_NEAR(su / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(sn / n, 0.0, 5 / std::sqrt(n));
  EXPECT_NEAR(sn2 / n, 1.0, 0.02);
}

TEST(DropoutSampler, RateMatchesProbability) {
  for (double p : {0.1, 0.5, 0.9}) {
    sdpa::DropoutSampler s(123, 0, p);
    const int n = 100000;
    int dropped = 0;
    for (int k = 0; k < n; ++k) dropped += s.dropped(3, 5, k);
    EXPECT_NEAR(static_cast<double>(dropped) / n, p, 5 * std::sqrt(p * (1 - p) / n)) << "p " << p;
  }
}

TEST(DropoutSampler, ZeroAndOneAreExact) {
  sdpa::DropoutSampler none(9, 0, 0.0), all(9, 0, 1.0);
  EXPECT_FALSE(none.active());
  EXPECT_TRUE(all.drops_everything());
  for (int k = 0; k < 4096; ++k) {
    EXPECT_FALSE(none.dropped(0, 0, k));
    EXPECT_TRUE(all.dropped(0, 0, k));
  }
}

TEST(DropoutSampler, DependsOnEveryCoordinateAndTheCall) {
  sdpa::DropoutSampler s(5, 0, 0.5), next_call(5, 1, 0.5), other_seed(6, 0, 0.5);
  std::set<std::vector<bool>> rows;
  for (int bh = 0; bh < 3; ++bh)
    for (int q = 0; q < 3; ++q) {
      std::vector<bool> row;
      for (int k = 0; k < 64; ++k) row.push_back(s.dropped(bh, q, k));
      rows.insert(row);
    }
  EXPECT_EQ(rows.size(), 9u);
  int same_call = 0, same_seed = 0;
  for (int k = 0; k < 256; ++k) {
    same_call += s.dropped(0, 0, k) == next_call.dropped(0, 0, k);
    same_seed += s.dropped(0, 0, k) == other_seed.dropped(0, 0, k);
  }
  EXPECT_LT(same_call, 200);
  EXPECT_LT(same_seed, 200);
}

TEST(DropoutSampler, BlockAgreesWithElementwise) {
  sdpa::DropoutSampler s(77, 3, 0.3);
  for (int k4 = 0; k4 < 16; ++k4) {
    const auto words = s.block(2, 9, k4);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(s.dropped_bits(words[j]), s.dropped(2, 9, 4 * k4 + j));
  }
}

// fill_bits (vectorised on the AVX2 and AVX-512 paths in blocks of 8 or 16, scalar for the tail) must give
// block()'s words on the path chosen now (simd_test checks every path).
TEST(DropoutSampler, FillBitsAgreesWithBlock) {
  sdpa::DropoutSampler s(0x1234567890abcdefULL, 7, 0.4);
  for (std::int64_t begin : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{1000}, std::int64_t{4294967290}}) {
    for (std::int64_t blocks : {0, 1, 15, 16, 17, 33, 64}) {
      std::vector<std::uint32_t> out(static_cast<std::size_t>(4 * blocks) + 1, 0xdeadbeefu);
      s.fill_bits(sdpa::active_isa(), 11, 3, begin, blocks, out.data());
      for (std::int64_t i = 0; i < blocks; ++i) {
        const auto words = s.block(11, 3, begin + i);
        for (int j = 0; j < 4; ++j)
          ASSERT_EQ(out[static_cast<std::size_t>(4 * i + j)], words[static_cast<std::size_t>(j)])
              << "begin " << begin << " block " << i << " word " << j;
      }
      EXPECT_EQ(out.back(), 0xdeadbeefu) << "wrote past the end";
    }
  }
}

}  // namespace random_test

// The process-wide seed sequence: sdpa::manual_seed restarts it, consecutive seeds differ, other bases
// give other sequences, and concurrent draws never hand out the same seed twice.
TEST(SeedSequence, ManualSeedRestartsTheSequence) {
  sdpa::manual_seed(42);
  const std::uint64_t a = sdpa::next_seed(), b = sdpa::next_seed(), c = sdpa::next_seed();
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_NE(a, c);
  sdpa::manual_seed(42);
  EXPECT_EQ(sdpa::next_seed(), a);
  EXPECT_EQ(sdpa::next_seed(), b);
  sdpa::manual_seed(43);
  EXPECT_NE(sdpa::next_seed(), a);
}

TEST(SeedSequence, ConcurrentDrawsAreDistinct) {
  sdpa::manual_seed(7);
  constexpr int kThreads = 4, kEach = 500;
  std::vector<std::vector<std::uint64_t>> drawn(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&drawn, t] {
      for (int i = 0; i < kEach; ++i) drawn[static_cast<std::size_t>(t)].push_back(sdpa::next_seed());
    });
  for (auto& th : threads) th.join();
  std::set<std::uint64_t> all;
  for (const auto& d : drawn) all.insert(d.begin(), d.end());
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kThreads * kEach));
  // They are the first kThreads * kEach seeds of the sequence, in some order.
  sdpa::manual_seed(7);
  std::set<std::uint64_t> serial;
  for (int i = 0; i < kThreads * kEach; ++i) serial.insert(sdpa::next_seed());
  EXPECT_EQ(all, serial);
}
