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
#include <string>

struct PackedShardHeader {
  char magic[8];  // "VITPACK1"
  uint32_t version, count, size, channels, classes;
  uint8_t reserved[36];
};
static_assert(sizeof(PackedShardHeader) == 64, "the header is 64 bytes");

constexpr uint32_t kPackedVersion = 1;
constexpr uint32_t kMaxPackedSide = 4096;        // pack_images --size's largest
constexpr uint32_t kMaxPackedCount = 1u << 30;   // images in one shard, and in one directory
inline bool packed_magic_ok(const PackedShardHeader& h) { return std::memcmp(h.magic, "VITPACK1", 8) == 0; }
inline size_t packed_image_bytes(const PackedShardHeader& h) { return size_t(h.size) * h.size * h.channels; }
inline size_t packed_shard_bytes(const PackedShardHeader& h) {
  return sizeof(PackedShardHeader) + size_t(h.count) * 4 + size_t(h.count) * packed_image_bytes(h);
}

// A shard's contents, pointing into its bytes.
struct PackedShard {
  uint32_t count = 0, size = 0;
  const uint8_t* labels = nullptr;  // int32[count], little-endian
  const uint8_t* pixels = nullptr;  // uint8[count][size][size][3]
};
// Checks a shard's bytes against its header and classes.txt's class count: the magic and version,
// 3 channels, a side of 1..kMaxPackedSide, 1..kMaxPackedCount images, the classes, the file's
// length, every label in [0, classes). Throws RuntimeError naming `name` and the problem.
PackedShard check_packed_shard(const uint8_t* bytes, size_t size, const std::string& name, int classes);
