#!/usr/bin/env bash
# tools/format.sh -- format the tree's C, CUDA and header files with clang-format (the rules in
# .clang-format), or with --check only report the files that differ (exit 1 if any).
#
#   bash tools/format.sh            rewrite every file in place
#   bash tools/format.sh --check    list the files clang-format would change; exit 1 if any
#
# The tree is kept formatted with clang-format 14 (what Debian 12 ships); other major versions
# break lines differently, so --check with another version says so and exits 0 without checking.
# CMake offers the same as targets: `cmake --build build --target format` / `format-check`.
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
--check) check=1 ;;
"") ;;
*)
    echo "usage: bash tools/format.sh [--check]" >&2
    exit 2
    ;;
esac
cf=${CLANG_FORMAT:-clang-format}
if ! command -v "$cf" >/dev/null; then
    echo "format: $cf not found (apt-get install clang-format)" >&2
    exit 2
fi
major=$("$cf" --version | sed -n 's/.*version \([0-9][0-9]*\)\..*/\1/p')
if [ "$check" = 1 ] && [ "$major" != 14 ]; then
    echo "format: skipped: the tree is formatted with clang-format 14, this is $major"
    exit 0
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files -co --exclude-standard '*.c' '*.h' '*.cu' '*.cuh')
else
    mapfile -t files < <(find . -path ./build\* -prune -o -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print | sed 's|^\./||')
fi
if [ "$check" = 0 ]; then
    "$cf" -i "${files[@]}"
    echo "format: ${#files[@]} files formatted"
    exit 0
fi
bad=()
for f in "${files[@]}"; do
    [ -f "$f" ] || continue
    "$cf" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
    echo "format: ${#bad[@]} of ${#files[@]} files differ from clang-format (run bash tools/format.sh):"
    printf '  %s\n' "${bad[@]}"
    exit 1
fi
echo "format: ${#files[@]} files formatted as clang-format 14 would"
