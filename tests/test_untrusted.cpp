// Untrusted files (CPU tier): the inputs fuzzing found (tests/fuzz/regressions/) refused with a
// clean message and without the memory they once took; FIFOs never block a reader; every size
// and number a file claims is bounded; checkpoints' dtypes and finiteness checked on load.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "engine/checkpoint_dir.h"
#include "engine/checkpoint_format.h"
#include "engine/dataset.h"
#include "engine/packed_loader.h"
#include "engine/regular_file.h"
#include "engine/safetensors.h"
#include "kernels/check.h"
#include "kernels/fp8_scaling.h"
#include "model/params.h"
#include "model/vit.h"
#include "tests/fuzz/tiny_checkpoint.h"
#include "tests/shell.h"
#include "tools/image_decode.h"

namespace fs = std::filesystem;

namespace {
const fs::path kRegressions = "tests/fuzz/regressions";

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}
fs::path temp_dir(const std::string& tag) {
  const fs::path p = fresh_temp_dir("untrusted_" + tag);
  fs::create_directories(p);
  return p;
}
void make_fifo(const fs::path& p) {
  fs::create_directories(p.parent_path());
  REQUIRE(::mkfifo(p.c_str(), 0600) == 0);
}

// The message of what f throws (RuntimeError or UsageError), or "" if it returns.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

std::string safetensors_error(const std::string& bytes) {
  return error_of([&] { SafetensorsFile("x.safetensors", reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()); });
}
// An 8-byte length, the header, then the data.
std::string safetensors_bytes(const std::string& header, size_t data_bytes) {
  std::string f(8, '\0');
  for (int i = 0; i < 8; ++i) f[i] = char((header.size() >> (8 * i)) & 0xFF);
  return f + header + std::string(data_bytes, '\0');
}

std::vector<uint8_t> gzip(const std::string& raw) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::vector<uint8_t> out(deflateBound(&z, raw.size()));
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
std::string idx_images(uint32_t n, uint32_t r, uint32_t c) {
  std::string b;
  for (const uint32_t v : {0x803u, n, r, c})
    for (int s = 24; s >= 0; s -= 8) b += char(v >> s);
  return b + std::string(size_t(n) * r * c, '\x07');
}
std::string idx_error(const std::string& bytes, int rank) {
  return error_of([&] { decode_idx(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), rank, "f.idx"); });
}

std::string jpeg(int w, int h) {
  std::vector<uint8_t> rgb(size_t(w) * h * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = uint8_t(i * 31);
  tjhandle tj = tjInitCompress();
  unsigned char* out = nullptr;
  unsigned long size = 0;
  REQUIRE(tjCompress2(tj, rgb.data(), w, 0, h, TJPF_RGB, &out, &size, TJSAMP_420, 90, 0) == 0);
  std::string b(reinterpret_cast<const char*>(out), size);
  tjFree(out);
  tjDestroy(tj);
  return b;
}
std::string image_error(const std::string& b) {
  return error_of([&] {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(b.data());
    decode_image(p, b.size(), probe_image(p, b.size(), kImageLimits));
  });
}

// A valid checkpoint of the tiny model in dir, with the given contents' tweaks applied.
TrainOptions tiny(Precision p) { return tiny_checkpoint_options(p); }
InitialState tiny_contents(Precision p) {
  const TrainOptions o = tiny(p);
  InitialState c;
  c.params.assign(ParamLayout(o.model).total(), 0.5f);
  c.optimizer_state.emplace_back("momentum", std::vector<float>(c.params.size(), 0.25f));
  c.state.step = 12;
  if (p == Precision::FP8) {
    std::vector<Fp8Meta> metas(ViT::fp8_tensors_of(o.model));
    const uint8_t* b = reinterpret_cast<const uint8_t*>(metas.data());
    c.fp8_metas.assign(b, b + metas.size() * sizeof(Fp8Meta));
  }
  return c;
}
std::string checkpoint_error(const fs::path& dir, const InitialState& c, Precision p) {
  const TrainOptions o = tiny(p);
  write_checkpoint_files(dir.string(), o.model, c, run_facts(o.model, o, 1));
  return error_of([&] { read_checkpoint(dir.string(), o, 1); });
}
}  // namespace

