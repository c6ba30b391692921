#!/usr/bin/env bash
# The kernels' CUDA lowering under the oldest supported jax (0.11.2), on a
# machine without a GPU. CI resolves the newest jax, whose Mosaic GPU defers
# the dialect's lowering to the CUDA plugin's compile: under 0.11.2 it runs
# at lowering time, so only this catches what that step refuses (2026-12-02:
# segment-id loads from GMEM, "Only optimized transfers to SMEM supported",
# found on the H200 first).
#
#   bash lab/oldest_jax.sh [PYTEST-ARGS...]   (default: the lowering tests)
#
# VENV (default /tmp/jax_flash2_oldest) is made once and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/jax_flash2_oldest}
if [[ ! -x $venv/bin/python ]]; then
  if PYENV_VERSION=3.12.1 python3.12 --version >/dev/null 2>&1; then export PYENV_VERSION=3.12.1; fi
  python3.12 -m venv "$venv"
  "$venv/bin/pip" install -q -e '.[test]' 'jax==0.11.2' 'jaxlib==0.11.2'
fi
"$venv/bin/python" -c "import jax; print('jax', jax.__version__)"
(($#)) || set -- -k "lower or lowers" tests
"$venv/bin/python" -m pytest -q -n auto -p no:cacheprovider "$@"
