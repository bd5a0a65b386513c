// Loading and saving a module's parameters as safetensors, the format PyTorch users share weights in
// (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
// dtype, shape and byte range, then the little-endian data. load_safetensors() takes the module's tensors
// by their PyTorch names under a prefix, converting F32, F64, F16 and BF16 to the module's Scalar;
// save_safetensors() writes F32 or F64 exactly as the reference implementation lays them out. Files are
// untrusted input: every malformation is refused with a SafetensorsError naming the file and the problem,
// before anything is allocated beyond the file's own size and before the module is touched. The pieces
// (parse_safetensors, tensor_values, half_to_float, bfloat16_to_float) are public for tests and fuzzing.
// Needs nlohmann_json (CMake target sdpa::io).
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

#include "sdpa/error.hpp"
#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/parameter.hpp"
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

// Every refusal of a file, malformed or not matching the module: "sdpa: safetensors file '<path>': ...".
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LoadOptions {
  // Tensors under the prefix that the module does not have are an error unless this is set (as PyTorch's
  // load_state_dict(strict=True) refuses unexpected keys). Tensors outside the prefix are always ignored.
  bool ignore_unexpected = false;
  // A float module keeps the file's dtype for its weights when the four projection weights are all BF16 or
  // all F16 (set_weight_storage: half the memory, nothing rounded); otherwise, or when this is not set, the
  // weights take the module's current weight storage (a narrow module's rounded to it).
  bool keep_dtype = false;
};

// The reference implementation's cap: a header beyond it is corruption, not a model.
constexpr std::uint64_t kSafetensorsMaxHeaderSize = 100000000;

// One tensor of a parsed file. Its bytes are data[0, end - begin), inside the buffer parse_safetensors()
// was given (or the file's own storage), valid as long as that buffer lives.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;                // as written, e.g. "F32", "BF16", "I64"
  std::vector<Eigen::Index> shape;  // {} for a scalar
  std::uint64_t begin = 0;          // data_offsets, relative to the start of the data buffer
  std::uint64_t end = 0;
  const std::uint8_t* data = nullptr;

  // The element count; parse_safetensors() checked that it does not overflow.
  Eigen::Index numel() const noexcept {
    Eigen::Index n = 1;
    for (Eigen::Index d : shape) n *= d;
    return n;
  }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(end - begin); }
};

struct SafetensorsFile {
  std::string name;                            // what errors call the file (its path)
  std::size_t header_size = 0;                 // N, the JSON header's length including padding
  std::size_t data_size = 0;                   // the data buffer's length: file size - 8 - N
  std::vector<SafetensorsTensor> tensors;      // sorted by name
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
  // The bytes the tensors point into when the file owns them (read_safetensors); null for a view made
  // by parse_safetensors over the caller's buffer. Shared so that copies stay valid.
  std::shared_ptr<const std::vector<std::uint8_t>> storage;

  const SafetensorsTensor* find(const std::string& tensor_name) const {
    auto it = std::lower_bound(tensors.begin(), tensors.end(), tensor_name,
                               [](const SafetensorsTensor& t, const std::string& n) { return t.name < n; });
    return it != tensors.end() && it->name == tensor_name ? &*it : nullptr;
  }
};

