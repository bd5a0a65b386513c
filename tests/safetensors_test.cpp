// Tests for sdpa/io/safetensors.hpp: bit-exact save -> load round trips (float, double, prefix, metadata),
// byte-identical output to scripts/models/export_pytorch.py, PyTorch-exported F32/F64/F16/BF16 files under a
// prefix reproducing PyTorch's output, half and bfloat16 conversions against PyTorch's (and exhaustively
// against a formula), and one test per kind of malformed file: each must be refused with a
// SafetensorsError naming the file and the problem, leaving the module's parameters untouched. Narrow
// storage: caches saved and loaded in their own dtype (BF16, F16, I8 with scales), bfloat16 / float16
// weights saved as stored and kept with LoadOptions::keep_dtype.
// Fixtures: tests/fixtures/safetensors/, written by scripts/models/export_pytorch.py fixtures.
#include "sdpa/io/safetensors.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "sdpa/scaled_dot_product_attention.hpp"
#include "support/narrow.hpp"

namespace safetensors_test {

using sdpa::LoadOptions;
using sdpa::SafetensorsError;
using sdpa::SafetensorsFile;
using sdpa::ScaledDotProductAttention;

const std::string kPrefix = "encoder.layers.0.attn.";
constexpr Eigen::Index kDModel = 16, kDK = 4, kDV = 6, kH = 2;

std::string fixture(const std::string& name) { return std::string(SDPA_FIXTURE_DIR) + "/safetensors/" + name; }

// A file path of this test's own: tests may run in parallel processes.
std::string temp_path(const std::string& tag = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (std::filesystem::temp_directory_path() /
          ("sdpa_st_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name() + tag +
           ".safetensors"))
      .string();
}

std::string write_file(const std::string& bytes, const std::string& tag = "") {
  const std::string path = temp_path(tag);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A safetensors file from its header text and data bytes.
std::string st_bytes(const std::string& header, const std::string& data = "") { return le64(header.size()) + header + data; }

std::string zeros(std::size_t n) { return std::string(n, '\0'); }

// The small module of the malformed-file tests: fc_q (4, 4), fc_k (4, 4), fc_v (6, 4), fc_o (4, 6).
using Small = ScaledDotProductAttention<float>;
Small small_module() {
  Small m(4, 2, 3, 2);
  float x = 0.5f;
  for (auto& p : m.named_parameters())
    for (Eigen::Index i = 0; i < p.size(); ++i) p.data[i] = (x = -x * 1.01f);  // nothing here is 0, as a load of zeros would be
  return m;
}

struct Spec {
  std::string name, dtype;
  std::vector<std::size_t> shape;
};

std::size_t dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "C64") return 8;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  return 1;
}

// A well-formed file from specs, its data all zeros (or `fill`).
std::string build(const std::vector<Spec>& specs, const std::string& metadata_json = "") {
  std::string header = "{";
  if (!metadata_json.empty()) header += "\"__metadata__\":" + metadata_json;
  std::size_t offset = 0;
  for (const Spec& s : specs) {
    std::size_t n = dtype_size(s.dtype);
    std::string shape;
    for (std::size_t d : s.shape) {
      shape += (shape.empty() ? "" : ",") + std::to_string(d);
      n *= d;
    }
    header += (header.size() > 1 ? "," : "") + std::string("\"") + s.name + "\":{\"dtype\":\"" + s.dtype +
              "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + n) + "]}";
    offset += n;
  }
  header += "}";
  return st_bytes(header, zeros(offset));
}

std::vector<Spec> small_specs(const std::string& prefix = "", const std::string& dtype = "F32") {
  return {{prefix + "fc_q.weight", dtype, {4, 4}}, {prefix + "fc_q.bias", dtype, {4}},
          {prefix + "fc_k.weight", dtype, {4, 4}}, {prefix + "fc_k.bias", dtype, {4}},
          {prefix + "fc_v.weight", dtype, {6, 4}}, {prefix + "fc_v.bias", dtype, {6}},
          {prefix + "fc_o.weight", dtype, {4, 6}}, {prefix + "fc_o.bias", dtype, {4}}};
}

template <typename Module>
std::vector<std::string> raw_parameters(const Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters())
    out.emplace_back(reinterpret_cast<const char*>(p.data), static_cast<std::size_t>(p.size()) * sizeof(*p.data));
  return out;
}

// Loads `bytes` (from a file and from memory) into a small module; both must be refused with a message
// naming the file and containing `phrase`, and the module must keep its parameters.
void expect_refused(const std::string& bytes, const std::string& phrase, const std::string& prefix = "",
                    LoadOptions options = {}) {
  const std::string path = write_file(bytes);
  Small m = small_module();
  const auto before = raw_parameters(m);
  try {
    sdpa::load_safetensors(m, path, prefix, options);
    ADD_FAILURE() << "loading was not refused; expected: " << phrase;
  } catch (const SafetensorsError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find(phrase), std::string::npos) << "expected \"" << phrase << "\" in: " << what;
  }
  EXPECT_EQ(raw_parameters(m), before) << "a refused load changed the module";

  const std::string name = "memory:" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
  try {
    sdpa::load_safetensors_from_memory(m, reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), name,
                                       prefix, options);
    ADD_FAILURE() << "loading from memory was not refused; expected: " << phrase;
  } catch (const SafetensorsError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(name), std::string::npos) << what;
    EXPECT_NE(what.find(phrase), std::string::npos) << "expected \"" << phrase << "\" in: " << what;
  }
  EXPECT_EQ(raw_parameters(m), before) << "a refused load from memory changed the module";
  std::filesystem::remove(path);
}

// One tensor "fc_q.bias" of 4 F32 with the given JSON for its entry, and 16 bytes of data.
std::string one_entry(const std::string& entry_json, std::size_t data = 16) {
  return st_bytes("{\"fc_q.bias\":" + entry_json + "}", zeros(data));
}

using sdpa_test::bits_of;

// ------------------------------------------------------------------------------------------------
// Round trips and layout.

