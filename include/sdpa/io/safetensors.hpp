// Loading and saving a module's parameters, and a KVCache, as safetensors (the format:
// sdpa/io/safetensors_format.hpp). load_safetensors() takes the module's tensors by their PyTorch names
// under a prefix, converting F32, F64, F16 and BF16 to the module's Scalar; save_safetensors() writes F32
// or F64 (a narrow module's weights in their own dtype) exactly as the reference implementation lays them
// out. Files are untrusted input: every malformation or mismatch is refused with a SafetensorsError naming
// the file and the problem, before the module (or cache) is touched. Needs nlohmann_json (CMake target
// sdpa::io).
#pragma once

#include "sdpa/config.hpp"

#include "sdpa/detail/eigen.hpp"
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/error.hpp"
#include "sdpa/io/safetensors_format.hpp"
#include "sdpa/parameter.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

static_assert(std::is_same<Eigen::Index, std::ptrdiff_t>::value,
              "sdpa/io: SafetensorsTensor shapes are std::ptrdiff_t, Eigen's default index type");

struct LoadOptions {
  // Tensors under the prefix that the module does not have are an error unless this is set (as PyTorch's
  // load_state_dict(strict=True) refuses unexpected keys). Tensors outside the prefix are always ignored.
  bool ignore_unexpected = false;
  // A float module keeps the file's dtype for its weights when the four projection weights are all BF16 or
  // all F16 (set_weight_storage: half the memory, nothing rounded); otherwise, or when this is not set, the
  // weights take the module's current weight storage (a narrow module's rounded to it).
  bool keep_dtype = false;
};

namespace detail {
namespace safetensors {
// The module's shape as the metadata save_safetensors() writes: prefix + "sdpa.d_model" etc., so that a
// file holding several layers keeps each layer's shape beside its tensors.
template <class Module>
std::vector<std::pair<std::string, long long>> shape_metadata(const Module& module, const std::string& prefix) {
  return {{prefix + "sdpa.d_model", static_cast<long long>(module.d_model())},
          {prefix + "sdpa.d_k", static_cast<long long>(module.d_k())},
          {prefix + "sdpa.d_v", static_cast<long long>(module.d_v())},
          {prefix + "sdpa.h", static_cast<long long>(module.h())},
          {prefix + "sdpa.kv_heads", static_cast<long long>(module.kv_heads())}};
}
// A saved cache records the heads it holds (kv_heads), not the module's query heads.
template <class Cache>
std::vector<std::pair<std::string, long long>> cache_shape_metadata(const Cache& cache, const std::string& prefix) {
  return {{prefix + "sdpa.d_model", static_cast<long long>(cache.d_model())},
          {prefix + "sdpa.d_k", static_cast<long long>(cache.d_k())},
          {prefix + "sdpa.d_v", static_cast<long long>(cache.d_v())},
          {prefix + "sdpa.kv_heads", static_cast<long long>(cache.kv_heads())}};
}
template <typename Scalar>
struct CacheTensors;
template <typename Scalar>
std::vector<std::pair<std::string, long long>> shape_metadata(const CacheTensors<Scalar>& cache, const std::string& prefix) {
  return cache_shape_metadata(cache, prefix);
}
}  // namespace safetensors
}  // namespace detail

// Copies the module's parameters from a parsed file: each named prefix + its PyTorch name ("fc_q.weight"),
// of exactly the parameter's shape. All tensors are checked and converted first and copied only then, so
// a refused file leaves the module as it was.
namespace detail {
namespace safetensors {
template <class Module, class = void>
struct HasWeightStorage : std::false_type {};
template <class Module>
struct HasWeightStorage<Module, std::void_t<decltype(std::declval<Module&>().set_weight_storage(Storage::kFloat32)),
                                            decltype(std::declval<const Module&>().weight_storage())>> : std::true_type {};

// The values of a parsed file into a module whose parameters are Scalar (see load_safetensors).
template <class Module>
void load_values(Module& module, const SafetensorsFile& file, const std::string& prefix, LoadOptions options);
}  // namespace safetensors
}  // namespace detail

