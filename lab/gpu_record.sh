#!/usr/bin/env bash
# Bench sweeps of record on one device call, each its own bench run (the
# bench saves only at its end, so a sweep cut off at the call's limit loses
# only itself).
#
#   bash lab/gpu_record.sh 'NAME BENCH-ARGS...' ...
#
# tokamax and what it needs beyond the device image travel as wheels in
# .whl/ (carry it): tokamax 0.0.17, absl-py, annotated-types, einshape,
# immutabledict, pydantic, pydantic-core, tensorboardx, tqdm,
# typing-inspection (`pip download --no-deps`, as the device README says).
# xprof, which tokamax's own benchmarking module imports when tokamax is
# imported, is stubbed: the bench times tokamax's attention with its own
# timer and trace; so is qwix where the image lacks it (tokamax names its
# QArray in annotations; its quantize, for quantized inputs, the bench
# never calls; the real one needs flax and its dependencies). LIMIT (default 540 s) bounds the whole run;
# PRE, if set, is a command run first (a quick test, say). Each sweep's
# files and log go into $OUT/bench.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
deadline=$((SECONDS + ${LIMIT:-540}))
if compgen -G ".whl/*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/xprof/cli
  touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo 'def get_kernel_stats_tool(*args, **kwargs): raise NotImplementedError("xprof is stubbed")' \
    >/tmp/site/xprof/cli/tools.py
  if ! python -c "import qwix" 2>/dev/null; then
    mkdir -p /tmp/site/qwix
    printf 'class QArray:\n  """Stub."""\n\ndef quantize(*args, **kwargs):\n  raise NotImplementedError("qwix is stubbed")\n\ndequantize = quantize\n' \
      >/tmp/site/qwix/__init__.py
  fi
  export PYTHONPATH=.:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
python -c "import jax, tokamax; print('jax', jax.__version__, 'tokamax', tokamax.__version__)" 2>&1 | tail -1
if [[ -n ${PRE:-} ]]; then bash -c "$PRE" 2>&1 | tail -n 15; fi
for spec in "$@"; do
  name=${spec%% *} args=${spec#* }
  left=$((deadline - SECONDS))
  if ((left < 40)); then echo "$name: not run (out of time)"; continue; fi
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "$left" python -m jax_flash2.bench $args --no-progress --no-plot --out "$OUT/bench/$name" \
    >"$OUT/bench/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  grep -E "^(left out|check|FAIL)|unsupported|Error" "$OUT/bench/$name.log" | head -n 8
done
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -r "$OUT/bench"
