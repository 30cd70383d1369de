#include "model/params.h"

ParamLayout::ParamLayout(const ViTConfig& c) {
  const int64_t D = c.dim, H = c.hidden();
  cls_token = add("cls_token", {1, 1, D}, ParamInit::Normal1e6);
  pos_embed = add("pos_embed", {1, c.tokens(), D}, ParamInit::TruncNormal002);
  patch_w = add("patch_embed.proj.weight", {D, c.channels, c.patch, c.patch}, ParamInit::ConvUniform);
  patch_b = add("patch_embed.proj.bias", {D}, ParamInit::ConvUniform);
  for (int i = 0; i < c.depth; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    BlockParams b;
    b.norm1_w = add(p + "norm1.weight", {D}, ParamInit::One);
    b.norm1_b = add(p + "norm1.bias", {D}, ParamInit::Zero);
    b.qkv_w = add(p + "attn.qkv.weight", {3 * D, D}, ParamInit::TruncNormal002);
    b.qkv_b = add(p + "attn.qkv.bias", {3 * D}, ParamInit::Zero);
    b.proj_w = add(p + "attn.proj.weight", {D, D}, ParamInit::TruncNormal002);
    b.proj_b = add(p + "attn.proj.bias", {D}, ParamInit::Zero);
    b.norm2_w = add(p + "norm2.weight", {D}, ParamInit::One);
    b.norm2_b = add(p + "norm2.bias", {D}, ParamInit::Zero);
    b.fc1_w = add(p + "mlp.fc1.weight", {H, D}, ParamInit::TruncNormal002);
    b.fc1_b = add(p + "mlp.fc1.bias", {H}, ParamInit::Zero);
    b.fc2_w = add(p + "mlp.fc2.weight", {D, H}, ParamInit::TruncNormal002);
    b.fc2_b = add(p + "mlp.fc2.bias", {D}, ParamInit::Zero);
    blocks.push_back(b);
  }
  norm_w = add("norm.weight", {D}, ParamInit::One);
  norm_b = add("norm.bias", {D}, ParamInit::Zero);
  head_w = add("head.weight", {c.classes, D}, ParamInit::TruncNormal002);
  head_b = add("head.bias", {c.classes}, ParamInit::Zero);
}

int ParamLayout::add(const std::string& name, std::vector<int64_t> shape, ParamInit init) {
  ParamTensor t;
  t.name = name;
  t.numel = 1;
  for (int64_t d : shape) t.numel *= static_cast<size_t>(d);
  t.shape = std::move(shape);
  t.offset = total_;
  t.init = init;
  total_ += (t.numel + kParamAlign - 1) / kParamAlign * kParamAlign;
  count_ += t.numel;
  tensors_.push_back(std::move(t));
  return static_cast<int>(tensors_.size()) - 1;
}

int ParamLayout::find(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (tensors_[i].name == name) return static_cast<int>(i);
  return -1;
}
