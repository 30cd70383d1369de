// Decoding the images pack_images packs (JPEG through libturbojpeg, PNG through libpng), as
// untrusted input: the header is read first and an image larger than the limits is refused
// before any pixel memory is taken; a truncated JPEG is refused, not padded. Then the shorter
// side resized and the centre cropped. Errors are std::runtime_error with the reason.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

struct ImageLimits {
  int max_side;         // width and height
  uint64_t max_pixels;  // width x height
};
// pack_images' limits: a 16384-pixel side, 67,108,864 pixels (a 8192 x 8192 image).
constexpr ImageLimits kImageLimits{16384, uint64_t(1) << 26};

// What an image's header says.
struct ImageInfo {
  bool jpeg = false;  // else PNG
  bool cmyk = false;  // a CMYK or YCCK JPEG (decoded through a 4-channel buffer)
  bool gray = false;  // a one-component JPEG
  int w = 0, h = 0;
};
struct Image {
  int w = 0, h = 0;
  std::vector<uint8_t> rgb;  // h x w x 3
};

// The header checked against the limits.
ImageInfo probe_image(const uint8_t* bytes, size_t size, const ImageLimits& limits);
// The memory that decoding the image and resizing it to `side` takes at its peak.
size_t decode_peak_bytes(const ImageInfo& info, int side);
// The pixels, as RGB; info is probe_image's for the same bytes.
Image decode_image(const uint8_t* bytes, size_t size, const ImageInfo& info);
// Shorter side to `side` (antialiased: a triangle filter as wide as the downscale, as PIL's
// bilinear resize), then the centred side x side square.
std::vector<uint8_t> resize_crop(const Image& img, int side);
