// A dependency-free PNG writer for the examples' pictures (8-bit RGB, zlib "stored" blocks, so no
// compressor is needed), and a reader-side check that a written file is a well-formed PNG of the expected
// size (signature, chunk CRCs, the zlib stream's Adler-32). Not part of the library.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace sdpa_examples {

struct Rgb {
  std::uint8_t r, g, b;
};

namespace png_detail {

inline std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc = 0) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

inline std::uint32_t adler32(const std::vector<std::uint8_t>& data) {
  std::uint32_t a = 1, b = 0;
  for (std::uint8_t x : data) {
    a = (a + x) % 65521u;
    b = (b + a) % 65521u;
  }
  return (b << 16) | a;
}

inline void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

inline void chunk(std::vector<std::uint8_t>& out, const char* type, const std::vector<std::uint8_t>& data) {
  put32(out, static_cast<std::uint32_t>(data.size()));
  const std::size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  put32(out, crc32(out.data() + start, out.size() - start));
}

inline std::uint32_t get32(const std::vector<std::uint8_t>& in, std::size_t at) {
  return std::uint32_t(in[at]) << 24 | std::uint32_t(in[at + 1]) << 16 | std::uint32_t(in[at + 2]) << 8 | in[at + 3];
}

const std::uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};

}  // namespace png_detail

// Writes pixels (row-major, width * height) to path; throws std::runtime_error when the file cannot be written.
inline void write_png(const std::string& path, int width, int height, const std::vector<Rgb>& pixels) {
  using namespace png_detail;
  if (width <= 0 || height <= 0 || pixels.size() != static_cast<std::size_t>(width) * static_cast<std::size_t>(height))
    throw std::runtime_error("write_png: " + std::to_string(pixels.size()) + " pixels for " + std::to_string(width) +
                             " x " + std::to_string(height));
  std::vector<std::uint8_t> raw;  // each row: filter byte 0, then RGB
  raw.reserve(static_cast<std::size_t>(height) * (1 + 3 * static_cast<std::size_t>(width)));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    for (int x = 0; x < width; ++x) {
      const Rgb& p = pixels[static_cast<std::size_t>(y) * static_cast<std::size_t>(width) + static_cast<std::size_t>(x)];
      raw.insert(raw.end(), {p.r, p.g, p.b});
    }
  }
  std::vector<std::uint8_t> z = {0x78, 0x01};  // zlib header: deflate, 32K window, no preset dictionary
  for (std::size_t at = 0; at < raw.size();) {
    const std::size_t n = std::min<std::size_t>(65535, raw.size() - at);
    z.push_back(at + n == raw.size() ? 1 : 0);  // BFINAL on the last block; BTYPE 00 (stored)
    z.push_back(static_cast<std::uint8_t>(n));
    z.push_back(static_cast<std::uint8_t>(n >> 8));
    z.push_back(static_cast<std::uint8_t>(~n));
    z.push_back(static_cast<std::uint8_t>(~n >> 8));
    z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(at), raw.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  put32(z, adler32(raw));
  std::vector<std::uint8_t> ihdr;
  put32(ihdr, static_cast<std::uint32_t>(width));
  put32(ihdr, static_cast<std::uint32_t>(height));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, no filter method, no interlace
  std::vector<std::uint8_t> out(kSignature, kSignature + 8);
  chunk(out, "IHDR", ihdr);
  chunk(out, "IDAT", z);
  chunk(out, "IEND", {});
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
  f.close();
  if (!f) throw std::runtime_error("write_png: cannot write " + path);
}

// Whether path holds a PNG of width x height whose chunks' CRCs are right; the examples check what they
// wrote.
inline bool check_png(const std::string& path, int width, int height) {
  using namespace png_detail;
  std::ifstream f(path, std::ios::binary);
  const std::vector<std::uint8_t> in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (in.size() < 8 + 25 + 12 || !std::equal(kSignature, kSignature + 8, in.begin())) return false;
  std::size_t at = 8;
  bool header = false, end = false;
  while (at + 12 <= in.size() && !end) {
    const std::uint32_t n = get32(in, at);
    if (at + 12 + n > in.size()) return false;
    if (crc32(in.data() + at + 4, 4 + n) != get32(in, at + 8 + n)) return false;
    const std::string type(in.begin() + static_cast<std::ptrdiff_t>(at + 4), in.begin() + static_cast<std::ptrdiff_t>(at + 8));
    if (type == "IHDR")
      header = get32(in, at + 8) == static_cast<std::uint32_t>(width) && get32(in, at + 12) == static_cast<std::uint32_t>(height);
    end = type == "IEND";
    at += 12 + n;
  }
  return header && end && at == in.size();
}

// A perceptually even colour for t in [0, 1] (viridis, by its end and mid points).
inline Rgb viridis(double t) {
  static const double stops[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::min(1.0, std::max(0.0, t)) * 4.0;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  auto mix = [&](int c) { return static_cast<std::uint8_t>(stops[i][c] + f * (stops[i + 1][c] - stops[i][c]) + 0.5); };
  return {mix(0), mix(1), mix(2)};
}

}  // namespace sdpa_examples