namespace detail {
namespace safetensors {

[[noreturn]] inline void fail(const std::string& file, const std::string& problem) {
  throw SafetensorsError("sdpa: safetensors file '" + file + "': " + problem);
}

// A name or value from the file, quoted for a message, escaped, and cut short: the file decides what
// these strings hold and how long they are, and a message must stay one readable line.
inline std::string quote(const std::string& s) {
  constexpr std::size_t kMax = 160;
  static const char kHex[] = "0123456789abcdef";
  std::size_t length = s.size();
  if (length > kMax) {
    length = kMax;
    while (length > 0 && (static_cast<unsigned char>(s[length]) & 0xC0) == 0x80) --length;  // keep UTF-8 whole
  }
  std::string q = "\"";
  for (std::size_t i = 0; i < length; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      q += '\\';
      q += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7F) {
      q += "\\x";
      q += kHex[c >> 4];
      q += kHex[c & 15];
    } else {
      q += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) q += "...";
  return q + "\"";
}

inline std::string shape_text(const std::vector<Eigen::Index>& shape) {
  // detail::shape_string reads dims[0], which a scalar's empty shape does not have.
  return shape.empty() ? std::string("()") : shape_string(shape.data(), shape.size());
}

struct Dtype {
  const char* name;
  unsigned bits;
};

// The reference implementation's dtypes. Knowing each size lets a file that also holds, say, I64 buffers
// be checked and loaded: only tensors the module takes must be floating point.
inline const Dtype* find_dtype(const std::string& name) {
  static const Dtype kTable[] = {
      {"BOOL", 8},     {"U8", 8},       {"I8", 8},       {"F8_E5M2", 8},  {"F8_E4M3", 8},
      {"F8_E8M0", 8},  {"I16", 16},     {"U16", 16},     {"F16", 16},     {"BF16", 16},
      {"I32", 32},     {"U32", 32},     {"F32", 32},     {"I64", 64},     {"U64", 64},
      {"F64", 64},     {"C64", 64},     {"F4", 4},       {"F6_E2M3", 6},  {"F6_E3M2", 6}};
  for (const Dtype& d : kTable)
    if (name == d.name) return &d;
  return nullptr;
}

// Turns the header's JSON into SafetensorsTensor entries while it is parsed, checking the schema at each
// event. A SAX handler rather than a DOM: nothing is built that the schema does not allow, so deeply
// nested or oversized JSON is refused at its first wrong bracket instead of being materialised, and
// duplicate keys (which a DOM would silently merge) are seen.
class HeaderReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  HeaderReader(const std::string& file, SafetensorsFile& out) : file_(file), out_(out) {}

  bool null() override {
    if (state_ == State::kMetadataValue) {  // the reference reads "__metadata__": null as no metadata
      state_ = State::kTop;
      return true;
    }
    return refuse("null");
  }
  bool boolean(bool value) override { return refuse(value ? "true" : "false"); }
  bool number_integer(number_integer_t value) override {
    // Only literals with a minus sign arrive here; "-0" is zero.
    if (value == 0) return number_unsigned(0);
    return refuse("the negative integer " + std::to_string(value));
  }
  bool number_unsigned(number_unsigned_t value) override {
    if (state_ == State::kShape) {
      if (value > static_cast<std::uint64_t>(std::numeric_limits<Eigen::Index>::max()))
        fail(file_, "shape of tensor " + quote(tensor_.name) + " has a dimension too large: " + std::to_string(value));
      tensor_.shape.push_back(static_cast<Eigen::Index>(value));
      return true;
    }
    if (state_ == State::kOffsets) {
      if (offsets_count_ == 2)
        fail(file_, "data_offsets of tensor " + quote(tensor_.name) + " must be two integers [begin, end], but has more");
      (offsets_count_ == 0 ? tensor_.begin : tensor_.end) = value;
      ++offsets_count_;
      return true;
    }
    return refuse("the integer " + std::to_string(value));
  }
  bool number_float(number_float_t, const string_t& text) override {
    return refuse("the floating-point number " + text.substr(0, 40));
  }
  bool string(string_t& value) override {
    if (state_ == State::kDtype) {
      const Dtype* dtype = find_dtype(value);
      if (dtype == nullptr)
        fail(file_, "tensor " + quote(tensor_.name) + " has the unknown dtype " + quote(value) +
                        " (known: BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F16, BF16, F32, F64, C64, F8_*, F6_*, F4)");
      tensor_.dtype = dtype->name;
      state_ = State::kEntry;
      return true;
    }
    if (state_ == State::kMetadataString) {
      out_.metadata.emplace(std::move(metadata_key_), std::move(value));
      state_ = State::kMetadata;
      return true;
    }
    return refuse("the string " + quote(value));
  }
#if NLOHMANN_JSON_VERSION_MAJOR > 3 || (NLOHMANN_JSON_VERSION_MAJOR == 3 && NLOHMANN_JSON_VERSION_MINOR >= 8)
  // Only the binary formats (CBOR, MessagePack, ...) produce this; the interface has it since 3.8.
  bool binary(binary_t&) override { return refuse("binary data"); }
#endif

