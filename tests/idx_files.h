// IDX files (the MNIST format) written by tests: datasets of known contents, plain or gzip.
#pragma once
#include <doctest/doctest.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

inline void put_be32(std::vector<uint8_t>& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& b, bool gz) {
  if (gz) {
    gzFile f = gzopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(gzwrite(f, b.data(), static_cast<unsigned>(b.size())) == static_cast<int>(b.size()));
    gzclose(f);
  } else {
    FILE* f = std::fopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fwrite(b.data(), 1, b.size(), f);
    std::fclose(f);
  }
}

// An IDX pair of n images of r x c pixels with the given labels; pixel(i) gives the i-th byte of
// the images in order (by default i * 7).
inline void write_idx(const std::string& images, const std::string& labels, int n, int r, int c,
                      const std::vector<uint8_t>& label_values, bool gz,
                      const std::function<uint8_t(int)>& pixel = [](int i) { return static_cast<uint8_t>(i * 7); }) {
  std::vector<uint8_t> img, lab;
  put_be32(img, 0x803);
  put_be32(img, n);
  put_be32(img, r);
  put_be32(img, c);
  for (int i = 0; i < n * r * c; ++i) img.push_back(pixel(i));
  put_be32(lab, 0x801);
  put_be32(lab, static_cast<uint32_t>(label_values.size()));
  lab.insert(lab.end(), label_values.begin(), label_values.end());
  write_bytes(images, img, gz);
  write_bytes(labels, lab, gz);
}