template <typename Scalar>
void round_trip() {
  ScaledDotProductAttention<Scalar> a(8, 3, 5, 2);
  a.manual_seed(11);
  a.init_weights();
  // Values that a lossy path would alter: signed zero, subnormals, extremes, infinities, NaN.
  auto q = a.parameter("fc_q.weight");
  q.data[0] = -Scalar(0);
  q.data[1] = std::numeric_limits<Scalar>::denorm_min();
  q.data[2] = std::numeric_limits<Scalar>::max();
  q.data[3] = -std::numeric_limits<Scalar>::infinity();
  q.data[4] = std::numeric_limits<Scalar>::quiet_NaN();
  q.data[5] = std::numeric_limits<Scalar>::lowest();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}};
  const std::string path = temp_path();
  sdpa::save_safetensors(a, path, "model.attn.", metadata);

  ScaledDotProductAttention<Scalar> b(8, 3, 5, 2);
  b.manual_seed(99);
  b.init_weights();
  ASSERT_NE(raw_parameters(a), raw_parameters(b));
  sdpa::load_safetensors(b, path, "model.attn.");
  EXPECT_EQ(raw_parameters(a), raw_parameters(b));

  const SafetensorsFile file = sdpa::read_safetensors(path);
  std::map<std::string, std::string> expected_metadata = metadata;  // and the module's shape
  expected_metadata.insert({{"model.attn.sdpa.d_model", "8"}, {"model.attn.sdpa.d_k", "3"},
                            {"model.attn.sdpa.d_v", "5"}, {"model.attn.sdpa.h", "2"}, {"model.attn.sdpa.kv_heads", "2"}});
  EXPECT_EQ(file.metadata, expected_metadata);
  ASSERT_EQ(file.tensors.size(), 8u);
  for (const auto& t : file.tensors) {
    EXPECT_EQ(t.dtype, sizeof(Scalar) == 4 ? "F32" : "F64");
    EXPECT_EQ(t.name.rfind("model.attn.", 0), 0u);
  }
  EXPECT_EQ(file.header_size % 8, 0u);
  std::filesystem::remove(path);
}

TEST(SafetensorsRoundTrip, FloatIsBitExact) { round_trip<float>(); }
TEST(SafetensorsRoundTrip, DoubleIsBitExact) { round_trip<double>(); }

TEST(SafetensorsRoundTrip, LayoutIsTheReferences) {
  Small m = small_module();
  const auto bytes = sdpa::save_safetensors_to_memory(m, "p.", {{"k", "v"}});
  const SafetensorsFile file = sdpa::parse_safetensors(bytes.data(), bytes.size(), "saved");
  EXPECT_EQ(file.header_size % 8, 0u);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(file.header_size));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"k\":\"v\",\"p.sdpa.d_k\":\"2\",\"p.sdpa.d_model\":\"4\",\"p.sdpa.d_v\":\"3\","
                         "\"p.sdpa.h\":\"2\",\"p.sdpa.kv_heads\":\"2\"},\"p.fc_k.bias\":{\"dtype\":\"F32\",\"shape\":[4],"
                         "\"data_offsets\":[0,16]},",
                         0),
            0u)
      << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
  // Sorted by name and contiguous in that order.
  std::vector<std::pair<std::uint64_t, std::string>> by_offset;
  for (const auto& t : file.tensors) by_offset.emplace_back(t.begin, t.name);
  std::sort(by_offset.begin(), by_offset.end());
  for (std::size_t i = 1; i < by_offset.size(); ++i) EXPECT_LT(by_offset[i - 1].second, by_offset[i].second);
}

TEST(SafetensorsRoundTrip, SameBytesAsThePythonExporter) {
  // sdpa_f32_attn_only holds exactly the module's tensors, written by scripts/models/export_pytorch.py.
  const std::string expected = read_file(fixture("sdpa_f32_attn_only.safetensors"));
  ASSERT_FALSE(expected.empty());
  ScaledDotProductAttention<float> m(kDModel, kDK, kDV, kH);
  sdpa::load_safetensors(m, fixture("sdpa_f32_attn_only.safetensors"), kPrefix);
  const auto bytes = sdpa::save_safetensors_to_memory(m, kPrefix, {{"format", "pt"}});
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()), expected);
}

