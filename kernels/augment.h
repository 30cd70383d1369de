// GPU augmentation of packed images (uint8 RGB squares, engine/packed_format.h) into the model's
// float input [B, 3, H, W], normalised with ImageNet's mean and std:
//   training: torchvision's RandomResizedCrop(scale 0.08..1, ratio 3/4..4/3) with bilinear
//   sampling (no antialias), then a horizontal flip with probability 1/2;
//   evaluation: the centred H x W crop.
// The random draws are a hash of (seed, draw): draw = the sample's position in the run, so a
// resumed run augments as the uninterrupted one would.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

struct CropBox {
  int x0, y0, w, h;
  bool flip;
};

// The crop of draw `draw` from a size x size image (host and device: the CPU tests use it).
__host__ __device__ CropBox random_resized_crop(int size, uint64_t seed, uint64_t draw);

void augment_images(const uint8_t* src, int B, int size, float* out, int H, int W, bool train, uint64_t seed,
                    uint64_t first_draw, cudaStream_t stream);

constexpr float kImageNetMean[3] = {0.485f, 0.456f, 0.406f};
constexpr float kImageNetStd[3] = {0.229f, 0.224f, 0.225f};
