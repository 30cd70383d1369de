// gemm_rate: the rate cuBLASLt reaches on this card at the shapes of one ViT block's twelve GEMMs
// (through the engine's own GEMM entry point, each shape timed alone: CUDA events, median of 20
// after warm-up, random operands) and at a large square product, for comparison with the GEMM
// time inside a training step (vit_train --timing). Two tables: bf16, then FP8 in the engine's
// layouts (E4M3 inputs and weights, E5M2 output gradients, the transposed copies where the
// contraction runs along tokens or output features), forward products with and without fast
// accumulation.
// Usage: gemm_rate [--dim D] [--hidden H] [--tokens M]   (default: ViT-H/16 at batch 64)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/gemm.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/random.h"
#include "tools/block_shape_args.h"
#include "kernels/event_timing.h"

namespace {
struct Product {
  const char* name;
  int M, N, K;
  enum Kind { Forward, InputGrad, WeightGrad } kind;
  bool bias;
  bool in_block;  // one of the block's twelve, summed into the block total
};

}  // namespace

int main(int argc, char** argv) {
  BlockShape shape;
  if (!parse_block_shape(argc, argv, "gemm_rate", false, &shape)) return 2;
  const int D = shape.D, H = shape.H, M = shape.M;
  try {
    const std::vector<Product> products = {
        {"qkv forward", M, 3 * D, D, Product::Forward, true, true},
        {"proj forward", M, D, D, Product::Forward, true, true},
        {"fc1 forward", M, H, D, Product::Forward, true, true},
        {"fc2 forward", M, D, H, Product::Forward, true, true},
        {"qkv input grad", M, 3 * D, D, Product::InputGrad, false, true},
        {"proj input grad", M, D, D, Product::InputGrad, false, true},
        {"fc1 input grad", M, H, D, Product::InputGrad, false, true},
        {"fc2 input grad", M, D, H, Product::InputGrad, false, true},
        {"qkv weight grad", M, 3 * D, D, Product::WeightGrad, true, true},
        {"proj weight grad", M, D, D, Product::WeightGrad, true, true},
        {"fc1 weight grad", M, H, D, Product::WeightGrad, true, true},
        {"fc2 weight grad", M, D, H, Product::WeightGrad, true, true},
        // The same weight gradients without the fused bias gradient: what the epilogue costs.
        {"qkv wgrad, no db", M, 3 * D, D, Product::WeightGrad, false, false},
        {"proj wgrad, no db", M, D, D, Product::WeightGrad, false, false},
        {"fc1 wgrad, no db", M, H, D, Product::WeightGrad, false, false},
        {"fc2 wgrad, no db", M, D, H, Product::WeightGrad, false, false},
        {"square 8192^3", 8192, 8192, 8192, Product::Forward, false, false},
    };
    size_t most = 0;
    for (const Product& p : products) most = std::max({most, size_t(p.M) * p.K, size_t(p.N) * p.K, size_t(p.M) * p.N});
    float *x32, *out;
    __nv_bfloat16 *a, *b, *c;
    CUDA_CHECK(cudaMalloc(&x32, most * 4));
    CUDA_CHECK(cudaMalloc(&out, most * 4));
    for (__nv_bfloat16** p : {&a, &b, &c}) CUDA_CHECK(cudaMalloc(p, most * 2));
    fill_normal(x32, most, 1, 1, 0, 1, -1e30f, 1e30f, 0);
    std::vector<float> h(most);
    CUDA_CHECK(cudaMemcpy(h.data(), x32, most * 4, cudaMemcpyDeviceToHost));
    std::vector<__nv_bfloat16> hb(most);
    for (size_t i = 0; i < most; ++i) hb[i] = __float2bfloat16(h[i]);
    for (__nv_bfloat16* p : {a, b, c}) CUDA_CHECK(cudaMemcpy(p, hb.data(), most * 2, cudaMemcpyHostToDevice));

    Gemm gemm(32u << 20);
    std::printf("%-18s %7s %7s %7s %10s %10s\n", "product", "M", "N", "K", "ms", "TFLOP/s");
    double block_ms = 0, block_flops = 0;
    for (const Product& p : products) {
      auto launch = [&] {
        switch (p.kind) {
          case Product::Forward:
            gemm.linear_forward(a, b, p.bias ? b : nullptr, nullptr, c, DType::BF16, p.M, p.N, p.K, 0);
            break;
          case Product::InputGrad: gemm.linear_backward_input(a, b, c, p.M, p.N, p.K, 0); break;
          case Product::WeightGrad: gemm.linear_backward_weight(a, b, out, p.bias ? x32 : nullptr, p.M, p.N, p.K, 0); break;
        }
      };
      const double m = median_event_ms(launch), flops = 2.0 * p.M * p.N * p.K;
      std::printf("%-18s %7d %7d %7d %10.3f %10.1f\n", p.name, p.M, p.N, p.K, m, flops / (m * 1e-3) / 1e12);
      if (p.in_block) { block_ms += m; block_flops += flops; }
    }
    std::printf("one block's 12 GEMMs: %.3f ms, %.1f TFLOP/s\n", block_ms, block_flops / (block_ms * 1e-3) / 1e12);

    // FP8: random codes from the bf16 operands (scale 1: |x| < ~5, well inside both formats).
    uint8_t *a8, *b8;
    float *one, *amax;
    CUDA_CHECK(cudaMalloc(&a8, most));
    CUDA_CHECK(cudaMalloc(&b8, most));
    CUDA_CHECK(cudaMalloc(&one, 2 * sizeof(float)));
    amax = one + 1;
    fill_constant(one, 2, 1.0f, 0);
    const int rows64 = static_cast<int>(most / 64);
    cast_to_fp8(a, rows64, 64, Fp8Out{Fp8Kind::E5M2, one, a8, nullptr, amax}, 0);  // E5M2 codes: gradients
    cast_to_fp8(b, rows64, 64, Fp8Out{Fp8Kind::E4M3, one, b8, nullptr, amax}, 0);
    struct Fp8Product {
      std::string name;
      int M, N, K;
      DType a_type, y_type;
      bool bias, residual, fast, in_block;
    };
    std::vector<Fp8Product> fp8;
    const struct { const char* name; int n, k; DType y_type; bool residual; } linears[] = {
        {"qkv", 3 * D, D, DType::BF16, false}, {"proj", D, D, DType::F32, true},
        {"fc1", H, D, DType::BF16, false}, {"fc2", D, H, DType::F32, true}};
    for (bool fast : {false, true})
      for (const auto& l : linears)
        fp8.push_back({std::string(l.name) + (fast ? " fwd fast" : " forward"), M, l.n, l.k, DType::E4M3, l.y_type,
                       true, l.residual, fast, fast});
    for (const auto& l : linears)
      fp8.push_back({std::string(l.name) + " input grad", M, l.k, l.n, DType::E5M2, DType::BF16, false, false, false,
                     true});
    for (const auto& l : linears)
      fp8.push_back({std::string(l.name) + " weight grad", l.n, l.k, M, DType::E5M2, DType::F32, false, false, false,
                     true});
    fp8.push_back({"square 8192^3", 8192, 8192, 8192, DType::E4M3, DType::BF16, false, false, false, false});
    fp8.push_back({"square fast", 8192, 8192, 8192, DType::E4M3, DType::BF16, false, false, true, false});
    std::printf("\nFP8\n%-18s %7s %7s %7s %10s %10s\n", "product", "M", "N", "K", "ms", "TFLOP/s");
    block_ms = block_flops = 0;
    for (const Fp8Product& p : fp8) {
      auto launch = [&] {
        gemm.linear_fp8(a8, p.a_type, one, b8, DType::E4M3, one, p.bias ? b : nullptr, p.residual ? x32 : nullptr,
                        p.y_type == DType::F32 ? static_cast<void*>(out) : c, p.y_type, p.M, p.N, p.K, 0, 0, p.fast);
      };
      const double m = median_event_ms(launch), flops = 2.0 * p.M * p.N * p.K;
      std::printf("%-18s %7d %7d %7d %10.3f %10.1f\n", p.name.c_str(), p.M, p.N, p.K, m, flops / (m * 1e-3) / 1e12);
      if (p.in_block) { block_ms += m; block_flops += flops; }
    }
    std::printf("one block's 12 FP8 GEMMs (forward with fast accumulation): %.3f ms, %.1f TFLOP/s\n", block_ms,
                block_flops / (block_ms * 1e-3) / 1e12);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_rate: error: %s\n", e.what());
    return 1;
  }
}
