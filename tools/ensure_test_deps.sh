#!/usr/bin/env bash
# Makes sure the test tiers' build dependencies (zlib, Eigen, doctest, and libturbojpeg and
# libpng for the dataset packer: Debian packages) are
# present. The Fashion-MNIST files (dataset-fashion-mnist) are optional: without them the test
# on the real files reports itself skipped.
set -euo pipefail
missing=()
[ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
[ -f /usr/include/eigen3/Eigen/Core ] || missing+=(libeigen3-dev)
[ -f /usr/include/doctest/doctest.h ] || missing+=(doctest-dev)
[ -f /usr/include/turbojpeg.h ] || missing+=(libturbojpeg0-dev)  # pack_images
[ -f /usr/include/png.h ] || missing+=(libpng-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} for the tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "the tests need ${missing[*]}: run  sudo apt-get install ${missing[*]}" >&2
exit 1