  bool start_object(std::size_t) override {
    switch (state_) {
      case State::kStart: state_ = State::kTop; return true;
      case State::kEntryValue: state_ = State::kEntry; return true;
      case State::kMetadataValue: state_ = State::kMetadata; return true;
      default: return refuse("an object");
    }
  }
  bool key(string_t& key) override {
    if (state_ == State::kTop) {
      if (key == "__metadata__") {
        if (seen_metadata_) fail(file_, "the header has \"__metadata__\" twice (duplicate key)");
        seen_metadata_ = true;
        state_ = State::kMetadataValue;
      } else {
        tensor_ = SafetensorsTensor{};
        tensor_.name = std::move(key);
        seen_ = 0;
        offsets_count_ = 0;
        state_ = State::kEntryValue;
      }
      return true;
    }
    if (state_ == State::kEntry) {
      const char* keys[3] = {"dtype", "shape", "data_offsets"};
      const State states[3] = {State::kDtype, State::kShapeStart, State::kOffsetsStart};
      for (int i = 0; i < 3; ++i) {
        if (key != keys[i]) continue;
        if (seen_ & (1u << i))
          fail(file_, "tensor " + quote(tensor_.name) + " has the key \"" + keys[i] + "\" twice (duplicate key)");
        seen_ |= 1u << i;
        state_ = states[i];
        return true;
      }
      fail(file_, "tensor " + quote(tensor_.name) + " has the unexpected key " + quote(key) +
                      " (allowed: dtype, shape, data_offsets)");
    }
    // state_ == kMetadata: the parser only reports keys inside objects, and no other object is open.
    if (out_.metadata.count(key)) fail(file_, "__metadata__ has the key " + quote(key) + " twice (duplicate key)");
    metadata_key_ = std::move(key);
    state_ = State::kMetadataString;
    return true;
  }
  bool end_object() override {
    if (state_ == State::kEntry) {
      const char* keys[3] = {"dtype", "shape", "data_offsets"};
      for (int i = 0; i < 3; ++i)
        if (!(seen_ & (1u << i)))
          fail(file_, "tensor " + quote(tensor_.name) + " is missing the key \"" + keys[i] + "\"");
      tensor_.shape.shrink_to_fit();
      out_.tensors.push_back(std::move(tensor_));
      state_ = State::kTop;
    } else if (state_ == State::kMetadata) {
      state_ = State::kTop;
    } else {  // kTop
      state_ = State::kDone;
    }
    return true;
  }
  bool start_array(std::size_t) override {
    if (state_ == State::kShapeStart) {
      state_ = State::kShape;
      return true;
    }
    if (state_ == State::kOffsetsStart) {
      state_ = State::kOffsets;
      return true;
    }
    return refuse("an array");
  }
  bool end_array() override {
    if (state_ == State::kOffsets && offsets_count_ != 2)
      fail(file_, "data_offsets of tensor " + quote(tensor_.name) + " must be two integers [begin, end], but has " +
                      std::to_string(offsets_count_));
    state_ = State::kEntry;  // only shape and data_offsets arrays are ever opened
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) override {
    std::string what = error.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag; keep the position and the reason.
    const std::size_t tag = what.find("] ");
    if (what.compare(0, 1, "[") == 0 && tag != std::string::npos) what.erase(0, tag + 2);
    fail(file_, "the header is not valid JSON: " + what.substr(0, 400));
  }

  bool done() const noexcept { return state_ == State::kDone; }

