#include "engine/cli.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "kernels/check.h"
#include "engine/checkpoint.h"
#include "engine/dataset.h"

namespace {
[[noreturn]] void bad(const std::string& msg) { throw UsageError(msg); }

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
  if (x < lo || x > hi) bad(flag + " must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + v);
  return x;
}
}  // namespace

std::string usage() {
  return std::string(
             "usage: vit_train [options]\n"
             "Trains a Vision Transformer (timm parity) on the GPU; by default ViT-Huge/16, batch 64, bf16.\n\n"
             "run:\n"
             "  --gpus N               GPUs of this machine to train on, one worker thread each (default 1); the\n"
             "                         global batch is N x --batch (x the processes of a launcher's job)\n"
             "  --bucket-mb N          gradient all-reduce bucket size in MB (default 25)\n"
             "  --reduce-dtype D       fp32 (default) or bf16: the dtype the gradients are averaged in\n"
             "  --comm-overlap on|off  on (default): each bucket is all-reduced during the backward; off: after it\n"
             "  --allreduce A          how the gradients are summed: nccl, copy-engine (GPUs of one process: copied\n"
             "                         peer to peer by the copy engines, summed by a small kernel, no NCCL kernel\n"
             "                         beside the backward; fp32, no --nccl-window) or auto (default: copy-engine\n"
             "                         where it applies, else nccl)\n"
             "  --shard-optimizer S    auto (default: on with the copy-engine exchange and no --clip-grad), on or\n"
             "                         off; on: each rank sums and updates only its share of the weights and writes\n"
             "                         the new bf16 weights into every rank's copy (the same bits as off)\n"
             "  --nccl-window on|off   experimental, off by default: on all-reduces the gradients in NCCL-allocated memory\n"
             "                         registered as a symmetric window (faster; a failing rank can leave the others hung)\n"
             "  --comm-timeout S       a data-parallel run stops if no step finishes for S seconds (default 300)\n"
             "  --comm-ctas N          NCCL uses at most N thread blocks (SMs), leaving the rest to the backward\n"
             "                         it overlaps (default 0: NCCL's choice)\n"
             "  --precision P          bf16 (default) or fp8 (the blocks' Linear layers in FP8, all three GEMMs)\n"
             "  --second-stream on|off on (default): the backward's weight gradients run on a second stream beside\n"
             "                         the input gradients, the optimizer beside the next forward (not under\n"
             "                         --timing); off: one stream\n"
             "  --attention A          the attention kernels: auto (default: the engine's fastest that apply, or\n"
             "                         cuDNN's fused attention in a direction where it loads and, timed at\n"
             "                         start-up, is faster), engine (the engine's fastest, never cuDNN),\n"
             "                         single-pass (backward; T <= 96, head dim 16/32/64/80), resident (Hopper\n"
             "                         wgmma; forward: head dim 64/80/128 up to 832/656/384 tokens, backward: head\n"
             "                         dim 64/80/128 up to 1024), streamed (forward and backward, any shape) or\n"
             "                         cudnn (cuDNN's, both directions; libcudnn.so.9 from the library path)\n"
             "  --fp8-recipe R         delayed (default: scales from an amax history) or current (the tensor's own amax)\n"
             "  --amax-history N       delayed recipe: amaxes remembered (default 16)\n"
             "  --fp8-margin M         scale = fp8_max / amax / 2^M (default 0)\n"
             "  --fp8-stats            at each progress line, per FP8 tensor kind: scales, amax, and the fractions\n"
             "                         that underflow to zero or saturate in that step (which runs a little slower)\n"
             "  --batch N              images per step (default 64)\n"
             "  --steps N              training steps (default 50)\n"
             "  --warmup N             first steps left out of the timing summary (default 10, less if --steps is small)\n"
             "  --seed N               seed of the initial weights, the synthetic data and the shuffling (default 0)\n"
             "data:\n"
             "  --data D               synthetic (default: N(0,1) images, label = index % classes, made on the GPU)\n"
             "                         or fashion-mnist[:DIR] (IDX files, default DIR /usr/share/datasets/fashion-mnist;\n"
             "                         needs --img 28 --channels 1 --classes 10), or packed:DIR (DIR/train and\n"
             "                         optionally DIR/val written by tools/pack_images: random resized crops and\n"
             "                         flips on the GPU for training, centre crops for evaluation)\n"
             "  --epochs N             passes over the training set, shuffled each epoch (instead of --steps)\n"
             "  --eval-every N         top-1 on the test set every N steps (default: after each epoch)\n"
             "model (a preset, then any override):\n"
             "  --model NAME           ") + vit_preset_names() + " (default vit_h16)\n"
         "  --img N --patch N --channels N --classes N --dim N --depth N --heads N --mlp-ratio X\n"
         "optimizer (torch.optim.SGD semantics, fp32 master weights and momentum):\n"
         "  --lr X (0.001)  --momentum X (0.9)  --weight-decay X (0, L2 added to the gradient)  --nesterov\n"
         "  --lr-schedule S        constant (default) or cosine (decaying to zero at the end of the run)\n"
         "  --warmup-steps N       linear learning-rate warm-up over the first N steps (default 0)\n"
         "  --clip-grad X          clip the gradients' global L2 norm to X (torch.nn.utils.clip_grad_norm_)\n"
         "  --label-smoothing X    cross-entropy against (1 - X) onehot + X / classes (default 0)\n"
         "output and profiling:\n"
         "  --log-every N          print a progress line every N steps (default 10)\n"
         "  --timing               per-phase and per-op-kind CUDA-event breakdown (synchronises each step; one\n"
             "                         stream, so that each op is timed alone)\n"
         "  --profile-steps A:B    cudaProfilerStart/Stop around steps A..B (nsys --capture-range=cudaProfilerApi)\n"
         "  --peak-tflops X        dense peak for MFU when the GPU is not known to the engine\n"
         "  --no-gemm-autotune     take cuBLASLt's heuristic first choice instead of timing its candidates\n"
         "  --log FILE             append JSON lines: step, loss, lr, images/s, TFLOP/s, evaluations, FP8 events,\n"
         "                         checkpoints (tools/plot_metrics.py draws them)\n"
         "checkpoints:\n"
         "  --save DIR             write checkpoints under DIR (timm-loadable weights + optimizer and FP8 state);\n"
         "                         a DIR with checkpoints only with --resume from it\n"
         "  --save-every N         every N steps (default: only at the end); --keep K: the newest K (default 3)\n"
         "  --resume DIR           continue from DIR's newest checkpoint (the same run shape; the same losses)\n"
         "  --init-from FILE       start from a timm safetensors file (strict: every tensor, nothing else)\n"
         "  --dump-reference DIR   write weights, batches, step-0 logits/loss/gradients and the losses of\n"
         "                         --steps steps for tools/timm_reference.py\n"
         "  --help                 this text\n";
}

