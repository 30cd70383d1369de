#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "engine/checkpoint_dir.h"
#include "engine/safetensors.h"
#include "engine/training_step.h"
#include "kernels/check.h"
#include "model/params.h"
#include "model/vit.h"

namespace fs = std::filesystem;

namespace {

template <class T>
std::vector<T> to_host(const T* device, size_t n, cudaStream_t stream) {
  std::vector<T> h(n);
  if (n) CUDA_CHECK(cudaMemcpyAsync(h.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return h;
}

// What must match for a checkpoint to continue this run: the model's shape and the precision
// (and, as facts to report, the batch and the number of ranks).
std::vector<int64_t> run_shape(const ViTConfig& c, const TrainOptions& o, int world) {
  return {c.img, c.patch, c.channels, c.classes, c.dim, c.depth, c.heads, static_cast<int64_t>(c.mlp_ratio * 1000),
          o.precision == Precision::FP8 ? 1 : 0, o.batch, world, o.fp8_scaling == Fp8Scaling::Current ? 1 : 0, o.amax_history,
          o.fp8_margin};
}
const char* kShapeNames[] = {"img", "patch", "channels", "classes", "dim", "depth", "heads", "mlp_ratio x 1000",
                             "precision (1 fp8)", "batch", "ranks", "fp8 recipe (1 current)", "amax history",
                             "fp8 margin"};
constexpr size_t kMustMatch = 9;  // the model and the precision; the rest changes only the losses

void fsync_path(const std::string& path, bool dir) {
  const int fd = ::open(path.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw RuntimeError("cannot open " + path + " to flush it: " + std::strerror(errno));
  const int r = ::fsync(fd);
  ::close(fd);
  if (r != 0) throw RuntimeError("cannot flush " + path + ": " + std::strerror(errno));
}

void copy_to_device(float* dst, const std::vector<float>& src, cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

// The FP8 scaling records a model of this shape and precision keeps.
size_t fp8_meta_bytes(const ViTConfig& c, Precision p) {
  return p == Precision::FP8 ? ViT::fp8_tensors_of(c) * sizeof(Fp8Meta) : 0;
}
}  // namespace

std::string save_checkpoint(const std::string& dir, int keep, const CheckpointState& state, TrainingStep& training,
                            const TrainOptions& opts, int world, cudaStream_t stream) {
  training.await_update(stream);  // an optimizer step still running on the second stream
  const ViT& model = training.model();
  const Fp8Recipe* fp8 = training.fp8();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) throw RuntimeError("cannot create checkpoint directory " + dir + ": " + ec.message());
  char name[32];
  std::snprintf(name, sizeof name, "%s%08d", kCheckpointPrefix, state.step);
  const fs::path final_path = fs::path(dir) / name, tmp = fs::path(dir) / (std::string(".") + name + ".tmp");
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) throw RuntimeError("cannot create " + tmp.string() + ": " + ec.message());

  try {
    const ParamLayout& layout = model.layout();
    const std::vector<float> params = to_host(model.params(), layout.total(), stream);
    const std::vector<float> momentum = to_host(training.optimizer().momentum(), layout.total(), stream);
    std::vector<StTensor> weights, st;
    for (const ParamTensor& t : layout.tensors()) {
      weights.push_back({t.name, "F32", t.shape, params.data() + t.offset, t.numel * sizeof(float)});
      st.push_back({"momentum." + t.name, "F32", t.shape, momentum.data() + t.offset, t.numel * sizeof(float)});
    }
    const std::vector<Fp8Meta> metas = fp8 ? to_host(fp8->metas(), fp8->count(), stream) : std::vector<Fp8Meta>();
    const std::vector<int> counters = fp8 ? to_host(fp8->skip_counters(), 2, stream) : std::vector<int>();
    const std::vector<int64_t> shape = run_shape(model.config(), opts, world);
    const int64_t step = state.step;
    const float loss_sum = state.epoch_loss_sum;
    st.push_back({"run.shape", "I64", {static_cast<int64_t>(shape.size())}, shape.data(), shape.size() * 8});
    st.push_back({"run.step", "I64", {1}, &step, 8});
    st.push_back({"run.epoch_loss_sum", "F32", {1}, &loss_sum, 4});
    if (!metas.empty()) {
      st.push_back({"fp8.metas", "U8", {static_cast<int64_t>(metas.size() * sizeof(Fp8Meta))}, metas.data(),
                    metas.size() * sizeof(Fp8Meta)});
      st.push_back({"fp8.skipped", "I32", {2}, counters.data(), 8});
    }
    write_safetensors((tmp / "model.safetensors").string(), weights);
    write_safetensors((tmp / "state.safetensors").string(), st);
    std::string text = "step " + std::to_string(state.step) + "\nmodel " + model.config().describe() + "\nprecision " +
                       choice_name(opts.precision) + "\nbatch " + std::to_string(opts.batch) + " per rank, " + std::to_string(world) +
                       " rank(s)\n" + run_schedule_text(opts);
    write_text_file((tmp / "run.txt").string(), text);
    fsync_path(tmp.string(), true);
    // The same step saved again: the old one is set aside until the new one is in place.
    const fs::path old = fs::path(dir) / (std::string(".") + name + ".old");
    fs::remove_all(old, ec);
    if (fs::exists(final_path)) fs::rename(final_path, old);
    fs::rename(tmp, final_path);
    fsync_path(dir, true);
    fs::remove_all(old, ec);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw RuntimeError("cannot save the checkpoint " + final_path.string() + ": " + e.what());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  // The newest `keep` up to this step stay; checkpoints of later steps (another run's, in the
  // same directory) are left alone.
  std::vector<std::string> all = checkpoints_in(dir);
  all.erase(std::remove_if(all.begin(), all.end(),
                           [&](const std::string& p) { return checkpoint_step(p) > state.step; }),
            all.end());
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i], ec);
  return final_path.string();
}

std::string run_schedule_text(const TrainOptions& o) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.9g", o.lr);
  return "seed " + std::to_string(o.seed) + "\ndata " + choice_name(o.data) +
         (o.data_dir.empty() ? "" : ":" + o.data_dir) + "\nschedule " + choice_name(o.lr_schedule) + ", lr " + lr + ", warmup-steps " + std::to_string(o.warmup_steps) + ", steps " +
         std::to_string(o.steps) + "\n";
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

InitialState read_checkpoint(const std::string& path, const TrainOptions& opts, int world) {
  const SafetensorsFile st((fs::path(path) / "state.safetensors").string());
  const std::vector<int64_t> want = run_shape(opts.model, opts, world);
  const SafetensorsFile::Entry* shape = st.find("run.shape");
  if (!shape || shape->dtype != "I64" || shape->shape.size() != 1)
    throw RuntimeError(st.path() + " has no valid run.shape: not a checkpoint of this engine");
  if (shape->shape[0] != static_cast<int64_t>(want.size()))
    throw RuntimeError(st.path() + " records " + std::to_string(shape->shape[0]) + " run facts, this engine " +
                       std::to_string(want.size()) + ": a checkpoint of another version");
  std::vector<int64_t> have(want.size());
  std::memcpy(have.data(), st.data(*shape), have.size() * 8);
  for (size_t i = 0; i < kMustMatch; ++i)
    if (have[i] != want[i])
      throw UsageError("--resume " + path + ": the checkpoint is for " + kShapeNames[i] + " " + std::to_string(have[i]) +
                       ", this run has " + std::to_string(want[i]));
  for (size_t i = kMustMatch; i < want.size(); ++i)
    if (have[i] != want[i])
      std::fprintf(stderr, "vit_train: note: the checkpoint ran with %s %lld, this run has %lld: the loss sequence "
                   "will differ from the uninterrupted run's\n", kShapeNames[i], static_cast<long long>(have[i]),
                   static_cast<long long>(want[i]));

  std::ifstream run_txt(fs::path(path) / "run.txt");
  if (run_txt) {
    std::stringstream text;
    text << run_txt.rdbuf();
    for (const std::string& d : resume_differences(text.str(), opts))
      std::fprintf(stderr, "vit_train: note: the checkpoint's run and this one differ, %s: the loss sequence will "
                   "differ from the uninterrupted run's\n", d.c_str());
  }

  InitialState out;
  out.source = path;
  out.resumed = true;
  const SafetensorsFile weights((fs::path(path) / "model.safetensors").string());
  const ParamLayout layout(opts.model);
  out.params.assign(layout.total(), 0.0f);
  out.momentum.assign(layout.total(), 0.0f);
  for (const ParamTensor& t : layout.tensors()) {
    const std::vector<float> w = weights.as_f32(t.name, t.shape), m = st.as_f32("momentum." + t.name, t.shape);
    std::copy(w.begin(), w.end(), out.params.begin() + t.offset);
    std::copy(m.begin(), m.end(), out.momentum.begin() + t.offset);
  }
  const size_t meta_bytes = fp8_meta_bytes(opts.model, opts.precision);
  if (meta_bytes > 0) {
    const SafetensorsFile::Entry* metas = st.find("fp8.metas");
    const SafetensorsFile::Entry* skipped = st.find("fp8.skipped");
    if (!metas || metas->bytes != meta_bytes || !skipped || skipped->bytes != 8)
      throw RuntimeError(st.path() + " has no FP8 scaling state of this model's size");
    out.fp8_metas.assign(st.data(*metas), st.data(*metas) + meta_bytes);
    std::memcpy(out.fp8_skipped, st.data(*skipped), 8);
  }

  const SafetensorsFile::Entry* step = st.find("run.step");
  const SafetensorsFile::Entry* loss = st.find("run.epoch_loss_sum");
  if (!step || step->bytes != 8 || !loss || loss->bytes != 4) throw RuntimeError(st.path() + " has no run.step");
  int64_t s = 0;
  std::memcpy(&s, st.data(*step), 8);
  std::memcpy(&out.state.epoch_loss_sum, st.data(*loss), 4);
  if (s < 0 || s > (1 << 30)) throw RuntimeError(st.path() + " records step " + std::to_string(s) + " (corrupted?)");
  out.state.step = static_cast<int>(s);
  return out;
}

InitialState read_timm_weights(const std::string& file, const ViTConfig& model) {
  const SafetensorsFile f(file);
  const ParamLayout layout(model);
  InitialState out;
  out.source = file;
  out.params.assign(layout.total(), 0.0f);
  std::vector<std::string> missing;
  for (const ParamTensor& t : layout.tensors()) {
    if (!f.find(t.name)) {
      missing.push_back(t.name);
      continue;
    }
    const std::vector<int64_t>& head = f.find(t.name)->shape;
    if (t.name == "head.weight" && head != t.shape && head.size() == 2 && head[1] == t.shape[1])
      throw UsageError("--init-from " + file + ": its head has " + std::to_string(head[0]) + " classes, this model " +
                       std::to_string(model.classes) + " (--classes)");
    const std::vector<float> w = f.as_f32(t.name, t.shape);
    std::copy(w.begin(), w.end(), out.params.begin() + t.offset);
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, e] : f.tensors())
    if (layout.find(name) < 0) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty()) {
    std::string msg = "--init-from " + file + " does not match this model (timm's strict load):";
    if (!missing.empty()) msg += " " + std::to_string(missing.size()) + " missing, e.g. " + missing[0] + ";";
    if (!unexpected.empty()) msg += " " + std::to_string(unexpected.size()) + " unexpected, e.g. " + unexpected[0] + ";";
    throw UsageError(msg + " check --model and the shape flags");
  }
  return out;
}

