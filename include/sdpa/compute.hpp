// The type attention's products run in, apart from the type its inputs are stored in (ATen's opmath_type,
// FlashAttention's bf16 kernels): Compute::kFloat multiplies in float (the default, bit for bit what sdpa
// always computed); Compute::kBf16 rounds q, k, v and the unnormalised probabilities to bfloat16 (to
// nearest, ties to even), multiplies those pairs and accumulates in float, while the scale, the score
// options, the running max, the exponentials, the sums and the output accumulator stay in float.
//
// Which instructions multiply the bfloat16 pairs is chosen at run time, like the ISA paths (sdpa/cpu.hpp):
//   "amx"          AMX-BF16 tiles (Sapphire Rapids and later), once Linux grants the tile state
//                  (arch_prctl ARCH_REQ_XCOMP_PERM; refused: the next path)
//   "avx512_bf16"  AVX512_BF16's vdpbf16ps (Cooper Lake, Zen 4, Zen 5, Sapphire Rapids)
//   "emulated"     operands rounded to bfloat16 and multiplied by the float kernels: the same products (a
//                  product of two bfloat16 is exact in float), summed in another order
//   sdpa::bf16_compute_path()               the path kBf16 runs now
//   sdpa::set_bf16_compute_path("emulated") forces a path the CPU runs ("auto" = best); SDPA_BF16 likewise
// The hardware paths need the AVX-512 ISA path (sdpa/cpu.hpp); under SDPA_ISA=avx2 or portable kBf16 is
// emulated. Both hardware instructions treat bfloat16 subnormals (below 2^-126) as zero.
#pragma once

#include "sdpa/config.hpp"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "sdpa/cpu.hpp"

#if SDPA_DISPATCH
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sdpa {
namespace shared {
// One choice per process (outside the ABI namespace, as the ISA's slot): -1 unresolved, -2 refused name.
inline std::atomic<int>& bf16_path_slot() noexcept {
  static std::atomic<int> slot{-1};
  return slot;
}
}  // namespace shared
}  // namespace sdpa

SDPA_NAMESPACE_BEGIN

enum class Compute { kFloat, kBf16 };

inline const char* compute_name(Compute c) noexcept { return c == Compute::kBf16 ? "kBf16" : "kFloat"; }

// Ordered: a path needs what the ones below it need.
enum class Bf16Path : int { kEmulated = 0, kAvx512Bf16 = 1, kAmx = 2 };

inline const char* bf16_path_name(Bf16Path p) noexcept {
  switch (p) {
    case Bf16Path::kAmx:
      return "amx";
    case Bf16Path::kAvx512Bf16:
      return "avx512_bf16";
    default:
      return "emulated";
  }
}

namespace detail {

// Linux keeps AMX's 8 KiB tile state off until a process asks for it (ARCH_REQ_XCOMP_PERM with
// XFEATURE_XTILEDATA); asked once, for every thread of the process.
inline bool amx_permitted() noexcept {
#if SDPA_DISPATCH && defined(__linux__) && defined(SYS_arch_prctl)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XTILEDATA*/) == 0;
  return granted;
#else
  return false;
#endif
}

inline Bf16Path best_bf16_path_of(const CpuFeatures& f) noexcept {
#if SDPA_DISPATCH
  if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx512bf16) {
    if (f.amx_tile && f.amx_bf16 && amx_permitted()) return Bf16Path::kAmx;
    return Bf16Path::kAvx512Bf16;
  }
#else
  (void)f;
#endif
  return Bf16Path::kEmulated;
}

inline int bf16_path_from_name(const char* name) noexcept {
  if (std::strcmp(name, "amx") == 0) return static_cast<int>(Bf16Path::kAmx);
  if (std::strcmp(name, "avx512_bf16") == 0) return static_cast<int>(Bf16Path::kAvx512Bf16);
  if (std::strcmp(name, "emulated") == 0) return static_cast<int>(Bf16Path::kEmulated);
  return -1;
}

[[noreturn]] inline void throw_bf16_path(const char* where, const char* argument, const std::string& given,
                                         Bf16Path best) {
  throw std::invalid_argument(std::string("sdpa::") + where + ": " + argument + " must be auto, emulated" +
                              (best >= Bf16Path::kAvx512Bf16 ? ", avx512_bf16" : "") +
                              (best >= Bf16Path::kAmx ? ", amx" : "") + " (the paths this CPU runs), but is \"" +
                              given + "\"");
}

}  // namespace detail

// The best path this CPU and OS run (whatever the ISA path).
inline Bf16Path best_bf16_path() noexcept {
  static const Bf16Path best = detail::best_bf16_path_of(cpu_features());
  return best;
}

// The path kBf16 products take now: the chosen one (SDPA_BF16, set_bf16_compute_path; else the best),
// emulated while the ISA path is below AVX-512.
inline Bf16Path active_bf16_path() {
  const int v = detail::resolve_choice(
      shared::bf16_path_slot(), "SDPA_BF16", static_cast<int>(best_bf16_path()), detail::bf16_path_from_name,
      [](const char* env) {
        detail::throw_bf16_path("bf16_compute_path", "the environment variable SDPA_BF16", env, best_bf16_path());
      });
  return active_isa() == Isa::kAvx512 ? static_cast<Bf16Path>(v) : Bf16Path::kEmulated;
}

inline const char* bf16_compute_path() { return bf16_path_name(active_bf16_path()); }

// Forces a path: kEmulated always, the others where the CPU (and for AMX, the OS) runs them.
inline void set_bf16_compute_path(Bf16Path path) {
  if (static_cast<int>(path) < 0 || path > best_bf16_path())
    detail::throw_bf16_path("set_bf16_compute_path", "path", bf16_path_name(path), best_bf16_path());
  shared::bf16_path_slot().store(static_cast<int>(path), std::memory_order_relaxed);
}

// By name: "amx", "avx512_bf16", "emulated", or "auto" (the best).
inline void set_bf16_compute_path(const std::string& name) {
  if (name == "auto") {
    shared::bf16_path_slot().store(static_cast<int>(best_bf16_path()), std::memory_order_relaxed);
    return;
  }
  const int v = detail::bf16_path_from_name(name.c_str());
  if (v < 0 || v > static_cast<int>(best_bf16_path()))
    detail::throw_bf16_path("set_bf16_compute_path", "name", name, best_bf16_path());
  shared::bf16_path_slot().store(v, std::memory_order_relaxed);
}

SDPA_NAMESPACE_END
