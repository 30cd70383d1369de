#include "engine/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kernels/check.h"

namespace {
[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw RuntimeError("cannot " + what + " " + path + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail("write", path);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Write, fsync, rename: either the old file or the complete new one exists, never half of one.
void write_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) io_fail("create", tmp);
  try {
    for (const auto& [data, bytes] : pieces) write_all(fd, data, bytes, tmp);
    if (::fsync(fd) != 0) io_fail("flush", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) { ::unlink(tmp.c_str()); io_fail("close", tmp); }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) { ::unlink(tmp.c_str()); io_fail("rename into", path); }
}
}  // namespace

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors) {
  std::string header = "{";
  size_t offset = 0;
  for (const StTensor& t : tensors) {
    if (header.size() > 1) header += ",";
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.bytes) + "]}";
    offset += t.bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  std::vector<std::pair<const void*, size_t>> pieces = {{len, 8}, {header.data(), header.size()}};
  for (const StTensor& t : tensors) pieces.emplace_back(t.data, t.bytes);
  write_atomically(path, pieces);
}

void write_text_file(const std::string& path, const std::string& text) {
  write_atomically(path, {{text.data(), text.size()}});
}

namespace {
// The JSON a safetensors header holds: objects, arrays, strings, integers (and true, false,
// null, which it never needs but a writer may add to the metadata).
struct JsonValue {
  enum Kind { Object, Array, String, Number, Other } kind = Other;
  std::vector<std::pair<std::string, JsonValue>> members;
  std::vector<JsonValue> items;
  std::string text;
  int64_t number = 0;
};

class JsonParser {
 public:
  JsonParser(const std::string& s, const std::string& path) : s_(s), path_(path) {}
  JsonValue parse() {
    JsonValue v = value();
    space();
    if (i_ != s_.size()) fail("text after the header's end");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw RuntimeError(path_ + " is not a valid safetensors file: header " + what + " at byte " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    space();
    if (i_ >= s_.size()) fail("ends early");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expects '") + c + "'");
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\') {
        if (++i_ >= s_.size()) fail("ends in an escape");
        const char e = s_[i_];
        if (e == 'u') {  // kept as is: names here are ASCII
          if (i_ + 4 >= s_.size()) fail("ends in an escape");
          out += s_.substr(i_ - 1, 6);
          i_ += 4;
        } else {
          out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        }
        ++i_;
        continue;
      }
      out += s_[i_++];
    }
    if (i_ >= s_.size()) fail("has an unterminated string");
    ++i_;
    return out;
  }
  JsonValue value() {
    if (++depth_ > 32) fail("nests too deep");  // a header is two levels deep; never a stack overflow
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    JsonValue v;
    const char c = peek();
    if (c == '{') {
      v.kind = JsonValue::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      for (;;) {
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value());
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = JsonValue::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      for (;;) {
        v.items.push_back(value());
        if (peek() == ',') { ++i_; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = JsonValue::String;
      v.text = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Number;
      const size_t start = i_;
      if (s_[i_] == '-') ++i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E')) fail("has a non-integer number");
      try {
        v.number = std::stoll(s_.substr(start, i_ - start));
      } catch (const std::exception&) {
        fail("has a number out of range");
      }
      return v;
    }
    for (const char* word : {"true", "false", "null"})
      if (s_.compare(i_, std::strlen(word), word) == 0) {
        i_ += std::strlen(word);
        return v;
      }
    fail("has an unexpected character");
  }
  const std::string& s_;
  const std::string& path_;
  size_t i_ = 0;
  int depth_ = 0;
};

size_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}
}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw RuntimeError("cannot open " + path + ": " + std::strerror(errno));
  std::error_code ec;  // (a directory opens, and its "size" is no size)
  if (!std::filesystem::is_regular_file(path, ec)) throw RuntimeError("cannot read " + path + ": not a regular file");
  const std::streamoff size = in.tellg();
  in.seekg(0);
  bytes_.resize(static_cast<size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes_.data()), size))
    throw RuntimeError("cannot read " + path + ": " + std::strerror(errno));
  if (bytes_.size() < 8) throw RuntimeError(path + " is not a safetensors file: shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes_[i]) << (8 * i);
  if (n < 2 || n > bytes_.size() - 8)
    throw RuntimeError(path + " is not a safetensors file or is truncated: its header claims " + std::to_string(n) +
                       " bytes, the file has " + std::to_string(bytes_.size()));
  const std::string header(reinterpret_cast<const char*>(bytes_.data()) + 8, n);
  data_start_ = 8 + n;
  const size_t data_bytes = bytes_.size() - data_start_;
  const JsonValue root = JsonParser(header, path).parse();
  if (root.kind != JsonValue::Object) throw RuntimeError(path + ": the safetensors header is not a JSON object");
  for (const auto& [name, v] : root.members) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& what) { return RuntimeError(path + ": tensor " + name + ": " + what); };
    if (v.kind != JsonValue::Object) throw bad("its entry is not an object");
    Entry e;
    const JsonValue *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
    for (const auto& [k, m] : v.members) {
      if (k == "dtype") dtype = &m;
      else if (k == "shape") shape = &m;
      else if (k == "data_offsets") offsets = &m;
    }
    if (!dtype || dtype->kind != JsonValue::String || !dtype_size(dtype->text)) throw bad("missing or unknown dtype");
    if (!shape || shape->kind != JsonValue::Array) throw bad("missing shape");
    if (!offsets || offsets->kind != JsonValue::Array || offsets->items.size() != 2) throw bad("missing data_offsets");
    e.dtype = dtype->text;
    size_t count = 1;
    for (const JsonValue& d : shape->items) {
      if (d.kind != JsonValue::Number || d.number < 0) throw bad("a bad dimension");
      e.shape.push_back(d.number);
      if (d.number > 0 && count > (size_t(1) << 50) / static_cast<size_t>(d.number)) throw bad("a shape too large");
      count *= static_cast<size_t>(d.number);
    }
    if (offsets->items[0].kind != JsonValue::Number || offsets->items[1].kind != JsonValue::Number)
      throw bad("data_offsets that are not numbers");
    if (tensors_.count(name)) throw bad("it appears twice");
    const int64_t begin = offsets->items[0].number, end = offsets->items[1].number;
    if (begin < 0 || end < begin || static_cast<uint64_t>(end) > data_bytes)
      throw bad("its bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ") lie outside the file's " +
                std::to_string(data_bytes) + " data bytes (truncated?)");
    e.offset = static_cast<size_t>(begin);
    e.bytes = static_cast<size_t>(end - begin);
    if (e.bytes != count * dtype_size(e.dtype))
      throw bad(std::to_string(e.bytes) + " bytes do not hold a " + e.dtype + " tensor of shape " + shape_text(e.shape));
    tensors_[name] = e;
  }
}

const SafetensorsFile::Entry* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<float> SafetensorsFile::as_f32(const std::string& name, const std::vector<int64_t>& shape) const {
  const Entry* e = find(name);
  if (!e) throw RuntimeError(path_ + " has no tensor " + name);
  if (e->shape != shape)
    throw RuntimeError(path_ + ": tensor " + name + " has shape " + shape_text(e->shape) + ", the model needs " +
                       shape_text(shape));
  const size_t n = e->bytes / dtype_size(e->dtype);
  std::vector<float> out(n);
  const uint8_t* p = data(*e);
  if (e->dtype == "F32") {
    std::memcpy(out.data(), p, e->bytes);
  } else if (e->dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      const uint32_t w = static_cast<uint32_t>(b) << 16;
      std::memcpy(&out[i], &w, 4);
    }
  } else if (e->dtype == "F16") {
    for (size_t i = 0; i < n; ++i) {
      __half_raw h;
      std::memcpy(&h.x, p + 2 * i, 2);
      out[i] = __half2float(__half(h));
    }
  } else {
    throw RuntimeError(path_ + ": tensor " + name + " is " + e->dtype + "; weights must be F32, BF16 or F16");
  }
  return out;
}
