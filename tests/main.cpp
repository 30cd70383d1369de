// The test runner: doctest, plus the closing line `tests: N passed, N failed, N skipped`.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "tests/harness.h"

namespace {
bool current_skipped = false;
int passed = 0, failed = 0, skipped = 0;

struct CountingListener : doctest::IReporter {
  explicit CountingListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override { current_skipped = false; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    if (!st.testCaseSuccess) ++failed;
    else if (current_skipped) ++skipped;
    else ++passed;
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("counting", 1, CountingListener);
}  // namespace

bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    cudaGetLastError();
    if (!ok) std::printf("no GPU: the GPU tests are skipped\n");
    return ok;
  }();
  return available;
}

void mark_skipped() { current_skipped = true; }

int main(int argc, char** argv) {
  doctest::Context context;
  // doctest's own summary counts a GPU test that skipped itself as passed: the closing line is the
  // run's one summary (doctest adds its own only where something failed; -m=false shows it always).
  context.setOption("minimal", true);
  context.applyCommandLine(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  std::printf("tests: %d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return rc != 0 || failed != 0 ? 1 : 0;
}