// The module's shape is saved, and a module of another shape whose parameters have the same sizes (here h
// and d_k swapped: h * d_k and h * d_v stay 4 and 6) is refused by name; files without the metadata (as
// PyTorch writes them) load as before.
TEST(SafetensorsRoundTrip, ShapeMetadataIsSavedAndChecked) {
  Small m = small_module();  // (4, 2, 3, 2)
  const auto bytes = sdpa::save_safetensors_to_memory(m, "p.");
  const SafetensorsFile file = sdpa::parse_safetensors(bytes.data(), bytes.size(), "saved");
  EXPECT_EQ(file.metadata.at("p.sdpa.h"), "2");
  EXPECT_EQ(file.metadata.at("p.sdpa.d_model"), "4");
  Small other(4, 2, 3, 2);
  EXPECT_NO_THROW(sdpa::load_safetensors(other, file, "p."));
  // h = 1 with d_k = 4 and d_v = 6: every tensor has the shape of the (4, 2, 3, 2) module's.
  ScaledDotProductAttention<float> one_head(4, 4, 6, 1);
  const auto before = raw_parameters(one_head);
  try {
    sdpa::load_safetensors(one_head, file, "p.");
    ADD_FAILURE() << "a module with h = 1 loaded a file saved with h = 2";
  } catch (const SafetensorsError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("saved from a module with d_k = 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("but this module has d_k = 4"), std::string::npos) << msg;
  }
  EXPECT_EQ(raw_parameters(one_head), before);  // refused before anything was copied
  // A caller's metadata may repeat the shape, not contradict it.
  EXPECT_NO_THROW(sdpa::save_safetensors_to_memory(m, "p.", {{"p.sdpa.h", "2"}}));
  EXPECT_THROW(sdpa::save_safetensors_to_memory(m, "p.", {{"p.sdpa.h", "3"}}), SafetensorsError);
  // Metadata that is not an integer is refused.
  auto bad = sdpa::save_safetensors_to_memory(m, "");
  const std::string text(bad.begin(), bad.end());
  const std::size_t at = text.find("\"sdpa.h\":\"2\"");
  ASSERT_NE(at, std::string::npos);
  bad[at + 10] = 'x';
  EXPECT_THROW(sdpa::load_safetensors_from_memory(other, bad.data(), bad.size(), "bad"), SafetensorsError);
}

TEST(SafetensorsRoundTrip, SaveToAnUnwritablePathIsRefused) {
  Small m = small_module();
  const std::string path = "/nonexistent-dir/x.safetensors";
  try {
    sdpa::save_safetensors(m, path);
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot open for writing"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsRoundTrip, MetadataThatIsNotUtf8IsRefusedOnSave) {
  Small m = small_module();
  EXPECT_THROW(sdpa::save_safetensors_to_memory(m, "", {{"k", "\xff"}}), SafetensorsError);
}

// ------------------------------------------------------------------------------------------------
// PyTorch-exported files.

struct Io {
  SafetensorsFile file = sdpa::read_safetensors(fixture("sdpa_io.safetensors"));

  template <typename Scalar>
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> get(const std::string& name) const {
    const sdpa::SafetensorsTensor* t = file.find(name);
    EXPECT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape.size(), 3u);
    const std::vector<Scalar> v = sdpa::tensor_values<Scalar>(file, *t);
    Eigen::Tensor<Scalar, 3, Eigen::RowMajor> out(t->shape[0], t->shape[1], t->shape[2]);
    std::copy(v.begin(), v.end(), out.data());
    return out;
  }
};

template <typename Scalar>
double max_abs(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& t) {
  double m = 0;
  for (Eigen::Index i = 0; i < t.size(); ++i) m = std::max(m, std::abs(static_cast<double>(t.data()[i])));
  return m;
}

template <typename Scalar>
double max_abs_diff(const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& a, const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& b) {
  EXPECT_EQ(a.dimensions(), b.dimensions());
  double m = 0;
  for (Eigen::Index i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
  return m;
}

// Loads `model` under kPrefix, runs PyTorch's inputs, compares with `output` within rtol of its largest
// magnitude.
template <typename Scalar>
ScaledDotProductAttention<Scalar> check_pytorch(const std::string& model, const std::string& output, double rtol) {
  ScaledDotProductAttention<Scalar> m(kDModel, kDK, kDV, kH);
  sdpa::load_safetensors(m, fixture(model), kPrefix);
  m.eval();
  const Io io;
  const std::string suffix = sizeof(Scalar) == 4 ? "_f32" : "_f64";
  const auto out = m(io.get<Scalar>("queries" + suffix), io.get<Scalar>("keys" + suffix), io.get<Scalar>("values" + suffix));
  const auto expected = io.get<Scalar>(output);
  EXPECT_EQ(out.dimension(0), 2);
  EXPECT_EQ(out.dimension(1), 5);
  EXPECT_EQ(out.dimension(2), kDModel);
  EXPECT_GT(max_abs(expected), 0.1);  // the fixture's weights make a non-trivial output
  EXPECT_LE(max_abs_diff(out, expected), rtol * max_abs(expected)) << model;
  return m;
}

TEST(SafetensorsPyTorch, F32ReproducesPyTorch) { check_pytorch<float>("sdpa_f32.safetensors", "output_f32", 2e-5); }
TEST(SafetensorsPyTorch, F64ReproducesPyTorch) { check_pytorch<double>("sdpa_f64.safetensors", "output_f64", 1e-10); }

void check_half_file(const std::string& model, const std::string& output) {
  const auto m = check_pytorch<float>(model, output, 2e-5);
  // The file stores PyTorch's exact float32 conversion of the same tensors under "f32_reference.".
  ScaledDotProductAttention<float> reference(kDModel, kDK, kDV, kH);
  sdpa::load_safetensors(reference, fixture(model), "f32_reference.");
  EXPECT_EQ(raw_parameters(m), raw_parameters(reference));
  // Into a double module: the same values widened.
  ScaledDotProductAttention<double> d(kDModel, kDK, kDV, kH);
  sdpa::load_safetensors(d, fixture(model), kPrefix);
  const auto dp = d.named_parameters();
  const auto rp = reference.named_parameters();
  for (std::size_t i = 0; i < dp.size(); ++i)
    for (Eigen::Index j = 0; j < dp[i].size(); ++j) ASSERT_EQ(dp[i].data[j], static_cast<double>(rp[i].data[j])) << dp[i].name;
}

TEST(SafetensorsPyTorch, F16LoadsExactlyAndReproducesPyTorch) { check_half_file("sdpa_f16.safetensors", "output_f16"); }
TEST(SafetensorsPyTorch, BF16LoadsExactlyAndReproducesPyTorch) { check_half_file("sdpa_bf16.safetensors", "output_bf16"); }

TEST(SafetensorsPyTorch, CrossPrecisionLoadsConvert) {
  // F32 -> double widens exactly; F64 -> float rounds to nearest like PyTorch's copy_.
  ScaledDotProductAttention<float> f(kDModel, kDK, kDV, kH), f_from64(kDModel, kDK, kDV, kH);
  ScaledDotProductAttention<double> d(kDModel, kDK, kDV, kH), d_from32(kDModel, kDK, kDV, kH);
  sdpa::load_safetensors(f, fixture("sdpa_f32.safetensors"), kPrefix);
  sdpa::load_safetensors(d_from32, fixture("sdpa_f32.safetensors"), kPrefix);
  sdpa::load_safetensors(d, fixture("sdpa_f64.safetensors"), kPrefix);
  sdpa::load_safetensors(f_from64, fixture("sdpa_f64.safetensors"), kPrefix);
  const auto fp = f.named_parameters(), f64p = f_from64.named_parameters();
  const auto dp = d.named_parameters(), d32p = d_from32.named_parameters();
  for (std::size_t i = 0; i < fp.size(); ++i)
    for (Eigen::Index j = 0; j < fp[i].size(); ++j) {
      ASSERT_EQ(d32p[i].data[j], static_cast<double>(fp[i].data[j]));
      ASSERT_EQ(f64p[i].data[j], static_cast<float>(dp[i].data[j]));
      ASSERT_EQ(fp[i].data[j], static_cast<float>(dp[i].data[j]));  // PyTorch's .float() of the same model
    }
}

TEST(SafetensorsPyTorch, MetadataAndForeignTensorsAreRead) {
  const SafetensorsFile file = sdpa::read_safetensors(fixture("sdpa_bf16.safetensors"));
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(file.metadata.at("h"), "2");
  EXPECT_EQ(file.metadata.at("prefix"), kPrefix);
  const sdpa::SafetensorsTensor* steps = file.find("steps");  // an int64 scalar buffer outside the prefix
  ASSERT_NE(steps, nullptr);
  EXPECT_EQ(steps->dtype, "I64");
  EXPECT_TRUE(steps->shape.empty());
  EXPECT_EQ(steps->numel(), 1);
  EXPECT_EQ(steps->data[0] | steps->data[1] << 8, 1234);
  try {
    sdpa::tensor_values<float>(file, *steps);
    ADD_FAILURE() << "I64 converted";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("dtype I64"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsPyTorch, WithoutThePrefixTheTensorsAreMissing) {
  ScaledDotProductAttention<float> m(kDModel, kDK, kDV, kH);
  const auto before = raw_parameters(m);
  try {
    sdpa::load_safetensors(m, fixture("sdpa_f32.safetensors"));
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("missing tensors: \"fc_q.weight\", \"fc_q.bias\""), std::string::npos) << what;
    EXPECT_NE(what.find("unexpected tensors"), std::string::npos) << what;
  }
  EXPECT_EQ(raw_parameters(m), before);
  // A prefix without its final dot gets a hint.
  try {
    sdpa::load_safetensors(m, fixture("sdpa_f32.safetensors"), "encoder.layers.0.attn", {true});
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("does not end with '.'"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------------------------
// Half and bfloat16.

void check_special(const std::string& bits_name, const std::string& f32_name, float (*convert)(std::uint16_t)) {
  const SafetensorsFile file = sdpa::read_safetensors(fixture("special_values.safetensors"));
  const auto* bits = file.find(bits_name);
  const auto* expected = file.find(f32_name);
  ASSERT_TRUE(bits && expected);
  const std::vector<float> want = sdpa::tensor_values<float>(file, *expected);
  const std::vector<float> got = sdpa::tensor_values<float>(file, *bits);
  ASSERT_EQ(want.size(), 20u);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::uint16_t b = static_cast<std::uint16_t>(bits->data[2 * i] | bits->data[2 * i + 1] << 8);
    // Bitwise, so that -0, NaN signs and NaN payloads count.
    EXPECT_EQ(bits_of(convert(b)), bits_of(want[i])) << bits_name << " 0x" << std::hex << b;
    EXPECT_EQ(bits_of(got[i]), bits_of(want[i])) << bits_name << " 0x" << std::hex << b;
  }
}

TEST(SafetensorsHalf, SpecialValuesMatchPyTorch) { check_special("f16_bits", "f16_as_f32", sdpa::half_to_float); }
TEST(SafetensorsHalf, BFloat16SpecialValuesMatchPyTorch) {
  check_special("bf16_bits", "bf16_as_f32", sdpa::bfloat16_to_float);
}

TEST(SafetensorsHalf, EveryHalfMatchesTheFormula) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const int sign = h & 0x8000 ? -1 : 1;
    const int exponent = (h >> 10) & 0x1F;
    const int mantissa = h & 0x3FF;
    const float got = sdpa::half_to_float(static_cast<std::uint16_t>(h));
    if (exponent == 0x1F) {
      if (mantissa == 0) {
        ASSERT_EQ(got, sign * std::numeric_limits<float>::infinity()) << h;
      } else {
        ASSERT_TRUE(std::isnan(got)) << h;
        ASSERT_EQ(std::signbit(got), sign < 0) << h;
      }
      continue;
    }
    const double value = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
    ASSERT_EQ(static_cast<double>(got), sign * value) << h;
    ASSERT_EQ(std::signbit(got), sign < 0) << h;
  }
  EXPECT_EQ(sdpa::half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(sdpa::half_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(sdpa::bfloat16_to_float(0x7F7F), std::ldexp(255.0f / 128.0f, 127));
}

// ------------------------------------------------------------------------------------------------
// Valid edge cases that must be accepted.

TEST(SafetensorsParse, EdgeCasesThatAreValid) {
  auto parse = [](const std::string& bytes) {
    return sdpa::parse_safetensors(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), "edge");
  };
  EXPECT_TRUE(parse(st_bytes("{}")).tensors.empty());
  EXPECT_TRUE(parse(st_bytes("  {}   ")).tensors.empty());
  EXPECT_TRUE(parse(st_bytes("{\"__metadata__\":null}")).metadata.empty());
  const auto f = parse(st_bytes(
      "{\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[4,4]},\"s\":{\"data_offsets\":[0,4],"
      "\"shape\":[],\"dtype\":\"I32\"},\"z\":{\"dtype\":\"F16\",\"shape\":[-0],\"data_offsets\":[4,4]}}",
      zeros(4)));
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.find("e")->numel(), 0);
  EXPECT_EQ(f.find("s")->numel(), 1);
  EXPECT_TRUE(sdpa::tensor_values<double>(f, *f.find("e")).empty());
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(SafetensorsLoad, UnexpectedTensorsCanBeIgnored) {
  auto specs = small_specs("m.");
  specs.push_back({"m.extra", "I8", {3}});
  specs.push_back({"other.thing", "BOOL", {2}});  // outside the prefix: always ignored
  const std::string bytes = build(specs);
  expect_refused(bytes, "unexpected tensors under the prefix \"m.\": \"m.extra\"", "m.");
  Small m = small_module();
  const std::string path = write_file(bytes);
  sdpa::load_safetensors(m, path, "m.", LoadOptions{true});
  for (const auto& p : m.named_parameters())
    for (Eigen::Index i = 0; i < p.size(); ++i) ASSERT_EQ(p.data[i], 0.0f) << p.name;
  std::filesystem::remove(path);
}

TEST(SafetensorsLoad, TensorsOutsideThePrefixAreIgnored) {
  auto specs = small_specs("a.");
  for (auto s : small_specs("b.", "I32")) specs.push_back(s);
  specs.push_back({"a", "U8", {1}});
  Small m = small_module();
  const std::string path = write_file(build(specs));
  sdpa::load_safetensors(m, path, "a.");
  EXPECT_EQ(m.parameter("fc_o.bias").data[3], 0.0f);
  std::filesystem::remove(path);
}

// ------------------------------------------------------------------------------------------------
// Malformed files: one test each.

TEST(SafetensorsMalformed, MissingFile) {
  Small m = small_module();
  const auto before = raw_parameters(m);
  const std::string path = temp_path();
  try {
    sdpa::load_safetensors(m, path);
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no such file"), std::string::npos) << e.what();
  }
  EXPECT_EQ(raw_parameters(m), before);
}

TEST(SafetensorsMalformed, Directory) {
  Small m = small_module();
  try {
    sdpa::load_safetensors(m, std::filesystem::temp_directory_path().string());
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("directory"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsMalformed, EmptyFile) { expect_refused("", "the file is empty"); }
TEST(SafetensorsMalformed, ShortFile) { expect_refused("\x05\0\0\0\0", "too short for the 8-byte header length"); }
TEST(SafetensorsMalformed, HeaderLengthOnly) { expect_refused(le64(0), "not valid JSON"); }
TEST(SafetensorsMalformed, HeaderLengthBeyondTheFile) {
  expect_refused(le64(100) + "{}", "header length 100 reaches past the end of the file (10 bytes)");
}
TEST(SafetensorsMalformed, HeaderLengthAbsurd) {
  expect_refused(le64(std::uint64_t(1) << 63) + "{}", "exceeds the limit of 100000000 bytes");
  expect_refused(le64(~std::uint64_t(0)) + "{}", "exceeds the limit");
  expect_refused(le64(100000001) + "{}", "exceeds the limit");
}
TEST(SafetensorsMalformed, HeaderNotJson) {
  expect_refused(st_bytes("{\"a\":"), "the header is not valid JSON");
  expect_refused(st_bytes("not json"), "the header is not valid JSON");
  expect_refused(st_bytes("{} trailing"), "the header is not valid JSON");
  // nlohmann's lexer takes NUL for the end of input, which would let anything follow it.
  expect_refused(st_bytes(std::string("{}\0\0\0\0\0\0", 8)), "a NUL byte at offset 2");
  expect_refused(st_bytes(std::string("{}\0garbage", 10)), "a NUL byte");
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",}}"), "the header is not valid JSON");
}
TEST(SafetensorsMalformed, HeaderNotUtf8) {
  expect_refused(st_bytes("{\"\xff\xfe\":{}}"), "the header is not valid JSON");
}
TEST(SafetensorsMalformed, HeaderNotAnObject) {
  expect_refused(st_bytes("[1, 2]"), "the header must be a JSON object, but is an array");
  expect_refused(st_bytes("42"), "the header must be a JSON object, but is the integer 42");
  expect_refused(st_bytes("\"x\""), "the header must be a JSON object, but is the string");
  expect_refused(st_bytes("null"), "the header must be a JSON object, but is null");
}
TEST(SafetensorsMalformed, DeeplyNestedJson) {
  const std::size_t depth = 200000;  // deep enough to overflow the stack of a recursive parser
  expect_refused(st_bytes(std::string(depth, '[') + std::string(depth, ']')), "must be a JSON object");
  expect_refused(st_bytes("{\"a\":" + std::string(depth, '[') + std::string(depth, ']') + "}"),
                 "entry \"a\" must be an object with dtype, shape and data_offsets, but is an array");
  expect_refused(st_bytes("{\"a\":{\"shape\":" + std::string(depth, '[')), "must hold non-negative integers, but holds an array");
  expect_refused(st_bytes("{\"__metadata__\":{\"k\":" + std::string(depth, '{')), "value of key \"k\" must be a string");
  expect_refused(st_bytes("{\"a\":{\"dtype\":" + std::string(depth, '{')), "must be a string, but is an object");
  expect_refused(st_bytes("{\"a\":" + std::string(depth, '{')), "not valid JSON");  // an object key must be a string
}
TEST(SafetensorsMalformed, EntryNotAnObject) {
  expect_refused(st_bytes("{\"fc_q.bias\":5}"), "entry \"fc_q.bias\" must be an object with dtype, shape and data_offsets, but is the integer 5");
  expect_refused(st_bytes("{\"fc_q.bias\":\"F32\"}"), "but is the string \"F32\"");
  expect_refused(st_bytes("{\"fc_q.bias\":[]}"), "but is an array");
}
TEST(SafetensorsMalformed, MissingKeys) {
  expect_refused(one_entry("{\"shape\":[4],\"data_offsets\":[0,16]}"), "tensor \"fc_q.bias\" is missing the key \"dtype\"");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"data_offsets\":[0,16]}"), "is missing the key \"shape\"");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4]}"), "is missing the key \"data_offsets\"");
  expect_refused(one_entry("{}"), "is missing the key");
}
TEST(SafetensorsMalformed, ExtraKeys) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16],\"stride\":[1]}"),
                 "tensor \"fc_q.bias\" has the unexpected key \"stride\"");
}
TEST(SafetensorsMalformed, UnknownDtype) {
  expect_refused(one_entry("{\"dtype\":\"F17\",\"shape\":[4],\"data_offsets\":[0,16]}"), "has the unknown dtype \"F17\"");
  expect_refused(one_entry("{\"dtype\":\"f32\",\"shape\":[4],\"data_offsets\":[0,16]}"), "unknown dtype \"f32\"");
  expect_refused(one_entry("{\"dtype\":\"\",\"shape\":[4],\"data_offsets\":[0,16]}"), "unknown dtype \"\"");
}
TEST(SafetensorsMalformed, DtypeNotAString) {
  expect_refused(one_entry("{\"dtype\":32,\"shape\":[4],\"data_offsets\":[0,16]}"), "dtype of tensor \"fc_q.bias\" must be a string, but is the integer 32");
  expect_refused(one_entry("{\"dtype\":[\"F32\"],\"shape\":[4],\"data_offsets\":[0,16]}"), "must be a string, but is an array");
  expect_refused(one_entry("{\"dtype\":null,\"shape\":[4],\"data_offsets\":[0,16]}"), "must be a string, but is null");
}
TEST(SafetensorsMalformed, WrongDtypeForTheModule) {
  // Valid files whose module tensors are not floating point: refused naming the dtype, after the tensors
  // before them would have loaded (the module must still be untouched).
  for (const std::string dtype : {"I32", "I64", "I8", "U8", "BOOL", "I16", "U16", "F8_E4M3", "F8_E5M2", "C64"}) {
    auto specs = small_specs();
    specs[6].dtype = dtype;  // fc_o.weight
    expect_refused(build(specs), "tensor \"fc_o.weight\" has dtype " + dtype + ", which cannot be loaded as floating point");
  }
}
TEST(SafetensorsMalformed, ShapeNotAnArray) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}"), "shape of tensor \"fc_q.bias\" must be an array of non-negative integers, but is the integer 4");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":\"4\",\"data_offsets\":[0,16]}"), "must be an array of non-negative integers, but is the string");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,16]}"), "but is an object");
}
TEST(SafetensorsMalformed, ShapeNegative) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}"), "must hold non-negative integers, but holds the negative integer -4");
}
TEST(SafetensorsMalformed, ShapeFloat) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4.0],\"data_offsets\":[0,16]}"), "but holds the floating-point number 4.0");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4e0],\"data_offsets\":[0,16]}"), "floating-point");
  // Beyond 2^64: nlohmann reads it as a float, which is refused the same way.
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,16]}"), "floating-point");
}
TEST(SafetensorsMalformed, ShapeString) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[\"4\"],\"data_offsets\":[0,16]}"), "but holds the string \"4\"");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[true],\"data_offsets\":[0,16]}"), "but holds true");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[[4]],\"data_offsets\":[0,16]}"), "but holds an array");
}
TEST(SafetensorsMalformed, ShapeOverflows) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,2],\"data_offsets\":[0,16]}"), "whose element count overflows");
  // The element count fits in 64 bits but not once multiplied by the dtype's size.
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,16]}"), "whose element count overflows");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[9223372036854775808],\"data_offsets\":[0,16]}"), "dimension too large");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,16]}"), "whose element count overflows");
  // Fits 64 unsigned bits on the way to 0, but not Eigen::Index (signed), which numel() multiplies in.
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4611686018427387904,3,0],\"data_offsets\":[0,16]}"), "whose element count overflows");
}
TEST(SafetensorsMalformed, OffsetsNotTwoIntegers) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":16}"), "data_offsets of tensor \"fc_q.bias\" must be an array of two non-negative integers, but is the integer 16");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16]}"), "must be two integers [begin, end], but has 1");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[]}"), "but has 0");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16,16]}"), "but has more");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[-1,15]}"), "but holds the negative integer -1");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16.0]}"), "but holds the floating-point number 16.0");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[\"0\",16]}"), "but holds the string \"0\"");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,null]}"), "but holds null");
}
TEST(SafetensorsMalformed, OffsetsReversed) {
  expect_refused(st_bytes("{\"fc_q.bias\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[16,0]}}", zeros(16)),
                 "has reversed data_offsets [16, 0]");
}
TEST(SafetensorsMalformed, OffsetsPastTheEnd) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,32]}"),
                 "data_offsets [16, 32] past the end of the 16-byte data buffer");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[18446744073709551600,18446744073709551616]}"), "floating-point");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[18446744073709551599,18446744073709551615]}", 16),
                 "past the end");
}
TEST(SafetensorsMalformed, OffsetsNotMatchingShapeAndDtype) {
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}", 12),
                 "spanning 12 bytes, but shape (4,) of dtype F32 needs 16 bytes");
  expect_refused(one_entry("{\"dtype\":\"F64\",\"shape\":[4],\"data_offsets\":[0,16]}"), "needs 32 bytes");
  expect_refused(one_entry("{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}", 2), "does not fill whole bytes");
}
TEST(SafetensorsMalformed, OffsetsOverlap) {
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                          "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                          zeros(16)),
                 "tensor \"b\" (bytes 8 to 16) overlaps tensor \"a\" (bytes 0 to 16)");
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                          "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
                          zeros(16)),
                 "overlaps");
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                          "\"b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}",
                          zeros(16)),
                 "overlaps");
}
TEST(SafetensorsMalformed, OffsetsLeaveHoles) {
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                          "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                          zeros(20)),
                 "bytes 8 to 12 of the data buffer belong to no tensor (a hole before tensor \"b\")");
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", zeros(12)),
                 "bytes 0 to 4 of the data buffer belong to no tensor");
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", zeros(12)),
                 "the last 4 bytes of the data buffer (from byte 8) belong to no tensor");
  expect_refused(st_bytes("{}", zeros(3)), "the last 3 bytes");
}
TEST(SafetensorsMalformed, TruncatedData) {
  std::string bytes = build(small_specs());
  bytes.resize(bytes.size() - 5);
  expect_refused(bytes, "past the end of the");
  expect_refused(bytes, "truncated file");
  const std::string full = build(small_specs());
  const std::size_t header = 8 + (static_cast<unsigned char>(full[0]) | static_cast<unsigned char>(full[1]) << 8);
  expect_refused(full.substr(0, header), "past the end of the 0-byte data buffer");
  expect_refused(full.substr(0, header - 1), "reaches past the end of the file");
}
TEST(SafetensorsMalformed, DuplicateKeys) {
  expect_refused(st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                          "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                          zeros(8)),
                 "the header names tensor \"a\" twice (duplicate key)");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}"),
                 "has the key \"dtype\" twice");
  expect_refused(one_entry("{\"dtype\":\"F32\",\"shape\":[4],\"shape\":[4],\"data_offsets\":[0,16]}"), "\"shape\" twice");
  expect_refused(st_bytes("{\"__metadata__\":{},\"__metadata__\":{}}"), "\"__metadata__\" twice");
  expect_refused(st_bytes("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}"), "__metadata__ has the key \"k\" twice");
}
TEST(SafetensorsMalformed, MetadataNotStrings) {
  expect_refused(st_bytes("{\"__metadata__\":[]}"), "__metadata__ must be an object of strings, but is an array");
  expect_refused(st_bytes("{\"__metadata__\":\"x\"}"), "__metadata__ must be an object of strings");
  expect_refused(st_bytes("{\"__metadata__\":{\"k\":1}}"), "__metadata__ value of key \"k\" must be a string, but is the integer 1");
  expect_refused(st_bytes("{\"__metadata__\":{\"k\":null}}"), "must be a string, but is null");
}
TEST(SafetensorsMalformed, ShapeDiffersFromTheModule) {
  auto specs = small_specs();
  specs[4].shape = {4, 6};  // fc_v.weight transposed
  expect_refused(build(specs), "tensor \"fc_v.weight\" has shape (4, 6), but the module's parameter fc_v.weight has shape (6, 4)");
  specs = small_specs();
  specs[1].shape = {1, 4};
  expect_refused(build(specs), "tensor \"fc_q.bias\" has shape (1, 4), but the module's parameter fc_q.bias has shape (4,)");
  specs[1].shape = {};
  expect_refused(build(specs), "has shape (), but");
}
TEST(SafetensorsMalformed, MissingTensors) {
  auto specs = small_specs("p.");
  specs.erase(specs.begin() + 5);  // p.fc_v.bias
  specs.erase(specs.begin());      // p.fc_q.weight
  expect_refused(build(specs), "missing tensors: \"p.fc_q.weight\", \"p.fc_v.bias\"", "p.");
  expect_refused(build({}), "missing tensors: \"fc_q.weight\", \"fc_q.bias\", \"fc_k.weight\"");
}
TEST(SafetensorsMalformed, UnexpectedTensors) {
  auto specs = small_specs();
  specs.push_back({"fc_x.weight", "F32", {2}});
  expect_refused(build(specs), "unexpected tensors under the prefix \"\": \"fc_x.weight\"");
}
TEST(SafetensorsMalformed, LongNamesAreCutInMessages) {
  const std::string name(100000, 'n');
  try {
    const std::string bytes = st_bytes("{\"" + name + "\":1}");
    sdpa::parse_safetensors(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), "long");
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_LT(std::string(e.what()).size(), 500u);
    EXPECT_NE(std::string(e.what()).find("nnn...\""), std::string::npos);
  }
}

}  // namespace safetensors_test

