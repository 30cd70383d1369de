#include "engine/optimizer.h"

#include "comm/grad_sync.h"
#include "kernels/check.h"
#include "kernels/nvtx.h"

Sgd::Sgd(const ViT& model, MemoryRequest& memory) : model_(model) {
  memory.add(MemoryCategory::OptimizerState, &momentum_, model.layout().total());
}

void Sgd::zero_momentum(cudaStream_t st) {
  CUDA_CHECK(cudaMemsetAsync(momentum_, 0, model_.layout().total() * sizeof(float), st));
}

void Sgd::update(size_t begin, size_t end, const SgdHyper& h, bool first_step, const int* skip,
                 const float* grad_norm, cudaStream_t st) {
  sgd_momentum_step(model_.params() + begin, momentum_ + begin, model_.grads() + begin, model_.params_bf16() + begin,
                    end - begin, h, first_step, st, skip, grad_norm);
}

void Sgd::update_sharded(GradSync& sync, const SgdHyper& h, bool first_step, const int* skip, cudaStream_t st) {
  sync.begin_update(st);
  NvtxRange range("sharded optimizer: own shares, bf16 weights copied to every rank");
  for (const GradSync::Share& s : sync.own_shares()) {
    sgd_momentum_shard(model_.params() + s.begin, momentum_ + s.begin, model_.grads() + s.begin, s.received, s.stride,
                       s.sources, model_.params_bf16() + s.begin, s.count, h, first_step, st, skip);
    sync.send_weights(s);
  }
  sync.finish_update();
}
