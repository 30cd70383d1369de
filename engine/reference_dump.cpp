#include "engine/reference_dump.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/check.h"
#include "engine/safetensors.h"

namespace {
template <class T>
std::vector<T> to_host(const T* device, size_t n, cudaStream_t stream) {
  std::vector<T> h(n);
  CUDA_CHECK(cudaMemcpyAsync(h.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return h;
}

// Every parameter tensor of a flat buffer, under its timm name (prefix + name).
std::vector<StTensor> named_tensors(const ParamLayout& layout, const std::vector<float>& flat, const std::string& prefix) {
  std::vector<StTensor> out;
  for (const ParamTensor& t : layout.tensors())
    out.push_back({prefix + t.name, "F32", t.shape, flat.data() + t.offset, t.numel * sizeof(float)});
  return out;
}
}  // namespace

void dump_reference(Trainer& trainer, const TrainOptions& o) {
  const std::string& dir = o.dump_reference;
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw RuntimeError("cannot create directory " + dir + ": " + std::strerror(errno));
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw RuntimeError(dir + " is not a directory");

  ViT& model = trainer.model();
  const ViTConfig& c = model.config();
  const ParamLayout& layout = model.layout();
  cudaStream_t s = trainer.stream();
  const int B = model.batch();
  const size_t image_floats = static_cast<size_t>(B) * c.channels * c.img * c.img;

  char json[1024];
  std::snprintf(json, sizeof json,
                "{\"img\": %d, \"patch\": %d, \"channels\": %d, \"classes\": %d, \"dim\": %d, \"depth\": %d, "
                "\"heads\": %d, \"mlp_ratio\": %.17g, \"batch\": %d, \"optimizer\": \"%s\", \"lr\": %.17g, "
                "\"momentum\": %.17g, \"weight_decay\": %.17g, \"nesterov\": %s, \"betas\": [%.17g, %.17g], "
                "\"eps\": %.17g, \"drop_path\": %.9g, \"steps\": %d}\n",
                c.img, c.patch, c.channels, c.classes, c.dim, c.depth, c.heads, c.mlp_ratio, B,
                choice_name(o.optimizer), o.lr, o.momentum, o.weight_decay, o.nesterov ? "true" : "false", o.beta1,
                o.beta2, o.eps, model.drop_path(), o.steps);
  write_text_file(dir + "/config.json", json);
  const std::vector<float> init = to_host(model.params(), layout.total(), s);
  write_safetensors(dir + "/init.safetensors", named_tensors(layout, init, ""));
  std::printf("reference dump: weights written to %s/init.safetensors\n", dir.c_str());

  std::vector<std::vector<float>> images;
  std::vector<std::vector<int64_t>> labels;
  std::vector<std::vector<float>> drop_masks;  // stochastic depth's scales, [depth][2][B] a step
  std::vector<float> losses;
  for (int step = 0; step < o.steps; ++step) {
    trainer.load_batch(step);
    images.push_back(to_host(model.images(), image_floats, s));
    if (model.drop_path() > 0)
      drop_masks.push_back(to_host(model.drop_path_scales(), static_cast<size_t>(2) * c.depth * B, s));
    const std::vector<int> l = to_host(model.labels(), B, s);
    labels.emplace_back(l.begin(), l.end());
    trainer.forward_backward();
    losses.push_back(to_host(model.loss(), 1, s)[0]);
    if (step == 0) {
      const std::vector<float> grads = to_host(model.grads(), layout.total(), s);
      const std::vector<float> padded = to_host(model.logits(), static_cast<size_t>(B) * model.logits_ld(), s);
      std::vector<float> logits;
      for (int b = 0; b < B; ++b)
        logits.insert(logits.end(), padded.begin() + static_cast<size_t>(b) * model.logits_ld(),
                      padded.begin() + static_cast<size_t>(b) * model.logits_ld() + c.classes);
      std::vector<StTensor> t = named_tensors(layout, grads, "grad.");
      t.push_back({"logits", "F32", {B, c.classes}, logits.data(), logits.size() * sizeof(float)});
      t.push_back({"loss", "F32", {1}, &losses[0], sizeof(float)});
      write_safetensors(dir + "/step0.safetensors", t);
    }
    trainer.optimizer_step(step);
    trainer.end_step(step);
    std::printf("reference dump: step %d loss %.6f\n", step, losses.back());
    std::fflush(stdout);
  }
  std::vector<StTensor> batches;
  for (int step = 0; step < o.steps; ++step) {
    batches.push_back({"images." + std::to_string(step), "F32", {B, c.channels, c.img, c.img}, images[step].data(),
                       images[step].size() * sizeof(float)});
    batches.push_back({"labels." + std::to_string(step), "I64", {B}, labels[step].data(), labels[step].size() * 8});
    if (!drop_masks.empty())
      batches.push_back({"drop_path." + std::to_string(step), "F32", {c.depth, 2, B}, drop_masks[step].data(),
                         drop_masks[step].size() * sizeof(float)});
  }
  write_safetensors(dir + "/batches.safetensors", batches);
  std::string lj = "{\"losses\": [";
  for (size_t i = 0; i < losses.size(); ++i) {
    char v[40];  // JSON has no NaN: a diverged step is null, which the checker reports as such
    if (std::isfinite(losses[i]))
      std::snprintf(v, sizeof v, "%s%.9g", i ? ", " : "", losses[i]);
    else
      std::snprintf(v, sizeof v, "%snull", i ? ", " : "");
    lj += v;
  }
  write_text_file(dir + "/losses.json", lj + "]}\n");
  trainer.training_step().await_update(s);  // the last update, on the second stream
  const std::vector<float> final_weights = to_host(model.params(), layout.total(), s);
  write_safetensors(dir + "/final.safetensors", named_tensors(layout, final_weights, ""));
  std::printf("reference dump: %d steps written to %s\n", o.steps, dir.c_str());
}
