#!/usr/bin/env bash
# tools/check_examples.sh BUILD_DIR -- install a configured and built deltagrad build to a temporary
# prefix, then build examples/* against the installed package, once with CMake (find_package)
# and once with a plain compiler line and pkg-config, and run each build. Exits non-zero on the
# first failure. The build is not rebuilt: run it after `cmake --build BUILD_DIR`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: tools/check_examples.sh BUILD_DIR}
src=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

cmake --install "$build" --prefix "$prefix" >/dev/null
echo "installed $build to a temporary prefix:"
(cd "$prefix" && find . -type f | sort | sed 's/^/  /')

if ! command -v pkg-config >/dev/null; then
    echo "pkg-config is missing (apt-get install pkg-config)"
    exit 1
fi
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
echo "pkg-config --cflags --libs deltagrad: $(pkg-config --cflags --libs deltagrad)"
# a shared libdeltagrad in the prefix is not on the loader's path
export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

for dir in "$src"/examples/*/; do
    name=$(basename "$dir")
    echo "== example $name: CMake, find_package(deltagrad)"
    cmake -S "$dir" -B "$work/$name-cmake" -DCMAKE_PREFIX_PATH="$prefix" \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" >/dev/null
    cmake --build "$work/$name-cmake" >/dev/null
    "$work/$name-cmake/$name"

    echo "== example $name: ${CC:-cc} ... \$(pkg-config --cflags --libs deltagrad)"
    # shellcheck disable=SC2046 # the flags are meant to split
    "${CC:-cc}" -std=c11 -O2 -Wall -Wextra -Werror "$dir/$name.c" -o "$work/$name-pc" \
        $(pkg-config --cflags --libs deltagrad)
    "$work/$name-pc"
done
echo "== examples passed"
