// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): a pure function of (counter, key),
// so a value depends only on what it is for, never on how many values were drawn before it. That gives
// dropout masks that are identical whatever the tiling or the number of threads, and a small generator
// object (`Philox`) that satisfies UniformRandomBitGenerator for the init strategies. The one piece of
// process-wide state is the sequence of default module seeds (sdpa::manual_seed), as in PyTorch.
#pragma once

#include "sdpa/config.hpp"

#include <array>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>

#include "sdpa/cpu.hpp"
#include "sdpa/simd/dispatch.hpp"

SDPA_NAMESPACE_BEGIN

using PhiloxCounter = std::array<std::uint32_t, 4>;
using PhiloxKey = std::array<std::uint32_t, 2>;

// The Philox4x32 bijection with 10 rounds.
inline PhiloxCounter philox4x32_10(PhiloxCounter ctr, PhiloxKey key) noexcept {
  constexpr std::uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = kM0 * ctr[0];
    const std::uint64_t p1 = kM1 * ctr[2];
    ctr = {static_cast<std::uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<std::uint32_t>(p1),
           static_cast<std::uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<std::uint32_t>(p0)};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

inline PhiloxKey philox_key(std::uint64_t seed) noexcept {
  return {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
}

// A UniformRandomBitGenerator over Philox4x32-10: output i of stream s under seed k is word i % 4 of
// philox(counter = (i / 4, s), key = k). Copyable, reproducible, and cheap to split into streams.
class Philox {
 public:
  using result_type = std::uint32_t;

  explicit Philox(std::uint64_t seed = 0, std::uint64_t stream = 0) noexcept
      : key_(philox_key(seed)), stream_(stream) {}

  static constexpr result_type min() noexcept { return 0; }
  static constexpr result_type max() noexcept { return std::numeric_limits<result_type>::max(); }

  result_type operator()() noexcept {
    if (used_ == 4) {
      block_ = philox4x32_10({static_cast<std::uint32_t>(block_index_), static_cast<std::uint32_t>(block_index_ >> 32),
                              static_cast<std::uint32_t>(stream_), static_cast<std::uint32_t>(stream_ >> 32)},
                             key_);
      ++block_index_;
      used_ = 0;
    }
    return block_[used_++];
  }

  void discard(unsigned long long n) noexcept {
    while (n > 0 && used_ < 4) {
      ++used_;
      --n;
    }
    block_index_ += n / 4;
    for (unsigned long long r = n % 4; r > 0; --r) (*this)();
  }

  std::uint64_t seed() const noexcept { return key_[0] | (static_cast<std::uint64_t>(key_[1]) << 32); }
  std::uint64_t stream() const noexcept { return stream_; }

 private:
  PhiloxKey key_;
  std::uint64_t stream_;
  std::uint64_t block_index_ = 0;
  PhiloxCounter block_{};
  std::size_t used_ = 4;
};

namespace detail {
// The process-wide seed sequence behind sdpa::manual_seed and next_seed: a base seed and how many seeds
// have been handed out since it was set, under one mutex (construction, not a hot path).
struct SeedSequence {
  std::mutex mutex;
  std::uint64_t base = 0x5dfa0c1e2024ULL;
  std::uint64_t drawn = 0;
};
inline SeedSequence& seed_sequence() noexcept {
  static SeedSequence sequence;
  return sequence;
}
}  // namespace detail

// Seeds the process-wide sequence that modules built without a seed draw from (as torch.manual_seed does
// for PyTorch's default generator): after sdpa::manual_seed(s), the i-th module constructed gets the same
// weights and dropout masks in every run. Modules keep their own seed once drawn; their manual_seed
// member function reseeds one module alone.
inline void manual_seed(std::uint64_t seed) noexcept {
  detail::SeedSequence& s = detail::seed_sequence();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.base = seed;
  s.drawn = 0;
}

// The next seed of the process-wide sequence: seed i under base b is two words of
// philox(counter = (i, 0x5eed), key = b), so consecutive seeds are unrelated.
inline std::uint64_t next_seed() noexcept {
  detail::SeedSequence& s = detail::seed_sequence();
  std::uint64_t base = 0, index = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    base = s.base;
    index = s.drawn++;
  }
  const PhiloxCounter w = philox4x32_10(
      {static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32), 0x5eedu, 0u}, philox_key(base));
  return static_cast<std::uint64_t>(w[0]) | (static_cast<std::uint64_t>(w[1]) << 32);
}

