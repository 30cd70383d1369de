#include "kernels/gemm.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/nvtx.h"

namespace {
cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F32: return CUDA_R_32F;
    case DType::E4M3: return CUDA_R_8F_E4M3;
    case DType::E5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}
size_t elem_size(DType t) { return t == DType::F32 ? 4 : t == DType::BF16 ? 2 : 1; }
bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }
// cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise; plans are cached
// per shape, so every call must keep to that.
bool aligned256(const void* p) { return reinterpret_cast<uintptr_t>(p) % 256 == 0; }
std::string describe(const GemmShape& s) {
  return "M " + std::to_string(s.M) + " N " + std::to_string(s.N) + " K " + std::to_string(s.K) +
         (s.trans_a ? " A^T" : " A") + (s.trans_b ? " B^T" : " B") + " lda " +
         std::to_string(s.lda) + " ldb " + std::to_string(s.ldb) + " ldd " + std::to_string(s.ldd);
}
}  // namespace

Gemm::Gemm(size_t workspace_bytes, bool autotune) : workspace_bytes_(workspace_bytes), autotune_(autotune) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.cd);
    cublasLtMatmulDescDestroy(p.op);
  }
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

// Row-major D[M, N] is column-major D^T[N, M]; so the row-major product D = op(A) op(B) is the
// column-major product D^T = op(B)^T op(A)^T: cuBLASLt's "A" is our B and its "B" is our A,
// with m = N, n = M, and each operand's transpose flag kept (a row-major [r, c] matrix is a
// column-major [c, r] one, which is exactly the transposition the swap needs).
// The per-call operands a plan's descriptor carries: the epilogue's vector and the FP8 scales
// (cuBLASLt's A is our B, its B our A).
void Gemm::set_pointers(const Plan& p, const void* bias, const float* a_scale, const float* b_scale) {
  if (bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (b_scale)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  if (a_scale)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof(a_scale)));
}

const Gemm::Plan& Gemm::plan(const GemmShape& s, const void* A, const void* B, const void* C, void* D,
                             const void* bias, cudaStream_t stream, const float* a_scale, const float* b_scale) {
  auto it = plans_.find(s.key());
  if (it != plans_.end()) return it->second;

  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_b_as_a = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a_as_b = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b_as_a,
                                              sizeof(op_b_as_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a_as_b,
                                              sizeof(op_a_as_b)));
  if (s.epilogue != Epilogue::None) {
    // In cuBLASLt's column-major view our A is its B and our M its n: the bias gradient over
    // our op(A)'s K is its BGRADB.
    const cublasLtEpilogue_t epi =
        s.epilogue == Epilogue::Bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_BGRADB;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                sizeof(epi)));
    if (is_fp8(s.a_type) && s.epilogue == Epilogue::Bias) {  // FP8 products take a bf16 bias, whatever D is
      const cudaDataType_t bias_type = CUDA_R_16BF;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                  sizeof(bias_type)));
    }
  }
  if (s.fast_accum) {
    const int8_t on = 1;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof(on)));
  }
  // Column-major layouts (rows, cols, ld) of the stored matrices.
  const int b_rows = s.trans_b ? s.K : s.N, b_cols = s.trans_b ? s.N : s.K;  // our B, stored
  const int a_rows = s.trans_a ? s.M : s.K, a_cols = s.trans_a ? s.K : s.M;  // our A, stored
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(s.b_type), b_rows, b_cols, s.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(s.a_type), a_rows, a_cols, s.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.cd, cuda_type(s.d_type), s.N, s.M, s.ldd));

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t results[kCandidates];
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.cd, p.cd,
                                                           pref, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.cd);
    cublasLtMatmulDescDestroy(p.op);
    throw RuntimeError("cuBLASLt has no algorithm for GEMM " + describe(s) + ": " +
                       cublasLtGetStatusString(st));
  }
  p.algo = results[0].algo;
  // The heuristic's first choice is not always the fastest at these shapes: time the candidates
  // on the call's own operands, once per shape. Outputs are only written, so running a product
  // several times changes nothing, unless D is also the input C. Rounds go over all candidates
  // in turn and each keeps its best round, so a clock still ramping up favours none of them.
  if (autotune_ && found > 1 && C != D) {
    set_pointers(p, bias, a_scale, b_scale);
    const float alpha = 1.0f, beta = C ? 1.0f : 0.0f;
    auto launch = [&](int i) {
      return cublasLtMatmul(handle_, p.op, &alpha, B, p.a, A, p.b, &beta, C ? C : D, p.cd, D, p.cd,
                            &results[i].algo, workspace_, workspace_bytes_, stream);
    };
    std::vector<float> best(found, INFINITY);
    for (int i = 0; i < found; ++i)
      if (launch(i) != CUBLAS_STATUS_SUCCESS) best[i] = -1;  // a candidate may refuse these pointers
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    for (int round = 0; round < kTuneRounds; ++round) {
      for (int i = 0; i < found; ++i) {
        if (best[i] < 0) continue;
        CUDA_CHECK(cudaEventRecord(start, stream));
        CUBLAS_CHECK(launch(i));
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        best[i] = std::min(best[i], ms);
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    int pick = 0;
    for (int i = 0; i < found; ++i)
      if (best[i] >= 0 && (best[pick] < 0 || best[i] < best[pick])) pick = i;
    p.algo = results[pick].algo;
  }
  return plans_.emplace(s.key(), p).first->second;
}

void Gemm::run(const GemmShape& s, const void* A, const void* B, const void* C, void* D,
               const void* bias, cudaStream_t stream, const float* a_scale, const float* b_scale, float alpha) {
  ENSURE(s.with_c == (C != nullptr) && (s.epilogue != Epilogue::None) == (bias != nullptr),
          "GEMM operands do not match its shape: " + describe(s));
  NvtxRange range("gemm");
  ENSURE(aligned256(A) && aligned256(B) && aligned256(D) && (!C || aligned256(C)),
         "GEMM operands must be 256-byte aligned: " + describe(s));
  ENSURE((s.lda * elem_size(s.a_type)) % 16 == 0 && (s.ldb * elem_size(s.b_type)) % 16 == 0 &&
             (s.ldd * elem_size(s.d_type)) % 16 == 0,
         "GEMM leading dimensions must give 16-byte rows: " + describe(s));
  const bool fp8 = is_fp8(s.a_type) || is_fp8(s.b_type);
  ENSURE(is_fp8(s.a_type) == is_fp8(s.b_type) && !(s.a_type == DType::E5M2 && s.b_type == DType::E5M2) &&
             (!fp8 || (!s.trans_a && s.trans_b && a_scale && b_scale)),
         "FP8 GEMMs take two FP8 operands (not both E5M2), K contiguous in both, and both scales: " + describe(s));
  const Plan& p = plan(s, A, B, C, D, bias, stream, a_scale, b_scale);
  set_pointers(p, bias, a_scale, b_scale);
  const float beta = C ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, B, p.a, A, p.b, &beta, C ? C : D, p.cd, D,
                              p.cd, &p.algo, workspace_, workspace_bytes_, stream));
}