TEST_CASE("untrusted: pack_images refuses the fuzzed images from their headers, in bounded memory") {
  REQUIRE_MESSAGE(access("./pack_images", X_OK) == 0, "build ./pack_images first (make pack_images)");
  const fs::path tree = temp_dir("images"), out = fresh_temp_dir("images_out");
  fs::create_directories(tree / "a");
  for (const auto& e : fs::directory_iterator(kRegressions / "images")) fs::copy(e.path(), tree / "a" / e.path().filename());
  const std::string good = jpeg(40, 30);
  write(tree / "a" / "good.jpg", good);
  write(tree / "a" / "truncated.jpg", good.substr(0, good.size() * 2 / 3));
  make_fifo(tree / "a" / "fifo.jpg");
  // An address-space limit of 1 GiB: the 65,500^2 JPEG once took 12.8 GB, the 10^6^2 PNG 2.1 GB.
  const CommandResult r = run_command("bash -c 'ulimit -v 1048576; exec ./pack_images " + tree.string() + " " +
                                      out.string() + " --size 16 --threads 2'");
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("1 images in 1 shards, 5 skipped") != std::string::npos);
  CHECK(r.out.find("jpeg_tables_only.jpg: a JPEG without an image (tables only?)") != std::string::npos);
  CHECK(r.out.find("jpeg_gray_65500.jpg: 65500 x 65500 pixels, above the limits") != std::string::npos);
  CHECK(r.out.find("png_1e6x1e6.png: 1000000 x 1000000 pixels, above the limits") != std::string::npos);
  CHECK(r.out.find("png_37000x37000.png: 37000 x 37000 pixels, above the limits") != std::string::npos);
  CHECK(r.out.find("truncated.jpg: truncated JPEG") != std::string::npos);
  CHECK(r.seconds < 20);
  // The fuzz target's own reproducer (its first byte picks the side): the same refusal.
  const std::string fuzzed = bytes_of(kRegressions / "image_decode" / "img_fuzz_tables_only.bin");
  CHECK(image_error(fuzzed.substr(1)).find("tables only") != std::string::npos);
  fs::remove_all(tree);
  fs::remove_all(out);
}

TEST_CASE("untrusted: image limits are checked before the pixels are decoded") {
  CHECK(image_error(jpeg(40, 30)).empty());
  const std::string b = jpeg(300, 200);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(b.data());
  CHECK(error_of([&] { probe_image(p, b.size(), ImageLimits{299, 1 << 20}); }).find("above the limits") != std::string::npos);
  CHECK(error_of([&] { probe_image(p, b.size(), ImageLimits{300, 59999}); }).find("above the limits") != std::string::npos);
  CHECK(error_of([&] { probe_image(p, b.size(), ImageLimits{300, 60000}); }).empty());
  CHECK(image_error("").find("neither JPEG nor a readable PNG") != std::string::npos);
}

TEST_CASE("untrusted: an IDX gzip bomb is refused after inflating no more than its header allows") {
  // The fuzz target's input: the image file's length (4 bytes, little-endian), it, the label file.
  const MappedFile bomb((kRegressions / "idx" / "idx_gzbomb_1g.bin").string(), size_t(1) << 24);
  REQUIRE(bomb.size() > 4);
  const size_t images = bomb.data()[0] | bomb.data()[1] << 8 | bomb.data()[2] << 16 | size_t(bomb.data()[3]) << 24;
  REQUIRE(images <= bomb.size() - 4);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    decode_idx_pair(bomb.data() + 4, images, "bomb", bomb.data() + 4 + images, bomb.size() - 4 - images, "labels", 10);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(e.find("bomb: inflates to more bytes than its header says") != std::string::npos);
  CHECK(seconds < 0.5);  // 2.1 GB inflated took seconds; 785 bytes take microseconds
  // Gzip: trailing bytes, a short stream, a corrupted one; plain: trailing bytes.
  const std::vector<uint8_t> gz = gzip(idx_images(2, 3, 4));
  const std::string z(gz.begin(), gz.end());
  CHECK(idx_error(z, 3).empty());
  CHECK(idx_error(z + "garbage", 3).find("bytes after the end of its gzip stream") != std::string::npos);
  CHECK(idx_error(z + z, 3).find("inflates to more bytes than its header says") != std::string::npos);
  // Concatenated gzip members (cat a.gz b.gz) are one stream, as gzip reads them.
  const std::string raw = idx_images(2, 3, 4);
  const std::vector<uint8_t> head = gzip(raw.substr(0, 10)), tail = gzip(raw.substr(10));
  CHECK(idx_error(std::string(head.begin(), head.end()) + std::string(tail.begin(), tail.end()), 3).empty());
  CHECK(idx_error(z.substr(0, z.size() - 6), 3).find("the gzip stream ends early") != std::string::npos);
  std::string corrupt = z;
  corrupt[z.size() - 5] ^= 0x55;  // the CRC
  CHECK(idx_error(corrupt, 3).find("corrupted") != std::string::npos);
  CHECK(idx_error(idx_images(2, 3, 4) + "x", 3).find("its header says 40") != std::string::npos);
  // Sizes: a zero dimension, more than the element limit.
  CHECK(idx_error(idx_images(0, 3, 4), 3).find("implausible sizes 0 x 3 x 4") != std::string::npos);
  std::string huge = idx_images(1, 1, 1);
  huge[4] = huge[8] = huge[12] = '\xff';
  CHECK(idx_error(huge, 3).find("implausible sizes") != std::string::npos);
}

