// vit_train: parse the command line, train, and turn every failure into one clear message and
// an exit code (2: usage, 1: run time).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "engine/cli.h"
#include "engine/data_parallel.h"
#include "comm/rendezvous.h"
#include "engine/reference_dump.h"
#include "engine/trainer.h"

int main(int argc, char** argv) {
  try {
    const TrainOptions opts = parse_args(std::vector<std::string>(argv + 1, argv + argc));
    if (opts.help) {
      std::printf("%s", usage().c_str());
      return 0;
    }
    const ProcessGroup group = process_group_from_env([](const char* name) { return std::getenv(name); });
    // VIT_TRAIN_DATA_PARALLEL=1: the data-parallel machinery even for one rank (a test aid: NCCL,
    // buckets and the supervisor exercised on a one-GPU machine).
    const char* force = std::getenv("VIT_TRAIN_DATA_PARALLEL");
    if (group.size > 1 || opts.gpus > 1 || (force && std::string(force) == "1")) {
      if (!opts.dump_reference.empty()) throw UsageError("--dump-reference runs on one GPU in one process");
      return run_data_parallel(opts, group);
    }
    Trainer trainer(opts);
    if (opts.dump_reference.empty())
      trainer.train();
    else
      dump_reference(trainer, opts);
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "vit_train: %s\n(vit_train --help lists the options)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vit_train: error: %s\n", e.what());
    return 1;
  }
}
