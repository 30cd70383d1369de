// libFuzzer target: engine/safetensors.h's reader over arbitrary bytes, and every tensor it
// accepts read as fp32 where its dtype allows.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const SafetensorsFile f("input.safetensors", data, size);
    for (const auto& [name, e] : f.tensors())
      if (e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16") f.as_f32(name, e.shape);
  } catch (const std::runtime_error&) {  // refused with a message: the expected outcome
  }
  return 0;
}
