#!/usr/bin/env bash
# Installs a build into a scratch prefix and compiles examples/embed.c against it twice:
# through pkg-config and through the CMake package. Usage: scripts/check-install.sh BUILD_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-build}" && pwd)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig:$prefix/lib/x86_64-linux-gnu/pkgconfig"
cc -Wall -Werror "$root/examples/embed/embed.c" -o "$prefix/embed-pc" $(pkg-config --cflags --libs routepack)
LD_LIBRARY_PATH="$prefix/lib:$prefix/lib/x86_64-linux-gnu" "$prefix/embed-pc" "$root/examples/config-small.json"
cmake -S "$root/examples/embed" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
LD_LIBRARY_PATH="$prefix/lib:$prefix/lib/x86_64-linux-gnu" "$prefix/consumer/embed" "$root/examples/config-small.json"
"$prefix/bin/routepack" version
echo "check-install: pkg-config and CMake consumers built and ran against $prefix"
