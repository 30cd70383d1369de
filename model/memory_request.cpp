#include "model/memory_request.h"

void MemoryRequest::add_bytes(MemoryCategory category, void** slot, size_t bytes) {
  const int c = static_cast<int>(category);
  slots_[c].push_back({slot, bytes_[c]});
  bytes_[c] += (bytes + 255) / 256 * 256;
}

size_t MemoryRequest::bytes() const {
  size_t n = 0;
  for (size_t b : bytes_) n += b;
  return n;
}

void MemoryRequest::place(MemoryCategory category, void* base) const {
  for (const Slot& s : slots_[static_cast<int>(category)]) *s.where = static_cast<char*>(base) + s.offset;
}
