#include "engine/cli.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "engine/checkpoint_dir.h"
#include "engine/dataset.h"
#include "kernels/check.h"

namespace {
[[noreturn]] void bad(const std::string& msg) { throw UsageError(msg); }

// A number as a person writes it: 0.001, 1e+06, 0 (not std::to_string's 0.000000).
std::string number(double x) {
  char s[32];
  std::snprintf(s, sizeof s, "%g", x);
  return s;
}

long long parse_int(const std::string& flag, const std::string& v, long long lo, long long hi) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE) bad(flag + " expects an integer, got '" + v + "'");
  if (x < lo || x > hi)
    bad(flag + " must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + v);
  return x;
}

double parse_double(const std::string& flag, const std::string& v, double lo, double hi) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(x))
    bad(flag + " expects a number, got '" + v + "'");
  if (x < lo || x > hi) bad(flag + " must be between " + number(lo) + " and " + number(hi) + ", got " + v);
  return x;
}

// Each choice's name on the command line, in the order --help lists them.
template <class E>
struct Choice {
  const char* name;
  E value;
};
constexpr Choice<Precision> kPrecision[] = {{"bf16", Precision::BF16}, {"fp8", Precision::FP8}};
constexpr Choice<AttentionKernels> kAttention[] = {
    {"auto", AttentionKernels::Auto},         {"engine", AttentionKernels::Engine},
    {"single-pass", AttentionKernels::SinglePass}, {"resident", AttentionKernels::Resident},
    {"streamed", AttentionKernels::Streamed}, {"cudnn", AttentionKernels::Cudnn}};
constexpr Choice<Fp8Scaling> kFp8Scaling[] = {{"delayed", Fp8Scaling::Delayed}, {"current", Fp8Scaling::Current}};
constexpr Choice<DataKind> kData[] = {
    {"synthetic", DataKind::Synthetic}, {"fashion-mnist", DataKind::FashionMnist}, {"packed", DataKind::Packed}};
constexpr Choice<ShardOptimizer> kShard[] = {
    {"auto", ShardOptimizer::Auto}, {"on", ShardOptimizer::On}, {"off", ShardOptimizer::Off}};
constexpr Choice<ReduceDType> kReduceDType[] = {{"fp32", ReduceDType::F32}, {"bf16", ReduceDType::BF16}};
constexpr Choice<AllReduceMethod> kAllReduce[] = {
    {"auto", AllReduceMethod::Auto}, {"nccl", AllReduceMethod::Nccl}, {"copy-engine", AllReduceMethod::CopyEngine}};
constexpr Choice<LrSchedule::Kind> kSchedule[] = {
    {"constant", LrSchedule::Kind::Constant}, {"cosine", LrSchedule::Kind::Cosine}};
constexpr Choice<bool> kOnOff[] = {{"on", true}, {"off", false}};
constexpr Choice<OptimizerKind> kOptimizer[] = {{"sgd", OptimizerKind::Sgd}, {"adamw", OptimizerKind::AdamW}};

template <class E, size_t N>
const char* name_in(const Choice<E> (&table)[N], E v) {
  for (const Choice<E>& c : table)
    if (c.value == v) return c.name;
  return "?";
}

// "a, b or c"
template <class E, size_t N>
std::string alternatives(const Choice<E> (&table)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) s += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + table[i].name;
  return s;
}

// label names the flag in the message ("precision" for --precision, else the flag itself).
template <class E, size_t N>
E parse_choice(const std::string& label, const std::string& v, const Choice<E> (&table)[N]) {
  for (const Choice<E>& c : table)
    if (v == c.name) return c.value;
  bad("unknown " + label + " '" + v + "'; choose " + alternatives(table));
}
}  // namespace

const char* choice_name(Precision v) { return name_in(kPrecision, v); }
const char* choice_name(AttentionKernels v) { return name_in(kAttention, v); }
const char* choice_name(Fp8Scaling v) { return name_in(kFp8Scaling, v); }
const char* choice_name(DataKind v) { return name_in(kData, v); }
const char* choice_name(ShardOptimizer v) { return name_in(kShard, v); }
const char* choice_name(OptimizerKind v) { return name_in(kOptimizer, v); }
const char* choice_name(ReduceDType v) { return name_in(kReduceDType, v); }
const char* choice_name(AllReduceMethod v) { return name_in(kAllReduce, v); }
const char* choice_name(LrSchedule::Kind v) { return name_in(kSchedule, v); }

