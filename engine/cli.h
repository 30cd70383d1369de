// The command line of vit_train: every flag validated here, with one clear message per problem
// (thrown as UsageError, exit code 2). Checks that need the GPU happen at start-up, not here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

struct TrainOptions {
  ViTConfig model;
  int gpus = 1;  // worker threads (one GPU each) of this process
  int bucket_mb = 25;  // gradient all-reduce bucket size
  std::string reduce_dtype = "fp32";  // or "bf16"
  bool comm_overlap = true;  // all-reduce each bucket during the backward (false: after it)
  // How the gradients are summed: "nccl", "copy-engine" (GPUs of one process: cudaMemcpyPeerAsync
  // and a small sum kernel, no NCCL kernel beside the backward), or "auto" (copy-engine where it applies).
  std::string allreduce = "auto";
  // The optimizer sharded over the ranks: "auto" (where the copy engines sum the gradients and no
  // --clip-grad is given), "on" (the same, an error where it cannot) or "off".
  std::string shard_optimizer = "auto";
  // A second stream (ViT::set_second_stream): the backward's weight gradients beside the input
  // gradients and the memory-bound kernels of the critical path; the optimizer beside the next forward.
  bool second_stream = true;
  bool nccl_window = false;  // the all-reduced buffer from ncclMemAlloc, registered as a symmetric window
  int comm_timeout = 300;  // seconds without a finished step before a data-parallel run gives up
  int comm_ctas = 0;  // NCCL's thread blocks at most (0: NCCL's choice)
  std::string precision = "bf16";  // or "fp8"
  // the attention kernels: "auto", "engine", "single-pass", "resident", "streamed" or "cudnn"
  std::string attention = "auto";
  std::string fp8_recipe = "delayed";  // or "current"
  int amax_history = 16;
  int fp8_margin = 0;
  bool fp8_stats = false;  // print the FP8 tensors' scales, amaxes, underflow and saturation
  int batch = 64;
  int steps = 50;   // with --epochs, set by set_total_steps() once the dataset's size is known
  int epochs = 0;   // 0: --steps counts the run
  int warmup = -1;  // steps left out of the timing summary; -1: min(10, steps - 1)
  uint64_t seed = 0;
  std::string data = "synthetic";  // or "fashion-mnist"
  std::string data_dir;            // fashion-mnist: the IDX files' folder
  int eval_every = 0;              // steps between test-set evaluations; 0: at each epoch's end
  double lr = 0.001, momentum = 0.9, weight_decay = 0.0;
  bool nesterov = false;
  double clip_grad = 0;        // clip the gradients' global L2 norm to this (0: off)
  double label_smoothing = 0;  // PyTorch's CrossEntropyLoss(label_smoothing=...)
  std::string lr_schedule = "constant";  // or "cosine"
  int warmup_steps = 0;                  // linear learning-rate warm-up
  int log_every = 10;
  bool timing = false;
  bool gemm_autotune = true;  // time cuBLASLt's candidate algorithms per GEMM shape
  int profile_first = -1, profile_last = -1;  // --profile-steps A:B, inclusive
  std::string dump_reference;                 // --dump-reference DIR
  std::string save_dir;      // --save DIR: checkpoints
  int save_every = 0;        // steps between checkpoints (0: only at the end)
  int keep = 3;              // checkpoints kept
  std::string resume;        // --resume DIR: continue from its newest checkpoint
  std::string init_from;     // --init-from FILE: timm safetensors weights
  std::string log_file;      // --log FILE: JSON-lines metrics (appended)
  double peak_tflops = 0;                     // 0: known from the device name
  bool help = false;
};

// Throws UsageError naming the flag and the problem.
TrainOptions parse_args(const std::vector<std::string>& args);
// Sets the run's length (from --steps, or --epochs once the dataset is read), resolves the
// default timing warm-up and checks the flags that depend on it.
void set_total_steps(TrainOptions& o, int steps);
std::string usage();
