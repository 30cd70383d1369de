// --attention auto between the engine's kernels and cuDNN's fused attention: each direction
// (forward, backward) timed on this card at the model's shape at start-up, the engine's own
// auto choice (kernels/attention.h) against cuDNN's, and cuDNN taken only where it is faster by
// more than a margin (a near tie keeps the engine's kernels, so that the choice does not flip
// between runs on timing noise). Which side wins depends on the head dim and the token count,
// and on the cuDNN version, so it is timed rather than assumed.
#pragma once
#include "kernels/cudnn_attention.h"

struct AttentionChoice {
  double engine_forward_ms = 0, cudnn_forward_ms = 0, engine_backward_ms = 0, cudnn_backward_ms = 0;
  bool cudnn_forward = false, cudnn_backward = false;  // set by decide()
  // cuDNN where its time is below (1 - kMargin) times the engine's.
  static constexpr double kMargin = 0.05;
  void decide() {
    cudnn_forward = cudnn_forward_ms < (1 - kMargin) * engine_forward_ms;
    cudnn_backward = cudnn_backward_ms < (1 - kMargin) * engine_backward_ms;
  }
};

// Both sides' times on fresh random operands of the shape (median of 20 after 5, as the rate
// tools time: kernels/event_timing.h); allocates the operands for the call, frees them, and
// synchronises. cuDNN's plans must be prepared. decide() is left to the caller (the ranks sum
// their times first, so that every rank decides alike).
AttentionChoice time_attention(CudnnAttention& cudnn, int B, int T, int H, int hd);
