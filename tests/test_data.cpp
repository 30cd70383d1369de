// Datasets: IDX parsing and its bad inputs, the real Fashion-MNIST files, epoch shuffling, the
// learning-rate schedule (CPU); pixel normalisation, top-1 counting and the loader (GPU).
#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "engine/cli.h"
#include "engine/data_loader.h"
#include "engine/dataset.h"
#include "engine/schedule.h"
#include "kernels/data.h"
#include "tests/gpu_util.h"
#include "tests/harness.h"
#include "tests/idx_files.h"

namespace {
struct TempDir {
  std::string path;
  TempDir() {
    char p[] = "/tmp/vit_data_XXXXXX";
    REQUIRE(mkdtemp(p) != nullptr);
    path = p;
  }
  ~TempDir() { std::system(("rm -rf " + path).c_str()); }
};

std::string read_error(const std::string& images, const std::string& labels) {
  try {
    read_idx(images, labels, 10);
  } catch (const RuntimeError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("dataset: IDX files, plain and gzip, and every malformed one named") {
  TempDir d;
  const std::string im = d.path + "/im", lb = d.path + "/lb";
  for (bool gz : {false, true}) {
    CAPTURE(gz);
    write_idx(im, lb, 3, 2, 4, {1, 9, 0}, gz);
    const ImageSet s = read_idx(im, lb, 10);
    CHECK(s.count == 3);
    CHECK(s.rows == 2);
    CHECK(s.cols == 4);
    CHECK(s.pixels.size() == 24u);
    CHECK(s.pixels[5] == 35);
    CHECK(s.labels == std::vector<uint8_t>{1, 9, 0});
  }
  write_idx(im, lb, 3, 2, 4, {1, 10, 0}, false);
  CHECK(read_error(im, lb).find("label 10 of item 1") != std::string::npos);
  write_idx(im, lb, 3, 2, 4, {1, 2}, false);
  CHECK(read_error(im, lb).find("holds 2 labels but") != std::string::npos);
  write_idx(im, lb, 3, 2, 4, {1, 2, 3}, false);
  truncate(im.c_str(), 30);
  CHECK(read_error(im, lb).find("truncated") != std::string::npos);
  write_bytes(im, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, false);
  CHECK(read_error(im, lb).find("not an IDX file") != std::string::npos);
  CHECK(read_error(d.path + "/missing", lb).find("cannot open") != std::string::npos);
  CHECK_THROWS_WITH_AS(FashionMnist(d.path), doctest::Contains("Fashion-MNIST: no "), RuntimeError);
}

TEST_CASE("dataset: the Debian package's Fashion-MNIST, with the normalisation's statistics") {
  if (access((std::string(FashionMnist::kDefaultDir) + "/train-images-idx3-ubyte.gz").c_str(), R_OK) != 0) {
    mark_skipped();  // dataset-fashion-mnist is not installed here
    return;
  }
  const FashionMnist f(FashionMnist::kDefaultDir);
  CHECK(f.train.count == 60000);
  CHECK(f.test.count == 10000);
  std::vector<int> per_class(10, 0);
  for (uint8_t l : f.train.labels) ++per_class[l];
  for (int c : per_class) CHECK(c == 6000);
  double sum = 0, sq = 0;
  for (uint8_t p : f.train.pixels) {
    sum += p / 255.0;
    sq += (p / 255.0) * (p / 255.0);
  }
  const double n = static_cast<double>(f.train.pixels.size()), mean = sum / n;
  CHECK(mean == doctest::Approx(FashionMnist::kMean).epsilon(2e-3));
  CHECK(std::sqrt(sq / n - mean * mean) == doctest::Approx(FashionMnist::kStd).epsilon(2e-3));
}

TEST_CASE("dataset: each epoch visits every image once, in an order fixed by seed and epoch") {
  const std::vector<int> a = epoch_order(1000, 5, 0), b = epoch_order(1000, 5, 0);
  CHECK(a == b);
  CHECK(std::set<int>(a.begin(), a.end()).size() == 1000u);
  CHECK(*std::min_element(a.begin(), a.end()) == 0);
  CHECK(*std::max_element(a.begin(), a.end()) == 999);
  CHECK(epoch_order(1000, 5, 1) != a);
  CHECK(epoch_order(1000, 6, 0) != a);
}

TEST_CASE("schedule: linear warm-up, then constant or cosine to zero") {
  LrSchedule s;
  s.base = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  CHECK(s.at(0) == doctest::Approx(0.01));
  CHECK(s.at(9) == doctest::Approx(0.1));
  CHECK(s.at(50) == doctest::Approx(0.1));
  s.kind = LrSchedule::Kind::Cosine;
  CHECK(s.at(4) == doctest::Approx(0.05));
  CHECK(s.at(10) == doctest::Approx(0.1));
  CHECK(s.at(60) == doctest::Approx(0.05));
  CHECK(s.at(109) == doctest::Approx(0.1 * 0.5 * (1 + std::cos(M_PI * 99 / 100))));
  CHECK(s.at(110) == doctest::Approx(0.0));
}

TEST_CASE("cli: data, epochs, evaluation and schedule flags") {
  auto parse = [](std::vector<std::string> a) { return parse_args(a); };
  TempDir dir;
  const std::vector<std::string> fm = {"--data", "fashion-mnist:" + dir.path, "--img", "28", "--patch", "4", "--channels",
                                       "1", "--classes", "10", "--dim", "192", "--heads", "3", "--depth", "6"};
  TrainOptions o = parse(fm);
  CHECK(o.data == DataKind::FashionMnist);
  CHECK(o.data_dir == dir.path);
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = fm;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  o = parse(with({"--epochs", "10", "--lr-schedule", "cosine", "--warmup-steps", "468", "--eval-every", "100"}));
  CHECK(o.epochs == 10);
  CHECK(o.lr_schedule == LrSchedule::Kind::Cosine);
  CHECK(o.warmup_steps == 468);
  set_total_steps(o, 4680);
  CHECK(o.steps == 4680);
  CHECK(o.warmup == 10);
  auto error = [&](std::vector<std::string> a) {
    try {
      parse(a);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error({"--data", "imagenet"}).find("unknown dataset") != std::string::npos);
  CHECK(error({"--data", "synthetic:"}).find("takes no directory") != std::string::npos);
  CHECK(error({"--data", "fashion-mnist:/no/such/dir", "--img", "28", "--patch", "4", "--channels", "1", "--classes", "10"})
            .find("/no/such/dir is not a directory") != std::string::npos);
  CHECK(error({"--dump-reference", "/tmp/x", "--lr-schedule", "cosine"}).find("constant learning rate") !=
        std::string::npos);
  CHECK(error({"--data", "fashion-mnist"}).find("--img 28 --channels 1 --classes 10") != std::string::npos);
  CHECK(error({"--epochs", "2"}).find("--epochs needs a dataset") != std::string::npos);
  CHECK(error({"--eval-every", "5"}).find("test split") != std::string::npos);
  CHECK(error(with({"--epochs", "2", "--steps", "5"})).find("not both") != std::string::npos);
  CHECK(error({"--lr-schedule", "step"}).find("unknown --lr-schedule") != std::string::npos);
  CHECK(error({"--steps", "10", "--warmup-steps", "10"}).find("--warmup-steps 10") != std::string::npos);
}

TEST_CASE("gpu: pixel normalisation, top-1 counting and the test-set loader") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  // Ties go to the lowest class, as torch.argmax; rows past n_valid are not counted.
  const int C = 10, ld = 16, B = 6;
  std::vector<float> logits(B * ld, -1.0f);
  for (int b = 0; b < B; ++b)
    for (int c = C; c < ld; ++c) logits[b * ld + c] = 100.0f;  // padding columns must not be scanned
  std::vector<int> labels = {3, 3, 0, 9, 5, 5};
  logits[0 * ld + 3] = 2;                        // right
  logits[1 * ld + 3] = 2; logits[1 * ld + 1] = 2;  // tie, lowest wins: 1, wrong
  logits[2 * ld + 0] = 1;                        // right
  logits[3 * ld + 9] = 0.5f;                     // right
  logits[4 * ld + 5] = 3;                        // right, but past n_valid = 4
  DeviceBuffer<float> dl(logits);
  DeviceBuffer<int> dlab(labels), correct(2);
  CUDA_CHECK(cudaMemset(correct.get(), 0, 8));
  count_top_k(dl.get(), ld, C, dlab.get(), 4, 1, 2, correct.get(), 0);
  CHECK(correct.download() == std::vector<int>{3, 4});  // the tie is second: within the top 2
  {  // top-1 and top-5 on random rows (with ties) against a CPU ranking
    const int R = 300, K = 37;
    std::vector<float> z(R * K);
    std::vector<int> lab(R);
    for (float& v : z) v = static_cast<float>(rng() % 20);  // many ties
    for (int& l : lab) l = static_cast<int>(rng() % K);
    int want1 = 0, want5 = 0;
    for (int r = 0; r < R; ++r) {
      int above = 0;
      for (int c = 0; c < K; ++c) above += z[r * K + c] > z[r * K + lab[r]] || (z[r * K + c] == z[r * K + lab[r]] && c < lab[r]);
      want1 += above < 1;
      want5 += above < 5;
    }
    DeviceBuffer<float> dz(z);
    DeviceBuffer<int> dlb(lab), got(std::vector<int>{0, 0});
    count_top_k(dz.get(), K, K, dlb.get(), R, 1, 5, got.get(), 0);
    CHECK(got.download() == std::vector<int>{want1, want5});
  }

  ImageSet set;
  set.count = 10;
  set.rows = 2;
  set.cols = 3;
  for (int i = 0; i < 60; ++i) set.pixels.push_back(static_cast<uint8_t>(rng() % 256));
  for (int i = 0; i < 10; ++i) set.labels.push_back(static_cast<uint8_t>(i % 7));
  DataLoader loader(set, 4, 0.25f, 0.5f, false, 0);
  CHECK(loader.batches_per_epoch() == 3);
  DeviceBuffer<float> images(4 * 6);
  DeviceBuffer<int> lab(4);
  CHECK(loader.load(0, 2, images.get(), lab.get(), 0) == 2);  // images 8 and 9, then padding
  const auto got = images.download();
  const auto got_labels = lab.download();
  for (int b = 0; b < 2; ++b) {
    CHECK(got_labels[b] == set.labels[8 + b]);
    for (int p = 0; p < 6; ++p)
      CHECK(got[b * 6 + p] == doctest::Approx((set.pixels[(8 + b) * 6 + p] / 255.0 - 0.25) / 0.5));
  }
  CHECK(got_labels[2] == 0);
  // Training order: batches loaded back to back (more than the staging slots, no waiting in
  // between) into separate buffers; each epoch's two batches hold eight distinct images, each
  // with its own label.
  DataLoader shuffled(set, 4, 0.25f, 0.5f, true, 3);
  CHECK(shuffled.batches_per_epoch() == 2);  // the last partial batch is dropped in training
  const int loads = 6;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> imgs;
  std::vector<std::unique_ptr<DeviceBuffer<int>>> labs;
  for (int i = 0; i < loads; ++i) {
    imgs.push_back(std::make_unique<DeviceBuffer<float>>(4 * 6));
    labs.push_back(std::make_unique<DeviceBuffer<int>>(4));
    shuffled.load(i / 2, i % 2, imgs.back()->get(), labs.back()->get(), 0);
  }
  for (int epoch = 0; epoch < loads / 2; ++epoch) {
    std::set<int> seen;
    for (int i = 2 * epoch; i < 2 * epoch + 2; ++i) {
      const auto g = imgs[i]->download();
      const auto l = labs[i]->download();
      for (int b = 0; b < 4; ++b) {
        int match = -1;
        for (int k = 0; k < 10; ++k) {
          bool same = true;
          for (int p = 0; p < 6; ++p) same &= std::abs(g[b * 6 + p] - (set.pixels[k * 6 + p] / 255.0 - 0.25) / 0.5) < 1e-6;
          if (same) match = k;
        }
        REQUIRE(match >= 0);
        CHECK(l[b] == set.labels[match]);
        seen.insert(match);
      }
    }
    CHECK(seen.size() == 8u);
  }
}