// ------------------------------------------------------------------------------------------------
// Key/value caches: a parked conversation resumes exactly; a file for another module's shape is refused
// with the cache unchanged.
namespace safetensors_test {
TEST(SafetensorsKVCache, RoundTripResumesExactly) {
  ScaledDotProductAttention<float> m(16, 4, 6, 2);
  m.eval();
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(3, 9, 16), next(3, 1, 16);
  x.setRandom();
  next.setRandom();
  sdpa::KVCache<float> cache(m, 3);
  (void)m.step(x, cache);
  const std::string path = temp_path();
  sdpa::save_kv_cache(cache, path);
  sdpa::KVCache<float> parked(m, 1);  // another batch: the file's wins
  sdpa::load_kv_cache(parked, path);
  EXPECT_EQ(parked.batch(), 3);
  EXPECT_EQ(parked.size(), 9);
  EXPECT_EQ(parked.position(), 9);
  const auto a = m.step(next, cache), b = m.step(next, parked);
  for (Eigen::Index i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]) << i;
  const SafetensorsFile file = sdpa::read_safetensors(path);
  EXPECT_EQ(file.metadata.at("sdpa.kv_cache.position"), "9");
  EXPECT_EQ(file.metadata.at("sdpa.kv_heads"), "2");  // the heads the cache holds
  ASSERT_NE(file.find("kv_cache.keys"), nullptr);
  EXPECT_EQ(file.find("kv_cache.keys")->shape, (std::vector<Eigen::Index>{3, 9, 8}));
  EXPECT_EQ(file.find("kv_cache.values")->shape, (std::vector<Eigen::Index>{3, 9, 12}));
  std::filesystem::remove(path);

