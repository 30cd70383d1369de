#include "engine/checkpoint_format.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "engine/checkpoint_dir.h"
#include "engine/optimizer.h"
#include "engine/regular_file.h"
#include "engine/resample.h"
#include "kernels/check.h"
#include "kernels/fp8_scaling.h"
#include "model/params.h"
#include "model/vit.h"

namespace fs = std::filesystem;

std::vector<int64_t> run_facts(const ViTConfig& c, const TrainOptions& o, int world) {
  return {c.img, c.patch, c.channels, c.classes, c.dim, c.depth, c.heads, static_cast<int64_t>(c.mlp_ratio * 1000),
          o.precision == Precision::FP8 ? 1 : 0, o.batch, world, o.fp8_scaling == Fp8Scaling::Current ? 1 : 0,
          o.amax_history, o.fp8_margin, o.accum_steps};
}
const char* const kRunFactNames[] = {"img", "patch", "channels", "classes", "dim", "depth", "heads",
                                     "mlp_ratio x 1000", "precision (1 fp8)", "batch", "ranks",
                                     "fp8 recipe (1 current)", "amax history", "fp8 margin", "accum steps"};

void write_checkpoint_files(const std::string& dir, const ViTConfig& model, const InitialState& c,
                            const std::vector<int64_t>& facts) {
  const ParamLayout layout(model);
  ENSURE(c.params.size() == layout.total(), "write_checkpoint_files: contents of another layout");
  std::vector<StTensor> weights, st;
  for (const ParamTensor& t : layout.tensors())
    weights.push_back({t.name, "F32", t.shape, c.params.data() + t.offset, t.numel * sizeof(float)});
  for (const auto& [name, buffer] : c.optimizer_state) {
    ENSURE(buffer.size() == layout.total(), "write_checkpoint_files: optimizer state of another layout");
    for (const ParamTensor& t : layout.tensors())
      st.push_back({name + "." + t.name, "F32", t.shape, buffer.data() + t.offset, t.numel * sizeof(float)});
  }
  if (c.optimizer_state.size() > 1)  // AdamW
    st.push_back({"optimizer.steps", "I64", {1}, &c.optimizer_steps, 8});
  const int64_t step = c.state.step;
  st.push_back({"run.shape", "I64", {static_cast<int64_t>(facts.size())}, facts.data(), facts.size() * 8});
  st.push_back({"run.step", "I64", {1}, &step, 8});
  st.push_back({"run.epoch_loss_sum", "F32", {1}, &c.state.epoch_loss_sum, 4});
  if (!c.fp8_metas.empty()) {
    st.push_back({"fp8.metas", "U8", {static_cast<int64_t>(c.fp8_metas.size())}, c.fp8_metas.data(), c.fp8_metas.size()});
    st.push_back({"fp8.skipped", "I32", {2}, c.fp8_skipped, 8});
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), weights);
  write_safetensors((fs::path(dir) / "state.safetensors").string(), st);
}

namespace {
std::string regularisation_text(const TrainOptions& o) {
  char t[96];
  std::snprintf(t, sizeof t, "regularisation drop-path %.9g, label-smoothing %.9g", o.drop_path, o.label_smoothing);
  return t;
}

std::string optimizer_text(const TrainOptions& o) {
  char t[160];
  if (o.optimizer == OptimizerKind::Sgd)
    std::snprintf(t, sizeof t, "optimizer sgd, momentum %.9g, weight-decay %.9g, nesterov %s", o.momentum,
                  o.weight_decay, o.nesterov ? "on" : "off");
  else
    std::snprintf(t, sizeof t, "optimizer adamw, betas %.9g,%.9g, eps %.9g, weight-decay %.9g", o.beta1, o.beta2,
                  o.eps, o.weight_decay);
  return t;
}
}  // namespace

std::string run_schedule_text(const TrainOptions& o) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.9g", o.lr);
  return "seed " + std::to_string(o.seed) + "\ndata " + choice_name(o.data) +
         (o.data_dir.empty() ? "" : ":" + o.data_dir) + "\nschedule " + choice_name(o.lr_schedule) + ", lr " + lr +
         ", warmup-steps " + std::to_string(o.warmup_steps) + ", steps " + std::to_string(o.steps) + "\n" +
         optimizer_text(o) + "\n" + regularisation_text(o) + "\n";
}

