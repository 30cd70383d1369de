// The timeline (--trace, kernels/activity_trace.h): the Chrome trace's form on the CPU, and a
// traced run on the GPU.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/activity_trace.h"
#include "tests/harness.h"
#include "tests/shell.h"

TEST_CASE("trace: the Chrome trace names each stream's lane, escapes names, and times from the first event") {
  std::vector<TraceEvent> events = {
      {TraceEvent::Kind::Kernel, "gemm \"a\\b\"", 5000, 7500, 0, 7, 0, "grid 1,1,1 block 128,1,1"},
      {TraceEvent::Kind::Memcpy, "memcpy HtoD", 2000, 3000, 0, 9, 0, "64 bytes"},
      {TraceEvent::Kind::HostRange, "block 0 forward", 1000, 9000, 0, 0, 0, ""},
  };
  const std::string json = chrome_trace_json(events, {{{0, 7}, "critical path"}});
  CAPTURE(json);
  CHECK(json.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0) == 0);
  CHECK(json.find("\"args\": {\"name\": \"stream 7: critical path\"}") != std::string::npos);
  CHECK(json.find("\"args\": {\"name\": \"stream 9\"}") != std::string::npos);  // not named
  CHECK(json.find("\"name\": \"gemm \\\"a\\\\b\\\"\"") != std::string::npos);
  // Microseconds from the earliest event (the host range, at 1000 ns).
  CHECK(json.find("\"pid\": 0, \"tid\": 7, \"ts\": 4.000, \"dur\": 2.500") != std::string::npos);
  CHECK(json.find("\"pid\": 1, \"tid\": 0, \"ts\": 0.000, \"dur\": 8.000") != std::string::npos);
  CHECK(json.find("host (NVTX ranges)") != std::string::npos);
  CHECK(json.substr(json.size() - 4) == "\n]}\n");
  int depth = 0, braces = 0;  // balanced, whatever the names held
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '{' || c == '[') ++depth, ++braces;
    if (c == '}' || c == ']') REQUIRE(--depth >= 0);
  }
  CHECK(depth == 0);
  CHECK(braces > 10);
}

TEST_CASE("gpu: --trace writes the traced steps' kernels on each named stream and the NVTX ranges") {
  SKIP_WITHOUT_GPU();
  const std::string path = fresh_temp_dir("trace").string() + ".json";
  const CommandResult r = run_command(
      "./vit_train --img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 --batch 16 --steps 6 "
      "--warmup 2 --trace " + path);
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("trace: steps 3..5") != std::string::npos);
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  size_t kernels = 0;
  for (size_t at = json.find("\"cat\": \"kernel\""); at != std::string::npos; at = json.find("\"cat\": \"kernel\"", at + 1))
    ++kernels;
  CHECK(kernels > 3 * 50);  // three steps of a two-block model: over 50 kernels each
  for (const char* want : {": critical path\"", ": second stream\"", "layernorm_forward_kernel", "\"block 1 backward\"",
                           "host (NVTX ranges)"}) {
    CAPTURE(want);
    CHECK(json.find(want) != std::string::npos);
  }
  std::remove(path.c_str());
}
