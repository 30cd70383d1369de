// Safetensors files (the format timm and PyTorch load and save): an 8-byte little-endian header
// length, a JSON header of name -> {dtype, shape, data_offsets} (and an optional
// "__metadata__"), then the raw tensor bytes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

struct StTensor {
  std::string name;
  std::string dtype;  // "F32", "I64", ...
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

// Atomic: written to PATH.tmp, flushed to disk, then renamed over PATH. Throws RuntimeError
// naming the path and the cause.
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors);
// Also atomic, for small text files (JSON).
void write_text_file(const std::string& path, const std::string& text);

// A whole file read and checked: the header parses, every tensor's bytes lie inside the file
// and match its dtype and shape. Throws RuntimeError naming the file and what is wrong
// (missing, truncated, corrupted).
class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    size_t offset, bytes;  // into data()
  };
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const Entry* find(const std::string& name) const;
  const uint8_t* data(const Entry& e) const { return bytes_.data() + data_start_ + e.offset; }
  // The tensor as fp32 (F32, BF16 and F16 accepted), checked against the expected shape.
  std::vector<float> as_f32(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
  size_t data_start_ = 0;
  std::map<std::string, Entry> tensors_;
};
