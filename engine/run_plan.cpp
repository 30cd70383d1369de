#include "engine/run_plan.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "engine/checkpoint_dir.h"
#include "kernels/check.h"
#include "model/vit.h"

namespace {
// A file this process can append to, or create; throws RuntimeError naming the flag otherwise.
void check_appendable(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path, ec)) {
    if (!fs::is_regular_file(path, ec)) throw RuntimeError(flag + " " + path + ": not a regular file");
    if (::access(path.c_str(), W_OK) != 0) throw RuntimeError(flag + " " + path + ": " + std::strerror(errno));
    return;
  }
  const fs::path dir = fs::absolute(path, ec).parent_path();
  if (!fs::is_directory(dir, ec)) throw RuntimeError(flag + " " + path + ": no directory " + dir.string());
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw RuntimeError(flag + " " + path + ": cannot create it in " + dir.string() + ": " + std::strerror(errno));
}

void plan_data(RunPlan& p) {
  const TrainOptions& o = p.opts;
  const ViTConfig& m = o.model;
  if (o.data == DataKind::FashionMnist) {
    p.fashion = std::make_shared<const FashionMnist>(o.data_dir);
    p.train_count = p.fashion->train.count;
    p.test_count = p.fashion->test.count;
    p.data_summary = "Fashion-MNIST from " + o.data_dir;
  } else if (o.data == DataKind::Packed) {
    p.packed_train = std::make_shared<const PackedSet>(o.data_dir + "/train");
    if (std::filesystem::is_directory(o.data_dir + "/val"))
      p.packed_val = std::make_shared<const PackedSet>(o.data_dir + "/val");
    const PackedSet &train = *p.packed_train, *val = p.packed_val.get();
    if (train.classes() != m.classes)
      throw UsageError("--data packed:" + o.data_dir + " has " + std::to_string(train.classes()) +
                       " classes and the model's head " + std::to_string(m.classes) + " (--classes)");
    if (val && val->class_names() != train.class_names())
      throw UsageError("--data packed:" + o.data_dir + ": val's classes.txt differs from train's (the labels would not match)");
    if (val && (val->classes() != m.classes || val->size() < m.img))
      throw UsageError("--data packed:" + o.data_dir + "/val: " + std::to_string(val->classes()) + " classes of " +
                       std::to_string(val->size()) + "-pixel images; the model needs " + std::to_string(m.classes) +
                       " classes and at least " + std::to_string(m.img) + " pixels for its centre crop");
    p.train_count = train.count();
    p.test_count = val ? val->count() : 0;
    p.data_summary = "packed " + o.data_dir + " (" + std::to_string(train.size()) + " px, random resized crops and flips)";
  }
}
}  // namespace

RunPlan plan_run(const TrainOptions& opts, const ProcessGroup& group) {
  RunPlan p;
  p.opts = opts;
  p.group = group;
  p.world = group.size * opts.gpus;
  TrainOptions& o = p.opts;
  if (o.precision == Precision::FP8) {
    const std::string why = ViT::fp8_unsupported_reason(o.model, o.batch);
    if (!why.empty()) throw UsageError("--precision fp8: " + why);
  }

  plan_data(p);
  if (p.train_count > 0) {
    const int64_t global_batch = int64_t(o.accum_steps) * o.batch * p.world;
    if (global_batch > p.train_count)
      throw UsageError("the global batch (" + (o.accum_steps > 1 ? std::to_string(o.accum_steps) + " x " : "") +
                       std::to_string(p.world) + " x " + std::to_string(o.batch) + ") is larger than the " +
                       std::to_string(p.train_count) + " training images");
    if (o.epochs > 0) {
      const int64_t steps = int64_t(o.epochs) * (p.train_count / global_batch);
      if (steps > (1 << 30)) throw UsageError("--epochs " + std::to_string(o.epochs) + " makes more than 2^30 steps");
      set_total_steps(o, static_cast<int>(steps));
    }
  }

  if (!o.resume.empty()) {
    auto initial = std::make_shared<InitialState>(read_checkpoint(latest_checkpoint(o.resume), o, p.world));
    if (p.logs() && !initial->differences.empty() && !o.eval_only) {
      std::string list;
      for (const std::string& d : initial->differences) list += (list.empty() ? "" : "; ") + d;
      std::fprintf(stderr, "vit_train: note: this run differs from the checkpoint's (%s): the loss sequence will "
                   "differ from the uninterrupted run's\n", list.c_str());
    }
    if (initial->state.step >= o.steps && !o.eval_only)
      throw UsageError("--resume " + initial->source + ": the checkpoint is at step " +
                       std::to_string(initial->state.step) + " and this run ends at step " + std::to_string(o.steps) +
                       ": nothing is left to run");
    p.initial = std::move(initial);
  } else if (!o.init_from.empty()) {
    p.initial = std::make_shared<const InitialState>(read_timm_weights(o.init_from, o.model, o.reset_head));
    if (p.logs())
      for (const std::string& a : p.initial->adaptations)
        std::fprintf(stderr, "vit_train: note: --init-from %s: %s\n", o.init_from.c_str(), a.c_str());
  }

  // Checked now, not after the run; nothing is created until the run starts.
  if (p.logs() && !o.save_dir.empty()) check_writable_dir(o.save_dir, "--save");
  if (p.logs() && !o.log_file.empty()) check_appendable(o.log_file, "--log");
  if (p.logs() && !o.trace_file.empty()) check_appendable(o.trace_file, "--trace");
  return p;
}