  // A cache of another shape (h 4, d_k 2: the same h * d_k) refuses the file and stays as it was.
  ScaledDotProductAttention<float> other(16, 2, 3, 4);
  sdpa::KVCache<float> wrong(other, 2);
  (void)other.step(x.slice(Eigen::array<Eigen::Index, 3>{0, 0, 0}, Eigen::array<Eigen::Index, 3>{2, 4, 16}).eval(), wrong);
  const auto bytes = sdpa::save_kv_cache_to_memory(cache);
  try {
    sdpa::load_kv_cache_from_memory(wrong, bytes.data(), bytes.size(), "parked");
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("saved for a module with d_k = 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(wrong.size(), 4);
  EXPECT_EQ(wrong.batch(), 2);
  // A module's weight file is not a cache.
  const auto weights = sdpa::save_safetensors_to_memory(m);
  EXPECT_THROW(sdpa::load_kv_cache_from_memory(parked, weights.data(), weights.size(), "weights"), SafetensorsError);
}

// Grouped-query heads: a module's file records kv_heads; a cache holds and saves kv_heads heads, and a cache
// of another kv_heads refuses it.
TEST(SafetensorsKVCache, GroupedQueryHeads) {
  ScaledDotProductAttention<float> m(16, 4, 6, 4, 0.0f, /*kv_heads=*/2);
  m.eval();
  const auto weights = sdpa::save_safetensors_to_memory(m, "l.");
  const SafetensorsFile wf = sdpa::parse_safetensors(weights.data(), weights.size(), "weights");
  EXPECT_EQ(wf.metadata.at("l.sdpa.kv_heads"), "2");
  EXPECT_EQ(wf.find("l.fc_k.weight")->shape, (std::vector<Eigen::Index>{8, 16}));
  ScaledDotProductAttention<float> copy(16, 4, 6, 4, 0.0f, 2);
  EXPECT_NO_THROW(sdpa::load_safetensors(copy, wf, "l."));
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 5, 16);
  x.setRandom();
  sdpa::KVCache<float> cache(m, 1);
  (void)m.step(x, cache);
  const auto bytes = sdpa::save_kv_cache_to_memory(cache);
  const SafetensorsFile cf = sdpa::parse_safetensors(bytes.data(), bytes.size(), "cache");
  EXPECT_EQ(cf.metadata.at("sdpa.kv_heads"), "2");
  EXPECT_EQ(cf.find("kv_cache.keys")->shape, (std::vector<Eigen::Index>{1, 5, 8}));
  sdpa::KVCache<float> resumed(m, 1);
  sdpa::load_kv_cache_from_memory(resumed, bytes.data(), bytes.size(), "cache");
  EXPECT_EQ(resumed.size(), 5);
  ScaledDotProductAttention<float> mha(16, 2, 6, 4);  // kv_heads 4 of d_k 2: the same key width, 8
  sdpa::KVCache<float> wrong(mha, 1);
  try {
    sdpa::load_kv_cache_from_memory(wrong, bytes.data(), bytes.size(), "cache");
    ADD_FAILURE() << "not refused";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("d_k = 4"), std::string::npos) << e.what();
  }
}
}  // namespace safetensors_test

