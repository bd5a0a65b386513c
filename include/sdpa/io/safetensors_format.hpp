// The safetensors format (huggingface/safetensors), the file PyTorch users share weights in: an 8-byte
// little-endian header length N, N bytes of JSON naming each tensor's dtype, shape and byte range, then
// the little-endian data. parse_safetensors() / read_safetensors() check a buffer or a file and list its
// tensors; tensor_values() converts one (F32, F64, F16, BF16) to float or double; write_tensors() lays
// tensors out as the reference implementation does. Files are untrusted input: every malformation is
// refused with a SafetensorsError naming the file and the problem, before anything is allocated beyond the
// file's own size. No Eigen and no module here (the fuzz target builds the parser alone); the module's and
// the caches' save and load are sdpa/io/safetensors.hpp's. Needs nlohmann_json (CMake target sdpa::io).
#pragma once

#include "sdpa/config.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
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
#include "sdpa/storage.hpp"

SDPA_NAMESPACE_BEGIN

// Every refusal of a file, malformed or not matching the module: "sdpa: safetensors file '<path>': ...".
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The reference implementation's cap: a header beyond it is corruption, not a model.
constexpr std::uint64_t kSafetensorsMaxHeaderSize = 100000000;

// One tensor of a parsed file. Its bytes are data[0, end - begin), inside the buffer parse_safetensors()
// was given (or the file's own storage), valid as long as that buffer lives.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;                // as written, e.g. "F32", "BF16", "I64"
  std::vector<std::ptrdiff_t> shape;  // {} for a scalar
  std::uint64_t begin = 0;          // data_offsets, relative to the start of the data buffer
  std::uint64_t end = 0;
  const std::uint8_t* data = nullptr;

  // The element count; parse_safetensors() checked that it does not overflow.
  std::ptrdiff_t numel() const noexcept {
    std::ptrdiff_t n = 1;
    for (std::ptrdiff_t d : shape) n *= d;
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

inline std::string shape_text(const std::vector<std::ptrdiff_t>& shape) {
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
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()))
        fail(file_, "shape of tensor " + quote(tensor_.name) + " has a dimension too large: " + std::to_string(value));
      tensor_.shape.push_back(static_cast<std::ptrdiff_t>(value));
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
    // Every partial product must fit std::ptrdiff_t, as numel() multiplies in that type in the same order.
    const auto index_max = static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max());
    std::uint64_t count = 1;
    for (std::ptrdiff_t d : t.shape)
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
// One tensor to write: `count` elements of element_bytes (1, 2, 4 or 8) each at data, in host order.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<std::ptrdiff_t> shape;
  const void* data = nullptr;
  std::size_t element_bytes = 4;

  std::size_t count() const noexcept {
    std::size_t n = 1;
    for (std::ptrdiff_t d : shape) n *= static_cast<std::size_t>(d);
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

SDPA_NAMESPACE_END