TEST_CASE("untrusted: safetensors headers and ranges are bounded and must tile the data") {
  // The fuzzed zero-element tensor: read as an empty tensor.
  const SafetensorsFile empty((kRegressions / "safetensors" / "st_empty_f32.safetensors").string());
  for (const auto& [name, e] : empty.tensors()) CHECK(empty.as_f32(name, e.shape).empty());
  const std::string t = R"("dtype":"F32","shape":[2])";
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[0,8]},"b":{)" + t +
                                            R"(,"data_offsets":[4,12]}})", 12))
            .find("overlap tensor a's [0, 8)") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[0,8]},"b":{)" + t +
                                            R"(,"data_offsets":[0,8]}})", 8))
            .find("overlap") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[4,12]}})", 12))
            .find("data bytes [0, 4) belong to no tensor") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[0,8]}})", 9))
            .find("1 bytes after the last tensor's end") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[0,99999999999999999999]}})", 8))
            .find("number out of range") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{)" + t + R"(,"data_offsets":[8,0]}})", 8))
            .find("outside the file") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8))
            .find("expects a non-negative integer") != std::string::npos);
  CHECK(safetensors_error(safetensors_bytes(R"({"__metadata__":)" + std::string(100, '[') + std::string(100, ']') + "}", 0))
            .find("nests too deep") != std::string::npos);
  // A header length beyond the limit is refused before it is read.
  std::string big(16, '\0');
  big[3] = 0x10;  // 2^28 bytes claimed
  CHECK(safetensors_error(big).find("its header claims 268435456 bytes") != std::string::npos);
  // Metadata, unknown keys and escapes (a surrogate pair among them) are parsed; only tensors kept.
  const std::string named = safetensors_bytes(
      R"({"__metadata__":{"format":"pt","n":[1.5e3,null,{"x":true}]},"w\u00e9\ud83d\ude00":)"
      R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":"k"}})", 4);
  const SafetensorsFile f("m", reinterpret_cast<const uint8_t*>(named.data()), named.size());
  CHECK(f.tensors().size() == 1);
  CHECK(f.find("w\xc3\xa9\xf0\x9f\x98\x80") != nullptr);
  CHECK(safetensors_error(safetensors_bytes(R"({"a\ud83d":{)" + t + R"(,"data_offsets":[0,8]}})", 8))
            .find("lone surrogate") != std::string::npos);
}

TEST_CASE("untrusted: FIFOs and other non-regular files are refused, never waited on") {
  const fs::path d = temp_dir("fifo");
  make_fifo(d / "model.safetensors");
  CHECK(error_of([&] { SafetensorsFile((d / "model.safetensors").string()); }).find("not a regular file") !=
        std::string::npos);
  CHECK(error_of([&] { read_idx((d / "model.safetensors").string(), "none", 10); }).find("not a regular file") !=
        std::string::npos);
  CHECK(error_of([&] { read_text_file(d.string(), 100); }).find("not a regular file") != std::string::npos);
  // A checkpoint directory whose state file is a FIFO is no checkpoint.
  make_fifo(d / "step-00000004" / "state.safetensors");
  write(d / "step-00000004" / "model.safetensors", "");
  CHECK(!is_checkpoint_dir((d / "step-00000004").string()));
  // A run.txt that is a FIFO: refused by name.
  const fs::path ck = d / "step-00000012";
  fs::create_directories(ck);
  make_fifo(ck / "run.txt");
  CHECK(checkpoint_error(ck, tiny_contents(Precision::BF16), Precision::BF16).find("run.txt: not a regular file") !=
        std::string::npos);
  // Packed data: classes.txt, then a shard.
  const fs::path packed = d / "packed";
  make_fifo(packed / "classes.txt");
  CHECK(error_of([&] { PackedSet s(packed.string()); }).find("classes.txt: not a regular file") != std::string::npos);
  fs::remove(packed / "classes.txt");
  write(packed / "classes.txt", "a\nb\n");
  make_fifo(packed / "shard-00000.bin");
  CHECK(error_of([&] { PackedSet s(packed.string()); }).find("shard-00000.bin: not a regular file") != std::string::npos);
  fs::remove_all(d);
}

