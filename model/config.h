// The ViT architecture as numbers: presets matching timm and the shapes derived from them.
#pragma once
#include <cstdint>
#include <string>

// bf16: bf16 GEMMs. fp8: the four Linear layers of every block run all three of their GEMMs in
// FP8 (E4M3 weights and activations, E5M2 output gradients, per-tensor scales on the device);
// everything else as in bf16.
enum class Precision { BF16, FP8 };

struct ViTConfig {
  std::string name = "vit_h16";
  int img = 224, patch = 16, channels = 3, classes = 1000;
  int dim = 1280, depth = 32, heads = 16;
  double mlp_ratio = 4.0;

  int grid() const { return img / patch; }
  int patches() const { return grid() * grid(); }
  int tokens() const { return patches() + 1; }  // + class token
  int head_dim() const { return dim / heads; }
  int hidden() const { return static_cast<int>(dim * mlp_ratio); }  // timm: int(dim * mlp_ratio)
  int patch_dim() const { return channels * patch * patch; }         // (c, kh, kw) flattened
  // The patch rows as the patch embedding's GEMM reads them: padded with zeros to a multiple of 8
  // (16-byte bf16 rows), e.g. ViT-H/14's 588 to 592.
  int patch_dim_padded() const { return (patch_dim() + 7) / 8 * 8; }

  // Model FLOPs of one training step per image: 3x the forward's matmul FLOPs (the convention
  // behind MFU; the image gradient of the patch embedding is counted though never computed).
  double train_flops_per_image() const;
  // Throws std::invalid_argument naming the problem when the shape is not a valid ViT.
  void validate() const;
  // Throws std::invalid_argument when a batch of this size exceeds what the kernels index:
  // grids of at most 65535 images, 32-bit element counts per activation.
  void validate_batch(int batch) const;
  static constexpr int64_t kMaxTokens = 65536, kMaxPatchDim = 1 << 20, kMaxTokenRows = 2000000;
  std::string describe() const;
};

// Presets: vit_h16, vit_l16, vit_b16, vit_s16, vit_ti16 (timm's vit_*_patch16_224 shapes), vit_h14,
// vit_l14 (vit_huge_patch14_224, vit_large_patch14_224).
// Returns false if the name is unknown.
bool vit_preset(const std::string& name, ViTConfig* out);
const char* vit_preset_names();
