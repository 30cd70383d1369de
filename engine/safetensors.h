// Writing safetensors files (the format timm and PyTorch load): an 8-byte little-endian header
// length, a JSON header of name -> {dtype, shape, data_offsets}, then the raw tensor bytes.
#pragma once
#include <cstdint>
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