// ---- Narrow storage (sdpa/storage.hpp): caches in their own dtype, bfloat16 / float16 weights ----
namespace safetensors_storage_test {

using Index = Eigen::Index;
using sdpa::LoadOptions;
using sdpa::SafetensorsError;
using sdpa::SafetensorsFile;
using sdpa::Storage;
using sdpa_test::narrow::make_module;
using sdpa_test::narrow::max_abs_diff;
using sdpa_test::narrow::random3;
using sdpa_test::narrow::rounded;
using Tensor3 = sdpa_test::narrow::Tensor3;
using Module = sdpa::ScaledDotProductAttention<float>;
using Cache = sdpa::KVCache<float>;

class NarrowFiles : public ::testing::TestWithParam<Storage> {};

// A narrow cache saves in its own dtype (int8 with its F32 scales) and loads back exactly, into a cache of
// the same storage (nothing rounded again), of float (widened) or, from a float file, of its storage
// (rounded).
TEST_P(NarrowFiles, CachesKeepTheirDtype) {
  const Storage s = GetParam();
  sdpa_test::Rng rng(21);
  const Module m = make_module(rng, 32, 8, 4, 2);
  Cache f(m, 3), n(m, 3, 0, s);
  const Tensor3 prompt = random3(rng, 3, 40, 32);
  (void)m.step(prompt, f);
  (void)m.step(prompt, n);
  const std::vector<std::uint8_t> file = sdpa::save_kv_cache_to_memory(n);
  const SafetensorsFile parsed = sdpa::parse_safetensors(file.data(), file.size(), "cache");
  EXPECT_EQ(parsed.find("kv_cache.keys")->dtype, s == Storage::kBFloat16 ? "BF16" : s == Storage::kFloat16 ? "F16" : "I8");
  EXPECT_EQ(parsed.find("kv_cache.key_scales") != nullptr, s == Storage::kInt8);
  EXPECT_LT(file.size(), sdpa::save_kv_cache_to_memory(f).size());
  Cache back(m, 1, 0, s);
  sdpa::load_kv_cache_from_memory(back, file.data(), file.size());
  EXPECT_EQ(back.batch(), 3);
  EXPECT_EQ(back.position(), n.position());
  const Tensor3 saved_keys = n.keys();
  EXPECT_EQ(max_abs_diff(back.keys(), saved_keys), 0.0);
  EXPECT_EQ(max_abs_diff(back.values(), n.values()), 0.0);
  const Tensor3 x = random3(rng, 3, 1, 32);
  EXPECT_EQ(max_abs_diff(m.step(x, back), m.step(x, n)), 0.0);
  Cache as_float(m, 1);
  sdpa::load_kv_cache_from_memory(as_float, file.data(), file.size());
  EXPECT_EQ(as_float.storage(), Storage::kFloat32);
  EXPECT_EQ(max_abs_diff(as_float.keys(), saved_keys), 0.0);
  const std::vector<std::uint8_t> float_file = sdpa::save_kv_cache_to_memory(f);
  Cache narrowed(m, 1, 0, s);
  sdpa::load_kv_cache_from_memory(narrowed, float_file.data(), float_file.size());
  EXPECT_EQ(max_abs_diff(narrowed.keys(), rounded(f.keys(), s, 8)), 0.0);
  EXPECT_EQ(max_abs_diff(narrowed.values(), rounded(f.values(), s, 8)), 0.0);
}

// Weights are saved as stored (BF16 / F16, biases F32); keep_dtype keeps them narrow on load, otherwise a
// module takes them in its own storage; a refused file leaves a narrow module as it was.
class NarrowWeightFiles : public ::testing::TestWithParam<Storage> {};

TEST_P(NarrowWeightFiles, KeepTheirDtypeWhenAsked) {
  const Storage s = GetParam();
  Module a(32, 8, 8, 4, 0.0f);
  a.manual_seed(3);
  a.init_weights();
  a.set_weight_storage(s);
  const auto wa = a.fc_v().weight_values();
  const std::vector<std::uint8_t> file = sdpa::save_safetensors_to_memory(a);
  const SafetensorsFile parsed = sdpa::parse_safetensors(file.data(), file.size(), "w");
  EXPECT_EQ(parsed.find("fc_o.weight")->dtype, s == Storage::kBFloat16 ? "BF16" : "F16");
  EXPECT_EQ(parsed.find("fc_o.bias")->dtype, "F32");
  Module kept(32, 8, 8, 4, 0.0f), widened(32, 8, 8, 4, 0.0f);
  LoadOptions keep;
  keep.keep_dtype = true;
  sdpa::load_safetensors_from_memory(kept, file.data(), file.size(), "w", "", keep);
  sdpa::load_safetensors_from_memory(widened, file.data(), file.size(), "w");
  EXPECT_EQ(kept.weight_storage(), s);
  EXPECT_EQ(widened.weight_storage(), Storage::kFloat32);
  const auto wk = kept.fc_v().weight_values();
  for (Index i = 0; i < wa.size(); ++i) {
    ASSERT_EQ(wk.data()[i], wa.data()[i]);
    ASSERT_EQ(widened.fc_v().weight().data()[i], wa.data()[i]);
  }
  Module f(32, 8, 8, 4, 0.0f);
  f.manual_seed(4);
  f.init_weights();
  const std::vector<std::uint8_t> float_file = sdpa::save_safetensors_to_memory(f);
  sdpa::load_safetensors_from_memory(kept, float_file.data(), float_file.size(), "f");
  EXPECT_EQ(kept.weight_storage(), s);
  const auto wr = kept.fc_q().weight_values();
  for (Index i = 0; i < wr.size(); ++i) {
    const float w = f.fc_q().weight().data()[i];
    ASSERT_EQ(wr.data()[i], s == Storage::kBFloat16 ? sdpa::to_float(sdpa::to_bfloat16(w)) : sdpa::to_float(sdpa::to_float16(w)));
  }
  Module other(32, 8, 8, 2, 0.0f);  // h 2, where the module has 4
  const std::vector<std::uint8_t> wrong = sdpa::save_safetensors_to_memory(other);
  EXPECT_THROW(sdpa::load_safetensors_from_memory(kept, wrong.data(), wrong.size(), "wrong"), SafetensorsError);
  EXPECT_EQ(kept.weight_storage(), s);
  const auto after = kept.fc_q().weight_values();
  for (Index i = 0; i < wr.size(); ++i) ASSERT_EQ(after.data()[i], wr.data()[i]);
}

INSTANTIATE_TEST_SUITE_P(Storages, NarrowFiles, ::testing::Values(Storage::kBFloat16, Storage::kFloat16, Storage::kInt8),
                         [](const ::testing::TestParamInfo<Storage>& i) { return std::string(sdpa::storage_name(i.param)).substr(1); });
INSTANTIATE_TEST_SUITE_P(Storages, NarrowWeightFiles, ::testing::Values(Storage::kBFloat16, Storage::kFloat16),
                         [](const ::testing::TestParamInfo<Storage>& i) { return std::string(sdpa::storage_name(i.param)).substr(1); });

TEST(NarrowFilesRefused, Int8CacheWithoutItsScales) {
  sdpa_test::Rng rng(22);
  const Module m = make_module(rng, 32, 8, 4, 2);
  Cache n(m, 1, 0, Storage::kInt8);
  (void)m.step(random3(rng, 1, 5, 32), n);
  const std::vector<std::uint8_t> file = sdpa::save_kv_cache_to_memory(n);
  SafetensorsFile parsed = sdpa::parse_safetensors(file.data(), file.size(), "cache.safetensors");
  std::vector<sdpa::SafetensorsTensor> kept;
  for (const auto& t : parsed.tensors)
    if (t.name != "kv_cache.key_scales") kept.push_back(t);
  parsed.tensors = kept;
  try {
    sdpa::load_kv_cache(n, parsed);
    ADD_FAILURE() << "no exception";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("kv_cache.key_scales"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cache.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_EQ(n.size(), 5);
}

}  // namespace safetensors_storage_test
