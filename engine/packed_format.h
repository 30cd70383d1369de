// The packed image format: what tools/pack_images writes and `--data packed:DIR` reads.
//   DIR/classes.txt         the class names, one a line, in label order
//   DIR/shard-NNNNN.bin     a 64-byte header, labels int32[count], then the images
//                           uint8[count][size][size][3] (RGB, rows top to bottom)
// Images are already resized (shorter side) and centre-cropped to size x size, so the loader
// only copies bytes; augmentation happens on the GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

struct PackedShardHeader {
  char magic[8];  // "VITPACK1"
  uint32_t version, count, size, channels, classes;
  uint8_t reserved[36];
};
static_assert(sizeof(PackedShardHeader) == 64, "the header is 64 bytes");

constexpr uint32_t kPackedVersion = 1;
inline bool packed_magic_ok(const PackedShardHeader& h) { return std::memcmp(h.magic, "VITPACK1", 8) == 0; }
inline size_t packed_image_bytes(const PackedShardHeader& h) { return size_t(h.size) * h.size * h.channels; }
inline size_t packed_shard_bytes(const PackedShardHeader& h) {
  return sizeof(PackedShardHeader) + size_t(h.count) * 4 + size_t(h.count) * packed_image_bytes(h);
}
