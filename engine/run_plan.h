// A run, resolved and checked from the options before any GPU work: where this process sits in
// the job, the datasets (read, and checked against the model), what the run starts from (a
// checkpoint or timm weights, read and checked), its length, and where it saves and logs. Every
// user-facing input is checked here or in the command line's parser, so bad input stops the run
// with one message before a GPU is touched; what is left for start-up needs the GPU itself.
#pragma once
#include <memory>
#include <string>

#include "comm/rendezvous.h"
#include "engine/checkpoint_format.h"
#include "engine/cli.h"
#include "engine/dataset.h"
#include "engine/packed_loader.h"

struct RunPlan {
  TrainOptions opts;  // --epochs resolved into steps
  ProcessGroup group;
  int world = 1;  // ranks in the job: processes x --gpus
  // The data, shared by the ranks of this process (read only); all null for the synthetic set.
  std::shared_ptr<const FashionMnist> fashion;
  std::shared_ptr<const PackedSet> packed_train, packed_val;
  int train_count = 0, test_count = 0;
  std::string data_summary;
  // --resume or --init-from; null: timm's initialisation from the seed.
  std::shared_ptr<const InitialState> initial;
  bool logs() const { return group.rank == 0; }  // this process prints and writes (its first rank)
};

// Throws UsageError (bad input) or RuntimeError (a file that cannot be read or written) naming
// the problem.
RunPlan plan_run(const TrainOptions& opts, const ProcessGroup& group);
