// Checkpoints. CPU tier: safetensors read back what was written (F32, BF16, F16), every damaged
// file named clearly, the newest complete checkpoint found. GPU tier: a run interrupted and
// resumed gives the uninterrupted run's losses bit for bit (bf16 and fp8, cosine schedule); the
// newest K are kept; bad checkpoints and timm files are refused with a clear message.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "engine/checkpoint.h"
#include "engine/resample.h"
#include "engine/safetensors.h"
#include "model/params.h"
#include "tests/fuzz/tiny_checkpoint.h"
#include "tests/harness.h"
#include "tests/shell.h"

namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& tag) {  // created: the tests write into it
  const fs::path p = fresh_temp_dir("ckpt_" + tag);
  fs::create_directories(p);
  return p;
}

std::string read_error(const std::string& path) {
  try {
    SafetensorsFile f(path);
  } catch (const RuntimeError& e) {
    return e.what();
  }
  return "";
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream out(path, std::ios::binary);
  out << b;
}
}  // namespace

TEST_CASE("safetensors: what is written reads back, in F32, BF16 and F16; shapes are checked") {
  const fs::path d = temp_dir("st");
  const std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 7.0f};
  const std::vector<uint16_t> b = {0x3fc0, 0xc010};  // bf16 1.5, -2.25
  const std::vector<uint16_t> h = {0x3e00, 0xc080};  // f16 1.5, -2.25
  const std::string path = (d / "x.safetensors").string();
  write_safetensors(path, {{"blocks.0.attn.qkv.weight", "F32", {2, 3}, a.data(), 24},
                           {"b", "BF16", {2}, b.data(), 4},
                           {"h", "F16", {2}, h.data(), 4}});
  const SafetensorsFile f(path);
  CHECK(f.tensors().size() == 3);
  CHECK(f.as_f32("blocks.0.attn.qkv.weight", {2, 3}) == a);
  CHECK(f.as_f32("b", {2}) == std::vector<float>{1.5f, -2.25f});
  CHECK(f.as_f32("h", {2}) == std::vector<float>{1.5f, -2.25f});
  std::string err;
  try {
    f.as_f32("b", {3});
  } catch (const RuntimeError& e) {
    err = e.what();
  }
  CHECK(err.find("has shape [2], the model needs [3]") != std::string::npos);
  fs::remove_all(d);
}

TEST_CASE("safetensors: missing, truncated and corrupted files are named, never read past their end") {
  const fs::path d = temp_dir("bad");
  const std::vector<float> a(100, 1.0f);
  const std::string good = (d / "good.safetensors").string();
  write_safetensors(good, {{"w", "F32", {100}, a.data(), 400}});
  const std::string bytes = file_bytes(good);
  CHECK(read_error((d / "none.safetensors").string()).find("cannot open") != std::string::npos);
  const std::string p = (d / "bad.safetensors").string();
  write_bytes(p, bytes.substr(0, bytes.size() - 10));  // truncated data
  CHECK(read_error(p).find("outside the file") != std::string::npos);
  write_bytes(p, bytes.substr(0, 20));  // truncated header
  CHECK(read_error(p).find("truncated") != std::string::npos);
  write_bytes(p, "abc");
  CHECK(read_error(p).find("shorter than") != std::string::npos);
  std::string corrupt = bytes;
  corrupt[8] = '#';  // the JSON header's opening brace
  write_bytes(p, corrupt);
  CHECK(read_error(p).find("not a valid safetensors file") != std::string::npos);
  auto with_header = [&](const std::string& h) {  // an 8-byte length, the header, 8 data bytes
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[i] = char((h.size() >> (8 * i)) & 0xFF);
    write_bytes(p, f + h + std::string(8, '\0'));
  };
  with_header("{\"__metadata__\":" + std::string(100000, '[') + std::string(100000, ']') + "}");  // a stack overflow, were it recursed
  CHECK(read_error(p).find("nests too deep") != std::string::npos);
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  CHECK(read_error(p).find("appears twice") != std::string::npos);
  with_header(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})");
  CHECK(read_error(p).find("too large") != std::string::npos);
  fs::remove_all(d);
}