 private:
  enum class State {
    kStart, kTop, kEntryValue, kEntry, kDtype, kShapeStart, kShape, kOffsetsStart, kOffsets,
    kMetadataValue, kMetadata, kMetadataString, kDone
  };

  // A value of the wrong kind where `state_` expects something else: says what was expected where.
  [[noreturn]] bool refuse(const std::string& what) {
    const std::string t = quote(tensor_.name);
    switch (state_) {
      case State::kStart:
        fail(file_, "the header must be a JSON object, but is " + what);
      case State::kEntryValue:
        fail(file_, "entry " + t + " must be an object with dtype, shape and data_offsets, but is " + what);
      case State::kDtype:
        fail(file_, "dtype of tensor " + t + " must be a string, but is " + what);
      case State::kShapeStart:
        fail(file_, "shape of tensor " + t + " must be an array of non-negative integers, but is " + what);
      case State::kShape:
        fail(file_, "shape of tensor " + t + " must hold non-negative integers, but holds " + what);
      case State::kOffsetsStart:
        fail(file_, "data_offsets of tensor " + t + " must be an array of two non-negative integers, but is " + what);
      case State::kOffsets:
        fail(file_, "data_offsets of tensor " + t + " must hold non-negative integers, but holds " + what);
      case State::kMetadataValue:
        fail(file_, "__metadata__ must be an object of strings, but is " + what);
      case State::kMetadataString:
        fail(file_, "__metadata__ value of key " + quote(metadata_key_) + " must be a string, but is " + what);
      default:
        fail(file_, "unexpected " + what + " in the header");
    }
  }

  const std::string& file_;
  SafetensorsFile& out_;
  State state_ = State::kStart;
  SafetensorsTensor tensor_;
  unsigned seen_ = 0;  // bit i: keys[i] of the current entry was seen
  unsigned offsets_count_ = 0;
  bool seen_metadata_ = false;
  std::string metadata_key_;
};

// out = a * b, or false when that exceeds limit.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return true;
}