template <class Module>
void load_safetensors(Module& module, const SafetensorsFile& file, const std::string& prefix = "",
                      LoadOptions options = {}) {
  namespace st = detail::safetensors;
  if constexpr (st::HasWeightStorage<Module>::value) {
    // Weights stored narrower are widened (exactly) while the file's values come in, then stored again: as
    // the file has them with keep_dtype (when they are all BF16 or all F16), else as they were.
    using Scalar = typename std::remove_reference_t<decltype(module.fc_q().bias())>::Scalar;
    const Storage before = module.weight_storage();
    Storage after = before;
    if (options.keep_dtype && std::is_same<Scalar, float>::value) {
      std::set<std::string> dtypes;
      for (const char* layer : {"fc_q", "fc_k", "fc_v", "fc_o"}) {
        const SafetensorsTensor* t = file.find(prefix + layer + ".weight");
        dtypes.insert(t != nullptr ? t->dtype : "");
      }
      if (dtypes.size() == 1 && *dtypes.begin() == "BF16") after = Storage::kBFloat16;
      if (dtypes.size() == 1 && *dtypes.begin() == "F16") after = Storage::kFloat16;
    }
    module.set_weight_storage(native_storage<Scalar>());
    try {
      st::load_values(module, file, prefix, options);
    } catch (...) {
      module.set_weight_storage(before);  // the values are unchanged: back exactly as they were
      throw;
    }
    module.set_weight_storage(after);
  } else {
    st::load_values(module, file, prefix, options);
  }
}

template <class Module>
void detail::safetensors::load_values(Module& module, const SafetensorsFile& file, const std::string& prefix,
                                      LoadOptions options) {
  namespace st = detail::safetensors;
  auto params = module.named_parameters();
  using Ref = typename decltype(params)::value_type;
  using Scalar = std::remove_pointer_t<decltype(std::declval<Ref&>().data)>;

  // The shape the file was saved from, when it says (files from sdpa do; PyTorch's do not): a module whose
  // h differs but whose h * d_k is the same would otherwise load tensors of the right sizes and compute
  // something else.
  for (const auto& entry : st::shape_metadata(module, prefix)) {
    const auto it = file.metadata.find(entry.first);
    if (it == file.metadata.end()) continue;
    const std::string& text = it->second;
    long long saved = -1;
    std::size_t used = 0;
    try {
      saved = std::stoll(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != text.size())
      st::fail(file.name, "__metadata__ " + st::quote(entry.first) + " must be an integer, but is " + st::quote(text));
    if (saved != entry.second)
      st::fail(file.name, "the file was saved from a module with " + entry.first.substr(prefix.size() + 5) + " = " +
                              text + " (__metadata__ " + st::quote(entry.first) + "), but this module has " +
                              entry.first.substr(prefix.size() + 5) + " = " + std::to_string(entry.second));
  }

  std::set<std::string> wanted;
  std::vector<const SafetensorsTensor*> sources;
  std::string missing, unexpected;
  std::size_t n_missing = 0, n_unexpected = 0;
  auto list = [](std::string& text, std::size_t& count, const std::string& name) {
    if (count < 20) text += (count ? ", " : "") + st::quote(name);
    ++count;
  };
  for (const Ref& p : params) {
    const std::string name = prefix + p.name;
    wanted.insert(name);
    sources.push_back(file.find(name));
    if (sources.back() == nullptr) list(missing, n_missing, name);
  }
  if (!options.ignore_unexpected) {
    for (const SafetensorsTensor& t : file.tensors)
      if (t.name.compare(0, prefix.size(), prefix) == 0 && !wanted.count(t.name)) list(unexpected, n_unexpected, t.name);
  }
  if (n_missing || n_unexpected) {
    auto more = [](std::size_t count) { return count > 20 ? " and " + std::to_string(count - 20) + " more" : std::string(); };
    std::string problem;
    if (n_missing) {
      problem = "missing tensors: " + missing + more(n_missing);
      if (!prefix.empty() && prefix.back() != '.') problem += " (the prefix " + st::quote(prefix) + " does not end with '.')";
    }
    if (n_unexpected)
      problem += std::string(n_missing ? "; " : "") + "unexpected tensors under the prefix " + st::quote(prefix) + ": " +
                 unexpected + more(n_unexpected) + " (LoadOptions::ignore_unexpected skips them)";
    st::fail(file.name, problem);
  }

  for (std::size_t i = 0; i < params.size(); ++i) {
    const SafetensorsTensor& t = *sources[i];
    if (t.shape != params[i].shape)
      st::fail(file.name, "tensor " + st::quote(t.name) + " has shape " + st::shape_text(t.shape) +
                              ", but the module's parameter " + params[i].name + " has shape " +
                              st::shape_text(params[i].shape));
  }
  std::vector<std::vector<Scalar>> staged;
  staged.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) staged.push_back(tensor_values<Scalar>(file, *sources[i]));
  for (std::size_t i = 0; i < params.size(); ++i) std::copy(staged[i].begin(), staged[i].end(), params[i].data);
}

