// libFuzzer target: a checkpoint's state.safetensors (engine/checkpoint_format.h) over arbitrary
// bytes, read beside a valid model.safetensors of a tiny model, in bf16 and fp8, with SGD and
// AdamW.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "engine/checkpoint_format.h"
#include "model/params.h"
#include "tests/fuzz/tiny_checkpoint.h"

namespace {
// The weights file: a header and the tiny model's zero weights, made once.
const std::vector<uint8_t>& weights_file() {
  static const std::vector<uint8_t> bytes = [] {
    const ParamLayout layout(tiny_checkpoint_options(Precision::BF16).model);
    std::string header = "{";
    size_t offset = 0;
    for (const ParamTensor& t : layout.tensors()) {
      header += std::string(header.size() > 1 ? "," : "") + "\"" + t.name + "\":{\"dtype\":\"F32\",\"shape\":[";
      for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
      header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + 4 * t.numel) + "]}";
      offset += 4 * t.numel;
    }
    header += "}";
    std::vector<uint8_t> b(8);
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(header.size() >> (8 * i));
    b.insert(b.end(), header.begin(), header.end());
    b.resize(b.size() + offset, 0);
    return b;
  }();
  return bytes;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t>& w = weights_file();
  const SafetensorsFile weights("model.safetensors", w.data(), w.size());
  for (const Precision p : {Precision::BF16, Precision::FP8})
    for (const OptimizerKind k : {OptimizerKind::Sgd, OptimizerKind::AdamW}) {
      try {
        const SafetensorsFile state("state.safetensors", data, size);
        TrainOptions o = tiny_checkpoint_options(p);
        o.optimizer = k;
        read_checkpoint_files("checkpoint", state, weights, o, 1);
      } catch (const std::runtime_error&) {  // RuntimeError or UsageError, with a message
      }
    }
  return 0;
}
