#include "engine/resample.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/check.h"

namespace {
// PIL's bicubic filter (Keys' cubic convolution with a = -0.5).
double cubic(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
  return 0.0;
}

// One output sample's taps: its first input index and normalised weights (PyTorch's
// _compute_weights_aa with align_corners false).
struct Taps {
  int64_t first;
  std::vector<double> weights;
};
std::vector<Taps> taps(int in, int out) {
  const double scale = static_cast<double>(in) / out;
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;  // interp_size 4, halved, widened when shrinking
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  std::vector<Taps> t(out);
  for (int i = 0; i < out; ++i) {
    const double center = scale * (i + 0.5);
    const int64_t xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t xsize = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in) - xmin;
    t[i].first = xmin;
    double total = 0;
    for (int64_t j = 0; j < xsize; ++j) {
      t[i].weights.push_back(cubic((j + xmin - center + 0.5) * invscale));
      total += t[i].weights.back();
    }
    if (total != 0.0)
      for (double& w : t[i].weights) w /= total;
  }
  return t;
}
}  // namespace

std::vector<float> resample_bicubic_antialiased(const std::vector<float>& in, int h, int w, int channels, int out_h,
                                                int out_w) {
  ENSURE(h > 0 && w > 0 && channels > 0 && out_h > 0 && out_w > 0 && in.size() == size_t(h) * w * channels,
         "resample_bicubic_antialiased: sizes");
  const std::vector<Taps> tx = taps(w, out_w), ty = taps(h, out_h);
  std::vector<double> rows(size_t(h) * out_w * channels, 0.0);  // the rows resampled
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < out_w; ++x)
      for (size_t k = 0; k < tx[x].weights.size(); ++k) {
        const float* src = &in[(size_t(y) * w + tx[x].first + k) * channels];
        double* dst = &rows[(size_t(y) * out_w + x) * channels];
        for (int c = 0; c < channels; ++c) dst[c] += tx[x].weights[k] * src[c];
      }
  std::vector<float> out(size_t(out_h) * out_w * channels);
  for (int y = 0; y < out_h; ++y)
    for (int x = 0; x < out_w; ++x)
      for (int c = 0; c < channels; ++c) {
        double s = 0;
        for (size_t k = 0; k < ty[y].weights.size(); ++k)
          s += ty[y].weights[k] * rows[((ty[y].first + k) * out_w + x) * channels + c];
        out[(size_t(y) * out_w + x) * channels + c] = static_cast<float>(s);
      }
  return out;
}
