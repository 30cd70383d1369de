// Checkpoints: a directory DIR/step-NNNNNNNN per save, written whole or not at all (files
// written and fsynced in a hidden temporary directory, renamed into place, the parent
// fsynced), the newest --keep kept:
//   model.safetensors   the fp32 weights under timm's state_dict names and shapes
//                       (timm: model.load_state_dict(safetensors.torch.load_file(...)), strict)
//   state.safetensors   the optimizer's state per tensor (SGD: "momentum.<name>"; AdamW:
//                       "exp_avg.<name>", "exp_avg_sq.<name>" and "optimizer.steps"), the FP8
//                       scaling state, the step and the epoch's running loss, and the run's
//                       shape (to refuse a checkpoint of another model)
//   run.txt             the same facts for a person to read
// The data position is the step: synthetic batches and each epoch's shuffle are functions of
// (seed, step), so a resumed run sees the batches an uninterrupted one would. Reading one back
// is engine/checkpoint_format.h's.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint_dir.h"
#include "engine/checkpoint_format.h"
#include "engine/cli.h"

class TrainingStep;  // engine/training_step.h

// Saves after `state.step` steps into dir (created if needed) and returns the checkpoint's path;
// removes all but the newest `keep` checkpoints. Synchronises the stream. Throws RuntimeError
// naming the path and the cause (a full disk, no permission); a failed save leaves every earlier
// checkpoint as it was.
std::string save_checkpoint(const std::string& dir, int keep, const CheckpointState& state, TrainingStep& step,
                            const TrainOptions& opts, int world, cudaStream_t stream);

// Writes the state into the step's model, optimizer and FP8 recipe (momentum zero where the
// state has none) and refreshes the weight copies. Synchronises the stream.
void upload(const InitialState& initial, TrainingStep& step, cudaStream_t stream);
