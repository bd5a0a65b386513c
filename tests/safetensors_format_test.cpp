// sdpa/io/safetensors_format.hpp on its own: it must build without Eigen (the fuzz target and tools parse
// files without the module), parse bytes written by hand to the format's specification, refuse a header
// that runs past the file, and read back what write_tensors writes.
#include "sdpa/io/safetensors_format.hpp"

#if defined(EIGEN_CORE_H) || defined(EIGEN_CXX11_TENSOR_MODULE_H)
#error "sdpa/io/safetensors_format.hpp must not include Eigen"
#endif

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// A file as the specification lays it out: little-endian header length, JSON header, data.
std::vector<std::uint8_t> file_of(const std::string& header, const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out(8);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<std::uint8_t> bytes_of(const std::vector<float>& v) {
  std::vector<std::uint8_t> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.data(), out.size());  // this test runs on little-endian hosts only (x86, ARM64)
  return out;
}

TEST(SafetensorsFormat, ParsesAHandWrittenFile) {
  const std::vector<float> a = {1.5f, -2.0f, 0.25f, 8.0f, 3.0f, -0.5f};
  const auto bytes = file_of(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"k":"v"}})", bytes_of(a));
  const sdpa::SafetensorsFile file = sdpa::parse_safetensors(bytes.data(), bytes.size(), "hand");
  ASSERT_EQ(file.tensors.size(), 1u);
  const sdpa::SafetensorsTensor* t = file.find("a");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<std::ptrdiff_t>{2, 3}));
  EXPECT_EQ(t->numel(), 6);
  EXPECT_EQ(sdpa::tensor_values<float>(file, *t), a);
  EXPECT_EQ(file.metadata.at("k"), "v");
}

TEST(SafetensorsFormat, RefusesAHeaderLongerThanTheFile) {
  auto bytes = file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", bytes_of({1.0f}));
  bytes[0] = 0xFF;  // the header length now runs past the end
  EXPECT_THROW(sdpa::parse_safetensors(bytes.data(), bytes.size(), "short"), sdpa::SafetensorsError);
}

TEST(SafetensorsFormat, ReadsBackWhatItWrites) {
  const std::vector<float> a = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<double> b = {-1.0, 0.5};
  std::vector<sdpa::detail::safetensors::RawTensor> tensors(2);
  tensors[0] = {"z", "F32", {2, 2}, a.data(), 4};
  tensors[1] = {"b", "F64", {2}, b.data(), 8};
  const auto bytes = sdpa::detail::safetensors::write_tensors(tensors, {{"m", "1"}}, "written");
  const sdpa::SafetensorsFile file = sdpa::parse_safetensors(bytes.data(), bytes.size(), "written");
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors[0].name, "b");  // sorted by name
  EXPECT_EQ(sdpa::tensor_values<double>(file, *file.find("b")), b);
  EXPECT_EQ(sdpa::tensor_values<float>(file, *file.find("z")), a);
  EXPECT_EQ(file.find("z")->shape, (std::vector<std::ptrdiff_t>{2, 2}));
  EXPECT_EQ(file.metadata.at("m"), "1");
}

}  // namespace