// Parses and validates the header (header_size bytes at `header`) of a file whose data buffer has
// data_size bytes; the tensors' data pointers are left null.
inline SafetensorsFile parse_header(const std::uint8_t* header, std::size_t header_size, std::size_t data_size,
                                    const std::string& file) {
  SafetensorsFile out;
  out.name = file;
  out.header_size = header_size;
  out.data_size = data_size;
  const char* text = reinterpret_cast<const char*>(header);
  // nlohmann's lexer reads a NUL byte as the end of input, which would accept whatever follows it; JSON
  // never holds one outside a string (and escapes it inside), so none may appear.
  if (const void* nul = header_size ? std::memchr(text, 0, header_size) : nullptr)
    fail(file, "the header is not valid JSON: it holds a NUL byte at offset " +
                   std::to_string(static_cast<const char*>(nul) - text));
  HeaderReader reader(file, out);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text, text + header_size, &reader);
  } catch (const nlohmann::json::exception& e) {  // defensive: errors normally arrive via parse_error
    fail(file, std::string("the header is not valid JSON: ") + e.what());
  }
  if (!ok || !reader.done()) fail(file, "the header is not a complete JSON object");

  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
  for (std::size_t i = 1; i < out.tensors.size(); ++i)
    if (out.tensors[i].name == out.tensors[i - 1].name)
      fail(file, "the header names tensor " + quote(out.tensors[i].name) + " twice (duplicate key)");

  for (const SafetensorsTensor& t : out.tensors) {
    const std::string where = "tensor " + quote(t.name);
    // Every partial product must fit Eigen::Index, as numel() multiplies in that type in the same order.
    const auto index_max = static_cast<std::uint64_t>(std::numeric_limits<Eigen::Index>::max());
    std::uint64_t count = 1;
    for (Eigen::Index d : t.shape)
      if (!checked_mul(count, static_cast<std::uint64_t>(d), index_max, count))
        fail(file, where + " has a shape " + shape_text(t.shape) + " whose element count overflows");
    std::uint64_t bits = 0;
    if (!checked_mul(count, find_dtype(t.dtype)->bits, std::numeric_limits<std::uint64_t>::max(), bits))
      fail(file, where + " has a shape " + shape_text(t.shape) + " whose element count overflows");
    if (bits % 8 != 0)
      fail(file, where + " of dtype " + t.dtype + " and shape " + shape_text(t.shape) + " does not fill whole bytes");
    const std::uint64_t bytes = bits / 8;
    const std::string range = "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
    if (t.begin > t.end) fail(file, where + " has reversed " + range + " (begin after end)");
    if (t.end - t.begin != bytes)
      fail(file, where + " has " + range + " spanning " + std::to_string(t.end - t.begin) + " bytes, but shape " +
                     shape_text(t.shape) + " of dtype " + t.dtype + " needs " + std::to_string(bytes) + " bytes");
    if (t.end > data_size)
      fail(file, where + " has " + range + " past the end of the " + std::to_string(data_size) +
                     "-byte data buffer (truncated file or wrong offsets)");
  }

  // The spec requires the tensors to tile the buffer exactly: no byte shared, none left over. A hole
  // could hide data; an overlap would let one write show through another tensor.
  std::vector<const SafetensorsTensor*> by_offset;
  by_offset.reserve(out.tensors.size());
  for (const SafetensorsTensor& t : out.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t cursor = 0;
  const SafetensorsTensor* previous = nullptr;
  for (const SafetensorsTensor* t : by_offset) {
    if (t->begin < cursor)
      fail(file, "tensor " + quote(t->name) + " (bytes " + std::to_string(t->begin) + " to " + std::to_string(t->end) +
                     ") overlaps tensor " + quote(previous->name) + " (bytes " + std::to_string(previous->begin) +
                     " to " + std::to_string(previous->end) + ")");
    if (t->begin > cursor)
      fail(file, "bytes " + std::to_string(cursor) + " to " + std::to_string(t->begin) +
                     " of the data buffer belong to no tensor (a hole before tensor " + quote(t->name) + ")");
    cursor = t->end;
    previous = t;
  }
  if (cursor != data_size)
    fail(file, "the last " + std::to_string(data_size - cursor) + " bytes of the data buffer (from byte " +
                   std::to_string(cursor) + ") belong to no tensor");
  return out;
}

inline void attach(SafetensorsFile& file, const std::uint8_t* data) {
  for (SafetensorsTensor& t : file.tensors) t.data = data == nullptr ? nullptr : data + t.begin;
}

inline std::uint64_t read_le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The header length field, checked against the cap and the file's size.
inline std::uint64_t checked_header_size(const std::uint8_t* first8, std::uint64_t file_size, const std::string& file) {
  const std::uint64_t n = read_le64(first8);
  if (n > kSafetensorsMaxHeaderSize)
    fail(file, "header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(kSafetensorsMaxHeaderSize) + " bytes (corrupt or not a safetensors file)");
  if (n > file_size - 8)
    fail(file, "header length " + std::to_string(n) + " reaches past the end of the file (" +
                   std::to_string(file_size) + " bytes)");
  return n;
}

inline void check_file_size(std::uint64_t size, const std::string& file) {
  if (size == 0) fail(file, "the file is empty (a safetensors file starts with an 8-byte header length)");
  if (size < 8)
    fail(file, "the file has " + std::to_string(size) + " bytes, too short for the 8-byte header length");
}

template <typename Scalar>
const char* scalar_dtype() {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "sdpa safetensors: only float (F32) and double (F64) modules can be saved");
  return std::is_same<Scalar, float>::value ? "F32" : "F64";
}

inline float float_from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline double double_from_bits(std::uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

}  // namespace safetensors
}  // namespace detail

// half_to_float and bfloat16_to_float: sdpa/storage.hpp.

