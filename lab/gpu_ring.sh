#!/usr/bin/env bash
# Issue 32 on a multi-GPU lent machine (nvidia-h200-x8, or -x4 / -x2), its
# first call: the GPU tests of the sharding and the ring on a real mesh, then
# the bench's --ring sweeps, each its own bench run (the bench saves only at
# its end, so a sweep cut off at the call's limit loses only itself).
#
#   bash lab/gpu_ring.sh [SWEEP ...]     (default: every sweep below, in order)
#
# NCCL_NVLS_ENABLE=0: NVLink multicast stays off on the lent machines
# (issue 32; the device README's KINDS.md says why); exported here for every
# process, and recorded in each results.json's metadata. LIMIT (default
# 560 s) bounds the whole call; TESTS=0 skips the tests (a second call that
# only runs the sweeps left over, named on its command line); TEST_LIMIT
# (default 240 s) bounds the tests. Everything goes into $OUT/ring.tgz (the
# kept traces into $OUT/ring_traces.tgz), with the summary printed; the
# device returns at most 8 files.
#
# Sweeps: zigzag causal and contiguous non-causal, head_dim 128, 8k and 16k
# tokens per GPU, fwd and fwd+bwd, ring and all-gather, over every GPU; then
# zigzag ring on fewer GPUs (the targets say "the same or better"). Kernel
# times from a profiler trace; the zigzag-ring sweep keeps its traces (each
# step's kernels against the NCCL transfers, for Perfetto).
set -uo pipefail
OUT=${OUT:-gpu_out}
R="$OUT/ring"
mkdir -p "$R"
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
deadline=$((SECONDS + ${LIMIT:-560}))
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,power.draw --format=csv,noheader
  nvidia-smi topo -m
  python -c "import jax; print('jax', jax.__version__, jax.device_count(), 'devices:', jax.devices())"
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} 2>&1 | tee "$R/gpus.txt"

declare -A SWEEP=(
  [zigzag-ring]="--layout zigzag --strategy ring --keep-traces"
  [zigzag-allgather]="--layout zigzag --strategy allgather"
  [contiguous-ring]="--layout contiguous --strategy ring"
  [contiguous-allgather]="--layout contiguous --strategy allgather"
  [zigzag-ring-p4]="--layout zigzag --strategy ring --devices 4"
  [zigzag-ring-p2]="--layout zigzag --strategy ring --devices 2"
)
ORDER=(zigzag-ring zigzag-allgather contiguous-ring contiguous-allgather zigzag-ring-p4 zigzag-ring-p2)
(($#)) || set -- "${ORDER[@]}"

if [[ ${TESTS:-1} != 0 ]]; then
  start=$SECONDS
  # -m gpu: test_sharding's gpu variants (batch and heads sharded) and
  # test_ring's test_ring_on_gpus (sequence sharded, P = 2, 4, 8 as the
  # machine allows; values and gradients against the unsharded reference).
  timeout -s INT "${TEST_LIMIT:-240}" python -m pytest -m gpu -v -rfE -p no:cacheprovider --durations=15 \
    tests/test_ring.py tests/test_sharding.py >"$R/tests.log" 2>&1
  echo "== tests: exit $? after $((SECONDS - start)) s"
  grep -hE " PASSED| FAILED| ERROR| SKIPPED" "$R/tests.log" | sed -E 's/ +\[ *[0-9]+%\]//' | sort >"$R/outcomes.txt"
  grep -cE " PASSED" "$R/outcomes.txt" | sed 's/^/passed /'
  grep -hE "FAILED|ERROR" "$R/outcomes.txt" | head -20
  tail -n 1 "$R/tests.log"
fi

for name in "$@"; do
  args=${SWEEP[$name]:-}
  if [[ -z $args ]]; then echo "$name: no such sweep (${ORDER[*]})"; continue; fi
  if [[ $args =~ --devices\ ([0-9]+) ]] && ((BASH_REMATCH[1] > n)); then echo "$name: not run ($n GPUs)"; continue; fi
  left=$((deadline - SECONDS))
  if ((left < 60)); then echo "$name: not run (out of time)"; continue; fi
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "$left" python -m jax_flash2.bench --ring $args --tokens-per-device 8k 16k --head-dims 128 \
    --no-progress --out "$R/$name" >"$R/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  grep -E "^(left out|  flash2)|rel err|^flash2 |error|Error|OOM" "$R/$name.log" | head -n 12
done
# The kept traces apart: if they are over what a call returns, the results still come back.
traces=$(cd "$OUT" && find ring -type d -name traces)
if [[ -n $traces ]]; then
  # shellcheck disable=SC2086
  tar czf "$OUT/ring_traces.tgz" -C "$OUT" $traces && (cd "$OUT" && rm -r $traces)
fi
tar czf "$OUT/ring.tgz" -C "$OUT" ring && rm -r "$R"
ls -l "$OUT"
