// Safetensors files (the format timm and PyTorch load and save): an 8-byte little-endian header
// length, a JSON header of name -> {dtype, shape, data_offsets} (and an optional
// "__metadata__"), then the raw tensor bytes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/regular_file.h"

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

// A safetensors file mapped (never read whole) and checked: the header is at most 100 MB and
// parses, every tensor's dtype is known, its bytes match its shape and lie inside the file, and
// the tensors tile the data exactly (no overlap, no hole, nothing after the last), as the format
// requires. Throws RuntimeError naming the file and what is wrong (missing, not a regular file,
// truncated, corrupted).
class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    size_t offset, bytes;  // into the data section
  };
  static constexpr size_t kMaxHeaderBytes = 100'000'000;

  explicit SafetensorsFile(const std::string& path);
  // The same checks over bytes held by the caller (they must outlive this object); name stands
  // for the path in messages.
  SafetensorsFile(const std::string& name, const uint8_t* bytes, size_t size);

  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const Entry* find(const std::string& name) const;
  const uint8_t* data(const Entry& e) const { return bytes_ + data_start_ + e.offset; }
  // The tensor as fp32 (F32, BF16 and F16 accepted), checked against the expected shape.
  std::vector<float> as_f32(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::string& path() const { return path_; }

 private:
  void parse();
  std::string path_;
  MappedFile file_;
  const uint8_t* bytes_ = nullptr;
  size_t size_ = 0, data_start_ = 0;
  std::map<std::string, Entry> tensors_;
};