std::vector<std::string> resume_differences(const std::string& run_txt, const TrainOptions& opts) {
  // Each line's first word and the line, in both texts.
  const auto lines = [](const std::string& text) {
    std::map<std::string, std::string> by_key;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) by_key[line.substr(0, line.find(' '))] = line;
    return by_key;
  };
  const auto had = lines(run_txt), has = lines(run_schedule_text(opts));
  std::vector<std::string> out;
  for (const auto& [key, line] : has) {
    const auto it = had.find(key);
    if (it != had.end() && it->second != line) out.push_back(it->second + " -> " + line);
  }
  return out;
}

namespace {
// run.txt is a few lines; anything larger is not this engine's.
constexpr size_t kMaxRunTextBytes = 1 << 16;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string t = "[";
  for (size_t i = 0; i < shape.size(); ++i) t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + "]";
}

[[noreturn]] void bad_tensor(const SafetensorsFile& f, const std::string& name, const std::string& what) {
  throw RuntimeError(f.path() + ": tensor " + name + " " + what);
}

// The entry of a tensor this engine wrote, with the dtype and shape it writes.
const SafetensorsFile::Entry& expect_tensor(const SafetensorsFile& f, const std::string& name, const char* dtype,
                                            const std::vector<int64_t>& shape) {
  const SafetensorsFile::Entry* e = f.find(name);
  if (!e) throw RuntimeError(f.path() + " has no tensor " + name + ": not a checkpoint of this engine, or damaged");
  if (e->dtype != dtype || e->shape != shape)
    bad_tensor(f, name, "is not " + std::string(dtype) + " " + shape_text(shape) + ": not a checkpoint of this engine, or damaged");
  return *e;
}

// The tensor as fp32, every value finite.
std::vector<float> finite_f32(const SafetensorsFile& f, const std::string& name, const std::vector<int64_t>& shape) {
  std::vector<float> v = f.as_f32(name, shape);
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) bad_tensor(f, name, "holds " + std::to_string(v[i]) + " at element " + std::to_string(i));
  return v;
}

// The FP8 scaling records as the engine keeps them: positive finite scales, amaxes finite and
// not negative, an E4M3 or E5M2 maximum.
void check_fp8_metas(const SafetensorsFile& f, const std::vector<uint8_t>& bytes) {
  for (size_t r = 0; r < bytes.size() / sizeof(Fp8Meta); ++r) {
    Fp8Meta m;
    std::memcpy(&m, bytes.data() + r * sizeof(Fp8Meta), sizeof m);
    auto bad = [&](const char* field, float v) {
      bad_tensor(f, "fp8.metas", "record " + std::to_string(r) + " has " + field + " " + std::to_string(v) +
                                     " (corrupted?)");
    };
    if (!(std::isfinite(m.scale) && m.scale > 0)) bad("scale", m.scale);
    if (!(std::isfinite(m.scale_inv) && m.scale_inv > 0)) bad("scale_inv", m.scale_inv);
    if (!(std::isfinite(m.amax) && m.amax >= 0)) bad("amax", m.amax);
    if (m.fp8_max != 448.0f && m.fp8_max != 57344.0f) bad("fp8_max", m.fp8_max);
    for (const float h : m.history)
      if (!(std::isfinite(h) && h >= 0)) bad("an amax history entry", h);
  }
}
}  // namespace

namespace {
// The FP8 scaling state (in fp8), the step and the epoch's running loss, read into out.
InitialState finish_reading_state(const SafetensorsFile& st, const TrainOptions& opts, InitialState out) {
  if (opts.precision == Precision::FP8) {
    const size_t meta_bytes = ViT::fp8_tensors_of(opts.model) * sizeof(Fp8Meta);
    const SafetensorsFile::Entry& metas = expect_tensor(st, "fp8.metas", "U8", {static_cast<int64_t>(meta_bytes)});
    const SafetensorsFile::Entry& skipped = expect_tensor(st, "fp8.skipped", "I32", {2});
    out.fp8_metas.assign(st.data(metas), st.data(metas) + meta_bytes);
    check_fp8_metas(st, out.fp8_metas);
    std::memcpy(out.fp8_skipped, st.data(skipped), 8);
    if (out.fp8_skipped[0] < 0 || out.fp8_skipped[1] < 0)
      bad_tensor(st, "fp8.skipped", "holds a negative count (corrupted?)");
  }

  int64_t step = 0;
  std::memcpy(&step, st.data(expect_tensor(st, "run.step", "I64", {1})), 8);
  if (step < 0 || step > kMaxCheckpointStep)
    bad_tensor(st, "run.step", "records step " + std::to_string(step) + " (corrupted?)");
  out.state.step = static_cast<int>(step);
  // (May be NaN: an FP8 step skipped for a non-finite loss still adds it; it feeds only the
  // epoch's report.)
  std::memcpy(&out.state.epoch_loss_sum, st.data(expect_tensor(st, "run.epoch_loss_sum", "F32", {1})), 4);
  return out;
}
}  // namespace