// Uniform double in [0, 1) with 53 random bits, from any 32-bit generator. Written out rather than
// std::uniform_real_distribution so that a seed gives the same numbers with every standard library.
template <typename Gen>
double uniform_double(Gen& gen) {
  const std::uint64_t hi = static_cast<std::uint64_t>(gen()) >> 5;  // 27 bits
  const std::uint64_t lo = static_cast<std::uint64_t>(gen()) >> 6;  // 26 bits
  return static_cast<double>((hi << 26) | lo) * 0x1.0p-53;
}

// Standard normal deviate (Box-Muller), portable for the same reason as uniform_double.
template <typename Gen>
double normal_double(Gen& gen) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  double u1 = uniform_double(gen);
  while (u1 <= 0.0) u1 = uniform_double(gen);
  const double u2 = uniform_double(gen);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

// Which attention probabilities dropout removes. Element (b, h, q, k) of forward call `call` is dropped
// when its 32 random bits fall below p * 2^32; the bits are word k % 4 of
// philox(counter = (k / 4, q, b * heads + h, call), key = seed). Every kernel asks this object, so they
// agree bit for bit on the mask.
class DropoutSampler {
 public:
  DropoutSampler(std::uint64_t seed, std::uint64_t call, double p) noexcept
      : key_(philox_key(seed)),
        call_(static_cast<std::uint32_t>(call)),
        threshold_(p <= 0.0 ? 0u
                            : p >= 1.0 ? (std::uint64_t{1} << 32)
                                       : static_cast<std::uint64_t>(std::llround(p * 4294967296.0))) {}

  bool active() const noexcept { return threshold_ != 0; }

  // The same draw with every row index bh moved by `rows` (a packed sequence s of a batch of one draws as
  // batch entry s of a padded batch would: rows = s * heads).
  DropoutSampler offset_rows(std::int64_t rows) const noexcept {
    DropoutSampler s = *this;
    s.bh_offset_ += rows;
    return s;
  }
  bool drops_everything() const noexcept { return threshold_ == (std::uint64_t{1} << 32); }

  // The random words for keys 4*k4 .. 4*k4+3 of row (bh, q), where bh = b * heads + h.
  PhiloxCounter block(std::int64_t bh, std::int64_t q, std::int64_t k4) const noexcept {
    return philox4x32_10(
        {static_cast<std::uint32_t>(k4), static_cast<std::uint32_t>(q), static_cast<std::uint32_t>(bh + bh_offset_), call_}, key_);
  }

  // The words of `blocks` consecutive blocks k4_begin, k4_begin + 1, ... of row (bh, q):
  // out[4 * i + j] = block(bh, q, k4_begin + i)[j], i.e. out[k - 4 * k4_begin] decides key k. On the AVX2
  // and AVX-512 paths 8 or 16 blocks go through the rounds at once (simd/dispatch.hpp; with AVX-512 the
  // dropout mask of a tile costs far less than asking block() per key group); the words are the same on
  // every path.
  void fill_bits(Isa isa, std::int64_t bh, std::int64_t q, std::int64_t k4_begin, std::int64_t blocks,
                 std::uint32_t* out) const noexcept {
    std::int64_t i = simd::philox_fill(isa, {key_[0], key_[1], call_}, bh + bh_offset_, q, k4_begin, blocks, out);
    for (; i < blocks; ++i) {
      const PhiloxCounter words = block(bh, q, k4_begin + i);
      for (int j = 0; j < 4; ++j) out[4 * i + j] = words[static_cast<std::size_t>(j)];
    }
  }

  bool dropped_bits(std::uint32_t bits) const noexcept { return bits < threshold_; }

  bool dropped(std::int64_t bh, std::int64_t q, std::int64_t k) const noexcept {
    return dropped_bits(block(bh, q, k >> 2)[static_cast<std::size_t>(k & 3)]);
  }

 private:
  PhiloxKey key_;
  std::uint32_t call_;
  std::int64_t bh_offset_ = 0;
  std::uint64_t threshold_;
};

SDPA_NAMESPACE_END
