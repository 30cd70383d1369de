// Checkpoints: a directory DIR/step-NNNNNNNN per save, written whole or not at all (files
// written and fsynced in a hidden temporary directory, renamed into place, the parent
// fsynced), the newest --keep kept:
//   model.safetensors   the fp32 weights under timm's state_dict names and shapes
//                       (timm: model.load_state_dict(safetensors.torch.load_file(...)), strict)
//   state.safetensors   SGD momentum per tensor ("momentum.<name>"), the FP8 scaling state, the
//                       step and the epoch's running loss, and the run's shape (to refuse a
//                       checkpoint of another model)
//   run.txt             the same facts for a person to read
// The data position is the step: synthetic batches and each epoch's shuffle are functions of
// (seed, step), so a resumed run sees the batches an uninterrupted one would.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint_dir.h"
#include "engine/cli.h"
#include "model/config.h"

class TrainingStep;  // engine/training_step.h

struct CheckpointState {
  int step = 0;              // steps done; the next one to run
  float epoch_loss_sum = 0;  // the running epoch's summed loss, for its mean
};

// Where a run starts when not from the seed, read from disk and checked before any GPU work: a
// checkpoint (weights, momentum, FP8 scaling state, the step) or a timm file (weights only).
struct InitialState {
  std::string source;    // the checkpoint's directory, or the file
  bool resumed = false;  // a checkpoint (--resume), else a timm file (--init-from)
  std::vector<float> params, momentum;  // in the layout's order (model/params.h); momentum empty for timm
  std::vector<uint8_t> fp8_metas;       // the scaling records as the device holds them (empty in bf16)
  int32_t fp8_skipped[2] = {0, 0};
  CheckpointState state;
};

// Saves after `state.step` steps into dir (created if needed) and returns the checkpoint's path;
// removes all but the newest `keep` checkpoints. Synchronises the stream. Throws RuntimeError
// naming the path and the cause (a full disk, no permission); a failed save leaves every earlier
// checkpoint as it was.
std::string save_checkpoint(const std::string& dir, int keep, const CheckpointState& state, TrainingStep& step,
                            const TrainOptions& opts, int world, cudaStream_t stream);

// The lines of a checkpoint's run.txt that say what sets the batches and the learning rates:
// "seed N", "data KIND[:DIR]", "schedule ..." (from the options).
std::string run_schedule_text(const TrainOptions& opts);
// Where this run's seed, data or schedule differ from those in run.txt's text (an earlier
// version's run.txt may lack some: not compared), as "<the checkpoint's line> -> <this run's>".
std::vector<std::string> resume_differences(const std::string& run_txt, const TrainOptions& opts);

// Reads and checks a checkpoint for this run (opts.model, the precision, world ranks). A changed
// seed, data or schedule (run.txt) is allowed, with a note on stderr. Throws UsageError if the
// checkpoint belongs to another model shape or precision, RuntimeError if it is missing,
// truncated or corrupted.
InitialState read_checkpoint(const std::string& path, const TrainOptions& opts, int world);
// Reads a timm safetensors file (e.g. a pretrained model): every tensor of the model must be
// there with its shape, in F32, BF16 or F16, and nothing else (timm's strict load). Throws
// UsageError where it does not fit the model.
InitialState read_timm_weights(const std::string& file, const ViTConfig& model);
// Writes the state into the step's model, optimizer and FP8 recipe (momentum zero where the
// state has none) and refreshes the weight copies. Synchronises the stream.
void upload(const InitialState& initial, TrainingStep& step, cudaStream_t stream);
