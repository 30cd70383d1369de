// The small model the checkpoint-state fuzz target and its seed use: a checkpoint of it holds a
// few hundred floats, so that each input is read in microseconds.
#pragma once
#include "engine/cli.h"

inline TrainOptions tiny_checkpoint_options(Precision precision) {
  TrainOptions o;
  o.model.name = "tiny";
  o.model.img = 8;
  o.model.patch = 4;
  o.model.classes = 3;
  o.model.dim = 8;
  o.model.depth = 1;
  o.model.heads = 2;
  o.precision = precision;
  o.batch = 2;
  return o;
}
