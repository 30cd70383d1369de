#include "kernels/attention_choice.h"

#include "kernels/attention_operands.h"
#include "kernels/event_timing.h"
#include "kernels/attention.h"

AttentionChoice time_attention(CudnnAttention& cudnn, int B, int T, int H, int hd) {
  const AttentionOperands ops(B, T, H, hd);
  AttentionChoice c;
  // Each forward once first, so that the backwards read a real lse.
  c.engine_forward_ms = median_event_ms([&] { attention_forward(ops.qkv, ops.out, ops.lse, B, T, H, hd, 0); });
  c.engine_backward_ms = median_event_ms(
      [&] { attention_backward(ops.qkv, ops.out, ops.dout, ops.lse, ops.delta, ops.dqkv, B, T, H, hd, 0); });
  c.cudnn_forward_ms = median_event_ms([&] { cudnn.forward(ops.qkv, ops.out, ops.lse, B, T, H, hd, 0); });
  c.cudnn_backward_ms =
      median_event_ms([&] { cudnn.backward(ops.qkv, ops.out, ops.dout, ops.lse, ops.dqkv, B, T, H, hd, 0); });
  return c;  // median_event_ms waited for its last launch
}
