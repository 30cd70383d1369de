#include "engine/packed_format.h"

#include "kernels/check.h"

PackedShard check_packed_shard(const uint8_t* bytes, size_t size, const std::string& name, int classes) {
  if (size < sizeof(PackedShardHeader))
    throw RuntimeError("packed data: " + name + " is truncated (shorter than its header)");
  PackedShardHeader h;
  std::memcpy(&h, bytes, sizeof h);
  if (!packed_magic_ok(h) || h.version != kPackedVersion)
    throw RuntimeError("packed data: " + name + " is not a version-1 packed shard (corrupted?)");
  if (h.channels != 3 || h.size == 0 || h.size > kMaxPackedSide || h.count == 0 || h.count > kMaxPackedCount ||
      h.classes != static_cast<uint32_t>(classes))
    throw RuntimeError("packed data: " + name + " has channels " + std::to_string(h.channels) + ", size " +
                       std::to_string(h.size) + ", " + std::to_string(h.count) + " images, " +
                       std::to_string(h.classes) + " classes (classes.txt lists " + std::to_string(classes) +
                       "; a shard holds 3 channels, sides up to " + std::to_string(kMaxPackedSide) + ")");
  if (packed_shard_bytes(h) != size)  // (no overflow: the bounds above keep it below 2^64)
    throw RuntimeError("packed data: " + name + " is " + std::to_string(size) + " bytes, its header says " +
                       std::to_string(packed_shard_bytes(h)) + " (truncated or corrupted)");
  PackedShard s;
  s.count = h.count;
  s.size = h.size;
  s.labels = bytes + sizeof h;
  s.pixels = s.labels + size_t(h.count) * 4;
  for (uint32_t i = 0; i < h.count; ++i) {
    int32_t label;
    std::memcpy(&label, s.labels + size_t(i) * 4, 4);
    if (label < 0 || label >= classes)
      throw RuntimeError("packed data: " + name + " image " + std::to_string(i) + " has label " +
                         std::to_string(label) + " of " + std::to_string(classes) + " classes");
  }
  return s;
}
