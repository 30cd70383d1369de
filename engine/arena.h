// Device memory by category: every buffer of a category is declared once (add), then one
// cudaMalloc serves them all (commit). Sizes are known before anything is allocated, so the
// start-up summary and the "does this batch fit" check come for free, and nothing is allocated
// inside the training step.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

class Arena {
 public:
  explicit Arena(std::string name) : name_(std::move(name)) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves count elements of T; *slot is set by commit(). Each buffer is 256-byte aligned.
  template <class T>
  void add(T** slot, size_t count) {
    add_bytes(reinterpret_cast<void**>(slot), count * sizeof(T));
  }
  void add_bytes(void** slot, size_t bytes);
  // Another allocator than cudaMalloc/cudaFree for this arena (e.g. NCCL's, for memory that
  // NCCL registers); set before commit().
  using Alloc = void* (*)(size_t bytes);
  using Release = void (*)(void* p);
  void set_allocator(Alloc alloc, Release release);
  void commit();  // one allocation for everything added; fills every slot

  const std::string& name() const { return name_; }
  size_t bytes() const { return bytes_; }

 private:
  std::string name_;
  struct Slot { void** where; size_t offset; };
  std::vector<Slot> slots_;
  size_t bytes_ = 0;
  void* base_ = nullptr;
  Alloc alloc_ = nullptr;
  Release release_ = nullptr;
};
