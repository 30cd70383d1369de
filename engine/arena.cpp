#include "engine/arena.h"

#include "kernels/check.h"

Arena::~Arena() {
  if (!base_) return;  // no throw from a destructor; a failure here changes nothing
  if (release_)
    release_(base_);
  else
    cudaFree(base_);
}

void Arena::set_allocator(Alloc alloc, Release release) {
  ENSURE(base_ == nullptr && alloc && release, "Arena " + name_ + ": allocator set after commit");
  alloc_ = alloc;
  release_ = release;
}

void Arena::add_bytes(void** slot, size_t bytes) {
  ENSURE(base_ == nullptr, "Arena " + name_ + ": add after commit");
  slots_.push_back({slot, bytes_});
  bytes_ += (bytes + 255) / 256 * 256;
}

void Arena::commit() {
  ENSURE(base_ == nullptr, "Arena " + name_ + ": committed twice");
  if (bytes_ == 0) return;
  if (alloc_) {
    base_ = alloc_(bytes_);  // throws on failure
    for (const Slot& s : slots_) *s.where = static_cast<char*>(base_) + s.offset;
    return;
  }
  const cudaError_t e = cudaMalloc(&base_, bytes_);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free allocation error
    throw RuntimeError("could not allocate " + std::to_string(bytes_ >> 20) + " MiB for " + name_ +
                       ": " + cudaGetErrorString(e));
  }
  for (const Slot& s : slots_) *s.where = static_cast<char*>(base_) + s.offset;
}
