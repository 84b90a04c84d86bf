#!/bin/bash
# tests/scripts/layers.sh SRC_DIR -- dependencies point one way (README, Architecture): a folder
# includes only the folders above it. Fails naming each include that points up.
#   tensor/   may not include autograd/ dist/ ops/ train/ tools/
#   autograd/ may not include dist/ ops/ train/ tools/
#   kernels/  may not include autograd/ dist/ ops/ train/ tools/
#   dist/     may not include autograd/ ops/ train/ tools/
#   ops/      may not include train/ tools/
#   train/    may not include tools/
set -u
src=${1:?usage: layers.sh SRC_DIR}
cd "$src" || exit 1
bad=0
check() { # folder, forbidden folders...
    local dir=$1
    shift
    local pat
    pat=$(printf '%s/|' "$@")
    pat="#include \"([^\"]*/)?(${pat%|})"
    local hits
    hits=$(grep -rEn "$pat" "$dir" --include='*.c' --include='*.h' --include='*.cu' \
        --include='*.cuh' || true)
    if [ -n "$hits" ]; then
        echo "FAIL: $dir/ includes a layer above it:"
        echo "$hits"
        bad=1
    fi
}
check tensor autograd dist ops train tools
check autograd dist ops train tools
check kernels autograd dist ops train tools
check dist autograd ops train tools
check ops train tools
check train tools
[ $bad = 0 ] && echo "layers: every include points down"
exit $bad
