#include "tools/image_decode.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace {
bool is_jpeg(const uint8_t* b, size_t n) { return n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF; }

struct TjHandle {
  tjhandle h = tjInitDecompress();
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
};

// A simplified-API PNG reader, released however the decode ends.
struct PngReader {
  png_image p;
  PngReader() {
    std::memset(&p, 0, sizeof p);
    p.version = PNG_IMAGE_VERSION;
  }
  ~PngReader() { png_image_free(&p); }
};

void check_limits(int w, int h, const ImageLimits& limits) {
  if (w > limits.max_side || h > limits.max_side || uint64_t(w) * uint64_t(h) > limits.max_pixels)
    throw std::runtime_error(std::to_string(w) + " x " + std::to_string(h) + " pixels, above the limits (a side of " +
                             std::to_string(limits.max_side) + ", " + std::to_string(limits.max_pixels) + " pixels)");
}
}  // namespace

ImageInfo probe_image(const uint8_t* b, size_t n, const ImageLimits& limits) {
  ImageInfo info;
  if (is_jpeg(b, n)) {
    TjHandle tj;
    if (!tj.h) throw std::runtime_error("libturbojpeg cannot start");
    int w = 0, h = 0, sub = 0, cs = 0;  // (a tables-only JPEG sets none of them)
    if (tjDecompressHeader3(tj.h, b, static_cast<unsigned long>(n), &w, &h, &sub, &cs) != 0)
      throw std::runtime_error(std::string("not a readable JPEG (") + tjGetErrorStr2(tj.h) + ")");
    if (w <= 0 || h <= 0) throw std::runtime_error("a JPEG without an image (tables only?)");
    check_limits(w, h, limits);
    info.jpeg = true;
    info.cmyk = cs == TJCS_CMYK || cs == TJCS_YCCK;  // libturbojpeg decodes these to CMYK only
    info.gray = cs == TJCS_GRAY;
    info.w = w;
    info.h = h;
    return info;
  }
  PngReader png;
  if (!png_image_begin_read_from_memory(&png.p, b, n))
    throw std::runtime_error(std::string("neither JPEG nor a readable PNG (") + png.p.message + ")");
  if (png.p.width == 0 || png.p.height == 0 || png.p.width > 0x7fffffffu || png.p.height > 0x7fffffffu)
    throw std::runtime_error("a PNG without an image");
  check_limits(int(png.p.width), int(png.p.height), limits);
  info.w = static_cast<int>(png.p.width);
  info.h = static_cast<int>(png.p.height);
  return info;
}

size_t decode_peak_bytes(const ImageInfo& info, int side) {
  const size_t pixels = size_t(info.w) * info.h;
  // A progressive JPEG keeps every DCT coefficient (2 bytes a component a pixel) until its last scan.
  const size_t components = info.jpeg ? (info.gray ? 1 : info.cmyk ? 4 : 3) : 0;
  return pixels * (info.cmyk ? 7 : 3) + pixels * components * 2 + size_t(info.h) * side * 3 * sizeof(float) +
         size_t(side) * side * 3;
}

