// libFuzzer target: pack_images' decoding (tools/image_decode.h). The first byte picks the
// packed side (2 to 65 pixels), the rest is the image file; limits smaller than pack_images'
// keep each input fast while exercising the same checks.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "tools/image_decode.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int side = 2 + data[0] % 64;
  constexpr ImageLimits kFuzzLimits{2048, uint64_t(1) << 20};
  try {
    const ImageInfo info = probe_image(data + 1, size - 1, kFuzzLimits);
    resize_crop(decode_image(data + 1, size - 1, info), side);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
