// vit_train: parse the command line, plan the run, train, and turn every failure into one clear
// message and an exit code (2: usage, 1: run time).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "comm/rendezvous.h"
#include "engine/cli.h"
#include "engine/data_parallel.h"
#include "engine/reference_dump.h"
#include "engine/run_plan.h"
#include "engine/trainer.h"
#include "kernels/activity_trace.h"
#include "kernels/check.h"

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
    const bool data_parallel = group.size > 1 || opts.gpus > 1 || (force && std::string(force) == "1");
    if (data_parallel && !opts.dump_reference.empty())
      throw UsageError("--dump-reference runs on one GPU in one process");
    if (!opts.trace_file.empty()) ActivityTrace::prepare();  // before the first NVTX range and CUDA call
    RunPlan plan;
    try {
      plan = plan_run(opts, group);  // every input checked before any GPU work
    } catch (const std::exception& e) {
      if (group.size > 1) report_failure_to_job(group, e.what());  // the other processes stop too
      throw;
    }
    if (data_parallel) return run_data_parallel(plan);
    Trainer trainer(plan);
    plan.initial.reset();  // uploaded: the host copy of the weights is not needed again
    if (opts.eval_only)
      trainer.evaluate_only();
    else if (opts.dump_reference.empty())
      trainer.train();
    else
      dump_reference(trainer, plan.opts);
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "vit_train: %s\n(vit_train --help lists the options)\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vit_train: error: %s\n", e.what());
    return 1;
  }
}