// Parses and validates a whole safetensors file held in memory: header length, JSON schema, dtypes,
// shapes, offsets and their exact tiling of the data buffer. The result points into `bytes`.
inline SafetensorsFile parse_safetensors(const std::uint8_t* bytes, std::size_t size, const std::string& name_for_errors) {
  namespace st = detail::safetensors;
  st::check_file_size(size, name_for_errors);
  const std::uint64_t n = st::checked_header_size(bytes, size, name_for_errors);
  SafetensorsFile file =
      st::parse_header(bytes + 8, static_cast<std::size_t>(n), size - 8 - static_cast<std::size_t>(n), name_for_errors);
  st::attach(file, bytes + 8 + n);
  return file;
}

// Reads and validates a safetensors file. The header is read and checked before the data buffer is
// allocated, so a corrupt file costs no more than its header.
inline SafetensorsFile read_safetensors(const std::string& path) {
  namespace st = detail::safetensors;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) st::fail(path, "cannot open: no such file");
  if (ec) st::fail(path, "cannot open: " + ec.message());
  if (fs::is_directory(status)) st::fail(path, "cannot open: it is a directory");
  if (!fs::is_regular_file(status)) st::fail(path, "cannot open: not a regular file");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) st::fail(path, "cannot read its size: " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) st::fail(path, std::string("cannot open: ") + std::strerror(errno));
  st::check_file_size(size, path);

  auto read = [&](std::uint8_t* dst, std::size_t count, const char* what) {
    in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(count));
    if (static_cast<std::size_t>(in.gcount()) != count)
      st::fail(path, std::string("cannot read the ") + what + " (the file is shorter than its size said, or unreadable)");
  };
  std::uint8_t first8[8];
  read(first8, 8, "header length");
  const std::size_t n = static_cast<std::size_t>(st::checked_header_size(first8, size, path));
  std::vector<std::uint8_t> header(n);
  read(header.data(), n, "header");
  const std::uint64_t data_size = size - 8 - n;
  if (data_size > std::numeric_limits<std::size_t>::max()) st::fail(path, "the data buffer does not fit in memory");
  SafetensorsFile file = st::parse_header(header.data(), n, static_cast<std::size_t>(data_size), path);

  std::shared_ptr<std::vector<std::uint8_t>> storage;
  try {
    storage = std::make_shared<std::vector<std::uint8_t>>(static_cast<std::size_t>(data_size));
  } catch (const std::bad_alloc&) {
    st::fail(path, "cannot allocate " + std::to_string(data_size) + " bytes for the data buffer");
  }
  read(storage->data(), storage->size(), "data buffer");
  st::attach(file, storage->empty() ? nullptr : storage->data());
  file.storage = std::move(storage);
  return file;
}

