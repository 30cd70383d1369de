// The attention tools' arguments: shapes as groups of four positive integers, B H T HD.
#pragma once
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct AttentionShape {
  int B, H, T, hd;
};

// The shapes argv[1..] name, or `defaults` when it names none; false, with one line on stderr naming
// the problem, when the count is not a multiple of four or an argument is not a positive integer
// (strtol over the whole argument: "12x" and "0" are refused, not read as 12 and 0).
inline bool parse_shapes(int argc, char** argv, const char* tool, const std::vector<AttentionShape>& defaults,
                         std::vector<AttentionShape>* shapes) {
  if ((argc - 1) % 4 != 0) {
    std::fprintf(stderr, "%s: %d arguments; give B H T HD groups of four (usage: %s [B H T HD ...])\n", tool, argc - 1,
                 tool);
    return false;
  }
  std::vector<AttentionShape> out;
  for (int i = 1; i < argc; i += 4) {
    int v[4];
    for (int k = 0; k < 4; ++k) {
      char* end = nullptr;
      const long x = std::strtol(argv[i + k], &end, 10);
      if (end == argv[i + k] || *end != '\0' || x <= 0 || x > INT_MAX) {
        std::fprintf(stderr, "%s: '%s' is not a positive integer (usage: %s [B H T HD ...])\n", tool, argv[i + k], tool);
        return false;
      }
      v[k] = int(x);
    }
    out.push_back({v[0], v[1], v[2], v[3]});
  }
  *shapes = out.empty() ? defaults : out;
  return true;
}
