// cuDNN's fused attention (its SDPA forward and backward operations) on the engine's layouts:
// `--attention cudnn`, one of the choices `--attention auto` weighs, and the library yardstick
// ./attention_rate times beside the engine's kernels on the same operands and the same layout.
// The contract is kernels/attention.h's: qkv [B*T, 3D] (Q, K, V, head h at columns h*hd..),
// out and dout [B*T, D], lse [B, H, T] (natural-log-sum-exp of the scaled scores: cuDNN's
// "stats" are the same quantity, so either side's forward feeds either side's backward), dqkv
// as qkv; no mask, scale 1/sqrt(hd). (The backward's graph carries a padding mask that masks
// nothing: it keeps cuDNN's engines from a NaN reported of them; cudnn_attention.cpp.)
//
// The library is loaded at run time (dlopen of libcudnn.so.9), not linked: vit_train starts
// where cuDNN is not installed, and only this choice then fails, with one message naming what is
// missing. Its headers are needed to build this (without them it builds as a stub that says
// so). Plans (graph, heuristics, execution plan) are built once per shape and kept; the workspace
// the plans need is allocated with them (call prepare before the step).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>

// Empty where cuDNN's fused attention can run on this machine (libcudnn.so.9 loads, and its
// version has the SDPA operations), else why not, in one line. Loads the library once.
std::string cudnn_attention_unavailable_reason();

class CudnnAttention {
 public:
  // Throws RuntimeError with cudnn_attention_unavailable_reason() where it is not empty.
  // deterministic_backward false: the backward graph that sums dQ in fp32 (cuDNN's engines may
  // do so by atomics; PyTorch's choice), where an engine takes it.
  explicit CudnnAttention(bool deterministic_backward = true);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Builds the forward and backward plans of this shape (and their workspace), if not yet built;
  // throws RuntimeError if cuDNN has no engine for it. Synchronises the device.
  void prepare(int B, int T, int H, int hd);
  void forward(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, int B, int T, int H, int hd,
               cudaStream_t stream);
  void backward(const __nv_bfloat16* qkv, const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* lse,
                __nv_bfloat16* dqkv, int B, int T, int H, int hd, cudaStream_t stream);
  // Whether the backward plan of this shape is deterministic (cuDNN's engines may sum dQ by
  // atomics); prepare first.
  bool backward_deterministic(int B, int T, int H, int hd) const;
  static int version();                 // cudnnGetVersion(), e.g. 91400; 0 where it does not load
  static std::string version_string();  // "9.14"
  size_t device_bytes() const;  // device memory held: the workspace and the plans' own buffers

  struct Plan;  // one execution plan and the descriptors it owns (cudnn_attention.cpp)

 private:
  using Shape = std::tuple<int, int, int, int>;  // B, T, H, hd
  void* handle_ = nullptr;                        // cudnnHandle_t
  bool deterministic_backward_;
  std::map<Shape, std::unique_ptr<Plan>> forward_plans_, backward_plans_;
  void* workspace_ = nullptr;  // device memory shared by every plan (one stream at a time)
  size_t workspace_bytes_ = 0;
  Plan& plan(bool backward, int B, int T, int H, int hd);
};
