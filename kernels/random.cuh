// The counter-based generator behind kernels/random.h and the other random draws on the device:
// a value is a hash of a key (seed and stream) and its index, so it depends on neither the
// launch shape nor what was drawn before.
#pragma once
#include <cstdint>

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1): 24 random bits, never 0 (log is taken of it).
__device__ __forceinline__ float uniform01(uint64_t key, uint64_t counter) {
  return (static_cast<float>(splitmix64(key ^ splitmix64(counter)) >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// The key of a seed's stream (weights, data, drop-path masks: each its own).
inline uint64_t random_key(uint64_t seed, uint64_t stream_id) {
  return seed * 0x2545f4914f6cdd1dull ^ (stream_id + 0x632be59bd9b4e019ull) * 0x9e3779b97f4a7c15ull;
}
