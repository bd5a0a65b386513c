// A tiny server loop over a PagedKVCache (continuous batching): requests with prompts of random lengths
// arrive at random steps; each is admitted as a new sequence (its prompt appended in one step), then every
// running sequence decodes one token per step together with the others (one ragged step), and a sequence
// that has generated its tokens is retired and its blocks go back to the pool. Half the requests share a
// system prompt: they are forks of a sequence that holds it, so its blocks are stored once. Prints the
// throughput and the pool's use.
//
//   serve [REQUESTS] [STORAGE]     (default 24 requests; STORAGE f32, bf16, f16 or int8)
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <sdpa/sdpa.hpp>

namespace {

using Tensor3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Id = sdpa::PagedKVCache<float>::SequenceId;
constexpr Eigen::Index kModel = 256;

struct Request {
  Id sequence = -1;
  int remaining = 0;  // tokens still to generate
};

Tensor3 tokens(std::mt19937& gen, Eigen::Index batch, Eigen::Index n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Tensor3 x(batch, n, kModel);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = u(gen);
  return x;
}

sdpa::Storage storage_of(const char* name) {
  if (std::strcmp(name, "bf16") == 0) return sdpa::Storage::kBFloat16;
  if (std::strcmp(name, "f16") == 0) return sdpa::Storage::kFloat16;
  if (std::strcmp(name, "int8") == 0) return sdpa::Storage::kInt8;
  return sdpa::Storage::kFloat32;
}

}  // namespace

int main(int argc, char** argv) {
  const int requests = argc > 1 ? std::atoi(argv[1]) : 24;
  const sdpa::Storage storage = argc > 2 ? storage_of(argv[2]) : sdpa::Storage::kFloat32;
  sdpa::manual_seed(1);
  sdpa::ScaledDotProductAttention<float> model(kModel, 32, 32, 8, 0.0f, /*kv_heads=*/2);
  model.init_weights(sdpa::init::PyTorchDefaultPolicy{});
  model.eval();
  model.set_rotary(sdpa::Rotary{});
  sdpa::PagedKVCache<float> cache(model, /*block_size=*/32, /*max_blocks=*/2048, storage);
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> prompt_len(16, 400), gen_len(8, 64), arrival(0, 3);

  // The shared system prompt, held by one sequence that later requests fork.
  const Id system = cache.add_sequence();
  (void)model.step(tokens(gen, 1, 200), cache, {system});

  std::vector<Request> running;
  int admitted = 0, retired = 0, steps = 0;
  long generated = 0, prompt_tokens = 0;
  Eigen::Index peak_blocks = cache.blocks_used();
  const auto t0 = std::chrono::steady_clock::now();
  int next_arrival = 0;
  while (retired < requests) {
    // Admit the requests that have arrived: a new sequence, or a fork of the system prompt; its prompt in one step.
    while (admitted < requests && next_arrival <= steps) {
      Request r;
      r.sequence = admitted % 2 == 0 ? cache.fork(system) : cache.add_sequence();
      const int n = prompt_len(gen);
      (void)model.step(tokens(gen, 1, n), cache, {r.sequence});
      prompt_tokens += n;
      r.remaining = gen_len(gen);
      running.push_back(r);
      ++admitted;
      next_arrival += arrival(gen);
    }
    // One token for every running sequence, in one ragged step.
    std::vector<Id> ids;
    for (const Request& r : running) ids.push_back(r.sequence);
    const Tensor3 y = model.step(tokens(gen, static_cast<Eigen::Index>(ids.size()), 1), cache, ids);
    generated += static_cast<long>(ids.size());
    ++steps;
    peak_blocks = std::max(peak_blocks, cache.blocks_used());
    // Retire the finished ones.
    for (std::size_t i = 0; i < running.size();) {
      if (--running[i].remaining == 0) {
        cache.remove_sequence(running[i].sequence);
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
        ++retired;
      } else {
        ++i;
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << requests << " requests (" << prompt_tokens << " prompt tokens, half of them after a shared 200-token "
            << "system prompt), " << generated << " tokens generated in " << steps << " ragged steps: " << generated / seconds
            << " tokens/s, " << (generated + prompt_tokens) / seconds << " tokens/s with the prompts\n"
            << "cache (" << sdpa::storage_name(storage) << ", blocks of " << cache.block_size() << "): peak "
            << peak_blocks << " of " << cache.max_blocks() << " blocks (" << peak_blocks * static_cast<Eigen::Index>(cache.block_bytes()) / 1024
            << " KiB), " << cache.blocks_used() << " in use at the end (the system prompt)\n";
  return cache.blocks_used() > 0 && cache.sequences().size() == 1 ? 0 : 1;
}