template <class Module>
void load_safetensors(Module& module, const std::string& path, const std::string& prefix = "",
                      LoadOptions options = {}) {
  load_safetensors(module, read_safetensors(path), prefix, options);
}

// The same from a file already in memory (as the fuzzer feeds it); name_for_errors stands for the path.
template <class Module>
void load_safetensors_from_memory(Module& module, const std::uint8_t* bytes, std::size_t size,
                                  const std::string& name_for_errors, const std::string& prefix = "",
                                  LoadOptions options = {}) {
  load_safetensors(module, parse_safetensors(bytes, size, name_for_errors), prefix, options);
}


namespace detail {
namespace safetensors {
// The parameters of a module whose weights are stored narrower (set_weight_storage): weights in their dtype
// (BF16 or F16), biases in the module's.
template <class Module>
std::vector<RawTensor> stored_parameters(const Module& module, const std::string& prefix) {
  std::vector<RawTensor> out;
  const char* names[4] = {"fc_q", "fc_k", "fc_v", "fc_o"};
  const decltype(&module.fc_q()) layers[4] = {&module.fc_q(), &module.fc_k(), &module.fc_v(), &module.fc_o()};
  for (int i = 0; i < 4; ++i) {
    const auto& layer = *layers[i];
    using Scalar = typename std::remove_reference_t<decltype(layer.bias())>::Scalar;
    const Storage s = layer.weight_storage();
    const char* dtype = s == Storage::kBFloat16 ? "BF16" : s == Storage::kFloat16 ? "F16" : scalar_dtype<Scalar>();
    out.push_back({prefix + names[i] + ".weight", dtype, {layer.out_features(), layer.in_features()}, layer.stored_weight(),
                   storage_bytes(s)});
    out.push_back({prefix + names[i] + ".bias", scalar_dtype<Scalar>(), {layer.out_features()}, layer.bias().data(), sizeof(Scalar)});
  }
  return out;
}
}  // namespace safetensors
}  // namespace detail

// The bytes save_safetensors() writes: the module's parameters as prefix + PyTorch name in the module's
// dtype (F32 or F64), sorted by name and contiguous, "__metadata__" first when there is any (see
// detail::safetensors::write_tensors).
template <class Module>
std::vector<std::uint8_t> save_safetensors_to_memory(const Module& module, const std::string& prefix = "",
                                                     const std::map<std::string, std::string>& metadata = {},
                                                     const std::string& name_for_errors = "<memory>") {
  namespace st = detail::safetensors;
  // The module's shape goes into the metadata (load_safetensors checks it); a caller's entry of the same
  // name must agree.
  std::map<std::string, std::string> all_metadata = metadata;
  for (const auto& entry : st::shape_metadata(module, prefix)) {
    const std::string value = std::to_string(entry.second);
    const auto inserted = all_metadata.emplace(entry.first, value);
    if (!inserted.second && inserted.first->second != value)
      st::fail(name_for_errors, "metadata " + st::quote(entry.first) + " is the module's shape, " + value +
                                    ", and cannot be " + st::quote(inserted.first->second));
  }
  std::vector<st::RawTensor> tensors;
  if constexpr (st::HasWeightStorage<Module>::value) {
    using Scalar = typename std::remove_reference_t<decltype(module.fc_q().bias())>::Scalar;
    if (module.weight_storage() != native_storage<Scalar>())  // weights as stored (BF16, F16)
      return st::write_tensors(st::stored_parameters(module, prefix), all_metadata, name_for_errors);
  }
  auto params = module.named_parameters();
  using Ref = typename decltype(params)::value_type;
  using Scalar = std::remove_const_t<std::remove_pointer_t<decltype(std::declval<Ref&>().data)>>;
  const char* dtype = st::scalar_dtype<Scalar>();
  for (const Ref& p : params) tensors.push_back({prefix + p.name, dtype, p.shape, p.data, sizeof(Scalar)});
  return st::write_tensors(std::move(tensors), all_metadata, name_for_errors);
}



