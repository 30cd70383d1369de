#include "model/config.h"

#include <sstream>
#include <stdexcept>

bool vit_preset(const std::string& name, ViTConfig* out) {
  struct Preset { const char* name; int dim, depth, heads, patch; };
  static const Preset presets[] = {
      {"vit_h16", 1280, 32, 16, 16}, {"vit_l16", 1024, 24, 16, 16}, {"vit_b16", 768, 12, 12, 16},
      {"vit_s16", 384, 12, 6, 16},   {"vit_ti16", 192, 12, 3, 16},
      {"vit_h14", 1280, 32, 16, 14}, {"vit_l14", 1024, 24, 16, 14},  // timm's vit_huge_patch14_224, vit_large_patch14_224
  };
  for (const Preset& p : presets) {
    if (name == p.name) {
      ViTConfig c;
      c.name = p.name;
      c.dim = p.dim;
      c.depth = p.depth;
      c.heads = p.heads;
      c.patch = p.patch;
      *out = c;
      return true;
    }
  }
  return false;
}

const char* vit_preset_names() { return "vit_h16, vit_l16, vit_b16, vit_s16, vit_ti16, vit_h14, vit_l14"; }

double ViTConfig::train_flops_per_image() const {
  const double D = dim, N = tokens(), P = patches(), H = hidden();
  const double block = N * (2 * D * 3 * D + 2 * D * D + 2 * 2 * D * H)  // qkv, proj, fc1, fc2
                       + 2 * 2 * N * N * D;                              // q k^T and p v
  const double forward = depth * block + P * 2.0 * patch_dim() * D + 2.0 * D * classes;
  return 3.0 * forward;
}

void ViTConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  if (img < 1 || patch < 1 || channels < 1 || classes < 1 || dim < 1 || depth < 1 || heads < 1)
    fail("--img, --patch, --channels, --classes, --dim, --depth and --heads must all be positive");
  if (img % patch != 0)
    fail("image size " + std::to_string(img) + " is not divisible by patch size " +
         std::to_string(patch));
  // Sizes in 64 bits first: the int accessors below are only safe once these bounds hold.
  const int64_t grid64 = img / patch, tokens64 = grid64 * grid64 + 1;
  const int64_t patch_dim64 = int64_t(channels) * patch * patch;
  if (tokens64 > kMaxTokens)
    fail(std::to_string(tokens64) + " tokens per image is more than the " + std::to_string(kMaxTokens) +
         " the kernels support");
  if (patch_dim64 > kMaxPatchDim)
    fail("channels*patch*patch = " + std::to_string(patch_dim64) + " is more than " + std::to_string(kMaxPatchDim));
  if (dim % heads != 0)
    fail("dim " + std::to_string(dim) + " is not divisible by heads " + std::to_string(heads));
  if (!(mlp_ratio > 0) || hidden() < 1) fail("--mlp-ratio must give a positive hidden size");
  if (dim % 8 != 0 || hidden() % 8 != 0)
    fail("dim and the MLP hidden size must be multiples of 8 (16-byte rows for the bf16 GEMMs); got dim " +
         std::to_string(dim) + ", hidden " + std::to_string(hidden()));
  if (dim > 1536) fail("dim " + std::to_string(dim) + " is above 1536, the LayerNorm kernels' limit");
  if (head_dim() % 8 != 0 || head_dim() > 128)
    fail("head dim (dim/heads) must be a multiple of 8 and at most 128 for the attention "
         "kernels; got " + std::to_string(head_dim()));
}

void ViTConfig::validate_batch(int batch) const {
  const int64_t rows = int64_t(batch) * tokens();
  if (batch > 65535 || rows > kMaxTokenRows)
    throw std::invalid_argument("batch " + std::to_string(batch) + " gives " + std::to_string(rows) +
                                " token rows per step; the kernels take at most 65535 images and " +
                                std::to_string(kMaxTokenRows) + " token rows");
}

std::string ViTConfig::describe() const {
  std::ostringstream s;
  s << name << ": img " << img << ", patch " << patch << ", channels " << channels << ", classes "
    << classes << ", dim " << dim << ", depth " << depth << ", heads " << heads << " (head dim "
    << head_dim() << "), mlp hidden " << hidden() << ", tokens " << tokens();
  return s.str();
}