Image decode_image(const uint8_t* b, size_t n, const ImageInfo& info) {
  Image img;
  img.w = info.w;
  img.h = info.h;
  img.rgb.resize(size_t(info.w) * info.h * 3);
  if (info.jpeg) {
    TjHandle tj;
    if (!tj.h) throw std::runtime_error("libturbojpeg cannot start");
    std::vector<uint8_t> ink(info.cmyk ? size_t(info.w) * info.h * 4 : 0);
    // LIMITSCANS: a progressive JPEG of thousands of scans is refused, not decoded for minutes.
    const int flags = TJFLAG_ACCURATEDCT | TJFLAG_LIMITSCANS;
    const unsigned long len = static_cast<unsigned long>(n);
    const int r = info.cmyk ? tjDecompress2(tj.h, b, len, ink.data(), info.w, 0, info.h, TJPF_CMYK, flags)
                            : tjDecompress2(tj.h, b, len, img.rgb.data(), info.w, 0, info.h, TJPF_RGB, flags);
    if (r != 0) {
      const std::string e = tjGetErrorStr2(tj.h);
      // A warning leaves a usable image, except at a premature end: the rest would be grey.
      if (tjGetErrorCode(tj.h) == TJERR_FATAL) throw std::runtime_error("corrupted JPEG (" + e + ")");
      if (e.find("Premature end") != std::string::npos) throw std::runtime_error("truncated JPEG (" + e + ")");
    }
    // CMYK JPEGs come from Adobe software, which stores the inks inverted (255: no ink); RGB as
    // PIL converts it: R = 255 - min(255, C + K) with C = 255 - stored c.
    for (size_t i = 0; info.cmyk && i < size_t(info.w) * info.h; ++i) {
      const int k = ink[4 * i + 3];
      for (int c = 0; c < 3; ++c) img.rgb[3 * i + c] = uint8_t(std::max(0, ink[4 * i + c] + k - 255));
    }
    return img;
  }
  PngReader png;
  if (!png_image_begin_read_from_memory(&png.p, b, n))
    throw std::runtime_error(std::string("neither JPEG nor a readable PNG (") + png.p.message + ")");
  if (png.p.width != png_uint_32(info.w) || png.p.height != png_uint_32(info.h))
    throw std::runtime_error("decode_image: the PNG is not the one probed");
  png.p.format = PNG_FORMAT_RGB;
  if (!png_image_finish_read(&png.p, nullptr, img.rgb.data(), 0, nullptr))
    throw std::runtime_error(std::string("corrupted PNG (") + png.p.message + ")");
  return img;
}

namespace {
// Weights of a 1-D resample of n source samples to `out` samples starting at output offset
// `off` of a full resize to `full` samples: a triangle filter as wide as the scale when
// shrinking (antialiasing, like PIL's bilinear), plain linear interpolation when growing.
struct Taps {
  std::vector<int> first;
  std::vector<std::vector<float>> w;
};
Taps taps(int n, int full, int off, int out) {
  Taps t;
  const double scale = double(n) / full, support = std::max(1.0, scale);
  for (int x = 0; x < out; ++x) {
    const double center = (x + off + 0.5) * scale;
    const int lo = std::max(0, int(std::floor(center - support))), hi = std::min(n - 1, int(std::ceil(center + support)));
    std::vector<float> w;
    double sum = 0;
    for (int i = lo; i <= hi; ++i) {
      const double v = std::max(0.0, 1.0 - std::abs((i + 0.5 - center) / support));
      w.push_back(float(v));
      sum += v;
    }
    if (sum <= 0) {  // a tap-less edge: the nearest sample
      w.assign(1, 1.0f);
      t.first.push_back(std::min(n - 1, std::max(0, int(center))));
    } else {
      for (float& v : w) v = float(v / sum);
      t.first.push_back(lo);
    }
    t.w.push_back(std::move(w));
  }
  return t;
}

}  // namespace

std::vector<uint8_t> resize_crop(const Image& img, int size) {
  const bool wide = img.w >= img.h;
  const int full_w = wide ? int(std::lround(double(img.w) * size / img.h)) : size;
  const int full_h = wide ? size : int(std::lround(double(img.h) * size / img.w));
  const Taps tx = taps(img.w, std::max(full_w, size), (std::max(full_w, size) - size) / 2, size);
  const Taps ty = taps(img.h, std::max(full_h, size), (std::max(full_h, size) - size) / 2, size);
  std::vector<float> rows(size_t(img.h) * size * 3);  // horizontal pass
  for (int y = 0; y < img.h; ++y)
    for (int x = 0; x < size; ++x)
      for (int c = 0; c < 3; ++c) {
        float s = 0;
        for (size_t k = 0; k < tx.w[x].size(); ++k) s += tx.w[x][k] * img.rgb[(size_t(y) * img.w + tx.first[x] + k) * 3 + c];
        rows[(size_t(y) * size + x) * 3 + c] = s;
      }
  std::vector<uint8_t> out(size_t(size) * size * 3);
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x)
      for (int c = 0; c < 3; ++c) {
        float s = 0;
        for (size_t k = 0; k < ty.w[y].size(); ++k) s += ty.w[y][k] * rows[((ty.first[y] + k) * size + x) * 3 + c];
        out[(size_t(y) * size + x) * 3 + c] = uint8_t(std::min(255.0f, std::max(0.0f, std::round(s))));
      }
  return out;
}