void Gemm::linear_forward(const void* x, const void* W, const void* bias, const void* residual,
                          void* y, DType y_type, int M, int N, int K, cudaStream_t stream,
                          int ldy, float alpha) {
  const GemmShape s{M, N, K, false, true, K, K, ldy ? ldy : N, y_type, residual != nullptr,
                    bias ? Epilogue::Bias : Epilogue::None};
  run(s, x, W, residual, y, bias, stream, nullptr, nullptr, alpha);
}

void Gemm::linear_fp8(const void* a, DType a_type, const float* a_scale, const void* b, DType b_type,
                      const float* b_scale, const void* bias, const void* residual, void* y, DType y_type, int M,
                      int N, int K, cudaStream_t stream, int ldy, bool fast_accum, float alpha) {
  ENSURE(y_type == DType::BF16 || y_type == DType::F32, "linear_fp8: the output is bf16 or fp32");
  GemmShape s{M, N, K, false, true, K, K, ldy ? ldy : N, y_type, residual != nullptr,
              bias ? Epilogue::Bias : Epilogue::None};
  s.a_type = a_type;
  s.b_type = b_type;
  s.fast_accum = fast_accum;
  run(s, a, b, residual, y, bias, stream, a_scale, b_scale, alpha);
}

void Gemm::linear_backward_input(const void* dy, const void* W, void* dx, int M, int N, int K,
                                 cudaStream_t stream, int lddy) {
  const GemmShape s{M, K, N, false, false, lddy ? lddy : N, K, K, DType::BF16, false, Epilogue::None};
  run(s, dy, W, nullptr, dx, nullptr, stream);
}

void Gemm::linear_backward_weight(const void* dy, const void* x, float* dW, float* db, int M, int N,
                                  int K, cudaStream_t stream, int lddy, GradWrite write) {
  const bool accumulate = write == GradWrite::Accumulate;
  const GemmShape s{N, K, M, true, false, lddy ? lddy : N, K, K, DType::F32, accumulate,
                    db ? Epilogue::BiasGrad : Epilogue::None};
  run(s, dy, x, accumulate ? dW : nullptr, dW, db, stream);
}
