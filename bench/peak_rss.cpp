// sdpa_peak_rss IMPL N CAUSAL: one eval forward of the long configuration (batch 1, N tokens, d_model 512,
// d_k = d_v = 64, h = 8, self-attention), 1 thread, then prints the process's peak resident set size
// (getrusage ru_maxrss) as one JSON line. IMPL is sdpa or torch (when built with LibTorch), CAUSAL 0 or 1.
// Run it in a fresh process per measurement: ru_maxrss never goes down.
//
// Linux keeps ru_maxrss across execve and seeds it with the high-water mark of the memory the process had
// before (a Python parent's, when the parent spawns with vfork), so this small launcher forks a child that
// execs `<exe> --measure ...`: the fresh program's count then starts from the launcher's ~1 MiB. The
// kernel's per-address-space VmHWM (/proc/self/status) is printed alongside as a cross-check.
//
// The JSON also gives the peak before anything was allocated (startup: code and libraries) and after the
// inputs and the mask were built (setup), so the forward's own footprint is peak - setup. The LibTorch
// side lives in a sibling executable, sdpa_peak_rss_torch, which `sdpa_peak_rss torch ...` execs: the
// sdpa measurement must not carry LibTorch's libraries.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "bench_common.hpp"

#ifdef SDPA_BENCH_WITH_TORCH
#include "torch_peer.hpp"
#endif

namespace {

double peak_rss_mib() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s sdpa|torch N CAUSAL(0|1)\n", argv0);
  return 2;
}

std::string self_path() {
  std::string self(4096, '\0');
  const ssize_t len = readlink("/proc/self/exe", &self[0], self.size() - 1);
  self.resize(len > 0 ? static_cast<std::size_t>(len) : 0);
  return self;
}

// Forks a child that execs `exe --measure IMPL N CAUSAL` and waits for it.
int launch(const std::string& exe, char** argv) {
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 4;
  }
  if (child == 0) {
    char measure[] = "--measure";
    char* args[] = {const_cast<char*>(exe.c_str()), measure, argv[1], argv[2], argv[3], nullptr};
    execv(exe.c_str(), args);
    std::perror(exe.c_str());
    _exit(3);
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child) return 4;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 5;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace sdpa_bench;
  // Launcher: sdpa_peak_rss IMPL N CAUSAL. Measurement: <exe> --measure IMPL N CAUSAL, run by the launcher.
  const bool measuring = argc == 5 && std::strcmp(argv[1], "--measure") == 0;
  if (measuring) {
    ++argv;
    --argc;
  }
  if (argc != 4) return usage(argv[0]);
  const std::string impl = argv[1];
  const long n = std::atol(argv[2]);
  const bool causal = std::strcmp(argv[3], "1") == 0;
  if ((impl != "sdpa" && impl != "torch") || n <= 0 || (std::strcmp(argv[3], "0") != 0 && !causal))
    return usage(argv[0]);
  if (!measuring) {
    std::string exe = self_path();
#ifndef SDPA_BENCH_WITH_TORCH
    if (impl == "torch") {
#ifdef SDPA_PEAK_RSS_TORCH_SIBLING
      exe = exe.substr(0, exe.rfind('/') + 1) + SDPA_PEAK_RSS_TORCH_SIBLING;
#else
      std::fprintf(stderr, "%s: built without LibTorch\n", argv[0]);
      return 3;
#endif
    }
#endif
    return launch(exe, argv);
  }
#ifndef SDPA_BENCH_WITH_TORCH
  if (impl == "torch") return 3;
#endif
  const double startup = peak_rss_mib();
  const Config c = long_config(n, causal);
  double setup = 0, peak = 0;
  float checksum = 0;
  {
    // For torch the fixture builds no mask: the LibTorch peer makes its own triu mask, and only one mask
    // should be resident.
    Config fixture_cfg = c;
    if (impl == "torch") fixture_cfg.causal = false;
    Fixture f(fixture_cfg);
    if (impl == "sdpa") {
      setup = peak_rss_mib();
      const Tensor3 y = f.run(nullptr);
      checksum = y(0, n - 1, 0);
      peak = peak_rss_mib();
    }
#ifdef SDPA_BENCH_WITH_TORCH
    if (impl == "torch") {
      TorchPeer::set_num_threads(1);
      auto p = [](const sdpa::Linear<float>& l) { return TorchLinearParams{l.weight().data(), l.bias().data()}; };
      TorchPeer peer(TorchShape{c.batch, c.nq, c.nk, c.d_model, c.d_k, c.d_v, c.h}, p(f.module.fc_q()),
                     p(f.module.fc_k()), p(f.module.fc_v()), p(f.module.fc_o()));
      peer.set_inputs(f.queries().data(), f.keys().data(), f.values().data(), causal);
      setup = peak_rss_mib();
      peer.forward();
      checksum = peer.output()[(n - 1) * c.d_model];
      peak = peak_rss_mib();
    }
#endif
  }
  const double mask_mib = causal ? static_cast<double>(n) * static_cast<double>(n) / (1024.0 * 1024.0) : 0.0;
  std::printf(
      "{\"impl\": \"%s\", \"N\": %ld, \"causal\": %d, \"peak_rss_mib\": %.1f, \"startup_rss_mib\": %.1f, "
      "\"setup_rss_mib\": %.1f, \"vm_hwm_mib\": %.1f, \"mask_mib\": %.1f, \"checksum\": %.6g}\n",
      impl.c_str(), n, causal ? 1 : 0, peak, startup, setup, sdpa_bench::vm_hwm_mib(), mask_mib, static_cast<double>(checksum));
  return 0;
}
