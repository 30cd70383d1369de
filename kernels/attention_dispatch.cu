// The attention entry points (kernels/attention.h): the arguments checked, the kernel family
// chosen (the one asked for, or auto's), and its launcher called: the mma.sync kernels
// (kernels/attention_streamed.h) or the resident wgmma ones (kernels/attention_resident.h).
#include "kernels/attention.h"

#include <algorithm>
#include <string>

#include "kernels/attention_common.cuh"
#include "kernels/attention_resident.h"
#include "kernels/attention_streamed.h"
#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/nvtx.h"

namespace {
using bf16 = __nv_bfloat16;

// Preconditions common to both launchers; returns the current device.
int require_shape(const char* who, int B, int T, int H, int hd) {
  const std::string reason = attention_unsupported_reason(T, hd);
  ENSURE(reason.empty(), std::string(who) + ": " + reason);
  ENSURE(B >= 1 && H >= 1, std::string(who) + ": B and H must be positive");
  ENSURE(H <= 65535 && B <= 65535, std::string(who) + ": H and B must be at most 65535 (grid)");
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}
}  // namespace

std::string attention_unsupported_reason(int T, int hd) {
  if (hd < 8 || hd > 128 || hd % 8 != 0)
    return "attention head dim " + std::to_string(hd) +
           " unsupported (needs a multiple of 8 in [8, 128])";
  if (T < 1 || T > kAttentionMaxT)
    return "attention sequence length " + std::to_string(T) + " unsupported (needs 1 <= T <= " +
           std::to_string(kAttentionMaxT) + ")";
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const DeviceInfo info = device_info(dev);
  if (info.major != 9 || info.minor != 0)
    return "attention kernels are built for sm_90a only; device " + std::to_string(dev) +
           " is sm_" + std::to_string(info.major) + std::to_string(info.minor);
  // Shared memory does not depend on T (keys or queries stream through in chunks).
  const int need = attention_streamed_smem_bytes(hd);
  if (need > info.smem_optin)
    return "attention with hd=" + std::to_string(hd) + " needs " + std::to_string(need) +
           " bytes of shared memory per block; the device allows " +
           std::to_string(info.smem_optin);
  return {};
}

namespace {
// The kernel a call runs, for a shape the streamed kernels support on device dev: the one asked
// for (refused where it does not apply), or Auto's choice (the fastest that applies).
AttentionForward resolve_forward(AttentionForward kind, int T, int hd, int dev) {
  ENSURE(kind != AttentionForward::Resident || attention_forward_resident_fits(T, hd, dev),
         "attention_forward: the resident kernel takes hd 64 (T <= 832), 80 (T <= 656) or 128 (T <= 384) on sm_90a; T " + std::to_string(T) +
             ", hd " + std::to_string(hd));
  if (kind != AttentionForward::Auto) return kind;
  return attention_forward_resident_preferred(T, hd, dev) ? AttentionForward::Resident : AttentionForward::Streamed;
}

AttentionBackward resolve_backward(AttentionBackward kind, int T, int hd, int dev) {
  const bool single = attention_single_pass_fits(T, hd, dev), resident = attention_resident_fits(T, hd, dev);
  ENSURE(single || kind != AttentionBackward::SinglePass,
         "attention_backward: the single-pass kernel takes T <= 96 and hd 16, 32, 64 or 80");
  ENSURE(resident || kind != AttentionBackward::Resident,
         "attention_backward: the resident kernel takes hd 64, 80 or 128 (T <= 1024), on sm_90a");
  if (kind != AttentionBackward::Auto) return kind;
  return single ? AttentionBackward::SinglePass : resident ? AttentionBackward::Resident : AttentionBackward::Streamed;
}

// The current device, where the streamed kernels support (T, hd) on it; else -1.
int supporting_device(int T, int hd) {
  if (!attention_unsupported_reason(T, hd).empty()) return -1;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}
}  // namespace

void attention_forward(const bf16* qkv, bf16* out, float* lse, int B, int T, int H, int hd,
                       cudaStream_t stream, AttentionForward kind) {
  const int dev = require_shape("attention_forward", B, T, H, hd);
  ENSURE(qkv && out && lse, "attention_forward: null pointer");
  ENSURE(is_aligned16(qkv) && is_aligned16(out), "attention_forward: qkv/out must be 16-byte aligned");
  NvtxRange range("attention_forward");
  if (resolve_forward(kind, T, hd, dev) == AttentionForward::Resident) {
    attention_forward_resident(qkv, out, lse, B, T, H, hd, dev, stream);
    return;
  }
  attention_forward_streamed(qkv, out, lse, B, T, H, hd, dev, stream);
}


bool attention_single_pass_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && attention_single_pass_fits(T, hd, dev);
}

bool attention_forward_resident_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && attention_forward_resident_fits(T, hd, dev);
}

bool attention_resident_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && attention_resident_fits(T, hd, dev);
}

AttentionForward attention_forward_auto_choice(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 ? resolve_forward(AttentionForward::Auto, T, hd, dev) : AttentionForward::Streamed;
}

namespace {
// delta's floats, rounded up to 256 bytes: the dQ planes follow (attention_backward_workspace_floats).
size_t delta_floats_padded(int B, int T, int H) { return (size_t(B) * H * T + 63) / 64 * 64; }
}  // namespace

size_t attention_backward_workspace_floats(int B, int T, int H, int hd) {
  return delta_floats_padded(B, T, H) + attention_resident_dq_plane_floats(B, T, H, hd);
}

AttentionBackward attention_backward_auto_choice(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 ? resolve_backward(AttentionBackward::Auto, T, hd, dev) : AttentionBackward::Streamed;
}

void attention_backward(const bf16* qkv, const bf16* out, const bf16* dout, const float* lse,
                        float* delta, bf16* dqkv, int B, int T, int H, int hd,
                        cudaStream_t stream, AttentionBackward kind) {
  const int dev = require_shape("attention_backward", B, T, H, hd);
  ENSURE(qkv && out && dout && lse && delta && dqkv, "attention_backward: null pointer");
  ENSURE(is_aligned16(qkv) && is_aligned16(out) && is_aligned16(dout) && is_aligned16(dqkv),
         "attention_backward: qkv/out/dout/dqkv must be 16-byte aligned");
  NvtxRange range("attention_backward");

  const AttentionBackward chosen = resolve_backward(kind, T, hd, dev);  // require_shape checked the rest
  if (chosen == AttentionBackward::Resident) {
    // Past 256 tokens in key blocks: delta computed first, the dQ planes after it in the workspace.
    const bool blocks = attention_resident_takes_delta(T, hd), planes = attention_resident_dq_plane_floats(B, T, H, hd) > 0;
    if (blocks) attention_delta(out, dout, delta, B, T, H, hd, stream);
    attention_backward_resident(qkv, out, dout, lse, blocks ? delta : nullptr,
                                planes ? delta + delta_floats_padded(B, T, H) : nullptr, dqkv, B, T, H, hd, dev, stream);
    return;
  }
  if (chosen == AttentionBackward::SinglePass) {
    attention_backward_single_pass(qkv, out, dout, lse, dqkv, B, T, H, hd, dev, stream);
    return;
  }
  attention_delta(out, dout, delta, B, T, H, hd, stream);
  attention_backward_streamed(qkv, dout, lse, delta, dqkv, B, T, H, hd, dev, stream);
}