InitialState read_checkpoint_files(const std::string& path, const SafetensorsFile& st, const SafetensorsFile& weights,
                                   const TrainOptions& opts, int world) {
  const std::vector<int64_t> want = run_facts(opts.model, opts, world);
  const SafetensorsFile::Entry* shape = st.find("run.shape");
  if (!shape || shape->dtype != "I64" || shape->shape.size() != 1)
    throw RuntimeError(st.path() + " has no valid run.shape: not a checkpoint of this engine");
  // The engine's checkpoints before --accum-steps record one fact less (one micro-batch a step).
  const int64_t recorded = shape->shape[0];
  if (recorded != static_cast<int64_t>(want.size()) && recorded != static_cast<int64_t>(want.size()) - 1)
    throw RuntimeError(st.path() + " records " + std::to_string(recorded) + " run facts, this engine " +
                       std::to_string(want.size()) + ": a checkpoint of another version");
  std::vector<int64_t> have(want.size(), 1);
  std::memcpy(have.data(), st.data(*shape), recorded * 8);
  for (size_t i = 0; i < kRunFactsMustMatch; ++i)
    if (have[i] != want[i])
      throw UsageError("--resume " + path + ": the checkpoint is for " + kRunFactNames[i] + " " +
                       std::to_string(have[i]) + ", this run has " + std::to_string(want[i]));
  InitialState out;
  for (size_t i = kRunFactsMustMatch; i < want.size(); ++i)
    if (have[i] != want[i])
      out.differences.push_back(std::string(kRunFactNames[i]) + " " + std::to_string(have[i]) + " -> " +
                                std::to_string(want[i]));

  out.source = path;
  out.resumed = true;
  const ParamLayout layout(opts.model);
  out.params.assign(layout.total(), 0.0f);
  for (const ParamTensor& t : layout.tensors()) {
    const std::vector<float> w = finite_f32(weights, t.name, t.shape);
    std::copy(w.begin(), w.end(), out.params.begin() + t.offset);
  }
  // The optimizer's state: this run's optimizer must be the checkpoint's (--eval-only needs none).
  if (opts.eval_only) return finish_reading_state(st, opts, std::move(out));
  const std::string first = layout.tensors().front().name;
  for (const OptimizerKind other : {OptimizerKind::Sgd, OptimizerKind::AdamW})
    if (other != opts.optimizer && !st.find(optimizer_state_names(opts.optimizer)[0] + "." + first) &&
        st.find(optimizer_state_names(other)[0] + "." + first))
      throw UsageError("--resume " + path + ": the checkpoint holds " + choice_name(other) +
                       "'s state, this run uses --optimizer " + choice_name(opts.optimizer));
  for (const std::string& name : optimizer_state_names(opts.optimizer)) {
    std::vector<float> buffer(layout.total(), 0.0f);
    for (const ParamTensor& t : layout.tensors()) {
      const std::vector<float> v = finite_f32(st, name + "." + t.name, t.shape);
      std::copy(v.begin(), v.end(), buffer.begin() + t.offset);
    }
    out.optimizer_state.emplace_back(name, std::move(buffer));
  }
  if (opts.optimizer == OptimizerKind::AdamW) {
    std::memcpy(&out.optimizer_steps, st.data(expect_tensor(st, "optimizer.steps", "I64", {1})), 8);
    if (out.optimizer_steps < 0 || out.optimizer_steps > kMaxCheckpointStep)
      bad_tensor(st, "optimizer.steps", "records " + std::to_string(out.optimizer_steps) + " updates (corrupted?)");
  }
  return finish_reading_state(st, opts, std::move(out));
}

InitialState read_checkpoint(const std::string& path, const TrainOptions& opts, int world) {
  const SafetensorsFile state((fs::path(path) / "state.safetensors").string());
  const SafetensorsFile weights((fs::path(path) / "model.safetensors").string());
  InitialState out = read_checkpoint_files(path, state, weights, opts, world);
  const std::string run_txt = (fs::path(path) / "run.txt").string();
  std::error_code ec;
  if (fs::exists(run_txt, ec))  // (an earlier version wrote none)
    for (const std::string& d : resume_differences(read_text_file(run_txt, kMaxRunTextBytes), opts))
      out.differences.push_back(d);
  return out;
}