// A tensor's values converted to Scalar: F32, F64, F16 and BF16 (exactly, then rounded to Scalar if it is
// narrower). Any other dtype is refused, named.
template <typename Scalar>
std::vector<Scalar> tensor_values(const SafetensorsFile& file, const SafetensorsTensor& tensor) {
  static_assert(std::is_floating_point<Scalar>::value, "sdpa::tensor_values needs a floating-point Scalar");
  namespace st = detail::safetensors;
  const std::size_t n = static_cast<std::size_t>(tensor.numel());
  const std::uint8_t* p = tensor.data;
  std::vector<Scalar> out;
  auto check_size = [&](std::size_t width) {
    // parse_safetensors guarantees this; checked again because a SafetensorsTensor can be made by hand.
    if (tensor.nbytes() != n * width || (n != 0 && p == nullptr))
      st::fail(file.name, "tensor " + st::quote(tensor.name) + " has " + std::to_string(tensor.nbytes()) +
                              " bytes, not what its shape and dtype need");
    out.resize(n);
  };
  if (tensor.dtype == "F32") {
    check_size(4);
    for (std::size_t i = 0; i < n; ++i, p += 4) {
      const std::uint32_t bits = std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
                                 std::uint32_t(p[3]) << 24;
      out[i] = static_cast<Scalar>(st::float_from_bits(bits));
    }
  } else if (tensor.dtype == "F64") {
    check_size(8);
    for (std::size_t i = 0; i < n; ++i, p += 8) out[i] = static_cast<Scalar>(st::double_from_bits(st::read_le64(p)));
  } else if (tensor.dtype == "F16" || tensor.dtype == "BF16") {
    check_size(2);
    const bool half = tensor.dtype == "F16";
    for (std::size_t i = 0; i < n; ++i, p += 2) {
      const std::uint16_t bits = static_cast<std::uint16_t>(p[0] | p[1] << 8);
      out[i] = static_cast<Scalar>(half ? half_to_float(bits) : bfloat16_to_float(bits));
    }
  } else {
    st::fail(file.name, "tensor " + st::quote(tensor.name) + " has dtype " + tensor.dtype +
                            ", which cannot be loaded as floating point (supported: F32, F64, F16, BF16)");
  }
  return out;
}

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
// One tensor to write: `count` elements of element_bytes (1, 2, 4 or 8) each at data, in host order.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<Eigen::Index> shape;
  const void* data = nullptr;
  std::size_t element_bytes = 4;

  std::size_t count() const noexcept {
    std::size_t n = 1;
    for (Eigen::Index d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
};

// A safetensors file of these tensors, sorted by name and contiguous, "__metadata__" first when there is
// any, the header padded with spaces to a multiple of 8 as the reference implementation does, so the data
// is aligned; every element written little-endian.
inline std::vector<std::uint8_t> write_tensors(std::vector<RawTensor> tensors, const std::map<std::string, std::string>& metadata,
                                               const std::string& name_for_errors) {
  std::sort(tensors.begin(), tensors.end(), [](const RawTensor& a, const RawTensor& b) { return a.name < b.name; });
  auto json_string = [&](const std::string& s) {
    try {
      return nlohmann::json(s).dump();  // strict: bytes that are not UTF-8 cannot be written as JSON
    } catch (const nlohmann::json::exception&) {
      fail(name_for_errors, "cannot save " + quote(s) + ": it is not valid UTF-8");
    }
  };
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& kv : metadata) {
      header += (first ? "" : ",") + json_string(kv.first) + ":" + json_string(kv.second);
      first = false;
    }
    header += "}";
  }
  std::uint64_t offset = 0;
  for (const RawTensor& t : tensors) {
    if (t.name == "__metadata__") fail(name_for_errors, "a tensor cannot be named \"__metadata__\"");
    const std::uint64_t bytes = static_cast<std::uint64_t>(t.count()) * t.element_bytes;
    header += (header.size() > 1 ? "," : "") + json_string(t.name) + ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kSafetensorsMaxHeaderSize)
    fail(name_for_errors, "the header would exceed the limit of " + std::to_string(kSafetensorsMaxHeaderSize) + " bytes");

  std::vector<std::uint8_t> out;
  out.reserve(8 + header.size() + static_cast<std::size_t>(offset));
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(std::uint64_t(header.size()) >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (const RawTensor& t : tensors) {
    const auto* p = static_cast<const unsigned char*>(t.data);
    const std::size_t n = t.count(), es = t.element_bytes;
    for (std::size_t i = 0; i < n; ++i) {
      std::uint64_t bits = 0;
      if (es == 1) bits = p[i];
      else if (es == 2) { std::uint16_t x; std::memcpy(&x, p + 2 * i, 2); bits = x; }
      else if (es == 4) { std::uint32_t x; std::memcpy(&x, p + 4 * i, 4); bits = x; }
      else std::memcpy(&bits, p + 8 * i, 8);
      for (std::size_t b = 0; b < es; ++b) out.push_back(static_cast<std::uint8_t>(bits >> (8 * b)));
    }
  }
  return out;
}
}  // namespace safetensors
}  // namespace detail

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
