// attention_rate: the engine's fused attention (kernels/attention.h) timed alone at ViT shapes:
// forward, backward and both, CUDA events, median of 20 after 5 untimed. FLOPs as
// FlashAttention counts them: forward 4 B H T^2 hd, backward 2.5x that (the score recompute
// included); tools/attention_bench.py measures PyTorch's cuDNN and flash backends the same way.
// Forward and backward are the default choices; where more than one kernel applies, each is also
// timed on a line of its own.
// cuDNN's fused attention (kernels/cudnn_attention.h), where libcudnn.so.9 loads, is timed the same
// way on the same operands and layout: the library's own yardstick, without PyTorch's layout or
// launch path.
// Usage: attention_rate [B H T HD ...]   (default: ViT-H/16 and ViT-H/14 at batch 64, ViT-L/16 at 384 px,
//                                       ViT-B/16, ViT-S/16 at batch 256)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_operands.h"
#include "kernels/check.h"
#include "kernels/cudnn_attention.h"
#include "kernels/event_timing.h"
#include "kernels/attention.h"
#include "tools/shape_args.h"

int main(int argc, char** argv) {
  std::vector<AttentionShape> shapes;
  if (!parse_shapes(argc, argv, "attention_rate",
                    {{64, 16, 197, 80}, {64, 16, 257, 80}, {32, 16, 577, 64}, {256, 12, 197, 64}, {256, 6, 197, 64}}, &shapes))
    return 2;
  try {
    const std::string no_cudnn = cudnn_attention_unavailable_reason();
    std::unique_ptr<CudnnAttention> cudnn, cudnn_summed;  // the deterministic backward, and dQ summed in fp32
    if (no_cudnn.empty()) {
      cudnn = std::make_unique<CudnnAttention>();
      cudnn_summed = std::make_unique<CudnnAttention>(false);
      std::printf("cuDNN %s\n", CudnnAttention::version_string().c_str());
    } else {
      std::printf("cuDNN not timed: %s\n", no_cudnn.c_str());
    }
    std::printf("%-22s %10s %10s %10s %12s %12s\n", "B H T hd", "fwd ms", "bwd ms", "both ms", "fwd TFLOP/s",
                "both TFLOP/s");
    for (const auto& s : shapes) {
      const int B = s.B, H = s.H, T = s.T, hd = s.hd;
      const std::string why = attention_unsupported_reason(T, hd);
      if (!why.empty()) {
        std::printf("%d %d %d %d: not supported (%s)\n", B, H, T, hd, why.c_str());
        continue;
      }
      const AttentionOperands ops(B, T, H, hd);
      __nv_bfloat16 *qkv = ops.qkv, *out = ops.out, *dout = ops.dout, *dqkv = ops.dqkv;
      float *lse = ops.lse, *delta = ops.delta;
      auto fwd = [&] { attention_forward(qkv, out, lse, B, T, H, hd, 0); };
      auto bwd = [&] { attention_backward(qkv, out, dout, lse, delta, dqkv, B, T, H, hd, 0); };
      fwd();
      const double f = median_event_ms(fwd), b = median_event_ms(bwd), both = median_event_ms([&] { fwd(); bwd(); });
      const double flop = 4.0 * B * H * double(T) * T * hd;
      char name[64];
      std::snprintf(name, sizeof name, "%d %d %d %d", B, H, T, hd);
      std::printf("%-22s %10.3f %10.3f %10.3f %12.1f %12.1f\n", name, f, b, both, flop / (f * 1e-3) / 1e12,
                  3.5 * flop / (both * 1e-3) / 1e12);
      std::printf("RESULT attention shape=%d,%d,%d,%d fwd_ms=%.4f bwd_ms=%.4f both_ms=%.4f\n", B, H, T, hd, f, b, both);
      // Every backward path where more than one applies, whichever the default took.
      std::vector<std::pair<AttentionBackward, const char*>> kinds = {{AttentionBackward::Streamed, "streamed"}};
      if (attention_single_pass_supported(T, hd)) kinds.push_back({AttentionBackward::SinglePass, "single_pass"});
      if (attention_resident_supported(T, hd)) kinds.push_back({AttentionBackward::Resident, "resident"});
      if (kinds.size() > 1)  // with one, the line above is its
        for (const auto& [kind, label] : kinds) {
          const double ms =
              median_event_ms([&] { attention_backward(qkv, out, dout, lse, delta, dqkv, B, T, H, hd, 0, kind); });
          std::printf("%-22s %10s %10.3f %10s   (%s backward)\n", name, "", ms, "", label);
          std::printf("RESULT attention_%s shape=%d,%d,%d,%d bwd_ms=%.4f\n", label, B, H, T, hd, ms);
        }
      // Both forwards where the resident one applies.
      if (attention_forward_resident_supported(T, hd))
        for (const auto& [kind, label] : {std::pair{AttentionForward::Streamed, "streamed"},
                                          std::pair{AttentionForward::Resident, "resident"}}) {
          const double ms = median_event_ms([&] { attention_forward(qkv, out, lse, B, T, H, hd, 0, kind); });
          std::printf("%-22s %10.3f %10s %10s   (%s forward)\n", name, ms, "", "", label);
          std::printf("RESULT attention_fwd_%s shape=%d,%d,%d,%d fwd_ms=%.4f\n", label, B, H, T, hd, ms);
        }
      for (CudnnAttention* c : {cudnn.get(), cudnn_summed.get()}) {
        if (!c) continue;
        c->prepare(B, T, H, hd);
        const auto cf = [&] { c->forward(qkv, out, lse, B, T, H, hd, 0); };
        const auto cb = [&] { c->backward(qkv, out, dout, lse, dqkv, B, T, H, hd, 0); };
        cf();
        const double f2 = median_event_ms(cf), b2 = median_event_ms(cb), both2 = median_event_ms([&] { cf(); cb(); });
        const bool det = c->backward_deterministic(B, T, H, hd);
        std::printf("%-22s %10.3f %10.3f %10.3f %12.1f %12.1f   (cuDNN, backward %sdeterministic; engine / cuDNN %.2f)\n",
                    name, f2, b2, both2, flop / (f2 * 1e-3) / 1e12, 3.5 * flop / (both2 * 1e-3) / 1e12, det ? "" : "not ",
                    both / both2);
        std::printf("RESULT %s shape=%d,%d,%d,%d fwd_ms=%.4f bwd_ms=%.4f both_ms=%.4f deterministic=%d\n",
                    c == cudnn.get() ? "attention_cudnn" : "attention_cudnn_summed", B, H, T, hd, f2, b2, both2, int(det));
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_rate: error: %s\n", e.what());
    return 1;
  }
}
