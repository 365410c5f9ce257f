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
# Another apt (unattended-upgrades on a fresh machine, a second install) holding the dpkg
# or lists lock is waited for, up to RP_APT_LOCK_TIMEOUT seconds (default 600), instead of
# failing at once (apt >= 1.9.11, Debian 11 on).
wait_lock=(-o "DPkg::Lock::Timeout=${RP_APT_LOCK_TIMEOUT:-600}")
$sudo apt-get "${wait_lock[@]}" update -q
$sudo apt-get "${wait_lock[@]}" install -y -q --no-install-recommends "${packages[@]}"
