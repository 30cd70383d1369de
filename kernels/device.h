// The CUDA GPUs of this machine.
#pragma once
#include <string>

// How many CUDA GPUs this process can use; 0 where there are none, and then *why_none (if
// given) says why in a few words: no NVIDIA driver, a driver too old for this CUDA, or no device.
int cuda_gpu_count(std::string* why_none = nullptr);
