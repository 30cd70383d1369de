// --gpus N and launcher jobs: one worker thread per GPU in this process, each with its own
// Trainer and NCCL communicator, under a supervisor that stops every rank when one fails (or
// when no step finishes for --comm-timeout seconds). Threads rather than spawned processes: one
// process shares the dataset in host memory, has one exit code and one place that sees every
// worker's failure; across machines, a launcher starts one such process per node or per GPU.
#pragma once
#include <string>

#include "engine/run_plan.h"

// Runs the training; returns the exit code (0, 1 run-time failure, 2 bad input), having
// printed the failure's message. Releases the plan's initial state once every rank has it.
int run_data_parallel(RunPlan& plan);
// A process of a launcher's job that fails before training (its run plan) joins the rendezvous
// only to say so: every other process stops with the cause instead of waiting for it.
void report_failure_to_job(const ProcessGroup& group, const std::string& what);
