// libFuzzer target for sdpa/io/safetensors_format.hpp and sdpa/io/safetensors.hpp (built and run by
// .ci/fuzz.sh): every input is parsed, its floating-point tensors converted, and loaded into a small
// module with and without a prefix. A SafetensorsError is the expected answer to a bad file; any other
// exception, a sanitizer report, or a refused load that changed the module is a crash. An accepted load must also survive save -> load
// bit-exactly. Seeds: tests/fuzz/corpus/ (scripts/models/export_pytorch.py fixtures), for a
// ScaledDotProductAttention<float>(4, 2, 2, 2) stored without a prefix or under "m.".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sdpa/io/safetensors.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"

namespace {

using Module = sdpa::ScaledDotProductAttention<float>;

std::vector<std::uint8_t> raw(const Module& m) {
  std::vector<std::uint8_t> out;
  for (const auto& p : m.named_parameters()) {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(p.data);
    out.insert(out.end(), bytes, bytes + p.size() * sizeof(float));
  }
  return out;
}

[[noreturn]] void crash(const char* why) {
  std::fprintf(stderr, "safetensors_fuzzer: %s\n", why);
  std::abort();
}

void load(const std::uint8_t* data, std::size_t size, const std::string& prefix, bool ignore_unexpected) {
  Module m(4, 2, 2, 2);
  const std::vector<std::uint8_t> before = raw(m);
  try {
    sdpa::load_safetensors_from_memory(m, data, size, "fuzz-input", prefix, sdpa::LoadOptions{ignore_unexpected});
  } catch (const sdpa::SafetensorsError&) {
    if (raw(m) != before) crash("a refused load changed the module");
    return;
  }
  // Accepted: what was loaded must save and load back bit-exactly.
  const std::vector<std::uint8_t> saved = sdpa::save_safetensors_to_memory(m, prefix, {{"k", "v"}});
  Module again(4, 2, 2, 2);
  again.manual_seed(1);
  again.init_weights();
  sdpa::load_safetensors_from_memory(again, saved.data(), saved.size(), "resaved", prefix);
  if (raw(again) != raw(m)) crash("save -> load is not bit-exact");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const sdpa::SafetensorsFile file = sdpa::parse_safetensors(data, size, "fuzz-input");
    for (const sdpa::SafetensorsTensor& t : file.tensors) {
      if (t.end > file.data_size || (t.nbytes() != 0 && (t.data < data + 8 || t.data + t.nbytes() > data + size)))
        crash("parse accepted a tensor outside the input");
      try {
        const std::vector<double> values = sdpa::tensor_values<double>(file, t);
        if (values.size() != static_cast<std::size_t>(t.numel())) crash("wrong element count");
      } catch (const sdpa::SafetensorsError&) {
      }
    }
  } catch (const sdpa::SafetensorsError&) {
  }
  load(data, size, "", false);
  load(data, size, "m.", false);
  load(data, size, "m.", true);
  return 0;
}
