#include "model/memory_request.h"

#include "kernels/check.h"

void MemoryRequest::add_bytes(MemoryCategory category, void** slot, size_t bytes) {
  const int c = static_cast<int>(category);
  ENSURE(!placed_[c], "MemoryRequest: a buffer added after its category was placed");
  slots_[c].push_back({slot, bytes_[c]});
  bytes_[c] += (bytes + 255) / 256 * 256;
}

size_t MemoryRequest::bytes() const {
  size_t n = 0;
  for (size_t b : bytes_) n += b;
  return n;
}

void MemoryRequest::place(MemoryCategory category, void* base) {
  const int c = static_cast<int>(category);
  ENSURE(!placed_[c], "MemoryRequest: a category placed twice");
  placed_[c] = true;
  for (const Slot& s : slots_[c]) *s.where = static_cast<char*>(base) + s.offset;
}