namespace {
// The file's pos_embed [1, 1 + g^2, D] resampled to the model's [1, 1 + grid^2, D] (the class
// token's row kept), rounded to the file's dtype as timm's resample_abs_pos_embed rounds it;
// the old grid's side in *old_grid. Throws UsageError where the file's is of no such shape.
std::vector<float> resampled_pos_embed(const SafetensorsFile& f, const SafetensorsFile::Entry& e,
                                       const ViTConfig& model, int* old_grid) {
  const int64_t dim = model.dim;
  const int64_t side = e.shape.size() == 3 && e.shape[1] >= 2
                           ? static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(e.shape[1] - 1))))
                           : 0;
  if (e.shape.size() != 3 || e.shape[0] != 1 || e.shape[2] != dim || side * side != e.shape[1] - 1 || side > 4096)
    throw UsageError("--init-from " + f.path() + ": tensor pos_embed has shape " + shape_text(e.shape) +
                     ", the model needs " + shape_text({1, model.tokens(), dim}) +
                     " (only a class token and a square grid of the model's width are resampled)");
  const std::vector<float> old = finite_f32(f, "pos_embed", e.shape);
  const std::vector<float> grid(old.begin() + dim, old.end());
  const int g = model.grid();
  std::vector<float> out(old.begin(), old.begin() + dim);  // the class token's
  std::vector<float> r =
      resample_bicubic_antialiased(grid, static_cast<int>(side), static_cast<int>(side), model.dim, g, g);
  for (float& v : r)
    v = e.dtype == "BF16" ? __bfloat162float(__float2bfloat16_rn(v))
        : e.dtype == "F16" ? __half2float(__float2half_rn(v))
                           : v;
  out.insert(out.end(), r.begin(), r.end());
  *old_grid = static_cast<int>(side);
  return out;
}
}  // namespace

InitialState read_timm_weights(const std::string& file, const ViTConfig& model, bool reset_head) {
  const SafetensorsFile f(file);
  const ParamLayout layout(model);
  InitialState out;
  out.source = file;
  out.params.assign(layout.total(), 0.0f);
  out.loaded.assign(layout.tensors().size(), 1);
  std::vector<std::string> missing;
  const auto is_head = [](const std::string& name) { return name == "head.weight" || name == "head.bias"; };
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const ParamTensor& t = layout.tensors()[i];
    if (reset_head && is_head(t.name)) {
      out.loaded[i] = 0;
      continue;
    }
    const SafetensorsFile::Entry* e = f.find(t.name);
    if (!e) {
      missing.push_back(t.name);
      continue;
    }
    if (t.name == "head.weight" && e->shape != t.shape && e->shape.size() == 2 && e->shape[1] == t.shape[1])
      throw UsageError("--init-from " + file + ": its head has " + std::to_string(e->shape[0]) + " classes, this model " +
                       std::to_string(model.classes) + " (--classes): --reset-head starts a new head");
    std::vector<float> w;
    int old_grid = 0;
    if (t.name == "pos_embed" && e->shape != t.shape) {
      w = resampled_pos_embed(f, *e, model, &old_grid);
      out.adaptations.push_back("pos_embed resampled from a " + std::to_string(old_grid) + "x" +
                                std::to_string(old_grid) + " grid to " + std::to_string(model.grid()) + "x" +
                                std::to_string(model.grid()) + " (bicubic, antialiased, as timm)");
    } else {
      w = finite_f32(f, t.name, t.shape);
    }
    std::copy(w.begin(), w.end(), out.params.begin() + t.offset);
  }
  if (reset_head)
    out.adaptations.push_back(std::string("a new head of ") + std::to_string(model.classes) + " classes (" +
                              (f.find("head.weight") ? "the file's left out" : "the file has none") +
                              "), initialised as timm does");
  std::vector<std::string> unexpected;
  for (const auto& [name, e] : f.tensors())
    if (layout.find(name) < 0) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty()) {
    std::string msg = "--init-from " + file + " does not match this model (timm's strict load):";
    if (!missing.empty()) msg += " " + std::to_string(missing.size()) + " missing, e.g. " + missing[0] + ";";
    if (!unexpected.empty()) msg += " " + std::to_string(unexpected.size()) + " unexpected, e.g. " + unexpected[0] + ";";
    const bool headless = missing.size() <= 2 && std::all_of(missing.begin(), missing.end(), is_head);
    throw UsageError(msg + (headless ? " a headless model (num_classes=0): --reset-head starts a new head"
                                     : " check --model and the shape flags"));
  }
  return out;
}
