// Parameter layout: every tensor of the model, with timm's state_dict name and shape, at an
// offset in one flat buffer. The same layout serves fp32 master weights, bf16 copies, gradients
// and momentum, so the optimizer is one pass over one buffer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

enum class ParamInit { Zero, One, TruncNormal002, Normal1e6, ConvUniform };

struct ParamTensor {
  std::string name;            // timm state_dict name, e.g. "blocks.3.attn.qkv.weight"
  std::vector<int64_t> shape;  // timm shape
  size_t offset = 0;           // in elements, into the flat buffer; a multiple of kParamAlign
  size_t numel = 0;
  ParamInit init = ParamInit::Zero;
};

// Offsets of one block's tensors (indices into ParamLayout::tensors).
struct BlockParams {
  int norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

class ParamLayout {
 public:
  // Each tensor starts on a 128-element boundary: 256-byte aligned in bf16, the alignment
  // cuBLASLt's algorithms assume by default. Padding elements are zero and stay zero.
  static constexpr size_t kParamAlign = 128;

  explicit ParamLayout(const ViTConfig& cfg);

  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  const ParamTensor& at(int index) const { return tensors_[index]; }
  int find(const std::string& name) const;  // -1 if absent
  size_t total() const { return total_; }   // flat buffer length in elements, padding included
  size_t count() const { return count_; }   // real parameters, padding excluded

  int cls_token, pos_embed, patch_w, patch_b, norm_w, norm_b, head_w, head_b;
  std::vector<BlockParams> blocks;

 private:
  int add(const std::string& name, std::vector<int64_t> shape, ParamInit init);
  std::vector<ParamTensor> tensors_;
  size_t total_ = 0, count_ = 0;
};
