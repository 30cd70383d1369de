// A checkpoint's safetensors files on the host (engine/checkpoint.h saves them from the device),
// and timm files read as a starting point. Reading checks everything before any GPU work: each
// tensor's name, dtype, shape and finiteness, the FP8 scaling records' values, the recorded
// step; a problem is one message naming the file and the tensor.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cli.h"
#include "engine/safetensors.h"
#include "model/config.h"

struct CheckpointState {
  int step = 0;              // steps done; the next one to run
  float epoch_loss_sum = 0;  // the running epoch's summed loss, for its mean
};

// What a checkpoint holds (weights, optimizer state, FP8 scaling state, the step), or a timm
// file's weights: where a run starts when not from the seed.
struct InitialState {
  std::string source;    // the checkpoint's directory, or the file
  bool resumed = false;  // a checkpoint (--resume), else a timm file (--init-from)
  std::vector<float> params;  // in the layout's order (model/params.h)
  // Per layout tensor: whether params holds it (a new head under --reset-head keeps the seed's
  // initialisation, as timm initialises one); empty: every tensor.
  std::vector<char> loaded;
  // The optimizer's state buffers by name (engine/optimizer.h's optimizer_state_names), each in
  // the layout's order; none for a timm file. AdamW's updates made (its bias correction's t).
  std::vector<std::pair<std::string, std::vector<float>>> optimizer_state;
  int64_t optimizer_steps = 0;
  std::vector<uint8_t> fp8_metas;       // the scaling records as the device holds them (empty in bf16)
  int32_t fp8_skipped[2] = {0, 0};
  CheckpointState state;
  // What a resumed run does differently from the checkpoint's (a batch, a seed, a schedule):
  // its loss sequence differs from the uninterrupted run's. One line each, for stderr.
  std::vector<std::string> differences;
  // What a timm file needed to fit the model (a position embedding resampled, a head reset).
  std::vector<std::string> adaptations;
};

// The facts a checkpoint records about its run (state.safetensors' run.shape), in order: the
// first kRunFactsMustMatch (the model's shape and the precision) must match a resuming run's;
// the others (batch, ranks, FP8 recipe) only change the losses.
std::vector<int64_t> run_facts(const ViTConfig& model, const TrainOptions& opts, int world);
extern const char* const kRunFactNames[];
constexpr size_t kRunFactsMustMatch = 9;

// Writes contents as dir/model.safetensors and dir/state.safetensors (each atomically), with the
// run's facts (run_facts); contents.params and each optimizer buffer follow the layout of model.
void write_checkpoint_files(const std::string& dir, const ViTConfig& model, const InitialState& contents,
                            const std::vector<int64_t>& facts);

// The lines of a checkpoint's run.txt that say what sets the batches and the updates: "seed N",
// "data KIND[:DIR]", "schedule ...", "optimizer ..." (from the options).
std::string run_schedule_text(const TrainOptions& opts);
// Where this run's seed, data or schedule differ from those in run.txt's text (an earlier
// version's run.txt may lack some: not compared), as "<the checkpoint's line> -> <this run's>".
std::vector<std::string> resume_differences(const std::string& run_txt, const TrainOptions& opts);

// Reads and checks a checkpoint for this run (opts.model, the precision, world ranks). A changed
// batch, rank count, FP8 recipe, seed, data or schedule (run.txt) is allowed and listed in
// `differences`. Throws UsageError if the
// checkpoint belongs to another model shape or precision, RuntimeError if it is missing,
// truncated, corrupted or holds a non-finite value.
InitialState read_checkpoint(const std::string& path, const TrainOptions& opts, int world);
// The same over files already open (the fuzz target's entry): state and weights are the
// checkpoint's state.safetensors and model.safetensors; path names the checkpoint in messages.
InitialState read_checkpoint_files(const std::string& path, const SafetensorsFile& state,
                                   const SafetensorsFile& weights, const TrainOptions& opts, int world);
// Reads a timm safetensors file (e.g. a pretrained model): every tensor of the model must be
// there with its shape, in F32, BF16 or F16, finite, and nothing else (timm's strict load), but
// for what fine-tuning changes, as timm's own loading adapts it: a position embedding of
// another patch grid (another image size) is resampled as timm.layers.resample_abs_pos_embed
// does; with reset_head (--reset-head) the file's head, of any class count or none (a model
// saved with num_classes=0), is left out and the model's own initialisation kept. Throws
// UsageError where it does not fit the model (naming the tensor), RuntimeError where it is
// damaged.
InitialState read_timm_weights(const std::string& file, const ViTConfig& model, bool reset_head = false);
