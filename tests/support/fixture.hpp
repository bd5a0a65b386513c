// Reader of the PyTorch parity fixtures written by scripts/fixtures/make_fixtures.py (tests/fixtures/*.sdpafix),
// and helpers that load them into a ScaledDotProductAttention and Eigen tensors.
//
// File format "SDPAFIX1" (all integers and floats little-endian, no padding, no alignment):
//
//     file   := magic  u32 count  entry*count          (the file ends right after the last entry)
//     magic  := the 8 ASCII bytes "SDPAFIX1"
//     entry  := u32 name_len  name  u8 dtype  u8 rank  i64 dims[rank]  data
//     name   := name_len bytes of ASCII, no terminator; names are unique within a file
//     dtype  := 0 f64 (IEEE-754 binary64) | 1 bool (u8, 0 or 1) | 2 i64
//     data   := prod(dims) elements of dtype in row-major order (last index fastest); rank 0 is a
//               scalar (one element)
//
// Entries of every fixture (shapes as in PyTorch):
//     d_model, d_k, d_v, h        i64 scalars, the constructor's arguments
//     masked_rows                 i64 scalar: 0 sdpa::MaskedRows::kZero, 1 kNaN
//     scalar_bits                 i64 scalar: 32 (float) or 64 (double)
//     self_attention              i64 scalar: 1 when queries, keys and values are one tensor
//     fc_q.weight (h*d_k, d_model), fc_q.bias (h*d_k), fc_k.*, fc_v.weight (h*d_v, d_model),
//     fc_v.bias (h*d_v), fc_o.weight (d_model, h*d_v), fc_o.bias (d_model)           f64
//     queries (b, nq, d_model), keys (b, nk, d_model), values (b, nk, d_model)       f64
//     attention_mask (b|1, h|1, nq|1, nk|1) bool, optional; attention_weights, same shape, f64, optional
//     output (b, nq, d_model) f64, PyTorch's result (NaN where PyTorch gives NaN)
// Float data is f64 on disk; in a 32-bit fixture all of it holds float32 values.
#pragma once

#include <unsupported/Eigen/CXX11/Tensor>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace sdpa_test {

enum class DType : std::uint8_t { kF64 = 0, kBool = 1, kI64 = 2 };

// One named array: the values live in the vector of its dtype (f64, boolean, i64); the others are empty.
struct Array {
  std::string name;
  DType dtype = DType::kF64;
  std::vector<std::int64_t> dims;
  std::vector<double> f64;
  std::vector<bool> boolean;
  std::vector<std::int64_t> i64;

  std::int64_t size() const {
    std::int64_t n = 1;
    for (std::int64_t d : dims) n *= d;
    return n;
  }
  int rank() const { return static_cast<int>(dims.size()); }
  std::string shape_string() const {
    std::ostringstream os;
    os << '(';
    for (std::size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
    os << (dims.size() == 1 ? ",)" : ")");
    return os.str();
  }
};

class Fixture {
 public:
  // Reads and validates a whole file; throws std::runtime_error naming the file and the problem.
  static Fixture load(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("fixture " + path + ": cannot open");
    const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw std::runtime_error("fixture " + path + ": read error");
    Fixture f;
    f.path_ = path;
    Reader r{bytes, 0, path};
    const std::string magic = r.text(8, "magic");
    if (magic != "SDPAFIX1") r.fail("bad magic (not an SDPAFIX1 file)");
    const std::uint32_t count = r.u32("entry count");
    for (std::uint32_t e = 0; e < count; ++e) {
      Array a;
      const std::uint32_t name_len = r.u32("name length");
      if (name_len == 0 || name_len > 256) r.fail("implausible name length " + std::to_string(name_len));
      a.name = r.text(name_len, "name");
      const std::uint8_t code = r.u8("dtype");
      if (code > 2) r.fail(a.name + ": unknown dtype code " + std::to_string(code));
      a.dtype = static_cast<DType>(code);
      const std::uint8_t rank = r.u8("rank");
      if (rank > 8) r.fail(a.name + ": implausible rank " + std::to_string(rank));
      std::int64_t n = 1;
      for (int i = 0; i < rank; ++i) {
        const std::int64_t d = r.i64("dimension");
        if (d < 0 || d > (std::int64_t(1) << 32)) r.fail(a.name + ": bad dimension " + std::to_string(d));
        a.dims.push_back(d);
        n *= d;
      }
      const std::size_t width = a.dtype == DType::kBool ? 1 : 8;
      if (static_cast<std::uint64_t>(n) > (bytes.size() - r.pos) / width)
        r.fail(a.name + ": data runs past the end of the file");
      for (std::int64_t i = 0; i < n; ++i) {
        switch (a.dtype) {
          case DType::kF64: {
            const std::uint64_t bits = r.u64("f64");
            double x;
            std::memcpy(&x, &bits, sizeof x);
            a.f64.push_back(x);
            break;
          }
          case DType::kBool: {
            const std::uint8_t b = r.u8("bool");
            if (b > 1) r.fail(a.name + ": bool element is " + std::to_string(b));
            a.boolean.push_back(b != 0);
            break;
          }
          case DType::kI64:
            a.i64.push_back(r.i64("i64"));
            break;
        }
      }
      if (f.arrays_.count(a.name)) r.fail("duplicate entry " + a.name);
      f.order_.push_back(a.name);
      f.arrays_.emplace(a.name, std::move(a));
    }
    if (r.pos != bytes.size()) r.fail(std::to_string(bytes.size() - r.pos) + " trailing bytes");
    return f;
  }

