// libFuzzer target: engine/dataset.h's IDX decoding (plain or gzip) over arbitrary bytes: the
// first 4 bytes (little-endian) give the image file's length, its bytes follow, the label file
// is the rest; the pair is decoded as a dataset split of 10 classes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "engine/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const uint32_t claimed = uint32_t(data[0]) | uint32_t(data[1]) << 8 | uint32_t(data[2]) << 16 | uint32_t(data[3]) << 24;
  const size_t images = std::min<size_t>(claimed, size - 4);
  try {
    decode_idx_pair(data + 4, images, "images", data + 4 + images, size - 4 - images, "labels", 10);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