TrainOptions parse_args(const std::vector<std::string>& args) {
  TrainOptions o;
  std::set<std::string> given;  // the valued flags on the command line
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
      {"--reduce-dtype", [&](const std::string& f, const std::string& v) {
         if (v != "fp32" && v != "bf16") bad("unknown " + f + " '" + v + "'; choose fp32 or bf16");
         o.reduce_dtype = v;
       }},
      {"--comm-overlap", [&](const std::string& f, const std::string& v) {
         if (v != "on" && v != "off") bad("unknown " + f + " '" + v + "'; choose on or off");
         o.comm_overlap = v == "on";
       }},
      {"--allreduce", [&](const std::string& f, const std::string& v) {
         if (v != "auto" && v != "nccl" && v != "copy-engine") bad("unknown " + f + " '" + v + "'; choose auto, nccl or copy-engine");
         o.allreduce = v;
       }},
      {"--shard-optimizer", [&](const std::string& f, const std::string& v) {
         if (v != "auto" && v != "on" && v != "off") bad("unknown " + f + " '" + v + "'; choose auto, on or off");
         o.shard_optimizer = v;
       }},
      {"--second-stream", [&](const std::string& f, const std::string& v) {
         if (v != "on" && v != "off") bad("unknown " + f + " '" + v + "'; choose on or off");
         o.second_stream = v == "on";
       }},
      {"--nccl-window", [&](const std::string& f, const std::string& v) {
         if (v != "on" && v != "off") bad("unknown " + f + " '" + v + "'; choose on or off");
         o.nccl_window = v == "on";
       }},
      {"--comm-timeout", [&](const std::string& f, const std::string& v) { o.comm_timeout = parse_int(f, v, 5, 1 << 20); }},
      {"--comm-ctas", [&](const std::string& f, const std::string& v) { o.comm_ctas = parse_int(f, v, 0, 64); }},
      {"--precision", [&](const std::string&, const std::string& v) {
         if (v != "bf16" && v != "fp8") bad("unknown precision '" + v + "'; choose bf16 or fp8");
         o.precision = v;
       }},
      {"--attention", [&](const std::string& f, const std::string& v) {
         if (v != "auto" && v != "engine" && v != "single-pass" && v != "resident" && v != "streamed" && v != "cudnn")
           bad("unknown " + f + " '" + v + "'; choose auto, engine, single-pass, resident, streamed or cudnn");
         o.attention = v;
       }},
      {"--fp8-recipe", [&](const std::string& f, const std::string& v) {
         if (v != "delayed" && v != "current") bad("unknown " + f + " '" + v + "'; choose delayed or current");
         o.fp8_recipe = v;
       }},
      {"--amax-history", [&](const std::string& f, const std::string& v) { o.amax_history = parse_int(f, v, 1, 1024); }},
      {"--fp8-margin", [&](const std::string& f, const std::string& v) { o.fp8_margin = parse_int(f, v, 0, 16); }},
      {"--batch", [&](const std::string& f, const std::string& v) { o.batch = parse_int(f, v, 1, kBig); }},
      {"--steps", [&](const std::string& f, const std::string& v) { o.steps = parse_int(f, v, 1, 1 << 30); }},
      {"--epochs", [&](const std::string& f, const std::string& v) { o.epochs = parse_int(f, v, 1, 100000); }},
      {"--warmup", [&](const std::string& f, const std::string& v) { o.warmup = parse_int(f, v, 0, 1 << 30); }},
      {"--data", [&](const std::string& f, const std::string& v) {
         const std::string kind = v.substr(0, v.find(':'));
         if (kind != "synthetic" && kind != "fashion-mnist" && kind != "packed")
           bad("unknown dataset '" + v + "'; choose synthetic, fashion-mnist[:DIR] or packed:DIR");
         o.data = kind;
         o.data_dir = v.find(':') == std::string::npos ? "" : v.substr(v.find(':') + 1);
         const bool colon = v.find(':') != std::string::npos;
         if (kind == "synthetic" && colon) bad(f + " synthetic takes no directory");
         if (kind == "fashion-mnist" && colon && o.data_dir.empty()) bad(f + " fashion-mnist: needs a directory after the colon");
         if (kind == "packed" && o.data_dir.empty()) bad(f + " packed:DIR needs the directory (DIR/train, DIR/val from tools/pack_images)");
       }},
      {"--eval-every", [&](const std::string& f, const std::string& v) { o.eval_every = parse_int(f, v, 1, 1 << 30); }},
      {"--lr-schedule", [&](const std::string& f, const std::string& v) {
         if (v != "constant" && v != "cosine") bad("unknown " + f + " '" + v + "'; choose constant or cosine");
         o.lr_schedule = v;
       }},
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
      {"--clip-grad", [&](const std::string& f, const std::string& v) { o.clip_grad = parse_double(f, v, 1e-6, 1e9); }},
      {"--label-smoothing", [&](const std::string& f, const std::string& v) { o.label_smoothing = parse_double(f, v, 0, 0.999); }},
      {"--log-every", [&](const std::string& f, const std::string& v) { o.log_every = parse_int(f, v, 1, 1 << 30); }},
      {"--peak-tflops", [&](const std::string& f, const std::string& v) { o.peak_tflops = parse_double(f, v, 1e-3, 1e6); }},
      {"--save", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a directory"); o.save_dir = v; }},
      {"--save-every", [&](const std::string& f, const std::string& v) { o.save_every = parse_int(f, v, 1, 1 << 30); }},
      {"--keep", [&](const std::string& f, const std::string& v) { o.keep = parse_int(f, v, 1, 1 << 20); }},
      {"--resume", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a directory"); o.resume = v; }},
      {"--init-from", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a file"); o.init_from = v; }},
      {"--log", [&](const std::string& f, const std::string& v) { if (v.empty()) bad(f + " needs a file"); o.log_file = v; }},
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
    if (a == "--nesterov") { o.nesterov = true; continue; }
    if (a == "--timing") { o.timing = true; continue; }
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
  if (o.nesterov && o.momentum <= 0) bad("--nesterov needs a positive --momentum (as in torch.optim.SGD)");
  if (o.data == "synthetic") {
    if (o.epochs > 0) bad("--epochs needs a dataset with a size (--data fashion-mnist); use --steps");
    if (o.eval_every > 0) bad("--eval-every needs a dataset with a test split (--data fashion-mnist)");
  } else if (o.data == "packed") {
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
  if (o.fp8_stats && o.precision != "fp8") bad("--fp8-stats needs --precision fp8");
  if (!o.dump_reference.empty() &&
      (o.data != "synthetic" || o.lr_schedule != "constant" || o.warmup_steps > 0 || o.precision != "bf16"))
    bad("--dump-reference replays the synthetic data at a constant learning rate in timm's bf16 autocast: it takes "
        "neither --data, --lr-schedule cosine, --warmup-steps nor --precision fp8");
  if (!o.dump_reference.empty() && o.gpus > 1) bad("--dump-reference runs on one GPU (--gpus 1)");
  if (o.allreduce == "copy-engine" && (o.reduce_dtype != "fp32" || o.nccl_window))
    bad("--allreduce copy-engine sums fp32 gradients in plain device memory: it takes neither --reduce-dtype bf16 "
        "nor --nccl-window on");
  if (o.shard_optimizer == "on" && (o.allreduce == "nccl" || o.reduce_dtype != "fp32" || o.nccl_window || o.clip_grad > 0))
    bad("--shard-optimizer on needs the copy-engine exchange in fp32 and no --clip-grad (each rank sees only its "
        "share of the gradients): it takes neither --allreduce nccl, --reduce-dtype bf16, --nccl-window on nor "
        "--clip-grad");
  if (o.save_every > 0 && o.save_dir.empty()) bad("--save-every needs --save DIR");
  if (given.count("--keep") && o.save_dir.empty()) bad("--keep needs --save DIR");
  for (const char* f : {"--fp8-recipe", "--amax-history", "--fp8-margin"})
    if (given.count(f) && o.precision != "fp8") bad(std::string(f) + " needs --precision fp8");
  if (given.count("--amax-history") && o.fp8_recipe != "delayed") bad("--amax-history applies to --fp8-recipe delayed only");
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
  if (steps < 1) bad("the run has no step: the dataset holds fewer images than one --batch");
  if (o.warmup < 0) o.warmup = std::min(10, steps - 1);
  if (o.warmup >= steps)
    bad("--warmup " + std::to_string(o.warmup) + " leaves no timed step out of " + std::to_string(steps) + " steps");
  if (o.profile_first >= 0 && o.profile_last >= steps)
    bad("--profile-steps goes past the last step (" + std::to_string(steps - 1) + ")");
  if (o.warmup_steps >= steps && o.warmup_steps > 0)
    bad("--warmup-steps " + std::to_string(o.warmup_steps) + " is not shorter than the run's " + std::to_string(steps) +
        " steps");
}
