#include "engine/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

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
// The header's JSON, parsed straight into the tensor table: nothing is kept but the entries
// (metadata and unknown keys are checked and skipped), so the memory the parse takes stays a
// small multiple of the header's size. Every number is bounded before it is used.
class HeaderParser {
 public:
  HeaderParser(const char* text, size_t size, const std::string& path) : s_(text), n_(size), path_(path) {}

  // name -> entry, in header order (offsets not yet checked against the file).
  std::vector<std::pair<std::string, SafetensorsFile::Entry>> parse() {
    std::vector<std::pair<std::string, SafetensorsFile::Entry>> out;
    expect('{');
    if (peek() == '}') {
      ++i_;
    } else {
      for (;;) {
        const size_t at = i_;
        std::string key = string();
        expect(':');
        if (key == "__metadata__") {
          if (seen_metadata_) fail_at(at, "has __metadata__ twice");
          seen_metadata_ = true;
          skip_value(1);
        } else {
          out.emplace_back(std::move(key), entry());
        }
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        break;
      }
    }
    space();
    if (i_ != n_) fail("has text after its end");
    return out;
  }

 private:
  static constexpr int kMaxDepth = 32;  // a header is two levels deep; metadata may nest a little
  static constexpr size_t kMaxRank = 32;
  static constexpr int64_t kMaxNumber = int64_t(1) << 62;

  [[noreturn]] void fail_at(size_t at, const std::string& what) {
    throw RuntimeError(path_ + " is not a valid safetensors file: header " + what + " at byte " + std::to_string(at));
  }
  [[noreturn]] void fail(const std::string& what) { fail_at(i_, what); }
  void space() {
    while (i_ < n_ && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    space();
    if (i_ >= n_) fail("ends early");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expects '") + c + "'");
    ++i_;
  }
  int hex4() {
    if (n_ - i_ < 4) fail("ends in an escape");
    int v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) fail("has a bad \\u escape");
      v = v * 16 + d;
    }
    return v;
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }
  // A JSON string, its escapes decoded (\uXXXX to UTF-8); with keep false, checked and dropped.
  std::string string(bool keep = true) {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= n_) fail("has an unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("has a control character in a string");
      if (c != '\\') {
        if (keep) out += c;
        continue;
      }
      if (i_ >= n_) fail("ends in an escape");
      const char e = s_[i_++];
      uint32_t cp;
      switch (e) {
        case '"': case '\\': case '/': cp = static_cast<unsigned char>(e); break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u': {
          cp = static_cast<uint32_t>(hex4());
          if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair
            if (n_ - i_ < 2 || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("has a lone surrogate");
            i_ += 2;
            const uint32_t low = static_cast<uint32_t>(hex4());
            if (low < 0xDC00 || low >= 0xE000) fail("has a lone surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("has a lone surrogate");
          }
          break;
        }
        default: fail("has an unknown escape");
      }
      if (keep) append_utf8(out, cp);
    }
  }
  // A non-negative integer no larger than kMaxNumber.
  int64_t count() {
    if (peek() < '0' || peek() > '9') fail("expects a non-negative integer");
    int64_t v = 0;
    while (i_ < n_ && s_[i_] >= '0' && s_[i_] <= '9') {
      const int digit = s_[i_++] - '0';
      if (v > (kMaxNumber - digit) / 10) fail("has a number out of range");
      v = v * 10 + digit;
    }
    if (i_ < n_ && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E')) fail("has a non-integer number");
    return v;
  }
  std::vector<int64_t> counts(size_t max_items) {
    std::vector<int64_t> v;
    expect('[');
    if (peek() == ']') { ++i_; return v; }
    for (;;) {
      if (v.size() == max_items) fail("has an array too long");
      v.push_back(count());
      if (peek() == ',') { ++i_; continue; }
      expect(']');
      return v;
    }
  }
  SafetensorsFile::Entry entry() {
    SafetensorsFile::Entry e{};
    bool dtype = false, shape = false, offsets = false;
    std::vector<int64_t> range;
    expect('{');
    if (peek() != '}') {
      for (;;) {
        const size_t at = i_;
        const std::string key = string();
        expect(':');
        bool* seen = key == "dtype" ? &dtype : key == "shape" ? &shape : key == "data_offsets" ? &offsets : nullptr;
        if (seen && *seen) fail_at(at, "has " + key + " twice in one entry");
        if (seen) *seen = true;
        if (key == "dtype") e.dtype = string();
        else if (key == "shape") e.shape = counts(kMaxRank);
        else if (key == "data_offsets") range = counts(2);
        else skip_value(2);
        if (peek() == ',') { ++i_; continue; }
        break;
      }
    }
    expect('}');
    if (!dtype || !shape || !offsets || range.size() != 2) fail("has an entry without dtype, shape and two data_offsets");
    e.offset = static_cast<size_t>(range[0]);
    e.bytes = range[1] >= range[0] ? static_cast<size_t>(range[1] - range[0]) : ~size_t(0);
    return e;
  }
  // Any JSON value, checked and dropped.
  void skip_value(int depth) {
    if (depth > kMaxDepth) fail("nests too deep");
    const char c = peek();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++i_;
      if (peek() == close) { ++i_; return; }
      for (;;) {
        if (c == '{') {
          string(false);
          expect(':');
        }
        skip_value(depth + 1);
        if (peek() == ',') { ++i_; continue; }
        expect(close);
        return;
      }
    }
    if (c == '"') {
      string(false);
      return;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {  // a number's characters; its value is not needed
      ++i_;
      while (i_ < n_ && std::strchr("0123456789.eE+-", s_[i_]) && s_[i_] != '\0') ++i_;
      return;
    }
    for (const char* word : {"true", "false", "null"}) {
      const size_t len = std::strlen(word);
      if (n_ - i_ >= len && std::memcmp(s_ + i_, word, len) == 0) {
        i_ += len;
        return;
      }
    }
    fail("has an unexpected character");
  }

  const char* s_;
  size_t n_;
  const std::string& path_;
  size_t i_ = 0;
  bool seen_metadata_ = false;
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

std::string range_text(size_t begin, size_t bytes) {
  return "[" + std::to_string(begin) + ", " + std::to_string(begin + bytes) + ")";
}

// A mapping's limit: the file is mapped, not read, so only the address space bounds it.
constexpr size_t kMaxFileBytes = size_t(1) << 42;
}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(path, kMaxFileBytes) {
  bytes_ = file_.data();
  size_ = file_.size();
  parse();
}

