// --dump-reference DIR: what tools/timm_reference.py needs to check the engine against timm:
// the initial weights under timm's names, every batch, the step-0 logits, loss and gradients,
// the loss of each of --steps optimizer steps (SGD or AdamW) and the weights after them.
#pragma once
#include <string>

#include "engine/cli.h"
#include "engine/trainer.h"

void dump_reference(Trainer& trainer, const TrainOptions& opts);
