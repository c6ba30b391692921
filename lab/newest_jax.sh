#!/usr/bin/env bash
# A newer jax (with its CUDA 13 plugin) for the device machine, whose image
# holds jax 0.11.2. The four wheels of 0.12.1 are 227 MB, over the 64 MiB
# a call carries: here they are unpacked, their shared libraries stripped
# of symbols (700 -> 511 MB), packed as one xz tarball (143 MB) and split
# into pieces that fit a call beside the working tree (about 12 MB).
#
#   bash lab/newest_jax.sh stage [VERSION]   (here, ~3.5 min: .jaxw1, .jaxw2, ...)
#   bash lab/newest_jax.sh install           (there, in the call carrying the last piece)
#
# The device keeps ignored paths between calls while warm (30 s idle), so
# one call a piece (`carry` [".jaxwN"], any short command), chained, leaves
# every piece in place for `install`; xz's checks fail it if one is missing.
# Then `export PYTHONPATH=/tmp/jax_site` before python (gpu_suite.sh keeps it).
# Stripping keeps the dynamic symbols, which are all a shared library's
# loader and Python's import need; the whole chain, run here (2026-12-07),
# gave a tree that imports jax 0.12.1 and runs on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
piece_mb=${PIECE_MB:-50}
case ${1:-} in
  stage)
    version=${2:-0.12.1}
    work=${WORK:-/tmp/jax_newest}
    rm -rf "$work" && mkdir -p "$work/wheels" "$work/site"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$work/wheels" "jax==$version" "jaxlib==$version" "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version"
    for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
    find "$work/site" -name '*.so' -size +1M -exec strip --strip-unneeded {} +
    tar -C "$work/site" -cf - . | xz -9 -T2 >"$work/site.tar.xz"
    rm -rf .jaxw* && split -b "${piece_mb}M" -d -a 1 "$work/site.tar.xz" "$work/piece."
    for p in "$work"/piece.*; do
      d=.jaxw$((${p##*.} + 1)); mkdir -p "$d" && mv "$p" "$d/"
    done
    mkdir -p .git/info && grep -qx '/.jaxw\*/' .git/info/exclude 2>/dev/null || echo '/.jaxw*/' >>.git/info/exclude
    ls -la .jaxw*/ ;;
  install)
    rm -rf /tmp/jax_site && mkdir -p /tmp/jax_site
    cat .jaxw*/piece.* | xz -d | tar -C /tmp/jax_site -xf -
    PYTHONPATH=/tmp/jax_site python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" ;;
  *) echo "usage: $0 stage [VERSION] | install" >&2; exit 2 ;;
esac
