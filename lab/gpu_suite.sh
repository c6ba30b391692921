#!/usr/bin/env bash
# The GPU suite (pytest -m gpu) in parallel shards on one call of the device
# machine, most valuable tests first, each shard stopped politely (SIGINT, so
# pytest still prints its summary and durations) before the call's limit.
#
#   bash lab/gpu_suite.sh [PYTEST-SELECTION...]     (default: tests)
#
# SHARDS (default 6, 4 under 100 GB of GPU memory) processes share the GPU
# (memory on demand). SHARD_LIMIT
# (default 420 s) bounds each; TEST_LIMIT (default 240 s) each test, with a
# traceback of where a hung one stood. XLA's GEMM autotuning is off: the
# tests' plain-jnp references are compiled, not timed, and autotuning their
# dots kept every core busy for minutes (2026-12-02: 4 tests per process in
# 500 s with it on). The summary and the outcomes go to $OUT, the shard logs
# into $OUT/shards.tgz (the device returns at most 8 files).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
# Six shards fit an H200's 141 GB; on an H100's 80 GB eight ran five tests
# out of memory (2026-12-06), so four there.
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
n=${SHARDS:-$((mem_mib > 100000 ? 6 : 4))}
(($#)) || set -- tests
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import jax, jaxlib; from jax._src.lib import cuda_versions as c; \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'cudnn', c.cudnn_get_version() if c else None)" \
  | tee -a "$OUT/gpu.txt"
# Mosaic and API-level tests first: they exercise the most code per second.
# REVERSE=1 takes the list from its end, for the tests a limited call did not reach.
python -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" | grep "::" \
  | awk '{ key = ($0 ~ /test_gpu.py::test_mosaic|test_mosaic/) ? 0 : 1; print key "\t" $0 }' \
  | sort -s -k1,1 | cut -f2 | { if ((${REVERSE:-0})); then tac; else cat; fi; } >"$OUT/ids.txt"
echo "$(wc -l <"$OUT/ids.txt") tests in $n shards"
for ((i = 0; i < n; i++)); do
  mapfile -t ids < <(awk -v n="$n" -v i="$i" 'NR % n == i' "$OUT/ids.txt")
  ((${#ids[@]})) || continue
  timeout -s INT "${SHARD_LIMIT:-420}" python -m pytest -m gpu -v -rfE -p no:cacheprovider --durations=0 \
    -o timeout="${TEST_LIMIT:-240}" "${ids[@]}" >"$OUT/logs/shard_$i.log" 2>&1 &
done
wait
grep -hE " PASSED| FAILED| ERROR" "$OUT"/logs/shard_*.log | sed -E 's/ +\[ *[0-9]+%\]//' | sort >"$OUT/outcomes.txt"
echo "passed $(grep -c ' PASSED' "$OUT/outcomes.txt"), failed $(grep -c ' FAILED' "$OUT/outcomes.txt"), errors $(grep -c ' ERROR' "$OUT/outcomes.txt") of $(wc -l <"$OUT/ids.txt")"
grep -hE "FAILED|ERROR" "$OUT/outcomes.txt" | head -40
tail -qn 1 "$OUT"/logs/shard_*.log
tar czf "$OUT/shards.tgz" -C "$OUT" logs && rm -r "$OUT/logs"