TEST_CASE("safetensors: a write that fails half way (a full disk) leaves the previous file whole") {
  const fs::path d = temp_dir("full");
  const std::string path = (d / "model.safetensors").string();
  const std::vector<float> small(16, 1.0f), big(1 << 20, 2.0f);  // 64 B and 4 MiB of data
  write_safetensors(path, {{"w", "F32", {16}, small.data(), small.size() * 4}});
  // A 1 MiB file-size limit stands in for a full disk: the write fails with EFBIG part way.
  struct rlimit old;
  ::getrlimit(RLIMIT_FSIZE, &old);
  struct rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  void (*previous)(int) = std::signal(SIGXFSZ, SIG_IGN);  // else the process is killed
  ::setrlimit(RLIMIT_FSIZE, &lim);
  std::string err;
  try {
    write_safetensors(path, {{"w", "F32", {1 << 20}, big.data(), big.size() * 4}});
  } catch (const RuntimeError& e) {
    err = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  CHECK(err.find("cannot write") != std::string::npos);
  CHECK(!fs::exists(path + ".tmp"));
  const SafetensorsFile f(path);  // the old file, whole
  CHECK(f.as_f32("w", {16}) == small);
  fs::remove_all(d);
}

TEST_CASE("checkpoint: the newest complete checkpoint is found; half-written ones are not") {
  const fs::path d = temp_dir("latest");
  for (const char* name : {"step-00000010", "step-00000020", ".step-00000030.tmp", "step-00000040"}) {
    fs::create_directories(d / name);
    if (std::string(name) != "step-00000040") {  // 40 lacks its state file: incomplete
      write_bytes((d / name / "model.safetensors").string(), "x");
      write_bytes((d / name / "state.safetensors").string(), "x");
    } else {
      write_bytes((d / name / "model.safetensors").string(), "x");
    }
  }
  CHECK(latest_checkpoint(d.string()) == (d / "step-00000020").string());
  CHECK(latest_checkpoint((d / "step-00000010").string()) == (d / "step-00000010").string());
  std::string err;
  try {
    latest_checkpoint((d / "nothing").string());
  } catch (const RuntimeError& e) {
    err = e.what();
  }
  CHECK(err.find("no such directory") != std::string::npos);
  fs::remove_all(d);
}

// ---- GPU tier ----
namespace {
using Run = CommandResult;
Run shell(const std::string& cmd) { return run_command(cmd); }
const std::string kSmall = "./vit_train --img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 "
                           "--batch 16 --lr 0.05 --lr-schedule cosine --warmup-steps 3 --steps 20 --warmup 2 "
                           "--log-every 1 --no-gemm-autotune --attention engine";  // no choice by timing
}  // namespace

TEST_CASE("checkpoint: a resumed run's changed seed, data, schedule or optimizer is found in run.txt") {
  TrainOptions o;
  o.seed = 7;
  o.data = DataKind::Packed;
  o.data_dir = "/data/p";
  o.lr = 0.1;
  o.lr_schedule = LrSchedule::Kind::Cosine;
  o.warmup_steps = 100;
  o.steps = 5000;
  const std::string text = run_schedule_text(o);
  CHECK(text == "seed 7\ndata packed:/data/p\nschedule cosine, lr 0.1, warmup-steps 100, steps 5000\n"
                "optimizer sgd, momentum 0.9, weight-decay 0, nesterov off\n"
                "regularisation drop-path 0, label-smoothing 0\n");
  const std::string run_txt = "step 1000\nmodel vit_h16 ...\nprecision bf16\nbatch 64 per rank, 1 rank(s)\n" + text;
  CHECK(resume_differences(run_txt, o).empty());
  TrainOptions other = o;
  other.seed = 8;
  other.steps = 6000;
  const std::vector<std::string> d = resume_differences(run_txt, other);
  REQUIRE(d.size() == 2);
  CHECK(d[0] == "schedule cosine, lr 0.1, warmup-steps 100, steps 5000 -> schedule cosine, lr 0.1, warmup-steps 100, steps 6000");
  CHECK(d[1] == "seed 7 -> seed 8");
  other = o;
  other.optimizer = OptimizerKind::AdamW;
  other.weight_decay = 0.05;
  CHECK(resume_differences(run_txt, other) ==
        std::vector<std::string>{"optimizer sgd, momentum 0.9, weight-decay 0, nesterov off -> optimizer adamw, betas "
                                 "0.9,0.999, eps 1e-08, weight-decay 0.05"});
  // An earlier version's run.txt (the seed only): only the seed compared.
  other = o;
  other.data = DataKind::Synthetic;
  other.data_dir.clear();
  CHECK(resume_differences("step 10\nseed 7\n", other).empty());
  other.seed = 9;
  CHECK(resume_differences("step 10\nseed 7\n", other) == std::vector<std::string>{"seed 7 -> seed 9"});
}

TEST_CASE("resample: bicubic with antialiasing keeps constants, the identity, and lines inside the grid") {
  const std::vector<float> flat(5 * 7 * 2, 0.25f);
  for (float v : resample_bicubic_antialiased(flat, 5, 7, 2, 9, 3)) CHECK(v == doctest::Approx(0.25f).epsilon(1e-6));
  std::vector<float> ramp(6 * 6);
  for (int y = 0; y < 6; ++y)
    for (int x = 0; x < 6; ++x) ramp[y * 6 + x] = float(0.5 * x - 0.25 * y);
  CHECK(resample_bicubic_antialiased(ramp, 6, 6, 1, 6, 6) == ramp);
  // Upsampled 6 -> 12: output i sits at input coordinate (i + 0.5) / 2 - 0.5; where all four
  // taps lie inside the grid the cubic (a = -0.5) reproduces a line exactly.
  const std::vector<float> up = resample_bicubic_antialiased(ramp, 6, 6, 1, 12, 12);
  for (int y = 3; y <= 8; ++y)
    for (int x = 3; x <= 8; ++x) {
      const double u = (x + 0.5) / 2 - 0.5, v = (y + 0.5) / 2 - 0.5;
      CHECK(up[y * 12 + x] == doctest::Approx(0.5 * u - 0.25 * v).epsilon(1e-6));
    }
}

TEST_CASE("init-from: another image size resamples pos_embed; --reset-head takes another head or none") {
  const fs::path d = temp_dir("finetune");
  ViTConfig saved;  // 32 px in patches of 8: a 4 x 4 grid, 10 classes
  saved.name = "test";
  saved.img = 32;
  saved.patch = 8;
  saved.classes = 10;
  saved.dim = 16;
  saved.depth = 1;
  saved.heads = 2;
  const ParamLayout layout(saved);
  std::vector<float> values(layout.total());
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(std::sin(0.1 * i));
  auto write_file = [&](const std::string& path, bool with_head) {
    std::vector<StTensor> t;
    for (const ParamTensor& p : layout.tensors())
      if (with_head || p.name.rfind("head.", 0) != 0)
        t.push_back({p.name, "F32", p.shape, values.data() + p.offset, p.numel * sizeof(float)});
    write_safetensors(path, t);
  };
  const std::string full = (d / "full.safetensors").string(), headless = (d / "headless.safetensors").string();
  write_file(full, true);
  write_file(headless, false);
  ViTConfig target = saved;  // 48 px: a 6 x 6 grid, 3 classes
  target.img = 48;
  target.classes = 3;
  auto usage_error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(usage_error([&] { read_timm_weights(full, target); }).find("its head has 10 classes, this model 3 (--classes): "
                                                                   "--reset-head starts a new head") != std::string::npos);
  CHECK(usage_error([&] { read_timm_weights(headless, target); }).find("a headless model (num_classes=0): --reset-head") !=
        std::string::npos);
  for (const std::string& file : {full, headless}) {
    CAPTURE(file);
    const InitialState s = read_timm_weights(file, target, true);
    const ParamLayout tl(target);
    const ParamTensor& pos = tl.at(tl.pos_embed);
    CHECK(pos.shape == std::vector<int64_t>{1, 37, 16});
    const ParamTensor& old_pos = layout.at(layout.pos_embed);
    for (int c = 0; c < 16; ++c) CHECK(s.params[pos.offset + c] == values[old_pos.offset + c]);  // the class token's row
    const std::vector<float> grid(values.begin() + old_pos.offset + 16, values.begin() + old_pos.offset + 17 * 16);
    const std::vector<float> want = resample_bicubic_antialiased(grid, 4, 4, 16, 6, 6);
    CHECK(std::equal(want.begin(), want.end(), s.params.begin() + pos.offset + 16));
    CHECK(s.loaded[tl.head_w] == 0);
    CHECK(s.loaded[tl.head_b] == 0);
    CHECK(s.loaded[tl.pos_embed] == 1);
    REQUIRE(s.adaptations.size() == 2);
    CHECK(s.adaptations[0] == "pos_embed resampled from a 4x4 grid to 6x6 (bicubic, antialiased, as timm)");
    const ParamTensor& qkv = tl.at(tl.blocks[0].qkv_w);  // the rest as saved
    CHECK(s.params[qkv.offset + 7] == values[layout.at(layout.blocks[0].qkv_w).offset + 7]);
  }
  // A bf16 file: the resampled embedding rounded to bf16, as timm rounds it back to the file's dtype.
  {
    std::vector<uint16_t> bf(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t b;
      std::memcpy(&b, &values[i], 4);
      bf[i] = uint16_t(b >> 16);  // (truncated: any bf16 values do)
    }
    std::vector<StTensor> t;
    for (const ParamTensor& p : layout.tensors())
      t.push_back({p.name, "BF16", p.shape, bf.data() + p.offset, p.numel * 2});
    const std::string path = (d / "bf16.safetensors").string();
    write_safetensors(path, t);
    const InitialState s = read_timm_weights(path, target, true);
    const ParamLayout tl(target);
    const ParamTensor& pos = tl.at(tl.pos_embed);
    for (size_t i = pos.offset; i < pos.offset + pos.numel; ++i) {
      uint32_t b;
      std::memcpy(&b, &s.params[i], 4);
      REQUIRE((b & 0xFFFF) == 0);
    }
  }
  // A position embedding of no square grid: refused, naming it.
  {
    std::vector<StTensor> t;
    std::vector<float> odd(values);
    for (const ParamTensor& p : layout.tensors())
      t.push_back({p.name, "F32", p.name == "pos_embed" ? std::vector<int64_t>{1, 16, 16} : p.shape,
                   odd.data() + p.offset, (p.name == "pos_embed" ? 16 * 16 : p.numel) * sizeof(float)});
    const std::string path = (d / "odd.safetensors").string();
    write_safetensors(path, t);
    CHECK(usage_error([&] { read_timm_weights(path, target, true); })
              .find("tensor pos_embed has shape [1, 16, 16], the model needs [1, 37, 16]") != std::string::npos);
  }
  // Another patch size is not adapted: the tensor is named.
  ViTConfig patch4 = target;
  patch4.patch = 4;
  std::string e;
  try {
    read_timm_weights(full, patch4, true);
  } catch (const std::runtime_error& x) {
    e = x.what();
  }
  CHECK(e.find("tensor patch_embed.proj.weight has shape [16, 3, 8, 8], the model needs [16, 3, 4, 4]") !=
        std::string::npos);
  fs::remove_all(d);
}

TEST_CASE("checkpoint: --eval-only reads a checkpoint of either optimizer, its state left out") {
  const fs::path d = temp_dir("eval_state");
  TrainOptions o = tiny_checkpoint_options(Precision::BF16);
  o.optimizer = OptimizerKind::AdamW;
  const ParamLayout layout(o.model);
  InitialState c;
  c.params.assign(layout.total(), 0.5f);
  c.optimizer_state = {{"exp_avg", std::vector<float>(layout.total(), 0.1f)},
                       {"exp_avg_sq", std::vector<float>(layout.total(), 0.2f)}};
  c.optimizer_steps = 3;
  c.state.step = 3;
  write_checkpoint_files(d.string(), o.model, c, run_facts(o.model, o, 1));
  TrainOptions sgd = o;
  sgd.optimizer = OptimizerKind::Sgd;
  std::string e;
  try {
    read_checkpoint(d.string(), sgd, 1);
  } catch (const UsageError& x) {
    e = x.what();
  }
  CHECK(e.find("the checkpoint holds adamw's state, this run uses --optimizer sgd") != std::string::npos);
  sgd.eval_only = true;
  const InitialState s = read_checkpoint(d.string(), sgd, 1);
  CHECK(s.optimizer_state.empty());
  CHECK(s.params[0] == 0.5f);
  CHECK(s.state.step == 3);
  fs::remove_all(d);
}

TEST_CASE("resumed_losses_mismatch: the resumed run's progress lines against the whole run's last ones") {
  auto lines = [](int from, int to, int steps, double bump_at) {
    std::string out;
    for (int s = from; s <= to; ++s)
      out += "  " + std::to_string(s) + "/" + std::to_string(steps) + "  " + std::to_string(2.0 + 0.01 * s + (s == bump_at ? 1e-6 : 0)) + " 1.0\n";
    return out;
  };
  InterruptedRun r;
  r.whole.out = lines(1, 4, 4, 0);
  r.rest.out = lines(3, 4, 4, 0);
  CHECK(resumed_losses_mismatch(r, 4, 2) == "");
  r.rest.out = lines(3, 4, 4, 4);  // a loss off in its last digit
  CHECK(resumed_losses_mismatch(r, 4, 2) == "step 4 differs");
  r.rest.out = lines(3, 3, 4, 0);  // a line missing
  CHECK(resumed_losses_mismatch(r, 4, 2) == "4 progress lines whole and 1 resumed");
}

TEST_CASE("gpu: an interrupted run resumed from its checkpoint gives the uninterrupted run's losses") {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char *precision, *optimizer;
    int accum_steps;
    const char* drop_path;
  };
  for (const Case c : {Case{"bf16", "sgd", 1, "0"}, Case{"fp8", "sgd", 1, "0"}, Case{"bf16", "adamw", 1, "0"},
                       Case{"fp8", "adamw", 1, "0"}, Case{"bf16", "adamw", 3, "0.3"}, Case{"fp8", "sgd", 2, "0.2"}}) {
    CAPTURE(c.precision);
    CAPTURE(c.optimizer);
    CAPTURE(c.accum_steps);
    CAPTURE(c.drop_path);
    const fs::path d = temp_dir(std::string("resume_") + c.precision + c.optimizer + std::to_string(c.accum_steps));
    const std::string adamw = " --lr 0.002 --weight-decay 0.05 --betas 0.9,0.95";
    const std::string args = kSmall + " --precision " + c.precision + " --optimizer " + c.optimizer +
                             (std::string(c.optimizer) == "adamw" ? adamw : "") +
                             " --accum-steps " + std::to_string(c.accum_steps) + " --drop-path " + c.drop_path;
    // Killed (a failure injected) at the start of step 11, after the checkpoint of step 10.
    const InterruptedRun r = run_interrupted_and_resumed(args, d.string(), 10, "--save-every 5 --keep 2");
    REQUIRE_INTERRUPTED_AND_RESUMED(r);
    CHECK(fs::exists(d / "step-00000010" / "model.safetensors"));
    CHECK(fs::exists(d / "step-00000005"));  // --keep 2: 5 and 10
    CHECK(resumed_losses_mismatch(r, 20, 10) == "");
    // The checkpoint's weights are the run's: every tensor under timm's name.
    const SafetensorsFile m((d / "step-00000010" / "model.safetensors").string());
    CHECK(m.find("blocks.1.mlp.fc2.weight") != nullptr);
    CHECK(m.tensors().size() == 32);
    fs::remove_all(d);
  }
}

