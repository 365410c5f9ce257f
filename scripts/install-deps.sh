#!/usr/bin/env bash
# Installs RoutePack's build and test dependencies from Debian's packages (the list in
# README.md). CUDA and NCCL come from the toolkit in /usr/local/cuda when present.
set -euo pipefail
packages=(
  build-essential cmake pkg-config          # toolchain
  clang-14 libclang-rt-14-dev llvm-14       # fuzzers: clang, the libFuzzer runtime, llvm-symbolizer
  libluajit-5.1-dev libjansson-dev          # required libraries
  libopenmpi-dev openmpi-bin                # MPI transport (optional part)
  perl                                      # prove, the TAP harness
  python3 python3-venv                      # Python binding and its tests
)
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${packages[@]}"
