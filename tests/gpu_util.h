// Helpers of the GPU tests: device buffers, poisoning, random inputs, error norms.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/check.h"

// n elements from device memory, after everything queued on the device.
template <class T>
std::vector<T> download(const T* p, size_t n) {
  std::vector<T> h(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)));
    poison();
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // All bits set: NaN in fp32 and bf16, so an element a kernel forgot to write fails the check.
  void poison() { CUDA_CHECK(cudaMemset(p_, 0xFF, std::max<size_t>(n_, 1) * sizeof(T))); }
  void upload(const std::vector<T>& h) { CUDA_CHECK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const { return ::download(p_, n_); }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_;
};

inline std::vector<double> random_vec(std::mt19937_64& rng, size_t n, double lo = -1, double hi = 1) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

// Values rounded to what the device type can hold, so host and device see the same inputs.
inline std::vector<double> round_bf16(std::vector<double> v) {
  for (double& x : v) x = static_cast<double>(__bfloat162float(__float2bfloat16_rn(static_cast<float>(x))));
  return v;
}
// Every bf16 value below 2^e in magnitude, both signs: zero, the subnormals and every normal
// value of exponent below e (e <= 128), in order of their bit patterns.
inline std::vector<double> every_bf16_below_pow2(int e) {
  std::vector<double> out;
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t bits = 0; bits < static_cast<uint32_t>(e + 127) << 7; ++bits) {
      const uint32_t f = sign << 31 | bits << 16;
      float v;
      std::memcpy(&v, &f, sizeof v);
      out.push_back(v);
    }
  return out;
}
inline std::vector<double> round_f32(std::vector<double> v) {
  for (double& x : v) x = static_cast<double>(static_cast<float>(x));
  return v;
}
inline std::vector<__nv_bfloat16> to_bf16(const std::vector<double>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(static_cast<float>(v[i]));
  return out;
}
inline std::vector<float> to_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
inline std::vector<double> to_f64(const std::vector<__nv_bfloat16>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
inline std::vector<double> to_f64(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ||a - b|| / ||b||; infinite if any element of a is not finite (a poisoned output left unwritten).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}
