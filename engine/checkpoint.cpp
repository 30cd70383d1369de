#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
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
    InitialState contents;
    contents.params = to_host(model.params(), layout.total(), stream);
    for (const Optimizer::StateBuffer& b : training.optimizer().state())
      contents.optimizer_state.emplace_back(b.name, to_host(b.data, layout.total(), stream));
    contents.optimizer_steps = training.optimizer().steps(stream);
    if (fp8) {
      const std::vector<Fp8Meta> metas = to_host(fp8->metas(), fp8->count(), stream);
      const std::vector<int> counters = to_host(fp8->skip_counters(), 2, stream);
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(metas.data());
      contents.fp8_metas.assign(bytes, bytes + metas.size() * sizeof(Fp8Meta));
      std::copy(counters.begin(), counters.end(), contents.fp8_skipped);
    }
    contents.state = state;
    write_checkpoint_files(tmp.string(), model.config(), contents, run_facts(model.config(), opts, world));
    std::string text = "step " + std::to_string(state.step) + "\nmodel " + model.config().describe() + "\nprecision " +
                       choice_name(opts.precision) + "\nbatch " + std::to_string(opts.batch) + " per rank, " + std::to_string(world) +
                       " rank(s), " + std::to_string(opts.accum_steps) + " micro-batch(es) a step\n" +
                       run_schedule_text(opts);
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

void upload(const InitialState& initial, TrainingStep& training, cudaStream_t stream) {
  training.await_update(stream);  // an optimizer step still running on the second stream
  ViT& model = training.model();
  const size_t n = model.layout().total();
  ENSURE(initial.params.size() == n, "upload: the initial state was read for another layout");
  const std::vector<ParamTensor>& tensors = model.layout().tensors();
  ENSURE(initial.loaded.empty() || initial.loaded.size() == tensors.size(), "upload: a tensor mask of another layout");
  if (std::find(initial.loaded.begin(), initial.loaded.end(), 0) == initial.loaded.end()) {
    copy_to_device(model.params(), initial.params, stream);
  } else {  // the tensors not loaded keep the seed's initialisation
    for (size_t i = 0; i < tensors.size(); ++i)
      if (initial.loaded[i])
        CUDA_CHECK(cudaMemcpyAsync(model.params() + tensors[i].offset, initial.params.data() + tensors[i].offset,
                                   tensors[i].numel * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  Optimizer& optimizer = training.optimizer();
  optimizer.reset(stream);  // zero where the state has none (a timm file)
  for (const Optimizer::StateBuffer& b : optimizer.state())
    for (const auto& [name, buffer] : initial.optimizer_state)
      if (name == b.name) {
        ENSURE(buffer.size() == n, "upload: optimizer state of another layout");
        copy_to_device(b.data, buffer, stream);
      }
  optimizer.set_steps(initial.optimizer_steps, stream);
  if (Fp8Recipe* fp8 = training.fp8(); fp8 && !initial.fp8_metas.empty()) {
    ENSURE(initial.fp8_metas.size() == fp8->count() * sizeof(Fp8Meta), "upload: FP8 state of another size");
    CUDA_CHECK(cudaMemcpyAsync(fp8->metas(), initial.fp8_metas.data(), initial.fp8_metas.size(), cudaMemcpyHostToDevice,
                               stream));
    CUDA_CHECK(cudaMemcpyAsync(fp8->skip_counters(), initial.fp8_skipped, 8, cudaMemcpyHostToDevice, stream));
  }
  model.refresh_weight_copies(stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
}
