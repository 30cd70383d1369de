#include "engine/packed_loader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "engine/dataset.h"
#include "engine/regular_file.h"
#include "kernels/augment.h"
#include "kernels/check.h"
#include "kernels/nvtx.h"

namespace fs = std::filesystem;

namespace {
constexpr size_t kMaxClassListBytes = 16 << 20;
constexpr size_t kMaxClasses = 1 << 20;
// A shard's largest possible length (the header's bounds), so that the mapping is checked first.
constexpr size_t kMaxShardBytes = sizeof(PackedShardHeader) +
                                  size_t(kMaxPackedCount) * (4 + size_t(kMaxPackedSide) * kMaxPackedSide * 3);
}  // namespace

PackedSet::PackedSet(const std::string& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) throw RuntimeError("packed data: " + dir + " is not a directory");
  const std::string class_list = (fs::path(dir) / "classes.txt").string();
  if (!fs::exists(class_list)) throw RuntimeError("packed data: " + class_list + " is missing (not a pack_images directory?)");
  std::istringstream names(read_text_file(class_list, kMaxClassListBytes));
  for (std::string line; std::getline(names, line);)
    if (!line.empty()) class_names_.push_back(line);
  if (class_names_.empty()) throw RuntimeError("packed data: " + class_list + " lists no class");
  if (class_names_.size() > kMaxClasses)
    throw RuntimeError("packed data: " + class_list + " lists " + std::to_string(class_names_.size()) +
                       " classes, more than " + std::to_string(kMaxClasses));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("shard-", 0) == 0 && e.path().extension() == ".bin") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw RuntimeError("packed data: " + dir + " has no shard-*.bin");
  for (const fs::path& f : files) {
    const std::string name = f.string();
    MappedFile map;
    try {
      map = MappedFile(name, kMaxShardBytes);
    } catch (const RuntimeError& e) {
      throw RuntimeError(std::string("packed data: ") + e.what());
    }
    const PackedShard checked = check_packed_shard(map.data(), map.size(), name, classes());
    if (size_ != 0 && int(checked.size) != size_)
      throw RuntimeError("packed data: " + name + " holds " + std::to_string(checked.size) + "-pixel images, the others " +
                         std::to_string(size_));
    if (int64_t(count_) + checked.count > int64_t(kMaxPackedCount))
      throw RuntimeError("packed data: " + dir + " holds too many images");
    size_ = static_cast<int>(checked.size);
    Shard s;
    s.first = count_;
    s.count = static_cast<int>(checked.count);
    s.labels = reinterpret_cast<const int32_t*>(checked.labels);  // (4-byte aligned: a mapping's start + 64)
    s.pixels = checked.pixels;
    s.file = std::move(map);
    shards_.push_back(std::move(s));
    count_ += static_cast<int>(checked.count);
  }
}

const PackedSet::Shard& PackedSet::shard_of(int i) const {
  auto it = std::upper_bound(shards_.begin(), shards_.end(), i, [](int v, const Shard& s) { return v < s.first; });
  return *(it - 1);
}
const uint8_t* PackedSet::image(int i) const {
  const Shard& s = shard_of(i);
  return s.pixels + size_t(i - s.first) * size_ * size_ * 3;
}
int PackedSet::label(int i) const {
  const Shard& s = shard_of(i);
  return s.labels[i - s.first];
}

PackedLoader::PackedLoader(const PackedSet& set, int batch, int img, bool train, uint64_t seed, int rank, int world,
                           int threads)
    : set_(set), batch_(batch), img_(img), rank_(rank), world_(world), train_(train), seed_(seed),
      image_bytes_(size_t(set.size()) * set.size() * 3) {
  batches_ = train ? set.count() / (batch * world) : (set.count() + batch - 1) / batch;
  for (int s = 0; s < kSlots; ++s) {
    CUDA_CHECK(cudaMallocHost(&staged_[s], size_t(batch) * image_bytes_));
    CUDA_CHECK(cudaMallocHost(&staged_labels_[s], size_t(batch) * sizeof(int)));
    CUDA_CHECK(cudaEventCreateWithFlags(&copied_[s], cudaEventDisableTiming));
    slot_job_[s] = -1;
  }
  CUDA_CHECK(cudaMalloc(&device_pixels_, size_t(batch) * image_bytes_));
  for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { work(); });
}

