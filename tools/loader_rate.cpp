// loader_rate: how many images/s the packed data path delivers to one GPU, augmentation
// included (engine/packed_loader.h), with nothing else running: the number to hold against
// what training consumes. Without DIR it first writes a synthetic packed set (random 256 px
// RGB images, ImageNet's shape after packing) to a temporary directory.
// Usage: loader_rate [--dir DIR] [--images N] [--size 256] [--img 224] [--batch 64] [--threads T] [--batches K]
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "engine/packed_format.h"
#include "engine/packed_loader.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::string dir;
  int images = 8192, size = 256, img = 224, batch = 64, threads = 4, batches = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir") { dir = argv[i + 1]; continue; }
    char* end = nullptr;
    const long parsed = std::strtol(argv[i + 1], &end, 10);
    if (*end || parsed <= 0 || parsed > (1 << 30)) {
      std::fprintf(stderr, "loader_rate: %s must be an integer from 1 to 2^30\n", a.c_str());
      return 2;
    }
    const int v = static_cast<int>(parsed);
    if (a == "--images") images = v; else if (a == "--size") size = v; else if (a == "--img") img = v;
    else if (a == "--batch") batch = v; else if (a == "--threads") threads = v; else if (a == "--batches") batches = v;
    else { std::fprintf(stderr, "loader_rate: unknown option %s\n", a.c_str()); return 2; }
  }
  try {
    fs::path tmp;
    if (dir.empty()) {  // a synthetic packed set: random pixels, 1000 classes
      tmp = fs::temp_directory_path() / ("loader_rate_" + std::to_string(::getpid()));
      fs::create_directories(tmp);
      std::ofstream(tmp / "classes.txt") << [] { std::string s; for (int c = 0; c < 1000; ++c) s += "c" + std::to_string(c) + "\n"; return s; }();
      std::mt19937 rng(1);
      const int per_shard = 1024;
      for (int first = 0, k = 0; first < images; first += per_shard, ++k) {
        PackedShardHeader h{};
        std::memcpy(h.magic, "VITPACK1", 8);
        h.version = kPackedVersion;
        h.count = uint32_t(std::min(per_shard, images - first));
        h.size = uint32_t(size);
        h.channels = 3;
        h.classes = 1000;
        std::vector<int32_t> labels(h.count);
        for (int32_t& l : labels) l = int32_t(rng() % 1000);
        std::vector<uint8_t> px(size_t(h.count) * size * size * 3);
        for (size_t i = 0; i < px.size(); i += 4) { const uint32_t r = rng(); std::memcpy(&px[i], &r, std::min<size_t>(4, px.size() - i)); }
        char name[32];
        std::snprintf(name, sizeof name, "shard-%05d.bin", k);
        std::ofstream out(tmp / name, std::ios::binary);
        out.write(reinterpret_cast<const char*>(&h), sizeof h);
        out.write(reinterpret_cast<const char*>(labels.data()), labels.size() * 4);
        out.write(reinterpret_cast<const char*>(px.data()), px.size());
      }
      dir = tmp.string();
    }
    const PackedSet set(dir);
    PackedLoader loader(set, batch, img, true, 1, 0, 1, threads);
    float* out;
    int* labels;
    CUDA_CHECK(cudaMalloc(&out, size_t(batch) * 3 * img * img * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&labels, batch * sizeof(int)));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    const int per_epoch = loader.batches_per_epoch();
    auto run = [&](int n, int from) {
      for (int i = 0; i < n; ++i) loader.load((from + i) / per_epoch, (from + i) % per_epoch, out, labels, s);
      CUDA_CHECK(cudaStreamSynchronize(s));
    };
    run(per_epoch, 0);  // one epoch first: the shards in the page cache, every thread started
    const auto t0 = std::chrono::steady_clock::now();
    run(batches, per_epoch);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = double(batches) * batch / sec;
    std::printf("loader_rate: %d images of %d px (%s), batch %d to %d px, %d threads: %.0f images/s (%.1f MB/s of "
                "pixels, %.0f images/s a thread)\n", set.count(), set.size(), tmp.empty() ? dir.c_str() : "synthetic",
                batch, img, threads, rate, rate * set.size() * set.size() * 3 / 1e6, rate / threads);
    std::printf("RESULT loader img_s=%.1f threads=%d\n", rate, threads);
    if (!tmp.empty()) fs::remove_all(tmp);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loader_rate: error: %s\n", e.what());
    return 1;
  }
}