std::string usage() {
  return std::string(R"(usage: vit_train [options]
Trains a Vision Transformer (timm's, parameter for parameter) on Hopper GPUs.
Default: ViT-Huge/16, batch 64, bf16, 50 steps on synthetic data, one GPU.

run:
  --model NAME           a preset (default vit_h16), one of
    )") + vit_preset_names() + R"(
  --img N --patch N --channels N --classes N --dim N --depth N --heads N
  --mlp-ratio X          override any of the preset's shape
  --batch N              images per GPU and micro-batch (default 64)
  --accum-steps K        micro-batches per optimizer step, their gradients
                         summed (default 1): a global batch of K x batch x
                         GPUs; steps, the schedule, logs and checkpoints
                         count optimizer steps
  --steps N              training (optimizer) steps (default 50)
  --epochs N             passes over the training set (instead of --steps)
  --precision P          bf16 (default) or fp8 (the blocks' Linear layers)
  --gpus N               GPUs of this machine, a worker thread each (default 1)
  --seed N               initial weights, synthetic data, shuffling (default 0)
data:
  --data D               synthetic (default: N(0,1) images made on the GPU),
                         fashion-mnist[:DIR] (IDX files; default DIR
                         /usr/share/datasets/fashion-mnist; needs --img 28
                         --channels 1 --classes 10) or packed:DIR (DIR/train,
                         optionally DIR/val, written by pack_images)
  --eval-every N         test top-1 every N steps (default: each epoch's end)
optimizer (fp32 master weights and state):
  --optimizer O          sgd (default: torch.optim.SGD) or adamw
                         (torch.optim.AdamW, timm's groups: no weight decay
                         on norms, biases, pos_embed and cls_token)
  --lr X                 learning rate (default 0.001)
  --weight-decay X       sgd: L2 added to the gradient (default 0); adamw:
                         decoupled (default 0.01)
  --momentum X           sgd (default 0.9)
  --nesterov             sgd: Nesterov momentum
  --betas B1,B2          adamw (default 0.9,0.999)
  --eps X                adamw (default 1e-08)
  --lr-schedule S        constant (default) or cosine (to zero at the run's end)
  --warmup-steps N       linear learning-rate warm-up (default 0)
  --clip-grad X          clip the gradients' global L2 norm to X
  --label-smoothing X    cross-entropy against (1 - X) onehot + X / classes
  --drop-path X          stochastic depth as timm's drop_path_rate: per sample,
                         rates rising linearly over the blocks to X (default 0)
checkpoints:
  --save DIR             checkpoints under DIR (timm-loadable weights, optimizer
                         and FP8 state); a DIR with checkpoints only with
                         --resume from it
  --save-every N         every N steps (default: at the end only)
  --keep K               the newest K kept (default 3)
  --resume DIR           continue from DIR's newest checkpoint
  --init-from FILE       start from a timm safetensors file (strict load; a
                         position embedding of another grid is resampled)
  --reset-head           with --init-from: a new head, initialised as timm does
                         (the file's has another class count, or none)
  --eval-only            with --init-from or --resume: no training; top-1 and
                         top-5 on the dataset's test split, and images/s
output and profiling:
  --log-every N          a progress line every N steps (default 10)
  --log FILE             append JSON lines (loss, lr, images/s, evaluations,
                         checkpoints; tools/plot_metrics.py draws them)
  --warmup N             first steps left out of the timing summary (default
                         10, fewer on short runs)
  --timing               per-phase and per-op CUDA-event breakdown (one stream;
                         synchronises every step)
  --profile-steps A:B    cudaProfilerStart/Stop around steps A..B
  --trace FILE           the kernels, copies and memsets of every stream and the
                         NVTX ranges of --profile-steps A:B (default: the three
                         steps after the warm-up) as a Chrome trace (JSON) for
                         ui.perfetto.dev; tools/trace_timeline.py draws a PNG
                         (CUPTI records them: those steps run a little slower)
  --peak-tflops X        dense peak for MFU on a GPU the engine does not know
  --dump-reference DIR   what tools/timm_reference.py checks against timm
FP8 (with --precision fp8):
  --fp8-recipe R         delayed (default: scale from an amax history) or
                         current (from the tensor's own amax)
  --amax-history N       delayed: amaxes remembered (default 16), one a
                         micro-batch under --accum-steps
  --fp8-margin M         scale = fp8_max / amax / 2^M (default 0)
  --fp8-stats            per tensor kind at each progress line: scales, amax,
                         underflow and saturation (a little slower)
kernels and streams:
  --attention A          auto (default: the engine's fastest, or cuDNN's where
                         timed faster at start-up), engine, single-pass,
                         resident, streamed or cudnn
  --second-stream on|off weight gradients and optimizer on a second stream
                         (default on; one stream under --timing)
  --no-gemm-autotune     cuBLASLt's first choice instead of timing candidates
several GPUs:
  --bucket-mb N          gradient bucket size in MB (default 25)
  --reduce-dtype D       fp32 (default) or bf16: what gradients are summed in
  --comm-overlap on|off  sum each bucket during the backward (default on)
  --allreduce A          auto (default), nccl or copy-engine (GPUs of one
                         process, peer to peer, no NCCL kernel)
  --shard-optimizer S    auto (default: with the copy engines and no
                         --clip-grad), on or off
  --nccl-window on|off   experimental: sum in NCCL-registered memory (off)
  --comm-timeout S       stop if no step finishes for S seconds (default 300)
  --comm-ctas N          NCCL uses at most N thread blocks (default: its choice)
  --help                 this text
)";
}

TrainOptions parse_args(const std::vector<std::string>& args) {
  TrainOptions o;
  std::set<std::string> given;  // the valued flags on the command line, and --nesterov
  // The preset first, so that overrides apply whatever their position.
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--model") {
      if (i + 1 >= args.size()) bad("--model needs a value");
      if (!vit_preset(args[i + 1], &o.model))
        bad("unknown model '" + args[i + 1] + "'; choose one of " + vit_preset_names());
    }
  }
  ViTConfig& m = o.model;
  const int kBig = 1 << 20;
  using Setter = std::function<void(const std::string&, const std::string&)>;
  const std::map<std::string, Setter> valued = {
      {"--model", [](const std::string&, const std::string&) {}},
      {"--gpus", [&](const std::string& f, const std::string& v) { o.gpus = parse_int(f, v, 1, 1024); }},
      {"--bucket-mb", [&](const std::string& f, const std::string& v) { o.bucket_mb = parse_int(f, v, 1, 1 << 16); }},
      {"--reduce-dtype", [&](const std::string& f, const std::string& v) { o.reduce_dtype = parse_choice(f, v, kReduceDType); }},
      {"--comm-overlap", [&](const std::string& f, const std::string& v) { o.comm_overlap = parse_choice(f, v, kOnOff); }},
      {"--allreduce", [&](const std::string& f, const std::string& v) { o.allreduce = parse_choice(f, v, kAllReduce); }},
      {"--shard-optimizer", [&](const std::string& f, const std::string& v) { o.shard_optimizer = parse_choice(f, v, kShard); }},
      {"--second-stream", [&](const std::string& f, const std::string& v) { o.second_stream = parse_choice(f, v, kOnOff); }},
      {"--nccl-window", [&](const std::string& f, const std::string& v) { o.nccl_window = parse_choice(f, v, kOnOff); }},
      {"--comm-timeout", [&](const std::string& f, const std::string& v) { o.comm_timeout = parse_int(f, v, 5, 1 << 20); }},
      {"--comm-ctas", [&](const std::string& f, const std::string& v) { o.comm_ctas = parse_int(f, v, 0, 64); }},
      {"--precision", [&](const std::string&, const std::string& v) { o.precision = parse_choice("precision", v, kPrecision); }},
      {"--attention", [&](const std::string& f, const std::string& v) { o.attention = parse_choice(f, v, kAttention); }},
      {"--fp8-recipe", [&](const std::string& f, const std::string& v) { o.fp8_scaling = parse_choice(f, v, kFp8Scaling); }},
      {"--amax-history", [&](const std::string& f, const std::string& v) { o.amax_history = parse_int(f, v, 1, 1024); }},
      {"--fp8-margin", [&](const std::string& f, const std::string& v) { o.fp8_margin = parse_int(f, v, 0, 16); }},
      {"--batch", [&](const std::string& f, const std::string& v) { o.batch = parse_int(f, v, 1, kBig); }},
      {"--accum-steps", [&](const std::string& f, const std::string& v) { o.accum_steps = parse_int(f, v, 1, 4096); }},
      {"--steps", [&](const std::string& f, const std::string& v) { o.steps = parse_int(f, v, 1, 1 << 30); }},
      {"--epochs", [&](const std::string& f, const std::string& v) { o.epochs = parse_int(f, v, 1, 100000); }},
      {"--warmup", [&](const std::string& f, const std::string& v) { o.warmup = parse_int(f, v, 0, 1 << 30); }},
      {"--data", [&](const std::string& f, const std::string& v) {
         const std::string kind = v.substr(0, v.find(':'));
         bool known = false;
         for (const Choice<DataKind>& c : kData)
           if (kind == c.name) o.data = c.value, known = true;
         if (!known) bad("unknown dataset '" + v + "'; choose synthetic, fashion-mnist[:DIR] or packed:DIR");
         o.data_dir = v.find(':') == std::string::npos ? "" : v.substr(v.find(':') + 1);
         const bool colon = v.find(':') != std::string::npos;
         if (o.data == DataKind::Synthetic && colon) bad(f + " synthetic takes no directory");
         if (o.data == DataKind::FashionMnist && colon && o.data_dir.empty())
           bad(f + " fashion-mnist: needs a directory after the colon");
         if (o.data == DataKind::Packed && o.data_dir.empty())
           bad(f + " packed:DIR needs the directory (DIR/train, DIR/val from pack_images)");
       }},
      {"--eval-every", [&](const std::string& f, const std::string& v) { o.eval_every = parse_int(f, v, 1, 1 << 30); }},
      {"--lr-schedule", [&](const std::string& f, const std::string& v) { o.lr_schedule = parse_choice(f, v, kSchedule); }},
      {"--warmup-steps", [&](const std::string& f, const std::string& v) { o.warmup_steps = parse_int(f, v, 0, 1 << 30); }},
      {"--seed", [&](const std::string& f, const std::string& v) { o.seed = parse_int(f, v, 0, (1LL << 62)); }},
      {"--img", [&](const std::string& f, const std::string& v) { m.img = parse_int(f, v, 1, 8192); }},
      {"--patch", [&](const std::string& f, const std::string& v) { m.patch = parse_int(f, v, 1, 8192); }},
      {"--channels", [&](const std::string& f, const std::string& v) { m.channels = parse_int(f, v, 1, 64); }},
      {"--classes", [&](const std::string& f, const std::string& v) { m.classes = parse_int(f, v, 1, kBig); }},
      {"--dim", [&](const std::string& f, const std::string& v) { m.dim = parse_int(f, v, 1, 65536); }},
      {"--depth", [&](const std::string& f, const std::string& v) { m.depth = parse_int(f, v, 1, 1024); }},
      {"--heads", [&](const std::string& f, const std::string& v) { m.heads = parse_int(f, v, 1, 1024); }},
      {"--mlp-ratio", [&](const std::string& f, const std::string& v) { m.mlp_ratio = parse_double(f, v, 1e-3, 64); }},
      {"--lr", [&](const std::string& f, const std::string& v) { o.lr = parse_double(f, v, 0, 1e3); }},
      {"--momentum", [&](const std::string& f, const std::string& v) { o.momentum = parse_double(f, v, 0, 0.999999); }},
      {"--weight-decay", [&](const std::string& f, const std::string& v) { o.weight_decay = parse_double(f, v, 0, 1e3); }},
      {"--optimizer", [&](const std::string& f, const std::string& v) { o.optimizer = parse_choice(f, v, kOptimizer); }},
      {"--betas", [&](const std::string& f, const std::string& v) {
         const size_t comma = v.find(',');
         if (comma == std::string::npos) bad(f + " expects B1,B2 (e.g. 0.9,0.999), got '" + v + "'");
         o.beta1 = parse_double(f, v.substr(0, comma), 0, 0.999999);
         o.beta2 = parse_double(f, v.substr(comma + 1), 0, 0.999999999);
       }},
      {"--eps", [&](const std::string& f, const std::string& v) { o.eps = parse_double(f, v, 1e-30, 1); }},
      {"--clip-grad", [&](const std::string& f, const std::string& v) { o.clip_grad = parse_double(f, v, 1e-6, 1e9); }},
      {"--label-smoothing", [&](const std::string& f, const std::string& v) { o.label_smoothing = parse_double(f, v, 0, 0.999); }},
      {"--drop-path", [&](const std::string& f, const std::string& v) { o.drop_path = parse_double(f, v, 0, 0.99); }},
      {"--log-every", [&](const std::string& f, const std::string& v) { o.log_every = parse_int(f, v, 1, 1 << 30); }},
      {"--peak-tflops", [&](const std::string& f, const std::string& v) { o.peak_tflops = parse_double(f, v, 1e-3, 1e6); }},
      {"--save", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a directory"); o.save_dir = v; }},
      {"--save-every", [&](const std::string& f, const std::string& v) { o.save_every = parse_int(f, v, 1, 1 << 30); }},
      {"--keep", [&](const std::string& f, const std::string& v) { o.keep = parse_int(f, v, 1, 1 << 20); }},
      {"--resume", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a directory"); o.resume = v; }},
      {"--init-from", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a file"); o.init_from = v; }},
      {"--log", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a file"); o.log_file = v; }},
      {"--trace", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a file"); o.trace_file = v; }},
      {"--dump-reference", [&](const std::string&, const std::string& v) {
         if (v.empty()) bad("--dump-reference needs a directory");
         o.dump_reference = v;
       }},
      {"--profile-steps", [&](const std::string& f, const std::string& v) {
         const size_t colon = v.find(':');
         if (colon == std::string::npos) bad(f + " expects A:B (first and last step, inclusive), got '" + v + "'");
         o.profile_first = parse_int(f, v.substr(0, colon), 0, 1 << 30);
         o.profile_last = parse_int(f, v.substr(colon + 1), 0, 1 << 30);
         if (o.profile_last < o.profile_first) bad(f + ": the last step comes before the first in '" + v + "'");
       }},
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") { o.help = true; continue; }
    if (a == "--nesterov") { o.nesterov = true; given.insert(a); continue; }
    if (a == "--timing") { o.timing = true; continue; }
    if (a == "--eval-only") { o.eval_only = true; continue; }
    if (a == "--reset-head") { o.reset_head = true; continue; }
    if (a == "--fp8-stats") { o.fp8_stats = true; continue; }
    if (a == "--no-gemm-autotune") { o.gemm_autotune = false; continue; }
    std::string flag = a, value;
    const size_t eq = a.find('=');
    const bool inline_value = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) { flag = a.substr(0, eq); value = a.substr(eq + 1); }
    const auto it = valued.find(flag);
    if (it == valued.end()) bad("unknown option '" + a + "'");
    if (!inline_value) {
      if (i + 1 >= args.size()) bad(flag + " needs a value");
      value = args[++i];
      // "--log --timing": the value forgotten, not a file named --timing (--flag=VALUE takes any).
      if (value.rfind("--", 0) == 0) bad(flag + " needs a value, got the option '" + value + "'");
    }
    given.insert(flag);
    it->second(flag, value);
  }
  if (o.help) return o;
  try {
    m.validate();
  } catch (const std::invalid_argument& e) {
    bad(std::string("invalid model shape: ") + e.what());
  }
  try {
    m.validate_batch(o.batch);
  } catch (const std::invalid_argument& e) {
    bad(std::string("--batch: ") + e.what());
  }
  if (o.optimizer == OptimizerKind::Sgd) {
    for (const char* f : {"--betas", "--eps"})
      if (given.count(f)) bad(std::string(f) + " applies to --optimizer adamw");
    if (o.nesterov && o.momentum <= 0) bad("--nesterov needs a positive --momentum (as in torch.optim.SGD)");
  } else {
    for (const char* f : {"--momentum", "--nesterov"})
      if (given.count(f)) bad(std::string(f) + " applies to --optimizer sgd");
    if (!given.count("--weight-decay")) o.weight_decay = 0.01;  // torch.optim.AdamW's default
  }
  if (o.data == DataKind::Synthetic) {
    if (o.epochs > 0) bad("--epochs needs a dataset with a size (--data fashion-mnist); use --steps");
    if (o.eval_every > 0) bad("--eval-every needs a dataset with a test split (--data fashion-mnist)");
  } else if (o.data == DataKind::Packed) {
    if (m.channels != 3) bad("--data packed holds RGB images: give --channels 3");
    struct stat st;
    if (::stat((o.data_dir + "/train").c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      bad("--data packed:" + o.data_dir + ": no " + o.data_dir + "/train directory (pack_images SRC " + o.data_dir + "/train)");
    if (o.eval_every > 0 && (::stat((o.data_dir + "/val").c_str(), &st) != 0 || !S_ISDIR(st.st_mode)))
      bad("--eval-every needs a test split: no " + o.data_dir + "/val directory (pack_images SRC " + o.data_dir + "/val)");
  } else {
    if (m.img != 28 || m.channels != 1 || m.classes != 10)
      bad("--data fashion-mnist holds 28x28 grey images of 10 classes: give --img 28 --channels 1 --classes 10");
    if (o.data_dir.empty()) o.data_dir = FashionMnist::kDefaultDir;
    struct stat st;
    if (::stat(o.data_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      bad("--data fashion-mnist: " + o.data_dir + " is not a directory" +
          (o.data_dir == FashionMnist::kDefaultDir ? " (apt-get install dataset-fashion-mnist)" : ""));
  }
  if (o.epochs > 0 && given.count("--steps")) bad("give --steps or --epochs, not both");
  if (o.fp8_stats && o.precision != Precision::FP8) bad("--fp8-stats needs --precision fp8");
  if (!o.dump_reference.empty() && (o.data != DataKind::Synthetic || o.lr_schedule != LrSchedule::Kind::Constant ||
                                    o.warmup_steps > 0 || o.precision != Precision::BF16 || o.clip_grad > 0 ||
                                    o.label_smoothing > 0 || o.accum_steps > 1))
    bad("--dump-reference replays the synthetic data at a constant learning rate in timm's bf16 autocast: it takes "
        "neither --data, --lr-schedule cosine, --warmup-steps, --precision fp8, --clip-grad, --label-smoothing nor "
        "--accum-steps");
  if (!o.dump_reference.empty() && o.gpus > 1) bad("--dump-reference runs on one GPU (--gpus 1)");
  if (o.allreduce == AllReduceMethod::CopyEngine && (o.reduce_dtype != ReduceDType::F32 || o.nccl_window))
    bad("--allreduce copy-engine sums fp32 gradients in plain device memory: it takes neither --reduce-dtype bf16 "
        "nor --nccl-window on");
  if (o.shard_optimizer == ShardOptimizer::On &&
      (o.allreduce == AllReduceMethod::Nccl || o.reduce_dtype != ReduceDType::F32 || o.nccl_window || o.clip_grad > 0))
    bad("--shard-optimizer on needs the copy-engine exchange in fp32 and no --clip-grad (each rank sees only its "
        "share of the gradients): it takes neither --allreduce nccl, --reduce-dtype bf16, --nccl-window on nor "
        "--clip-grad");
  if (o.reset_head && o.init_from.empty()) bad("--reset-head needs --init-from FILE (the weights it fine-tunes)");
  if (o.eval_only) {
    if (o.init_from.empty() && o.resume.empty()) bad("--eval-only needs the weights: --init-from FILE or --resume DIR");
    if (o.data == DataKind::Synthetic) bad("--eval-only needs a dataset with a test split (--data fashion-mnist or packed)");
    if (o.data == DataKind::Packed) {
      struct stat st;
      if (::stat((o.data_dir + "/val").c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        bad("--eval-only needs a test split: no " + o.data_dir + "/val directory (pack_images SRC " + o.data_dir + "/val)");
    }
    if (!o.save_dir.empty() || !o.dump_reference.empty() || o.timing || o.epochs > 0 || o.reset_head ||
        o.accum_steps > 1 || o.drop_path > 0)
      bad("--eval-only trains nothing: it takes neither --save, --dump-reference, --timing, --epochs, --accum-steps, "
          "--drop-path nor --reset-head (a new head is untrained)");
  }
  if (!o.trace_file.empty() && (o.eval_only || !o.dump_reference.empty()))
    bad("--trace records training steps: it takes neither --eval-only nor --dump-reference");
  if (o.save_every > 0 && o.save_dir.empty()) bad("--save-every needs --save DIR");
  if (given.count("--keep") && o.save_dir.empty()) bad("--keep needs --save DIR");
  for (const char* f : {"--fp8-recipe", "--amax-history", "--fp8-margin"})
    if (given.count(f) && o.precision != Precision::FP8) bad(std::string(f) + " needs --precision fp8");
  if (given.count("--amax-history") && o.fp8_scaling != Fp8Scaling::Delayed)
    bad("--amax-history applies to --fp8-recipe delayed only");
  if (!o.resume.empty() && !o.init_from.empty()) bad("--resume and --init-from exclude each other (a checkpoint has its weights)");
  if (!o.init_from.empty()) {
    struct stat st;
    if (::stat(o.init_from.c_str(), &st) != 0) bad("--init-from " + o.init_from + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) bad("--init-from " + o.init_from + ": not a file (give the safetensors file, e.g. DIR/model.safetensors)");
  }
  // A new run saving where an earlier one saved would overwrite its checkpoints of the same steps
  // and prune the rest: only the run that resumes from there may save there.
  if (!o.save_dir.empty()) {
    namespace fs = std::filesystem;
    const std::string newest = newest_checkpoint_in(o.save_dir);
    bool resumes_here = false;
    if (!o.resume.empty()) {  // --resume DIR, or one checkpoint DIR/step-N
      fs::path p(o.resume);
      if (!p.has_filename()) p = p.parent_path();  // (a trailing '/')
      if (is_checkpoint_dir(p.string())) p = p.has_parent_path() ? p.parent_path() : fs::path(".");
      std::error_code ec;
      resumes_here = fs::equivalent(p, o.save_dir, ec);
    }
    if (!newest.empty() && !resumes_here)
      bad("--save " + o.save_dir + " holds an earlier run's checkpoints (the newest " + newest +
          "), which this run would overwrite: continue that run with --resume " + o.save_dir +
          ", or save into another directory");
  }
  if (o.epochs == 0) set_total_steps(o, o.steps);
  return o;
}

void set_total_steps(TrainOptions& o, int steps) {
  o.steps = steps;
  if (steps < 1) bad("the run has no step: the dataset holds fewer images than one global batch");
  if (o.warmup < 0) o.warmup = std::min(10, steps - 1);
  if (o.warmup >= steps)
    bad("--warmup " + std::to_string(o.warmup) + " leaves no timed step out of " + std::to_string(steps) + " steps");
  if (o.profile_first >= 0 && o.profile_last >= steps)
    bad("--profile-steps goes past the last step (" + std::to_string(steps - 1) + ")");
  if (!o.trace_file.empty()) {
    o.trace_first = o.profile_first >= 0 ? o.profile_first : std::min(o.warmup, steps - 1);
    o.trace_last = o.profile_first >= 0 ? o.profile_last : std::min(o.trace_first + 2, steps - 1);
  }
  if (o.warmup_steps >= steps && o.warmup_steps > 0)
    bad("--warmup-steps " + std::to_string(o.warmup_steps) + " is not shorter than the run's " + std::to_string(steps) +
        " steps");
}
