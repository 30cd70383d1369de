#include "engine/arena.h"

#include "engine/check.h"

Arena::~Arena() {
  if (base_) cudaFree(base_);  // no throw from a destructor; a failure here changes nothing
}

void Arena::add_bytes(void** slot, size_t bytes) {
  ENSURE(base_ == nullptr, "Arena " + name_ + ": add after commit");
  slots_.push_back({slot, bytes_});
  bytes_ += (bytes + 255) / 256 * 256;
}

void Arena::commit() {
  ENSURE(base_ == nullptr, "Arena " + name_ + ": committed twice");
  if (bytes_ == 0) return;
  const cudaError_t e = cudaMalloc(&base_, bytes_);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free allocation error
    throw RuntimeError("could not allocate " + std::to_string(bytes_ >> 20) + " MiB for " + name_ +
                       ": " + cudaGetErrorString(e));
  }
  for (const Slot& s : slots_) *s.where = static_cast<char*>(base_) + s.offset;
}