template <class Module>
void save_safetensors(const Module& module, const std::string& path, const std::string& prefix = "",
                      const std::map<std::string, std::string>& metadata = {}) {
  namespace st = detail::safetensors;
  const std::vector<std::uint8_t> bytes = save_safetensors_to_memory(module, prefix, metadata, path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) st::fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) st::fail(path, "writing failed (disk full or I/O error)");
}

// ---- Key/value caches (sdpa/cache/kv_cache.hpp) ----
// A cache is one file: tensors "kv_cache.keys" (batch, size, h * d_k) and "kv_cache.values" (batch, size,
// h * d_v) in the cache's dtype (its storage: F32, F64, BF16, F16, or I8 with F32 scales), and metadata "sdpa.d_model", "sdpa.d_k", "sdpa.d_v", "sdpa.h" (the module
// shape it belongs to) and "sdpa.kv_cache.position" (the position after its last entry), so a server can
// park a conversation and resume it, on another module of the same shape.

namespace detail {
namespace safetensors {
// What save_safetensors_to_memory writes for a cache: its two tensors under their names, its shape.
template <typename Scalar>
struct CacheTensors {
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> keys, values;
  Eigen::Index d_model_, d_k_, d_v_, kv_heads_;
  Eigen::Index d_model() const { return d_model_; }
  Eigen::Index d_k() const { return d_k_; }
  Eigen::Index d_v() const { return d_v_; }
  Eigen::Index kv_heads() const { return kv_heads_; }
  std::vector<ParameterRef<const Scalar>> named_parameters() const {
    return {{"kv_cache.keys", keys.data(), {keys.dimension(0), keys.dimension(1), keys.dimension(2)}},
            {"kv_cache.values", values.data(), {values.dimension(0), values.dimension(1), values.dimension(2)}}};
  }
};
}  // namespace safetensors
}  // namespace detail

// A narrow cache (bfloat16, float16, int8) is written in its own dtype (BF16, F16, I8), the int8 one with its
// scales as F32 tensors "kv_cache.key_scales" and "kv_cache.value_scales" (batch, size, kv_heads).
template <typename Scalar>
std::vector<std::uint8_t> save_kv_cache_to_memory(const KVCache<Scalar>& cache, const std::string& name_for_errors = "<memory>") {
  namespace st = detail::safetensors;
  const std::map<std::string, std::string> metadata = {{"sdpa.kv_cache.position", std::to_string(cache.position())}};
  if (!is_narrow<Scalar>(cache.storage())) {
    const st::CacheTensors<Scalar> t{cache.keys(), cache.values(), cache.d_model(), cache.d_k(), cache.d_v(),
                                     cache.kv_heads()};
    return save_safetensors_to_memory(t, "", metadata, name_for_errors);
  }
  using Index = Eigen::Index;
  const Index batch = cache.batch(), n = cache.size(), g = cache.kv_heads();
  const std::size_t es = storage_bytes(cache.storage());
  const std::size_t hk = static_cast<std::size_t>(g * cache.d_k()) * es, hv = static_cast<std::size_t>(g * cache.d_v()) * es;
  std::vector<unsigned char> keys, values;
  std::vector<float> key_scales, value_scales;
  for (Index b = 0; b < batch; ++b) {
    keys.insert(keys.end(), cache.stored_keys(b), cache.stored_keys(b) + static_cast<std::size_t>(n) * hk);
    values.insert(values.end(), cache.stored_values(b), cache.stored_values(b) + static_cast<std::size_t>(n) * hv);
    if (cache.storage() == Storage::kInt8) {
      key_scales.insert(key_scales.end(), cache.stored_key_scales(b), cache.stored_key_scales(b) + n * g);
      value_scales.insert(value_scales.end(), cache.stored_value_scales(b), cache.stored_value_scales(b) + n * g);
    }
  }
  const char* dtype = cache.storage() == Storage::kBFloat16 ? "BF16" : cache.storage() == Storage::kFloat16 ? "F16" : "I8";
  std::map<std::string, std::string> all = metadata;
  for (const auto& entry : st::cache_shape_metadata(cache, "")) all.emplace(entry.first, std::to_string(entry.second));
  std::vector<st::RawTensor> tensors = {
      {"kv_cache.keys", dtype, {batch, n, g * cache.d_k()}, keys.data(), es},
      {"kv_cache.values", dtype, {batch, n, g * cache.d_v()}, values.data(), es}};
  if (cache.storage() == Storage::kInt8) {
    tensors.push_back({"kv_cache.key_scales", "F32", {batch, n, g}, key_scales.data(), 4});
    tensors.push_back({"kv_cache.value_scales", "F32", {batch, n, g}, value_scales.data(), 4});
  }
  return st::write_tensors(std::move(tensors), all, name_for_errors);
}

