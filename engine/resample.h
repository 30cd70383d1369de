// Host-side resampling of a parameter grid, as timm resamples a position embedding for another
// image size (timm.layers.resample_abs_pos_embed: torch.nn.functional.interpolate with mode
// "bicubic" and antialias=True, i.e. PIL's bicubic: a = -0.5, the filter widened by the scale
// when shrinking, the taps that fall outside dropped and the weights renormalised), in double.
#pragma once
#include <vector>

// in: [h, w, channels] row-major; returns [out_h, out_w, channels]. Separable: the rows (w)
// first, then the columns (h), as PyTorch's CPU kernel.
std::vector<float> resample_bicubic_antialiased(const std::vector<float>& in, int h, int w, int channels, int out_h,
                                                int out_w);
