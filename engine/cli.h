// The command line of vit_train: every flag parsed once into a typed value and checked, with one
// clear message per problem (thrown as UsageError, exit code 2). The names a choice has on the
// command line stay here: choice_name() gives them back for messages and reports. Checks that
// need files or the GPU happen in the run plan (engine/run_plan.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/options.h"
#include "engine/schedule.h"
#include "model/config.h"

// --attention: auto (the engine's fastest kernels, or cuDNN's where timed faster at start-up),
// engine (never cuDNN), one family of the engine's kernels, or cuDNN's fused attention.
enum class AttentionKernels { Auto, Engine, SinglePass, Resident, Streamed, Cudnn };
enum class Fp8Scaling { Delayed, Current };
enum class DataKind { Synthetic, FashionMnist, Packed };
enum class ShardOptimizer { Auto, On, Off };
enum class OptimizerKind { Sgd, AdamW };

struct TrainOptions {
  ViTConfig model;
  // The run.
  int gpus = 1;       // worker threads (one GPU each) of this process
  int batch = 64;     // images per rank and micro-batch
  int accum_steps = 1;  // micro-batches whose gradients one optimizer step sums
  int steps = 50;     // optimizer steps; with --epochs, set by set_total_steps() once the dataset's size is known
  int epochs = 0;     // 0: --steps counts the run
  int warmup = -1;    // steps left out of the timing summary; -1: min(10, steps - 1)
  uint64_t seed = 0;  // initial weights, synthetic data, shuffling
  Precision precision = Precision::BF16;
  // Data.
  DataKind data = DataKind::Synthetic;
  std::string data_dir;  // fashion-mnist: the IDX files' folder; packed: DIR (DIR/train, DIR/val)
  int eval_every = 0;    // steps between test-set evaluations; 0: at each epoch's end
  // Optimizer (torch.optim.SGD or AdamW) and loss.
  OptimizerKind optimizer = OptimizerKind::Sgd;
  double lr = 0.001;
  double weight_decay = 0.0;  // SGD: L2 in the gradient; AdamW: decoupled (torch's default 0.01)
  double momentum = 0.9;      // SGD
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double clip_grad = 0;        // clip the gradients' global L2 norm to this (0: off)
  double label_smoothing = 0;  // PyTorch's CrossEntropyLoss(label_smoothing=...)
  double drop_path = 0;        // stochastic depth: timm's drop_path_rate
  LrSchedule::Kind lr_schedule = LrSchedule::Kind::Constant;
  int warmup_steps = 0;  // linear learning-rate warm-up
  // FP8.
  Fp8Scaling fp8_scaling = Fp8Scaling::Delayed;
  int amax_history = 16;
  int fp8_margin = 0;
  bool fp8_stats = false;  // print the FP8 tensors' scales, amaxes, underflow and saturation
  // Kernels and streams.
  AttentionKernels attention = AttentionKernels::Auto;
  // A second stream (engine/second_stream.h) for the backward's weight gradients and the optimizer.
  bool second_stream = true;
  bool gemm_autotune = true;  // time cuBLASLt's candidate algorithms per GEMM shape
  // Data parallel.
  int bucket_mb = 25;  // gradient all-reduce bucket size
  ReduceDType reduce_dtype = ReduceDType::F32;
  bool comm_overlap = true;  // all-reduce each bucket during the backward (false: after it)
  AllReduceMethod allreduce = AllReduceMethod::Auto;
  // The optimizer sharded over the ranks: auto (where the copy engines sum the gradients and no
  // --clip-grad is given), on (the same, an error where it cannot) or off.
  ShardOptimizer shard_optimizer = ShardOptimizer::Auto;
  bool nccl_window = false;  // the all-reduced buffer from ncclMemAlloc, registered as a symmetric window
  int comm_timeout = 300;    // seconds without a finished step before a data-parallel run gives up
  int comm_ctas = 0;         // NCCL's thread blocks at most (0: NCCL's choice)
  // Checkpoints.
  std::string save_dir;   // --save DIR
  int save_every = 0;     // steps between checkpoints (0: only at the end)
  int keep = 3;           // checkpoints kept
  std::string resume;     // --resume DIR: continue from its newest checkpoint
  std::string init_from;  // --init-from FILE: timm safetensors weights
  bool reset_head = false;  // --reset-head: with --init-from, a new head (another class count)
  // Output and profiling.
  int log_every = 10;
  std::string log_file;  // --log FILE: JSON-lines metrics (appended)
  bool timing = false;
  int profile_first = -1, profile_last = -1;  // --profile-steps A:B, inclusive
  std::string trace_file;                     // --trace FILE: a Chrome trace of steps trace_first..trace_last
  int trace_first = -1, trace_last = -1;      // set by set_total_steps
  double peak_tflops = 0;                     // 0: known from the device name
  std::string dump_reference;                 // --dump-reference DIR
  bool eval_only = false;  // --eval-only: the test split's top-1 and top-5 of --init-from or --resume
  bool help = false;
};

// Throws UsageError naming the flag and the problem.
TrainOptions parse_args(const std::vector<std::string>& args);
// Sets the run's length (from --steps, or --epochs once the dataset is read), resolves the
// default timing warm-up and checks the flags that depend on it.
void set_total_steps(TrainOptions& o, int steps);
std::string usage();

// The command line's name of each choice ("fp8", "single-pass", "fashion-mnist", ...).
const char* choice_name(Precision v);
const char* choice_name(AttentionKernels v);
const char* choice_name(Fp8Scaling v);
const char* choice_name(DataKind v);
const char* choice_name(ShardOptimizer v);
const char* choice_name(OptimizerKind v);
const char* choice_name(ReduceDType v);
const char* choice_name(AllReduceMethod v);
const char* choice_name(LrSchedule::Kind v);