PackedLoader::~PackedLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  for (std::thread& t : workers_) t.join();
  for (int s = 0; s < kSlots; ++s) {
    if (copied_[s]) cudaEventSynchronize(copied_[s]);
    cudaFreeHost(staged_[s]);
    cudaFreeHost(staged_labels_[s]);
    if (copied_[s]) cudaEventDestroy(copied_[s]);
  }
  cudaFree(device_pixels_);
}

void PackedLoader::gather(const Job& j) {
  NvtxRange range("packed batch gather");
  const int first = train_ ? (j.index * world_ + rank_) * batch_ : j.index * batch_;
  const int real = std::min(batch_, set_.count() - first);
  for (int b = 0; b < batch_; ++b) {
    const int k = first + std::min(b, real - 1);  // evaluation's last batch repeats its last image
    const int i = train_ ? (*j.order)[k] : k;
    std::memcpy(staged_[j.slot] + size_t(b) * image_bytes_, set_.image(i), image_bytes_);
    staged_labels_[j.slot][b] = b < real ? set_.label(i) : 0;
  }
  staged_real_[j.slot] = real;
}

void PackedLoader::work() {
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      j = jobs_.front();
      jobs_.pop_front();
    }
    std::string error;
    try {
      gather(j);
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot_ready_[j.slot] = true;
      if (!error.empty() && error_.empty()) error_ = error;
    }
    changed_.notify_all();
  }
}

// Called with the lock not held, from load's thread only.
int PackedLoader::schedule(int epoch, int index) {
  const long id = long(epoch) * batches_ + index;
  int slot = -1;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    for (int s = 0; s < kSlots; ++s)
      if (slot_job_[s] == id) return s;
    slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % kSlots;
    // The slot's previous batch must be gathered (a batch gathered ahead but never loaded too)
    // before it is given a new one.
    changed_.wait(lock, [&] { return slot_job_[slot] < 0 || slot_ready_[slot] || !error_.empty(); });
  }
  CUDA_CHECK(cudaEventSynchronize(copied_[slot]));  // the copy that read this slot last
  if (train_ && order_epoch_ != epoch) {
    order_ = std::make_shared<const std::vector<int>>(epoch_order(set_.count(), seed_, epoch));
    order_epoch_ = epoch;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slot_job_[slot] = id;
    slot_ready_[slot] = false;
    jobs_.push_back({epoch, index, slot, order_});
  }
  changed_.notify_all();
  return slot;
}

int PackedLoader::load(int epoch, int index, float* images, int* labels, cudaStream_t stream) {
  NvtxRange range("packed batch");
  ENSURE(index >= 0 && index < batches_, "PackedLoader: batch index out of range");
  // This batch and the next kSlots - 1 this rank will load (within the epoch) are gathered by
  // the workers.
  const int stride = train_ ? 1 : world_;
  const int slot = schedule(epoch, index);
  for (int k = 1; k < kSlots && index + k * stride < batches_; ++k) schedule(epoch, index + k * stride);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return slot_ready_[slot] || !error_.empty(); });
    if (!error_.empty()) throw RuntimeError("packed data loader: " + error_);
  }
  CUDA_CHECK(cudaMemcpyAsync(device_pixels_, staged_[slot], size_t(batch_) * image_bytes_, cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaMemcpyAsync(labels, staged_labels_[slot], batch_ * sizeof(int), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(copied_[slot], stream));
  // Each sample's random draw is its place in the run, the same after a resume.
  const uint64_t first_draw = (uint64_t(epoch) * batches_ + index) * world_ * batch_ + uint64_t(rank_) * batch_;
  augment_images(device_pixels_, batch_, set_.size(), images, img_, img_, train_, seed_, first_draw, stream);
  return staged_real_[slot];
}
