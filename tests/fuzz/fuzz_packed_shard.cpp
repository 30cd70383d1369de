// libFuzzer target: a packed shard (engine/packed_format.h) over arbitrary bytes, checked for a
// directory of 10 classes; the images an accepted shard holds are read through.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "engine/packed_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const PackedShard s = check_packed_shard(data, size, "shard-00000.bin", 10);
    const size_t image_bytes = size_t(s.size) * s.size * 3;
    volatile uint8_t sink = 0;
    for (uint32_t i = 0; i < s.count; ++i) sink = sink + s.pixels[i * image_bytes + image_bytes - 1];
  } catch (const std::runtime_error&) {
  }
  return 0;
}
