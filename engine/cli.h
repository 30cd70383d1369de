// The command line of vit_train: every flag validated here, with one clear message per problem
// (thrown as UsageError, exit code 2). Checks that need the GPU happen at start-up, not here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

struct TrainOptions {
  ViTConfig model;
  int gpus = 1;
  std::string precision = "bf16";
  int batch = 64;
  int steps = 50;
  int warmup = 10;  // steps left out of the timing summary; capped below --steps unless given
  uint64_t seed = 0;
  double lr = 0.001, momentum = 0.9, weight_decay = 0.0;
  bool nesterov = false;
  int log_every = 10;
  bool timing = false;
  bool gemm_autotune = true;  // time cuBLASLt's candidate algorithms per GEMM shape
  int profile_first = -1, profile_last = -1;  // --profile-steps A:B, inclusive
  std::string dump_reference;                 // --dump-reference DIR
  double peak_tflops = 0;                     // 0: known from the device name
  bool help = false;
};

// Throws UsageError naming the flag and the problem.
TrainOptions parse_args(const std::vector<std::string>& args);
std::string usage();
