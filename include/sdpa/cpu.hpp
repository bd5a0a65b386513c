// Which instruction set sdpa's kernels run with, chosen at run time: one binary, built without any -march
// flag, runs the AVX-512 kernels on an AVX-512 CPU, the AVX2 + FMA kernels on an AVX2 CPU and the portable
// ones elsewhere (ATen's DispatchStub, ONNX Runtime's MLAS and oneDNN do the same). The per-ISA kernels are
// compiled through target attributes in namespaces named after their ISA (sdpa::avx512, sdpa::avx2,
// sdpa::portable), so no inline function has a body that depends on the translation unit's -march.
//
//   sdpa::cpu_isa()            "avx512", "avx2" or "portable": what the kernels use now
//   sdpa::set_cpu_isa("avx2")  forces a path the CPU runs (a higher one: std::invalid_argument); "auto" = best
//   SDPA_ISA=avx2              the same from the environment, read at the first call
//
// The choice is process-wide. Each kernel call reads it once at its start and runs on that path to its end,
// so changing it while other threads compute is safe (their calls finish on the path they started with).
#pragma once

#include "sdpa/config.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if SDPA_DISPATCH
#include <cpuid.h>
#endif

namespace sdpa {
// Outside the ABI namespace on purpose: one choice per process, whatever the translation units' baselines.
// (The body holds nothing that a -march could compile differently.)
namespace shared {
inline std::atomic<int>& isa_slot() noexcept {
  static std::atomic<int> slot{-1};  // -1: not resolved yet; -2: SDPA_ISA holds a value that is refused
  return slot;
}
}  // namespace shared
}  // namespace sdpa

SDPA_NAMESPACE_BEGIN

// Ordered: a path needs every feature of the ones below it.
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

// What the CPU offers beyond the paths (for the storage kernels of later issues and for reports).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512bf16 = false;
  bool avx512vnni = false, avx_vnni = false;  // vpdpwssd / vpdpbusd on zmm (EVEX) and on ymm (VEX)
  bool amx_tile = false, amx_bf16 = false;  // and the OS saves the tile state (XCR0 bits 17 and 18)
};

namespace detail {

#if SDPA_DISPATCH
// XCR0 through the instruction itself: _xgetbv needs -mxsave, which a portable build does not have.
inline unsigned long long xgetbv0() noexcept {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

// CPUID and the OS's saved register state (XCR0): a feature counts only when the OS saves its registers.
inline CpuFeatures detect_cpu_features() noexcept {
  CpuFeatures f;
#if SDPA_DISPATCH
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
  if (!osxsave || !avx) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;      // SSE and AVX state
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;    // and opmask, ZMM_Hi256, Hi16_ZMM
  if (!ymm_state) return f;
  f.fma = (c >> 12) & 1u;
  f.f16c = (c >> 29) & 1u;
  unsigned max_leaf = 0;
  __get_cpuid(0, &max_leaf, &b, &c, &d);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned sub_leaves = a;
  f.avx2 = (b >> 5) & 1u;
  const unsigned leaf7_c = c;
  if (zmm_state) {
    f.avx512f = (b >> 16) & 1u;
    f.avx512dq = (b >> 17) & 1u;
    f.avx512bw = (b >> 30) & 1u;
    f.avx512vl = (b >> 31) & 1u;
    f.avx512vnni = (leaf7_c >> 11) & 1u;
    const bool tile_state = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA
    f.amx_tile = tile_state && ((d >> 24) & 1u);
    f.amx_bf16 = tile_state && ((d >> 22) & 1u);
  }
  if (sub_leaves >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = (a >> 4) & 1u;
    if (zmm_state) f.avx512bf16 = (a >> 5) & 1u;
  }
#endif
  return f;
}

inline Isa best_isa_of(const CpuFeatures& f) noexcept {
#if SDPA_DISPATCH
  if (f.avx2 && f.fma && f.f16c) {
    if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl) return Isa::kAvx512;
    return Isa::kAvx2;
  }
#else
  (void)f;
#endif
  return Isa::kPortable;
}

// -1 when the name is none of the paths ("auto" is the caller's business).
inline int isa_from_name(const char* name) noexcept {
  if (std::strcmp(name, "avx512") == 0) return static_cast<int>(Isa::kAvx512);
  if (std::strcmp(name, "avx2") == 0) return static_cast<int>(Isa::kAvx2);
  if (std::strcmp(name, "portable") == 0) return static_cast<int>(Isa::kPortable);
  return -1;
}

[[noreturn]] inline void throw_isa(const char* where, const char* argument, const std::string& given, Isa best) {
  throw std::invalid_argument(std::string("sdpa::") + where + ": " + argument + " must be auto, portable" +
                              (best >= Isa::kAvx2 ? ", avx2" : "") + (best >= Isa::kAvx512 ? ", avx512" : "") +
                              " (the paths this CPU runs), but is \"" + given + "\"");
}

}  // namespace detail

inline const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures features = detail::detect_cpu_features();
  return features;
}

// The best path this CPU runs with this build.
inline Isa best_isa() noexcept {
  static const Isa best = detail::best_isa_of(cpu_features());
  return best;
}

namespace detail {
// A process-wide choice kept in `slot` (-1: not resolved yet; -2: the environment names a refused value):
// resolved at the first call from the environment variable `variable` ("auto" or unset: best), a name
// from_name maps to a value in [0, best] (-1: none). refuse(name) throws for a refused one.
template <typename FromName, typename Refuse>
int resolve_choice(std::atomic<int>& slot, const char* variable, int best, FromName&& from_name, Refuse&& refuse) {
  int v = slot.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  if (v == -1) {
    const char* env = std::getenv(variable);
    int chosen = best;
    if (env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
      chosen = from_name(env);
      if (chosen < 0 || chosen > best) chosen = -2;
    }
    int expected = -1;
    slot.compare_exchange_strong(expected, chosen, std::memory_order_relaxed);
    v = slot.load(std::memory_order_relaxed);
  }
  if (v == -2) {
    const char* env = std::getenv(variable);
    refuse(env != nullptr ? env : "");
  }
  return v;
}
}  // namespace detail

// The path the kernels use: the best one unless SDPA_ISA or set_cpu_isa chose a lower one. Throws
// std::invalid_argument while SDPA_ISA holds a name that is not a path this CPU runs.
inline Isa active_isa() {
  return static_cast<Isa>(detail::resolve_choice(
      shared::isa_slot(), "SDPA_ISA", static_cast<int>(best_isa()), detail::isa_from_name, [](const char* env) {
        detail::throw_isa("cpu_isa", "the environment variable SDPA_ISA", env, best_isa());
      }));
}

inline const char* cpu_isa() { return isa_name(active_isa()); }

// Forces a path: kPortable always works, kAvx2 and kAvx512 where the CPU runs them.
inline void set_cpu_isa(Isa isa) {
  if (static_cast<int>(isa) < 0 || isa > best_isa())
    detail::throw_isa("set_cpu_isa", "isa", isa_name(isa), best_isa());
  shared::isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
}

// By name: "avx512", "avx2", "portable", or "auto" (the best the CPU runs).
inline void set_cpu_isa(const std::string& name) {
  if (name == "auto") {
    shared::isa_slot().store(static_cast<int>(best_isa()), std::memory_order_relaxed);
    return;
  }
  const int v = detail::isa_from_name(name.c_str());
  if (v < 0 || v > static_cast<int>(best_isa())) detail::throw_isa("set_cpu_isa", "name", name, best_isa());
  shared::isa_slot().store(v, std::memory_order_relaxed);
}

SDPA_NAMESPACE_END
