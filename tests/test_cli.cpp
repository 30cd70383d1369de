// CPU tier: the command line, model presets and parameter layout, safetensors writing, and the
// exit codes of vit_train itself on bad input.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "kernels/attention_choice.h"
#include "kernels/check.h"
#include "engine/cli.h"
#include "engine/optimizer.h"
#include "engine/safetensors.h"
#include "model/params.h"
#include "tests/harness.h"

namespace {
TrainOptions parse(std::initializer_list<const char*> a) {
  return parse_args(std::vector<std::string>(a.begin(), a.end()));
}
std::string usage_error(std::initializer_list<const char*> a) {
  try {
    parse(a);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("cli: defaults are ViT-H/16, batch 64, bf16, SGD lr 0.001 momentum 0.9") {
  const TrainOptions o = parse({});
  CHECK(o.model.name == "vit_h16");
  CHECK(o.model.dim == 1280);
  CHECK(o.model.depth == 32);
  CHECK(o.model.heads == 16);
  CHECK(o.batch == 64);
  CHECK(o.precision == Precision::BF16);
  CHECK(o.lr == doctest::Approx(0.001));
  CHECK(o.momentum == doctest::Approx(0.9));
  CHECK(o.gpus == 1);
}

TEST_CASE("cli: --optimizer adamw with torch's defaults; each optimizer's flags only with it") {
  const TrainOptions a = parse({"--optimizer", "adamw"});
  CHECK(a.optimizer == OptimizerKind::AdamW);
  CHECK(a.beta1 == doctest::Approx(0.9));
  CHECK(a.beta2 == doctest::Approx(0.999));
  CHECK(a.eps == doctest::Approx(1e-8));
  CHECK(a.weight_decay == doctest::Approx(0.01));  // torch.optim.AdamW's default
  const TrainOptions b = parse({"--optimizer=adamw", "--betas", "0.95,0.98", "--eps", "1e-6", "--weight-decay", "0"});
  CHECK(b.beta1 == doctest::Approx(0.95));
  CHECK(b.beta2 == doctest::Approx(0.98));
  CHECK(b.eps == doctest::Approx(1e-6));
  CHECK(b.weight_decay == 0);
  CHECK(parse({}).optimizer == OptimizerKind::Sgd);
  CHECK(parse({}).weight_decay == 0);
  CHECK(usage_error({"--optimizer", "lamb"}).find("unknown --optimizer 'lamb'; choose sgd or adamw") != std::string::npos);
  CHECK(usage_error({"--betas", "0.9,0.99"}).find("--betas applies to --optimizer adamw") != std::string::npos);
  CHECK(usage_error({"--eps", "1e-6"}).find("--eps applies to --optimizer adamw") != std::string::npos);
  CHECK(usage_error({"--optimizer", "adamw", "--momentum", "0.8"}).find("--momentum applies to --optimizer sgd") !=
        std::string::npos);
  CHECK(usage_error({"--optimizer", "adamw", "--nesterov"}).find("--nesterov applies to --optimizer sgd") !=
        std::string::npos);
  CHECK(usage_error({"--optimizer", "adamw", "--betas", "0.9"}).find("--betas expects B1,B2") != std::string::npos);
  CHECK(usage_error({"--optimizer", "adamw", "--betas", "1,0.9"}).find("--betas must be between 0") != std::string::npos);
  CHECK(usage_error({"--optimizer", "adamw", "--eps", "0"}).find("--eps must be between") != std::string::npos);
}

TEST_CASE("cli: --accum-steps counts micro-batches; the reference dump and --eval-only take none") {
  CHECK(parse({"--accum-steps", "4"}).accum_steps == 4);
  CHECK(parse({}).accum_steps == 1);
  CHECK(usage_error({"--accum-steps", "0"}).find("--accum-steps must be between 1") != std::string::npos);
  CHECK(usage_error({"--accum-steps", "2", "--dump-reference", "/tmp/x"}).find("nor --accum-steps") !=
        std::string::npos);
  CHECK(usage_error({"--eval-only", "--init-from", "/dev/null", "--accum-steps", "2", "--data", "fashion-mnist:/tmp",
                     "--img", "28", "--patch", "4", "--channels", "1", "--classes", "10"})
            .find("--accum-steps") != std::string::npos);
}

TEST_CASE("cli: --trace records three steps after the warm-up, or --profile-steps; not in evaluation") {
  TrainOptions o = parse({"--trace", "t.json", "--steps", "20"});
  CHECK(o.trace_file == "t.json");
  CHECK(o.trace_first == 10);
  CHECK(o.trace_last == 12);
  o = parse({"--trace", "t.json", "--steps", "20", "--profile-steps", "3:5"});
  CHECK(o.trace_first == 3);
  CHECK(o.trace_last == 5);
  o = parse({"--trace", "t.json", "--steps", "2"});  // warm-up 1: the last step alone
  CHECK(o.trace_first == 1);
  CHECK(o.trace_last == 1);
  CHECK(parse({}).trace_first == -1);
  CHECK(usage_error({"--trace", "t.json", "--dump-reference", "/tmp/d"}).find("--trace records training steps") !=
        std::string::npos);
}

TEST_CASE("cli: --reset-head only with --init-from") {
  CHECK(usage_error({"--reset-head"}).find("--reset-head needs --init-from FILE") != std::string::npos);
}

TEST_CASE("cli: --eval-only needs weights and a test split, and trains nothing") {
  CHECK(usage_error({"--eval-only"}).find("--eval-only needs the weights: --init-from FILE or --resume DIR") !=
        std::string::npos);
  CHECK(usage_error({"--eval-only", "--init-from", "/dev/null", "--reset-head", "--data", "fashion-mnist:/tmp", "--img",
                     "28", "--patch", "4", "--channels", "1", "--classes", "10"})
            .find("nor --reset-head") != std::string::npos);
  CHECK(usage_error({"--eval-only", "--resume", "/tmp"}).find("--eval-only needs a dataset with a test split") !=
        std::string::npos);
  CHECK(usage_error({"--eval-only", "--resume", "/tmp", "--data", "packed:/nonexistent"}).find("no /nonexistent/train") !=
        std::string::npos);
}

TEST_CASE("cli: presets and overrides, in any order, with --flag=value too") {
  TrainOptions o = parse({"--dim", "64", "--model", "vit_b16", "--depth=2", "--heads", "4", "--img", "32",
                          "--patch", "8", "--classes", "10", "--mlp-ratio", "2", "--nesterov", "--timing",
                          "--profile-steps", "3:5", "--steps", "10", "--warmup", "2", "--no-gemm-autotune"});
  CHECK_FALSE(o.gemm_autotune);
  CHECK(o.model.dim == 64);
  CHECK(o.model.depth == 2);
  CHECK(o.model.heads == 4);
  CHECK(o.model.tokens() == 17);
  CHECK(o.model.hidden() == 128);
  CHECK(o.nesterov);
  CHECK(o.timing);
  CHECK(o.profile_first == 3);
  CHECK(o.profile_last == 5);
  o = parse({"--model", "vit_ti16"});
  CHECK(o.model.dim == 192);
  CHECK(o.model.heads == 3);
  o = parse({"--model", "vit_h14"});  // ViT-H/14: 257 tokens, patch dim 588 (padded to 592 for its GEMM)
  CHECK(o.model.dim == 1280);
  CHECK(o.model.tokens() == 257);
  CHECK(o.model.patch_dim_padded() == 592);
  CHECK(parse({"--model", "vit_l14", "--patch", "16"}).model.tokens() == 197);  // overrides after the preset
  CHECK(parse({"--steps", "3"}).warmup == 2);  // warm-up shrinks to leave a timed step
  CHECK(parse({"--dim", "1408", "--heads", "16"}).model.head_dim() == 88);  // ViT-g/14's heads
}

TEST_CASE("cli: every bad input is one clear usage error naming the problem") {
  CHECK(usage_error({"--bogus"}).find("unknown option '--bogus'") != std::string::npos);
  CHECK(usage_error({"--precision", "fp16"}).find("unknown precision 'fp16'") != std::string::npos);
  CHECK(usage_error({"--fp8-recipe", "hybrid"}).find("unknown --fp8-recipe 'hybrid'") != std::string::npos);
  CHECK(usage_error({"--amax-history", "0"}).find("--amax-history must be between 1") != std::string::npos);
  CHECK(parse({"--precision", "fp8", "--fp8-recipe", "current", "--fp8-margin", "1"}).fp8_margin == 1);
  CHECK(parse({"--precision", "fp8", "--fp8-stats"}).fp8_stats);
  CHECK(usage_error({"--fp8-stats"}).find("--fp8-stats needs --precision fp8") != std::string::npos);
  CHECK(usage_error({"--gpus", "0"}).find("--gpus must be between 1") != std::string::npos);
  CHECK(usage_error({"--batch", "-1"}).find("--batch must be between 1") != std::string::npos);
  CHECK(usage_error({"--batch", "12x"}).find("expects an integer") != std::string::npos);
  CHECK(usage_error({"--batch"}).find("needs a value") != std::string::npos);
  CHECK(usage_error({"--lr", "nan"}).find("expects a number") != std::string::npos);
  CHECK(usage_error({"--dim", "100", "--heads", "16"}).find("not divisible by heads") != std::string::npos);
  CHECK(usage_error({"--img", "225"}).find("not divisible by patch") != std::string::npos);
  CHECK(usage_error({"--model", "vit_x"}).find("unknown model 'vit_x'") != std::string::npos);
  CHECK(usage_error({"--steps", "5", "--warmup", "5"}).find("no timed step") != std::string::npos);
  CHECK(usage_error({"--nesterov", "--momentum", "0"}).find("--nesterov needs") != std::string::npos);
  CHECK(usage_error({"--profile-steps", "5:2"}).find("comes before") != std::string::npos);
  CHECK(usage_error({"--profile-steps", "1:99", "--steps", "10"}).find("past the last step") != std::string::npos);
  CHECK(usage_error({"--dim", "1288", "--heads", "8"}).find("head dim") != std::string::npos);
  CHECK(usage_error({"--dim", "1296", "--heads", "8"}).find("head dim") != std::string::npos);  // 162: not a multiple of 8
  CHECK(usage_error({"--dim", "2048", "--heads", "16"}).find("above 1536") != std::string::npos);
  CHECK(usage_error({"--batch", "70000", "--img", "32"}).find("65535 images") != std::string::npos);
  CHECK(usage_error({"--batch", "12000"}).find("token rows") != std::string::npos);
  CHECK(usage_error({"--channels", "64", "--patch", "8192", "--img", "8192"}).find("channels*patch*patch") !=
        std::string::npos);
  CHECK(usage_error({"--img", "4096", "--patch", "8"}).find("tokens per image") != std::string::npos);
  CHECK(usage_error({"--save-every", "10"}).find("--save-every needs --save DIR") != std::string::npos);
  CHECK(usage_error({"--resume", "a", "--init-from", "b"}).find("exclude each other") != std::string::npos);
  CHECK(usage_error({"--data", "packed"}).find("packed:DIR needs the directory") != std::string::npos);
  CHECK(usage_error({"--data", "packed:/nonexistent"}).find("no /nonexistent/train directory") != std::string::npos);
  CHECK(usage_error({"--data", "packed:/tmp", "--channels", "1"}).find("--channels 3") != std::string::npos);
  CHECK(usage_error({"--label-smoothing", "1"}).find("--label-smoothing must be between") != std::string::npos);
  CHECK(usage_error({"--clip-grad", "0"}).find("--clip-grad must be between") != std::string::npos);
  CHECK(usage_error({"--reduce-dtype", "fp16"}).find("unknown --reduce-dtype 'fp16'") != std::string::npos);
  CHECK(usage_error({"--comm-overlap", "maybe"}).find("unknown --comm-overlap 'maybe'") != std::string::npos);
  CHECK(usage_error({"--comm-ctas", "99"}).find("--comm-ctas must be between") != std::string::npos);
  CHECK(usage_error({"--keep", "0"}).find("--keep must be between") != std::string::npos);
  CHECK(parse({}).comm_overlap);
  CHECK(!parse({"--comm-overlap", "off"}).comm_overlap);
  CHECK(!parse({}).nccl_window);
  CHECK(parse({"--nccl-window", "on"}).nccl_window);
  CHECK(usage_error({"--nccl-window", "yes"}).find("unknown --nccl-window 'yes'") != std::string::npos);
  CHECK(parse({}).second_stream);
  CHECK(!parse({"--second-stream", "off"}).second_stream);
  CHECK(usage_error({"--second-stream", "auto"}).find("unknown --second-stream 'auto'; choose on or off") != std::string::npos);
  CHECK(parse({}).attention == AttentionKernels::Auto);
  CHECK(parse({"--attention", "streamed"}).attention == AttentionKernels::Streamed);
  CHECK(parse({"--attention", "resident"}).attention == AttentionKernels::Resident);
  CHECK(parse({"--attention", "cudnn"}).attention == AttentionKernels::Cudnn);
  CHECK(parse({"--attention", "engine"}).attention == AttentionKernels::Engine);
  CHECK(usage_error({"--attention", "flash"})
            .find("unknown --attention 'flash'; choose auto, engine, single-pass, resident, streamed or cudnn") !=
        std::string::npos);
  CHECK(parse({}).allreduce == AllReduceMethod::Auto);
  CHECK(parse({"--allreduce", "copy-engine"}).allreduce == AllReduceMethod::CopyEngine);
  CHECK(parse({"--allreduce", "nccl", "--nccl-window", "on"}).allreduce == AllReduceMethod::Nccl);
  CHECK(usage_error({"--allreduce", "ring"}).find("unknown --allreduce 'ring'; choose auto, nccl or copy-engine") !=
        std::string::npos);
  CHECK(usage_error({"--allreduce", "copy-engine", "--reduce-dtype", "bf16"}).find("--allreduce copy-engine sums fp32") !=
        std::string::npos);
  CHECK(usage_error({"--allreduce", "copy-engine", "--nccl-window", "on"}).find("--allreduce copy-engine sums fp32") !=
        std::string::npos);
  CHECK(parse({}).shard_optimizer == ShardOptimizer::Auto);
  CHECK(parse({"--shard-optimizer", "off"}).shard_optimizer == ShardOptimizer::Off);
  CHECK(usage_error({"--shard-optimizer", "zero"}).find("unknown --shard-optimizer 'zero'; choose auto, on or off") !=
        std::string::npos);
  const std::string shard_conflict = "--shard-optimizer on needs the copy-engine exchange in fp32 and no --clip-grad";
  CHECK(usage_error({"--shard-optimizer", "on", "--allreduce", "nccl"}).find(shard_conflict) != std::string::npos);
  CHECK(usage_error({"--shard-optimizer", "on", "--reduce-dtype", "bf16"}).find(shard_conflict) != std::string::npos);
  CHECK(usage_error({"--shard-optimizer", "on", "--nccl-window", "on"}).find(shard_conflict) != std::string::npos);
  CHECK(usage_error({"--shard-optimizer", "on", "--clip-grad", "1"}).find(shard_conflict) != std::string::npos);
  const TrainOptions t = parse({"--gpus", "2", "--bucket-mb", "50", "--reduce-dtype", "bf16", "--clip-grad", "1.5",
                                "--label-smoothing", "0.1", "--save", "ckpt", "--save-every", "100", "--keep", "5"});
  CHECK(t.gpus == 2);
  CHECK(t.bucket_mb == 50);
  CHECK(t.reduce_dtype == ReduceDType::BF16);
  CHECK(t.clip_grad == 1.5);
  CHECK(t.label_smoothing == 0.1);
  CHECK(t.save_dir == "ckpt");
  CHECK(t.save_every == 100);
  CHECK(t.keep == 5);
}

TEST_CASE("cli: a forgotten value, a flag with no effect, a directory given as a file, a --save that would overwrite") {
  // A value forgotten: the next option is not taken as it (--flag=VALUE takes any text).
  CHECK(usage_error({"--log", "--timing"}).find("--log needs a value, got the option '--timing'") != std::string::npos);
  CHECK(usage_error({"--save", "--nesterov"}).find("--save needs a value, got the option '--nesterov'") != std::string::npos);
  CHECK(parse({"--log=--odd-name"}).log_file == "--odd-name");
  CHECK(parse({"--lr", "-0"}).lr == 0);  // one dash: a number, not an option
  // Flags that would do nothing.
  CHECK(usage_error({"--keep", "5"}).find("--keep needs --save DIR") != std::string::npos);
  CHECK(usage_error({"--fp8-margin", "1"}).find("--fp8-margin needs --precision fp8") != std::string::npos);
  CHECK(usage_error({"--fp8-recipe", "current"}).find("--fp8-recipe needs --precision fp8") != std::string::npos);
  CHECK(usage_error({"--amax-history", "4"}).find("--amax-history needs --precision fp8") != std::string::npos);
  CHECK(usage_error({"--precision", "fp8", "--fp8-recipe", "current", "--amax-history", "4"})
            .find("--amax-history applies to --fp8-recipe delayed only") != std::string::npos);
  CHECK(parse({"--precision", "fp8", "--amax-history", "4"}).amax_history == 4);
  // --init-from: a file that is there.
  char dir_template[] = "/tmp/vit_cli_XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  CHECK(usage_error({"--init-from", dir.c_str()}).find("not a file") != std::string::npos);
  const std::string missing = dir + "/none.safetensors";
  CHECK(usage_error({"--init-from", missing.c_str()}).find("No such file") != std::string::npos);
  CHECK_THROWS_WITH_AS(SafetensorsFile{dir}, doctest::Contains("not a regular file"), RuntimeError);
  // --save into a directory that holds checkpoints: only the run resuming from there.
  const std::string ckpt = dir + "/ckpt", step = ckpt + "/step-00000005";
  CHECK(parse({"--save", ckpt.c_str()}).save_dir == ckpt);  // not there yet
  REQUIRE(std::system(("mkdir -p " + step + " && touch " + step + "/model.safetensors " + step + "/state.safetensors").c_str()) == 0);
  CHECK(usage_error({"--save", ckpt.c_str()}).find("holds an earlier run's checkpoints (the newest " + step) !=
        std::string::npos);
  const std::string other = dir + "/other";
  CHECK(usage_error({"--save", ckpt.c_str(), "--resume", other.c_str()}).find("holds an earlier run's") != std::string::npos);
  CHECK(parse({"--save", ckpt.c_str(), "--resume", ckpt.c_str()}).resume == ckpt);
  CHECK(parse({"--save", ckpt.c_str(), "--resume", step.c_str()}).resume == step);
  CHECK(parse({"--save", (ckpt + "/").c_str(), "--resume", (step + "/").c_str()}).resume == step + "/");
  // --eval-every on packed data needs DIR/val.
  const std::string packed = dir + "/packed", data = "packed:" + packed;
  REQUIRE(std::system(("mkdir -p " + packed + "/train").c_str()) == 0);
  CHECK(usage_error({"--data", data.c_str(), "--eval-every", "10"}).find("no " + packed + "/val directory") !=
        std::string::npos);
  CHECK(parse({"--data", data.c_str()}).data == DataKind::Packed);
  REQUIRE(std::system(("rm -rf " + dir).c_str()) == 0);
}

TEST_CASE("attention choice: cuDNN only where more than 5% faster, each direction on its own") {
  const auto choose = [](double engine_f, double cudnn_f, double engine_b, double cudnn_b) {
    AttentionChoice c;
    c.engine_forward_ms = engine_f, c.cudnn_forward_ms = cudnn_f, c.engine_backward_ms = engine_b;
    c.cudnn_backward_ms = cudnn_b;
    c.decide();
    return std::make_pair(c.cudnn_forward, c.cudnn_backward);
  };
  CHECK(choose(0.061, 0.084, 0.155, 0.294) == std::make_pair(false, false));  // ViT-H/16
  CHECK(choose(0.226, 0.109, 0.469, 0.375) == std::make_pair(true, true));    // (16, 16, 577, 128)
  CHECK(choose(0.076, 0.064, 0.262, 0.239) == std::make_pair(true, true));    // hd 128 at 197 tokens
  CHECK(choose(0.060, 0.083, 0.665, 0.479) == std::make_pair(false, true));   // one direction only
  CHECK(choose(1.0, 0.951, 1.0, 0.949) == std::make_pair(false, true));       // the margin's two sides
  CHECK(choose(1.0, INFINITY, 1.0, INFINITY) == std::make_pair(false, false)); // a rank without cuDNN
}

TEST_CASE("model: ViT-H/16 has timm's 632,199,400 parameters in 392 tensors") {
  ViTConfig c;
  const ParamLayout layout(c);
  CHECK(layout.count() == 632199400u);
  CHECK(layout.tensors().size() == 392u);
  CHECK(layout.at(layout.find("blocks.31.mlp.fc2.weight")).shape == std::vector<int64_t>{1280, 5120});
  CHECK(layout.at(layout.find("patch_embed.proj.weight")).shape == std::vector<int64_t>{1280, 3, 16, 16});
  CHECK(layout.at(layout.find("pos_embed")).shape == std::vector<int64_t>{1, 197, 1280});
  for (const ParamTensor& t : layout.tensors()) REQUIRE(t.offset % ParamLayout::kParamAlign == 0);
  CHECK(c.train_flops_per_image() / 1e9 == doctest::Approx(763.9).epsilon(1e-3));
}

TEST_CASE("optimizer: timm's AdamW groups decay the 130 matrices of ViT-H/16, no norm, bias or embedding") {
  const ParamLayout layout{ViTConfig{}};
  std::vector<std::string> decayed;
  for (const ParamTensor& t : layout.tensors())
    if (decays_weight(t)) decayed.push_back(t.name);
  CHECK(decayed.size() == 130u);  // the patch projection, 4 a block, the head
  CHECK(decayed.front() == "patch_embed.proj.weight");
  CHECK(decayed.back() == "head.weight");
  for (const std::string& name : decayed) CHECK(name.find(".weight") != std::string::npos);
  for (const char* name : {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "norm.bias"})
    CHECK(!decays_weight(layout.at(layout.find(name))));
}

TEST_CASE("safetensors: header and data as PyTorch reads them; the write is atomic") {
  char dir[] = "/tmp/vit_st_XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/t.safetensors";
  const float a[3] = {1.5f, -2.0f, 3.25f};
  const int64_t b[2] = {7, 9};
  write_safetensors(path, {{"a", "F32", {3}, a, sizeof a}, {"b.x", "I64", {1, 2}, b, sizeof b}});
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  REQUIRE(n % 8 == 0);
  const std::string header = bytes.substr(8, n);
  CHECK(header.find("\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}") != std::string::npos);
  CHECK(header.find("\"b.x\":{\"dtype\":\"I64\",\"shape\":[1,2],\"data_offsets\":[12,28]}") != std::string::npos);
  REQUIRE(bytes.size() == 8 + n + 28);
  float a2[3];
  std::memcpy(a2, bytes.data() + 8 + n, sizeof a2);
  CHECK(a2[2] == 3.25f);
  CHECK(access((path + ".tmp").c_str(), F_OK) != 0);
  // A write that cannot happen leaves the old file as it was.
  CHECK_THROWS_AS(write_safetensors(std::string(dir) + "/missing/t.safetensors", {}), RuntimeError);
  std::remove(path.c_str());
  rmdir(dir);
}

namespace {
// Runs ./vit_train with arguments; returns its exit code and stderr.
int run_vit_train(const std::string& args, std::string* err) {
  char path[] = "/tmp/vit_train_test_err_XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  const std::string cmd = "./vit_train " + args + " 2>" + path + " >/dev/null";
  const int st = std::system(cmd.c_str());
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  *err = ss.str();
  std::remove(path);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
}  // namespace

TEST_CASE("vit_train: exit code 2 and one message for usage errors, 1 for run-time errors") {
  REQUIRE_MESSAGE(access("./vit_train", X_OK) == 0, "build ./vit_train first (make)");
  std::string err;
  CHECK(run_vit_train("--precision fp16", &err) == 2);
  CHECK(err.find("unknown precision 'fp16'") != std::string::npos);
  CHECK(run_vit_train("--batch -1", &err) == 2);
  CHECK(err.find("--batch") != std::string::npos);
  CHECK(run_vit_train("--help", &err) == 0);
  if (!gpu_available()) {
    CHECK(run_vit_train("--steps 1", &err) == 1);
    CHECK(err.find("no CUDA GPU") != std::string::npos);
  } else {
    CHECK(run_vit_train("--gpus 64", &err) == 2);
    CHECK(err.find("but this machine has") != std::string::npos);
    CHECK(run_vit_train("--batch 10000", &err) == 1);  // valid, but ~2 TB of activations
    CHECK(err.find("does not fit") != std::string::npos);
  }
}