template <typename Scalar>
void save_kv_cache(const KVCache<Scalar>& cache, const std::string& path) {
  namespace st = detail::safetensors;
  const std::vector<std::uint8_t> bytes = save_kv_cache_to_memory(cache, path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) st::fail(path, std::string("cannot open for writing: ") + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) st::fail(path, "writing failed (disk full or I/O error)");
}

// Replaces the cache's content with the file's. The file must be a cache of a module of the cache's shape
// (d_model, h, d_k, d_v); its batch becomes the cache's. Everything is checked before the cache changes.
template <typename Scalar>
void load_kv_cache(KVCache<Scalar>& cache, const SafetensorsFile& file) {
  namespace st = detail::safetensors;
  using Index = Eigen::Index;
  auto integer = [&](const std::string& key) {
    const auto it = file.metadata.find(key);
    if (it == file.metadata.end()) st::fail(file.name, "__metadata__ has no " + st::quote(key) + ": not a saved KVCache");
    long long value = -1;
    std::size_t used = 0;
    try {
      value = std::stoll(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != it->second.size() || value < 0)
      st::fail(file.name, "__metadata__ " + st::quote(key) + " must be a non-negative integer, but is " + st::quote(it->second));
    return static_cast<Index>(value);
  };
  // (Files from before grouped-query heads record the cache's heads as "sdpa.h".)
  const char* heads_key = file.metadata.count("sdpa.kv_heads") > 0 ? "sdpa.kv_heads" : "sdpa.h";
  const std::pair<const char*, Index> shape[4] = {{"sdpa.d_model", cache.d_model()},
                                                  {"sdpa.d_k", cache.d_k()},
                                                  {"sdpa.d_v", cache.d_v()},
                                                  {heads_key, cache.kv_heads()}};
  for (const auto& s : shape) {
    const Index saved = integer(s.first);
    if (saved != s.second)
      st::fail(file.name, std::string("the cache was saved for a module with ") + (s.first + 5) + " = " + std::to_string(saved) +
                              ", but this cache's module has " + (s.first + 5) + " = " + std::to_string(s.second));
  }
  const Index position = integer("sdpa.kv_cache.position");
  const SafetensorsTensor* k = file.find("kv_cache.keys");
  const SafetensorsTensor* v = file.find("kv_cache.values");
  if (k == nullptr || v == nullptr) st::fail(file.name, "missing tensors: \"kv_cache.keys\" and \"kv_cache.values\" are needed");
  const Index hk = cache.kv_heads() * cache.d_k(), hv = cache.kv_heads() * cache.d_v();
  if (k->shape.size() != 3 || k->shape[2] != hk)
    st::fail(file.name, "tensor \"kv_cache.keys\" has shape " + st::shape_text(k->shape) + ", but must be (batch, size, " +
                            std::to_string(hk) + ")");
  if (v->shape.size() != 3 || v->shape[0] != k->shape[0] || v->shape[1] != k->shape[1] || v->shape[2] != hv)
    st::fail(file.name, "tensor \"kv_cache.values\" has shape " + st::shape_text(v->shape) + ", but must be (" +
                            std::to_string(k->shape[0]) + ", " + std::to_string(k->shape[1]) + ", " + std::to_string(hv) + ")");
  if (position < k->shape[1])
    st::fail(file.name, "__metadata__ \"sdpa.kv_cache.position\" is " + std::to_string(position) +
                            ", fewer than the entries held, " + std::to_string(k->shape[1]));
  if (k->dtype != v->dtype)
    st::fail(file.name, "tensors \"kv_cache.keys\" and \"kv_cache.values\" have dtypes " + k->dtype + " and " + v->dtype +
                            ": a saved cache has one");
  // int8 entries come with their scales, one per (batch, entry, head).
  std::vector<float> key_scales, value_scales;
  if (k->dtype == "I8") {
    const SafetensorsTensor* ks = file.find("kv_cache.key_scales");
    const SafetensorsTensor* vs = file.find("kv_cache.value_scales");
    if (ks == nullptr || vs == nullptr)
      st::fail(file.name, "missing tensors: an I8 cache needs \"kv_cache.key_scales\" and \"kv_cache.value_scales\"");
    const std::vector<Index> want = {k->shape[0], k->shape[1], cache.kv_heads()};
    for (const SafetensorsTensor* t : {ks, vs})
      if (t->shape != want)
        st::fail(file.name, "tensor " + st::quote(t->name) + " has shape " + st::shape_text(t->shape) + ", but must be " +
                                st::shape_text(want));
    key_scales = tensor_values<float>(file, *ks);
    value_scales = tensor_values<float>(file, *vs);
  }
  const Index batch = k->shape[0], n = k->shape[1];
  // Bytes in the file's element order (little-endian) as host elements of `es` bytes.
  const auto host = [&](const SafetensorsTensor& t, std::size_t es) {
    if (t.nbytes() != static_cast<std::size_t>(t.numel()) * es || (t.numel() != 0 && t.data == nullptr))
      st::fail(file.name, "tensor " + st::quote(t.name) + " has " + std::to_string(t.nbytes()) + " bytes, not what its shape and dtype need");
    std::vector<unsigned char> out(t.nbytes());
    for (std::size_t i = 0; i < out.size(); i += es) {
      if (es == 2) {
        const std::uint16_t x = static_cast<std::uint16_t>(t.data[i] | t.data[i + 1] << 8);
        std::memcpy(out.data() + i, &x, 2);
      } else {
        out[i] = t.data[i];
      }
    }
    return out;
  };
  const Storage s = cache.storage();
  const bool same = (k->dtype == "BF16" && s == Storage::kBFloat16) || (k->dtype == "F16" && s == Storage::kFloat16) ||
                    (k->dtype == "I8" && s == Storage::kInt8);
  if (same) {  // the cache's own dtype: taken as stored, nothing rounded again
    const std::size_t es = storage_bytes(s);
    const std::vector<unsigned char> kb = host(*k, es), vb = host(*v, es);
    cache.assign_stored(batch, n, kb.data(), vb.data(), key_scales.empty() ? nullptr : key_scales.data(),
                        value_scales.empty() ? nullptr : value_scales.data(), position);
    return;
  }
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> keys(batch, n, hk), values(batch, n, hv);
  if (k->dtype == "I8") {  // dequantised, then stored as this cache stores
    const std::vector<unsigned char> kb = host(*k, 1), vb = host(*v, 1);
    const Index g = cache.kv_heads();
    for (Index r = 0; r < batch * n; ++r) {
      for (Index c = 0; c < hk; ++c)
        keys.data()[r * hk + c] = static_cast<Scalar>(static_cast<float>(static_cast<std::int8_t>(kb[static_cast<std::size_t>(r * hk + c)])) *
                                                      key_scales[static_cast<std::size_t>(r * g + c / cache.d_k())]);
      for (Index c = 0; c < hv; ++c)
        values.data()[r * hv + c] = static_cast<Scalar>(static_cast<float>(static_cast<std::int8_t>(vb[static_cast<std::size_t>(r * hv + c)])) *
                                                        value_scales[static_cast<std::size_t>(r * g + c / cache.d_v())]);
    }
  } else {
    const std::vector<Scalar> kd = tensor_values<Scalar>(file, *k), vd = tensor_values<Scalar>(file, *v);
    std::copy(kd.begin(), kd.end(), keys.data());
    std::copy(vd.begin(), vd.end(), values.data());
  }
  cache.assign(keys, values, position);
}

template <typename Scalar>
void load_kv_cache(KVCache<Scalar>& cache, const std::string& path) {
  load_kv_cache(cache, read_safetensors(path));
}

template <typename Scalar>
void load_kv_cache_from_memory(KVCache<Scalar>& cache, const std::uint8_t* bytes, std::size_t size,
                               const std::string& name_for_errors = "<memory>") {
  load_kv_cache(cache, parse_safetensors(bytes, size, name_for_errors));
}

SDPA_NAMESPACE_END
