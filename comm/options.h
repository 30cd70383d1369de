// How gradients travel between ranks: the choices a run makes (engine/cli.h parses them).
#pragma once

// The dtype the gradients are summed in: fp32 (an exact average) or bf16 (half the bytes; the
// sum rounds to bf16 once).
enum class ReduceDType { F32, BF16 };
// NCCL's all-reduce, or the copy engines between GPUs of one process (comm/peer_group.h); auto
// takes the copy engines where they apply.
enum class AllReduceMethod { Auto, Nccl, CopyEngine };
