// The one GEMM entry point: every matrix product of the engine goes through cuBLASLt here.
// Plans (descriptors, layouts and the chosen algorithm) are cached per shape, so the step never
// queries the heuristic; only the pointers change from call to call. With autotune, a shape's
// first call also times cuBLASLt's candidate algorithms on its operands and keeps the fastest
// (that first call synchronises; it falls in the warm-up steps).
//
// Matrices are described in the row-major terms the model uses; the cuBLASLt column-major
// mapping lives in gemm.cpp alone.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "kernels/grad_write.h"

// E4M3 and E5M2 are Hopper's FP8 formats (one byte); an FP8 operand comes with a device pointer
// to the factor that turns its codes back into values (the inverse of its quantisation scale).
enum class DType { BF16, F32, E4M3, E5M2 };

// What the epilogue adds to the product. Bias: D += bias[N] (bias in D's dtype; bf16 for FP8
// products whatever D is). BiasGrad:
// also writes bias[M] = sum over K of op(A), the bias gradient of a weight-gradient product
// (fp32). cuBLASLt runs it as a kernel of its own after the product, slower than the model's own
// column sums (kernels/reduce.h), which the model takes; tools/gemm_rate prices it.
enum class Epilogue { None, Bias, BiasGrad };

// D[M, N] = op(A) * op(B) + (C if given) (+ the epilogue's), all row-major, fp32 accumulation.
// op(A) is [M, K]: A stored [M, K] (trans_a false) or [K, M] (trans_a true); likewise op(B) is
// [K, N]: B stored [K, N] or [N, K] (trans_b true). A and B are both bf16 or both FP8 (not both
// E5M2); FP8 products exist on Hopper only with K contiguous in both (trans_a false, trans_b
// true) and leading dimensions of whole 16 bytes. C and D share dtype and leading dimension.
struct GemmShape {
  int M, N, K;
  bool trans_a, trans_b;
  int lda, ldb, ldd;
  DType d_type;
  bool with_c;
  Epilogue epilogue;
  DType a_type = DType::BF16, b_type = DType::BF16;
  // FP8 only: accumulate in the tensor cores' own (reduced-precision) accumulator throughout,
  // instead of promoting partial sums to fp32 at intervals. Faster; Transformer Engine's choice
  // for forward products, not for gradients.
  bool fast_accum = false;
  auto key() const {
    return std::make_tuple(M, N, K, trans_a, trans_b, lda, ldb, ldd, d_type, with_c, epilogue, a_type, b_type,
                           fast_accum);
  }
};

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes, bool autotune = true);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // bias: the epilogue's vector (read for Bias, written for BiasGrad), nullptr for None.
  // a_scale, b_scale: the FP8 operands' dequantisation factors (device pointers), else nullptr.
  // alpha scales the product alone: D = alpha op(A) op(B) + C + bias.
  void run(const GemmShape& s, const void* A, const void* B, const void* C, void* D, const void* bias,
           cudaStream_t stream, const float* a_scale = nullptr, const float* b_scale = nullptr, float alpha = 1.0f);

  // The Linear layer's three products (PyTorch layout: W is [out, in]):
  // y[M, N] = alpha x[M, K] W[N, K]^T (+ bias) (+ residual, same dtype and layout as y)
  void linear_forward(const void* x, const void* W, const void* bias, const void* residual,
                      void* y, DType y_type, int M, int N, int K, cudaStream_t stream,
                      int ldy = 0, float alpha = 1.0f);
  // dx[M, K] = dy[M, N] W[N, K]   (bf16 out)
  void linear_backward_input(const void* dy, const void* W, void* dx, int M, int N, int K,
                             cudaStream_t stream, int lddy = 0);
  // dW[N, K] = dy[M, N]^T x[M, K] (fp32 out, written, or with Accumulate added to dW in place);
  // with db, also db[N] = column sums of dy, fused into the same product (always written: the
  // epilogue cannot add, so an accumulating caller passes scratch and adds it).
  void linear_backward_weight(const void* dy, const void* x, float* dW, float* db, int M, int N,
                              int K, cudaStream_t stream, int lddy = 0, GradWrite write = GradWrite::Overwrite);

  // The FP8 product in the one layout Hopper runs: y[M, N] = alpha (a_scale a[M, K]) (b_scale b[N, K])^T
  // (+ bias, bf16 whatever y's dtype) (+ residual, y's dtype and layout); y bf16 or fp32. The three products of a Linear layer all take this form, given
  // transposed FP8 copies where the contraction runs along tokens or output features.
  void linear_fp8(const void* a, DType a_type, const float* a_scale, const void* b, DType b_type, const float* b_scale,
                  const void* bias, const void* residual, void* y, DType y_type, int M, int N, int K,
                  cudaStream_t stream, int ldy = 0, bool fast_accum = false, float alpha = 1.0f);

  size_t plans_cached() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, cd = nullptr;
    cublasLtMatmulAlgo_t algo;
  };
  const Plan& plan(const GemmShape& s, const void* A, const void* B, const void* C, void* D,
                   const void* bias, cudaStream_t stream, const float* a_scale, const float* b_scale);
  void set_pointers(const Plan& p, const void* bias, const float* a_scale, const float* b_scale);
  static constexpr int kCandidates = 8, kTuneRounds = 5;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  bool autotune_;
  std::map<decltype(GemmShape{}.key()), Plan> plans_;
};
