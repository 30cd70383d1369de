// Checkpoint directories on disk: DIR/step-NNNNNNNN, each complete one holding model.safetensors
// and state.safetensors (engine/checkpoint.h writes them, engine/checkpoint_format.h reads them).
#pragma once
#include <string>
#include <vector>

constexpr const char* kCheckpointPrefix = "step-";
// The largest step a checkpoint records (--steps is at most this).
constexpr long long kMaxCheckpointStep = 1 << 30;

// Whether path is one complete checkpoint (a directory with model.safetensors and state.safetensors).
// Each must be a regular file, so that reading one never blocks on a FIFO.
bool is_checkpoint_dir(const std::string& path);
// The step in a checkpoint directory's name, or -1 (not step-<digits>, or a step above
// kMaxCheckpointStep).
long long checkpoint_step(const std::string& path);
// The complete checkpoints directly under dir, oldest first (none if there is no such directory).
std::vector<std::string> checkpoints_in(const std::string& dir);
// The newest complete checkpoint directly under dir, or "" (none there, or no such directory).
std::string newest_checkpoint_in(const std::string& dir);
// The newest complete checkpoint under dir (dir itself if it is one); throws if there is none.
std::string latest_checkpoint(const std::string& dir);
// Checks, creating nothing, that dir is a directory this process can write in, or one it can
// create (the first save creates it); throws RuntimeError ("<flag> DIR: cause") otherwise. Used
// up front, so that a run does not end unable to save.
void check_writable_dir(const std::string& dir, const std::string& flag);