void upload(const InitialState& initial, TrainingStep& training, cudaStream_t stream) {
  training.await_update(stream);  // an optimizer step still running on the second stream
  ViT& model = training.model();
  const size_t n = model.layout().total();
  ENSURE(initial.params.size() == n && (initial.momentum.empty() || initial.momentum.size() == n),
         "upload: the initial state was read for another layout");
  copy_to_device(model.params(), initial.params, stream);
  if (initial.momentum.empty())
    CUDA_CHECK(cudaMemsetAsync(training.optimizer().momentum(), 0, n * sizeof(float), stream));
  else
    copy_to_device(training.optimizer().momentum(), initial.momentum, stream);
  if (Fp8Recipe* fp8 = training.fp8(); fp8 && !initial.fp8_metas.empty()) {
    ENSURE(initial.fp8_metas.size() == fp8->count() * sizeof(Fp8Meta), "upload: FP8 state of another size");
    CUDA_CHECK(cudaMemcpyAsync(fp8->metas(), initial.fp8_metas.data(), initial.fp8_metas.size(), cudaMemcpyHostToDevice,
                               stream));
    CUDA_CHECK(cudaMemcpyAsync(fp8->skip_counters(), initial.fp8_skipped, 8, cudaMemcpyHostToDevice, stream));
  }
  model.refresh_weight_copies(stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
}