TEST_CASE("untrusted: checkpoint names, dtypes, steps and values are bounded and checked") {
  const fs::path d = temp_dir("ckpt");
  // A name of 20 digits is no checkpoint of this engine: skipped, not thrown out of --resume.
  const std::string long_name = std::string(kCheckpointPrefix) + "99999999999999999999";
  CHECK(checkpoint_step(long_name) == -1);
  CHECK(checkpoint_step(std::string(kCheckpointPrefix) + "1073741824") == kMaxCheckpointStep);
  CHECK(checkpoint_step(std::string(kCheckpointPrefix) + "1073741825") == -1);
  fs::create_directories(d / long_name);
  write(d / long_name / "model.safetensors", "");
  write(d / long_name / "state.safetensors", "");
  CHECK(checkpoints_in(d.string()).empty());
  CHECK(error_of([&] { latest_checkpoint(d.string()); }).find("no checkpoint") != std::string::npos);

  const fs::path ck = d / "step-00000012";
  fs::create_directories(ck);
  for (const Precision p : {Precision::BF16, Precision::FP8}) {
    CAPTURE(int(p));
    const InitialState good = tiny_contents(p);
    CHECK(checkpoint_error(ck, good, p).empty());
    InitialState nan_weight = good;
    nan_weight.params[5] = std::numeric_limits<float>::quiet_NaN();
    const std::string e = checkpoint_error(ck, nan_weight, p);
    CHECK(e.find("model.safetensors: tensor ") != std::string::npos);
    CHECK(e.find(" holds nan at element ") != std::string::npos);
    InitialState inf_momentum = good;
    inf_momentum.optimizer_state[0].second[ParamLayout(tiny(p).model).tensors().back().offset + 2] = INFINITY;
    const std::string inf_error = checkpoint_error(ck, inf_momentum, p);
    CAPTURE(inf_error);
    CHECK(inf_error.find("state.safetensors: tensor momentum.head.bias holds inf at element 2") !=
          std::string::npos);
    InitialState nan_loss = good;  // what an FP8 run saves after a skipped step: accepted
    nan_loss.state.epoch_loss_sum = std::nanf("");
    CHECK(checkpoint_error(ck, nan_loss, p).empty());
    InitialState negative = good;
    negative.state.step = -3;
    CHECK(checkpoint_error(ck, negative, p).find("tensor run.step records step -3") != std::string::npos);
  }
  // FP8 records: a NaN scale, a negative amax, an unknown format's maximum.
  for (const auto& [field, value, message] :
       {std::tuple<size_t, float, const char*>{offsetof(Fp8Meta, scale), std::nanf(""), "record 3 has scale nan"},
        {offsetof(Fp8Meta, amax), -1.0f, "record 3 has amax -1"},
        {offsetof(Fp8Meta, fp8_max), 100.0f, "record 3 has fp8_max 100"},
        {offsetof(Fp8Meta, history) + 8, INFINITY, "record 3 has an amax history entry inf"}}) {
    InitialState bad = tiny_contents(Precision::FP8);
    std::memcpy(bad.fp8_metas.data() + 3 * sizeof(Fp8Meta) + field, &value, 4);
    CHECK(checkpoint_error(ck, bad, Precision::FP8).find(std::string("tensor fp8.metas ") + message) != std::string::npos);
  }
  // A state file whose run.step is I32: named, not read as 8 bytes.
  const TrainOptions o = tiny(Precision::BF16);
  write_checkpoint_files(ck.string(), o.model, tiny_contents(Precision::BF16), run_facts(o.model, o, 1));
  const SafetensorsFile weights((ck / "model.safetensors").string());
  const ParamLayout layout(o.model);
  const std::vector<float> zeros(layout.total(), 0.0f);
  const std::vector<int64_t> facts = run_facts(o.model, o, 1);
  const int32_t step32[2] = {12, 0};
  const float loss = 0;
  std::vector<StTensor> st;
  for (const ParamTensor& t : layout.tensors())
    st.push_back({"momentum." + t.name, "F32", t.shape, zeros.data() + t.offset, t.numel * 4});
  st.push_back({"run.shape", "I64", {int64_t(facts.size())}, facts.data(), facts.size() * 8});
  st.push_back({"run.step", "I32", {2}, step32, 8});
  st.push_back({"run.epoch_loss_sum", "F32", {1}, &loss, 4});
  write_safetensors((ck / "state.safetensors").string(), st);
  CHECK(error_of([&] { read_checkpoint(ck.string(), o, 1); }).find("tensor run.step is not I64 [1]") != std::string::npos);
  fs::remove_all(d);
}
