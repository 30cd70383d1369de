// The model's device memory, asked for by category. The model says which buffers it needs and
// how large; whoever builds it (engine/device_memory.h) allocates each category once and fills
// in every pointer. Nothing is allocated here, so the sizes are known before anything is.
#pragma once
#include <array>
#include <cstddef>
#include <vector>

enum class MemoryCategory { Parameters, Gradients, OptimizerState, Activations, Workspace, Count };
constexpr int kMemoryCategories = static_cast<int>(MemoryCategory::Count);

class MemoryRequest {
 public:
  // Reserves count elements of T; *slot is set once the category is placed. Each buffer starts
  // on a 256-byte boundary of its category.
  template <class T>
  void add(MemoryCategory category, T** slot, size_t count) {
    add_bytes(category, reinterpret_cast<void**>(slot), count * sizeof(T));
  }
  void add_bytes(MemoryCategory category, void** slot, size_t bytes);
  size_t bytes(MemoryCategory category) const { return bytes_[static_cast<int>(category)]; }
  size_t bytes() const;
  // Points every slot of the category into [base, base + bytes(category)); nothing may be added
  // to it after this, and it is placed once.
  void place(MemoryCategory category, void* base);

 private:
  struct Slot {
    void** where;
    size_t offset;
  };
  std::array<std::vector<Slot>, kMemoryCategories> slots_;
  std::array<size_t, kMemoryCategories> bytes_{};
  std::array<bool, kMemoryCategories> placed_{};
};
