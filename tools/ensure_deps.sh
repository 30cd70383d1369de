#!/usr/bin/env bash
# Makes sure the build's dependencies (Debian packages) are present: for `make`, zlib (gzip
# datasets); for `make test` also Eigen and doctest (the test tiers), libturbojpeg and libpng
# (the dataset packer). Installs what is missing when run as root with apt-get, else names the
# command to run. The Fashion-MNIST files (dataset-fashion-mnist) are optional: without them
# the test on the real files reports itself skipped. For `make fuzz`: clang (libFuzzer and the
# sanitizers' runtimes) and the test tier's libraries.
# Usage: tools/ensure_deps.sh build|test|fuzz
set -euo pipefail
what=${1:-build}
missing=()
[ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
if [ "$what" = test ] || [ "$what" = fuzz ]; then
  [ -f /usr/include/eigen3/Eigen/Core ] || missing+=(libeigen3-dev)
  [ -f /usr/include/doctest/doctest.h ] || missing+=(doctest-dev)
  [ -f /usr/include/turbojpeg.h ] || missing+=(libturbojpeg0-dev)  # pack_images
  [ -f /usr/include/png.h ] || missing+=(libpng-dev)
fi
if [ "$what" = fuzz ]; then
  command -v clang++ >/dev/null || missing+=(clang)
  ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || missing+=(libclang-rt-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} (make $what needs them)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "make $what needs ${missing[*]}: run  sudo apt-get install ${missing[*]}" >&2
exit 1