TEST_CASE("gpu: the newest K checkpoints are kept; bad checkpoints and timm files are refused clearly") {
  SKIP_WITHOUT_GPU();
  const fs::path d = temp_dir("keep");
  const Run saved = shell(kSmall + " --steps 10 --save " + d.string() + " --save-every 2 --keep 3");
  CAPTURE(saved.out);
  REQUIRE(saved.code == 0);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-00000006", "step-00000008", "step-00000010"});

  // Another model: refused, exit 2, the difference named.
  Run other = shell(kSmall + " --dim 128 --resume " + d.string());
  CHECK(other.code == 2);
  CHECK(other.out.find("the checkpoint is for dim 64, this run has 128") != std::string::npos);
  // Another optimizer: refused, exit 2.
  Run adamw = shell(kSmall + " --optimizer adamw --resume " + d.string());
  CHECK(adamw.code == 2);
  CHECK(adamw.out.find("the checkpoint holds sgd's state, this run uses --optimizer adamw") != std::string::npos);
  // Another seed: allowed, with a note naming it.
  Run reseeded = shell(kSmall + " --steps 12 --seed 5 --resume " + d.string());
  CAPTURE(reseeded.out);
  CHECK(reseeded.code == 0);
  CHECK(reseeded.out.find("this run differs from the checkpoint's (") != std::string::npos);
  CHECK(reseeded.out.find("seed 0 -> seed 5") != std::string::npos);
  // Nothing left to run.
  Run done = shell(kSmall + " --steps 10 --resume " + d.string());
  CHECK(done.code == 2);
  CHECK(done.out.find("nothing is left to run") != std::string::npos);
  // A truncated state file: exit 1, the file named; the other checkpoints untouched.
  const std::string state = (d / "step-00000010" / "state.safetensors").string();
  const std::string bytes = file_bytes(state);
  write_bytes(state, bytes.substr(0, bytes.size() / 2));
  Run truncated = shell(kSmall + " --steps 12 --resume " + d.string());
  CHECK(truncated.code == 1);
  CHECK(truncated.out.find("state.safetensors") != std::string::npos);
  CHECK(fs::file_size(d / "step-00000008" / "state.safetensors") > 0);

  // A disk that fills during a save (a 64 KiB file-size limit, SIGXFSZ ignored so the write fails
  // with EFBIG as on a full disk): exit 1, the file named, no temporary left, the kept checkpoints whole.
  const std::string model8 = (d / "step-00000008" / "model.safetensors").string(), before8 = file_bytes(model8);
  const std::string model10 = (d / "step-00000010" / "model.safetensors").string(), before10 = file_bytes(model10);
  Run full = shell("bash -c 'trap \"\" XFSZ; ulimit -f 64; exec " + kSmall + " --steps 10 --resume " +
                   (d / "step-00000008").string() + " --save " + d.string() + " --save-every 2 --keep 3'");
  CAPTURE(full.out);
  CHECK(full.code == 1);
  CHECK(full.out.find("cannot write") != std::string::npos);
  CHECK(full.out.find(".step-00000010.tmp/model.safetensors") != std::string::npos);
  CHECK(!fs::exists(d / ".step-00000010.tmp"));
  CHECK(file_bytes(model8) == before8);
  CHECK(file_bytes(model10) == before10);  // the step being saved again: the old copy stays in place
  CHECK(SafetensorsFile(model8).tensors().size() == 32);
  CHECK(fs::exists(d / "step-00000006" / "state.safetensors"));

  // --init-from: a checkpoint's model file is a timm file; a model it does not fit is refused.
  const std::string weights = (d / "step-00000008" / "model.safetensors").string();
  Run init = shell(kSmall + " --steps 4 --init-from " + weights);
  CAPTURE(init.out);
  CHECK(init.code == 0);
  Run classes = shell(kSmall + " --steps 4 --classes 12 --init-from " + weights);
  CHECK(classes.code == 2);
  CHECK(classes.out.find("its head has 10 classes, this model 12") != std::string::npos);
  Run depth = shell(kSmall + " --steps 4 --depth 3 --init-from " + weights);
  CHECK(depth.code == 2);
  CHECK(depth.out.find("missing, e.g. blocks.2.norm1.weight") != std::string::npos);
  // A save that cannot be written: exit 1, named.
  Run unwritable = shell(kSmall + " --steps 4 --save /dev/null/ckpt");
  CHECK(unwritable.code == 1);
  CHECK(unwritable.out.find("cannot create checkpoint directory /dev/null/ckpt") != std::string::npos);
  fs::remove_all(d);
}