  const std::string& path() const { return path_; }
  const std::vector<std::string>& names() const { return order_; }
  bool has(const std::string& name) const { return arrays_.count(name) != 0; }

  const Array& get(const std::string& name) const {
    auto it = arrays_.find(name);
    if (it == arrays_.end()) throw std::runtime_error("fixture " + path_ + ": no entry " + name);
    return it->second;
  }

  // An i64 scalar (rank 0) entry.
  std::int64_t integer(const std::string& name) const {
    const Array& a = get(name);
    if (a.dtype != DType::kI64 || a.rank() != 0)
      throw std::runtime_error("fixture " + path_ + ": " + name + " is not an i64 scalar");
    return a.i64[0];
  }

  // An f64 entry of the given rank.
  const Array& real(const std::string& name, int rank) const {
    const Array& a = get(name);
    if (a.dtype != DType::kF64 || a.rank() != rank)
      throw std::runtime_error("fixture " + path_ + ": " + name + " is not an f64 array of rank " +
                               std::to_string(rank) + " (shape " + a.shape_string() + ")");
    return a;
  }

 private:
  struct Reader {
    const std::vector<unsigned char>& bytes;
    std::size_t pos;
    const std::string& path;

    [[noreturn]] void fail(const std::string& what) const {
      throw std::runtime_error("fixture " + path + ": " + what + " (at byte " + std::to_string(pos) + ")");
    }
    void need(std::size_t n, const char* what) const {
      if (bytes.size() - pos < n) fail(std::string("truncated while reading ") + what);
    }
    std::uint64_t le(std::size_t n, const char* what) {
      need(n, what);
      std::uint64_t v = 0;
      for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t(bytes[pos + i]) << (8 * i);
      pos += n;
      return v;
    }
    std::uint8_t u8(const char* what) { return static_cast<std::uint8_t>(le(1, what)); }
    std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(le(4, what)); }
    std::uint64_t u64(const char* what) { return le(8, what); }
    std::int64_t i64(const char* what) {
      const std::uint64_t u = le(8, what);
      std::int64_t v;
      std::memcpy(&v, &u, sizeof v);
      return v;
    }
    std::string text(std::size_t n, const char* what) {
      need(n, what);
      std::string s(reinterpret_cast<const char*>(bytes.data() + pos), n);
      pos += n;
      return s;
    }
  };

  std::string path_;
  std::vector<std::string> order_;
  std::map<std::string, Array> arrays_;
};

// A row-major Eigen tensor of the array's shape (rank must match), its f64 values cast to Scalar.
template <typename Scalar, int Rank>
Eigen::Tensor<Scalar, Rank, Eigen::RowMajor> to_tensor(const Fixture& f, const std::string& name) {
  const Array& a = f.real(name, Rank);
  Eigen::array<Eigen::Index, Rank> dims;
  for (int i = 0; i < Rank; ++i) dims[i] = static_cast<Eigen::Index>(a.dims[static_cast<std::size_t>(i)]);
  Eigen::Tensor<Scalar, Rank, Eigen::RowMajor> t(dims);
  for (Eigen::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<Scalar>(a.f64[static_cast<std::size_t>(i)]);
  return t;
}

// The array's f64 values cast to Scalar, flat in row-major order (storage for TensorMaps).
template <typename Scalar>
std::vector<Scalar> to_vector(const Fixture& f, const std::string& name) {
  const Array& a = f.get(name);
  if (a.dtype != DType::kF64) throw std::runtime_error("fixture " + f.path() + ": " + name + " is not f64");
  return std::vector<Scalar>(a.f64.begin(), a.f64.end());
}

// The rank-4 bool entry `name` as a mask tensor.
inline Eigen::Tensor<bool, 4, Eigen::RowMajor> to_mask(const Fixture& f, const std::string& name) {
  const Array& a = f.get(name);
  if (a.dtype != DType::kBool || a.rank() != 4)
    throw std::runtime_error("fixture " + f.path() + ": " + name + " is not a rank-4 bool array (shape " +
                             a.shape_string() + ")");
  Eigen::Tensor<bool, 4, Eigen::RowMajor> m(a.dims[0], a.dims[1], a.dims[2], a.dims[3]);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = a.boolean[static_cast<std::size_t>(i)];
  return m;
}

inline const char* const kParameterNames[8] = {"fc_q.weight", "fc_q.bias", "fc_k.weight", "fc_k.bias",
                                               "fc_v.weight", "fc_v.bias", "fc_o.weight", "fc_o.bias"};

// Copies the eight parameters into `module` through module.parameter(name), checking each shape.
template <typename Module>
void load_parameters(Module& module, const Fixture& f) {
  for (const char* name : kParameterNames) {
    const Array& a = f.get(name);
    auto p = module.parameter(name);
    std::vector<std::int64_t> shape(p.shape.begin(), p.shape.end());
    if (a.dtype != DType::kF64 || shape != a.dims) {
      Array want;
      want.dims = shape;
      throw std::runtime_error("fixture " + f.path() + ": " + name + " has shape " + a.shape_string() +
                               ", the module's is " + want.shape_string());
    }
    using Scalar = std::remove_pointer_t<decltype(p.data)>;
    for (std::size_t i = 0; i < a.f64.size(); ++i) p.data[i] = static_cast<Scalar>(a.f64[i]);
  }
}

}  // namespace sdpa_test
