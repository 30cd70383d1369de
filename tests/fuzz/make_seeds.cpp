// The fuzz targets' seed corpora: a few small valid inputs per reader, written by the engine's
// own writers where it has them, into OUT_DIR/<target>/; each is read back by its reader, so
// that a seed the reader refuses fails the build instead of starting a fuzz run from nothing.
// Usage: make_seeds OUT_DIR
#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/checkpoint_format.h"
#include "engine/dataset.h"
#include "engine/optimizer.h"
#include "engine/packed_format.h"
#include "engine/safetensors.h"
#include "kernels/fp8_scaling.h"
#include "model/params.h"
#include "model/vit.h"
#include "tests/fuzz/tiny_checkpoint.h"
#include "tools/image_decode.h"

namespace fs = std::filesystem;

namespace {
void write_file(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}
std::vector<uint8_t> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void safetensors_seeds(const fs::path& dir) {
  const std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 7.0f};
  const std::vector<uint16_t> b = {0x3fc0, 0xc010}, h = {0x3e00, 0xc080};
  write_safetensors((dir / "three.safetensors").string(), {{"blocks.0.attn.qkv.weight", "F32", {2, 3}, a.data(), 24},
                                                           {"b", "BF16", {2}, b.data(), 4},
                                                           {"h", "F16", {2}, h.data(), 4},
                                                           {"e", "F32", {0, 3}, a.data(), 0}});
  write_safetensors((dir / "empty.safetensors").string(), {});
  // A header with metadata, escapes and unknown keys, as other writers produce.
  const std::string header =
      R"({"__metadata__":{"format":"pt","note":"a\u00e9\n"},"w\u0041":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[1.5e3,null,true]}})";
  std::vector<uint8_t> f(8);
  for (int i = 0; i < 8; ++i) f[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  f.insert(f.end(), header.begin(), header.end());
  f.insert(f.end(), {0, 0, 0x80, 0x3f});
  write_file(dir / "metadata.safetensors", f);
  for (const auto& e : fs::directory_iterator(dir)) SafetensorsFile check(e.path().string());
}

void checkpoint_seeds(const fs::path& dir) {
  for (const Precision p : {Precision::BF16, Precision::FP8})
    for (const OptimizerKind k : {OptimizerKind::Sgd, OptimizerKind::AdamW}) {
      TrainOptions o = tiny_checkpoint_options(p);
      o.optimizer = k;
      const ParamLayout layout(o.model);
      InitialState c;
      c.params.assign(layout.total(), 0.5f);
      for (const std::string& name : optimizer_state_names(k))
        c.optimizer_state.emplace_back(name, std::vector<float>(layout.total(), 0.25f));
      c.optimizer_steps = 7;
      c.state.step = 7;
      c.state.epoch_loss_sum = 3.5f;
      if (p == Precision::FP8) {
        std::vector<Fp8Meta> metas(ViT::fp8_tensors_of(o.model));
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(metas.data());
        c.fp8_metas.assign(bytes, bytes + metas.size() * sizeof(Fp8Meta));
      }
      const fs::path tmp = dir / "tmp";
      fs::create_directories(tmp);
      write_checkpoint_files(tmp.string(), o.model, c, run_facts(o.model, o, 1));
      read_checkpoint(tmp.string(), o, 1);
      write_file(dir / (std::string("state_") + choice_name(p) + "_" + choice_name(k) + ".safetensors"),
                 read_file(tmp / "state.safetensors"));
      fs::remove_all(tmp);
    }
}

std::vector<uint8_t> gzip(const std::vector<uint8_t>& raw) {
  z_stream z{};
  if (deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) throw std::runtime_error("zlib");
  std::vector<uint8_t> out(deflateBound(&z, raw.size()));
  z.next_in = const_cast<uint8_t*>(raw.data());
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) throw std::runtime_error("zlib");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

void idx_seeds(const fs::path& dir) {
  auto be32 = [](std::vector<uint8_t>& b, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  };
  std::vector<uint8_t> images, labels;
  be32(images, 0x803);
  for (const uint32_t d : {3u, 4u, 5u}) be32(images, d);
  for (int i = 0; i < 60; ++i) images.push_back(static_cast<uint8_t>(i * 7));
  be32(labels, 0x801);
  be32(labels, 3);
  labels.insert(labels.end(), {1, 9, 0});
  // The fuzz target's input: the image file's length (4 bytes, little-endian), it, the label file.
  auto pair = [](const std::vector<uint8_t>& im, const std::vector<uint8_t>& lb) {
    std::vector<uint8_t> b;
    for (int s = 0; s < 32; s += 8) b.push_back(static_cast<uint8_t>(im.size() >> s));
    b.insert(b.end(), im.begin(), im.end());
    b.insert(b.end(), lb.begin(), lb.end());
    return b;
  };
  write_file(dir / "plain.pair", pair(images, labels));
  write_file(dir / "gzip.pair", pair(gzip(images), gzip(labels)));
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::vector<uint8_t> b = read_file(e.path());
    const size_t n = b[0] | b[1] << 8 | b[2] << 16 | size_t(b[3]) << 24;
    decode_idx_pair(b.data() + 4, n, "images", b.data() + 4 + n, b.size() - 4 - n, "labels", 10);
  }
}