SafetensorsFile::SafetensorsFile(const std::string& name, const uint8_t* bytes, size_t size)
    : path_(name), bytes_(bytes), size_(size) {
  parse();
}

void SafetensorsFile::parse() {
  if (size_ < 8) throw RuntimeError(path_ + " is not a safetensors file: shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes_[i]) << (8 * i);
  if (n < 2 || n > size_ - 8 || n > kMaxHeaderBytes)
    throw RuntimeError(path_ + " is not a safetensors file or is truncated: its header claims " + std::to_string(n) +
                       " bytes, the file has " + std::to_string(size_) + " (and a header may hold at most " +
                       std::to_string(kMaxHeaderBytes) + ")");
  data_start_ = 8 + n;
  const size_t data_bytes = size_ - data_start_;
  auto entries = HeaderParser(reinterpret_cast<const char*>(bytes_) + 8, n, path_).parse();
  std::vector<const std::pair<const std::string, Entry>*> by_offset;
  for (auto& entry : entries) {
    std::string& name = entry.first;
    Entry& e = entry.second;
    auto bad = [&](const std::string& what) { return RuntimeError(path_ + ": tensor " + name + ": " + what); };
    if (!dtype_size(e.dtype)) throw bad("unknown dtype " + e.dtype.substr(0, 16));
    size_t count = 1;
    for (const int64_t d : e.shape) {
      if (d > 0 && count > (size_t(1) << 50) / static_cast<size_t>(d)) throw bad("a shape too large");
      count *= static_cast<size_t>(d);
    }
    if (e.bytes == ~size_t(0) || e.offset > data_bytes || e.bytes > data_bytes - e.offset)
      throw bad("its bytes lie outside the file's " + std::to_string(data_bytes) + " data bytes (truncated?)");
    if (e.bytes != count * dtype_size(e.dtype))
      throw bad(std::to_string(e.bytes) + " bytes do not hold a " + e.dtype + " tensor of shape " + shape_text(e.shape));
    if (tensors_.count(name)) throw bad("it appears twice");
    by_offset.push_back(&*tensors_.emplace(std::move(name), std::move(e)).first);
  }
  // The tensors tile the data section: each begins where the one before it ends.
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->second.offset != b->second.offset ? a->second.offset < b->second.offset
                                                : a->second.bytes < b->second.bytes;
  });
  size_t end = 0;
  const std::pair<const std::string, Entry>* previous = nullptr;
  for (const auto* t : by_offset) {
    const Entry& e = t->second;
    if (e.offset < end)
      throw RuntimeError(path_ + ": tensor " + t->first + "'s bytes " + range_text(e.offset, e.bytes) +
                         " overlap tensor " + previous->first + "'s " +
                         range_text(previous->second.offset, previous->second.bytes));
    if (e.offset > end)
      throw RuntimeError(path_ + ": data bytes " + range_text(end, e.offset - end) + " belong to no tensor (corrupted?)");
    end = e.offset + e.bytes;
    previous = t;
  }
  if (end != data_bytes)
    throw RuntimeError(path_ + ": " + std::to_string(data_bytes - end) + " bytes after the last tensor's end (corrupted?)");
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
    if (n > 0) std::memcpy(out.data(), p, e->bytes);
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
