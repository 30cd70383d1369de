#include "engine/fp8_recipe.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "comm/communicator.h"
#include "kernels/check.h"

Fp8Recipe::Fp8Recipe(ViT& model, Fp8Options options, MemoryRequest& memory) : options_(options) {
  for (int t = 0; t < model.fp8_tensor_count(); ++t) {
    kinds_.push_back(model.fp8_tensor_kind(t));
    is_weight_.push_back(model.fp8_tensor_is_weight(t) ? 1 : 0);
  }
  const size_t n = kinds_.size();
  auto state = [&](auto** slot, size_t count) { memory.add(MemoryCategory::OptimizerState, slot, count); };
  state(&metas_, n);
  state(&stats_, n * 3);
  state(&non_finite_, 1);
  state(&skipped_, 2);  // skipped steps, and in a row
  state(&amax_scratch_, 1);
  state(&amax_reduce_, n + 1);
  memory.add(MemoryCategory::Workspace, &weights_, n);
  model.set_fp8(this);
}

void Fp8Recipe::init(cudaStream_t st) {
  std::vector<Fp8Meta> metas(kinds_.size());
  for (size_t i = 0; i < metas.size(); ++i) metas[i].fp8_max = kinds_[i] == Fp8Kind::E5M2 ? 57344.0f : 448.0f;
  CUDA_CHECK(cudaMemcpyAsync(metas_, metas.data(), metas.size() * sizeof(Fp8Meta), cudaMemcpyHostToDevice, st));
  CUDA_CHECK(cudaMemsetAsync(non_finite_, 0, sizeof(int), st));
  CUDA_CHECK(cudaMemsetAsync(skipped_, 0, 2 * sizeof(int), st));
  CUDA_CHECK(cudaMemcpyAsync(weights_, is_weight_.data(), is_weight_.size(), cudaMemcpyHostToDevice, st));
  CUDA_CHECK(cudaStreamSynchronize(st));  // metas goes out of scope
}

void Fp8Recipe::produce(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t st,
                        Fp8Producer launch) {
  Fp8Meta* m = meta(tensor);
  if (!recording_) {  // evaluation: the training scales, and nothing recorded
    launch(Fp8Out{kind, &m->scale, out, out_t, amax_scratch_});
    return;
  }
  if (options_.current) {  // the tensor's own amax first (from zero), its scale from that alone
    CUDA_CHECK(cudaMemsetAsync(&m->amax, 0, sizeof(float), st));
    launch(Fp8Out{kind, nullptr, nullptr, nullptr, &m->amax});
    if (comm_) {  // the global batch's amax; a NaN as +inf, which a maximum keeps
      fp8_nonfinite_to_inf(&m->amax, 1, st);
      comm_->all_reduce(&m->amax, 1, ncclFloat32, ncclMax, st, st);
    }
    fp8_update_scales(m, 1, 1, options_.margin, non_finite_, st);
    launch(Fp8Out{kind, &m->scale, out, out_t, amax_scratch_, stats(tensor)});
    return;
  }
  launch(one_pass_out(tensor, kind, out, out_t));  // the amax recorded for end_step
}

Fp8Out Fp8Recipe::one_pass_out(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t) const {
  Fp8Meta* m = meta(tensor);
  return Fp8Out{kind, &m->scale, out, out_t, &m->amax, stats(tensor)};
}

void Fp8Recipe::reset_counters(cudaStream_t st) {
  CUDA_CHECK(cudaMemsetAsync(non_finite_, 0, sizeof(int), st));
  CUDA_CHECK(cudaMemsetAsync(skipped_, 0, 2 * sizeof(int), st));
}

void Fp8Recipe::clear_step_flag(cudaStream_t st) { CUDA_CHECK(cudaMemsetAsync(non_finite_, 0, sizeof(int), st)); }

void Fp8Recipe::begin_step(cudaStream_t st) { clear_step_flag(st); }

void Fp8Recipe::end_step(const float* loss, cudaStream_t st, bool last_micro_batch) {
  const int n = count();
  if (comm_) {  // one all-reduce a step: the amaxes of the global batch, and whether any rank's step is bad
    fp8_gather_amax(metas_, n, non_finite_, loss, amax_reduce_, st);
    comm_->all_reduce(amax_reduce_, n + 1, ncclFloat32, ncclMax, st, st);
    fp8_scatter_amax(amax_reduce_, metas_, n, non_finite_, st);
  }
  if (!options_.current)
    fp8_update_scales(metas_, n, options_.history, options_.margin, non_finite_, st,
                      last_micro_batch ? nullptr : weights_);
  fp8_tally_skip(loss, non_finite_, last_micro_batch ? skipped_ : nullptr, st);
}

Fp8Recipe::Skipped Fp8Recipe::skipped_steps() const {
  int counters[2] = {0, 0};  // skipped steps, in a row
  CUDA_CHECK(cudaMemcpy(counters, skipped_, sizeof counters, cudaMemcpyDeviceToHost));
  return {counters[0], counters[1]};
}

void Fp8Recipe::check_guard(const Skipped& skipped) {
  if (skipped.in_a_row >= kMaxSkippedInARow)
    throw RuntimeError(std::to_string(skipped.in_a_row) +
                       " steps in a row saw non-finite values (loss or FP8 tensors) and were skipped; stopping");
}

void Fp8Recipe::set_counting(bool on, cudaStream_t st) {
  if (on && !counting_) CUDA_CHECK(cudaMemsetAsync(stats_, 0, kinds_.size() * 3 * sizeof(unsigned long long), st));
  counting_ = on;
}

std::string Fp8Recipe::stats_table(const std::vector<ViT::Fp8TensorGroup>& groups, cudaStream_t st) const {
  const size_t n = kinds_.size();
  std::vector<Fp8Meta> metas(n);
  std::vector<unsigned long long> counts(3 * n);
  CUDA_CHECK(cudaMemcpyAsync(metas.data(), metas_, n * sizeof(Fp8Meta), cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaMemcpyAsync(counts.data(), stats_, counts.size() * sizeof(counts[0]), cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaStreamSynchronize(st));
  char line[256];
  std::string out = "  fp8 tensor        blocks  scale min..max         last amax max  underflow  saturated\n";
  for (const ViT::Fp8TensorGroup& g : groups) {
    float smin = INFINITY, smax = 0, amax = 0;
    double under = 0, sat = 0, seen = 0;
    for (int i : g.tensors) {
      smin = std::min(smin, metas[i].scale);
      smax = std::max(smax, metas[i].scale);
      amax = std::max(amax, metas[i].history[0]);
      under += counts[3 * i];
      sat += counts[3 * i + 1];
      seen += counts[3 * i + 2];
    }
    const double u = seen > 0 ? under / seen : NAN, z = seen > 0 ? sat / seen : NAN;
    std::snprintf(line, sizeof line, "  %s  %6d  %9.3g..%-9.3g  %13.4g  %8.4f%%  %8.4f%%\n", g.name.c_str(),
                  static_cast<int>(g.tensors.size()), smin, smax, amax, 100 * u, 100 * z);
    out += line;
  }
  return out;
}
