// Phase stamps of the resident attention kernels (kernels/attention_resident_*.cu), for
// tools/attention_trace. Compiled in only with -DATTENTION_TRACE (make attention_trace builds a
// second copy of the kernels so); the kernels vit_train runs carry no stamping code.
// Per CTA kSlots 64-bit words: the start's globaltimer (ns) and clock64, the SM, the end's
// globaltimer and clock64 (the latest of the CTA's warps), and clock64 at each phase below (0
// where the CTA never reached it). Slot + k: k as in the comment.
#pragma once

namespace attention_trace {
constexpr int kSlots = 64;
enum Slot : int {
  kStartNs = 0, kStartClock = 1, kSm = 2, kEndNs = 3, kEndClock = 4,
  // forward
  kFwdIssueBegins = 6, kFwdIssued = 5,  // thread 0's TMA issue
  kFwdLanded = 48,    // + 4 wg + c: warpgroup wg finds tile c landed (on its first query tile)
  kFwdChunk = 8,      // + 4 i + c: query tile i, key chunk c's O += P V issued
  kFwdComplete = 28,  // + i: query tile i's O complete in registers
  kFwdStaged = 32,    // + i: its O / l staged in shared memory
  kFwdStored = 24,    // + i: its O's TMA store issued
  // backward
  kBwdIssueBegins = 47, kBwdIssued = 46,  // thread 128's TMA issue
  kBwdLanded = 8,       // + c: warpgroup 0 finds tile c landed
  kBwdDelta = 42,       // + t: warpgroup 2 has written tile t's delta
  kBwdSlotFull = 12,    // + 4 i + c: warpgroup 0 has filled slot c for query tile i
  kBwdDqComplete = 48,  // + i: dQ_i complete in registers
  kBwdDqStored = 28,    // + i: dQ_i written
  kBwdProducts = 32,    // + 4 j + i: key warpgroup j + 1 done with query tile i's products
  kBwdStaged = 52,      // + 2 part + j: key warpgroup j + 1 has staged dV (part 0) or dK (part 1)
  kBwdWritten = 56,     // + 2 part + j: and issued its TMA stores
};
// Where the stamping kernels write (nullptr: they do not): B H rows of kSlots words, row
// blockIdx.y * gridDim.x + blockIdx.x. Only in the traced build.
void set_buffer(unsigned long long* buffer);
// Its two halves: the forward's and the backward's translation units hold a pointer each.
void set_forward_buffer(unsigned long long* buffer);
void set_backward_buffer(unsigned long long* buffer);
}  // namespace attention_trace