void packed_seeds(const fs::path& dir) {
  PackedShardHeader h{};
  std::memcpy(h.magic, "VITPACK1", 8);
  h.version = kPackedVersion;
  h.count = 2;
  h.size = 4;
  h.channels = 3;
  h.classes = 10;
  std::vector<uint8_t> b(sizeof h);
  std::memcpy(b.data(), &h, sizeof h);
  for (const int32_t label : {3, 9}) {
    uint8_t le[4];
    std::memcpy(le, &label, 4);
    b.insert(b.end(), le, le + 4);
  }
  for (size_t i = 0; i < 2 * packed_image_bytes(h); ++i) b.push_back(static_cast<uint8_t>(i * 13));
  write_file(dir / "shard-00000.bin", b);
  check_packed_shard(b.data(), b.size(), "shard-00000.bin", 10);
}

// Test images: gradients, so the codecs have something to code.
std::vector<uint8_t> pixels(int w, int h, int channels) {
  std::vector<uint8_t> p(size_t(w) * h * channels);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>((i * 37) ^ (i >> 3));
  return p;
}

void image_seeds(const fs::path& dir) {
  struct Jpeg {
    const char* name;
    int pixel_format, subsampling, flags;
  };
  for (const Jpeg& j : {Jpeg{"rgb.jpg", TJPF_RGB, TJSAMP_420, 0}, Jpeg{"gray.jpg", TJPF_GRAY, TJSAMP_GRAY, 0},
                        Jpeg{"cmyk.jpg", TJPF_CMYK, TJSAMP_444, 0},
                        Jpeg{"progressive.jpg", TJPF_RGB, TJSAMP_422, TJFLAG_PROGRESSIVE}}) {
    tjhandle tj = tjInitCompress();
    const int w = 13, h = 7;
    const std::vector<uint8_t> p = pixels(w, h, tjPixelSize[j.pixel_format]);
    unsigned char* jpeg = nullptr;
    unsigned long size = 0;
    if (tjCompress2(tj, p.data(), w, 0, h, j.pixel_format, &jpeg, &size, j.subsampling, 90, j.flags) != 0)
      throw std::runtime_error(std::string("libturbojpeg: ") + tjGetErrorStr2(tj));
    std::vector<uint8_t> seed = {5};  // the fuzz target's first byte: the packed side
    seed.insert(seed.end(), jpeg, jpeg + size);
    write_file(dir / j.name, seed);
    tjFree(jpeg);
    tjDestroy(tj);
  }
  struct Png {
    const char* name;
    png_uint_32 format;
    int channels;
  };
  for (const Png& f : {Png{"rgb.png", PNG_FORMAT_RGB, 3}, Png{"gray_alpha.png", PNG_FORMAT_GA, 2},
                       Png{"rgba.png", PNG_FORMAT_RGBA, 4}}) {
    png_image img;
    std::memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    img.width = 9;
    img.height = 11;
    img.format = f.format;
    const std::vector<uint8_t> p = pixels(9, 11, f.channels);
    png_alloc_size_t size = 0;
    if (!png_image_write_to_memory(&img, nullptr, &size, 0, p.data(), 0, nullptr))
      throw std::runtime_error("libpng cannot size the image");
    std::vector<uint8_t> seed(1 + size, 3);
    if (!png_image_write_to_memory(&img, seed.data() + 1, &size, 0, p.data(), 0, nullptr))
      throw std::runtime_error("libpng cannot write the image");
    seed.resize(1 + size);
    write_file(dir / f.name, seed);
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::vector<uint8_t> b = read_file(e.path());
    decode_image(b.data() + 1, b.size() - 1, probe_image(b.data() + 1, b.size() - 1, kImageLimits));
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT_DIR\n");
    return 2;
  }
  try {
    const fs::path out = argv[1];
    const std::pair<const char*, void (*)(const fs::path&)> targets[] = {
        {"safetensors", safetensors_seeds}, {"checkpoint_state", checkpoint_seeds}, {"idx", idx_seeds},
        {"packed_shard", packed_seeds},     {"image_decode", image_seeds}};
    for (const auto& [name, make] : targets) {
      fs::remove_all(out / name);
      fs::create_directories(out / name);
      make(out / name);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
