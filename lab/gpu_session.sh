#!/usr/bin/env bash
# GPU work as stages, batched into few device calls (each call has 10 minutes;
# a session 30). Run from the repository root on the GPU machine:
#
#   bash lab/gpu_session.sh STAGE [STAGE ...]
#   bash lab/gpu_session.sh 0:mosaic_tests 1:train_1k 2:bench128 3:mosaic_api all:sharding
#
# A plain STAGE runs in the foreground with every GPU visible; N:STAGE+STAGE
# runs those stages one after another in the background on GPU N alone (log:
# $OUT/gpuN.log), all:STAGE in the background on every GPU, so a machine of
# several GPUs runs one stream per GPU (memory is then allocated on demand, not
# preallocated, so that streams sharing a GPU fit); each stream stops after
# STREAM_LIMIT seconds (570). `wait` waits for the streams started before it,
# so that timing stages after it have the GPU alone. At the end everything
# under $OUT (or ./gpu_out) is packed into $OUT/session.tgz (the device
# returns at most 8 files).
#
# The stages are the record of how each experiment of lab/NOTES.md was run.
# Those that time a switch since removed from the kernels (pingpong, early_q,
# adders=, unordered=, elementwise=, whole_heads=, the backward kernels alone
# in power_probe; lab/variants.md lists them) now stop at once with the tool's
# error naming the unknown field; their code is at the tag lab-variants.
#
# Stages (time on one H200):
#   Tests:    all_tests (the GPU suite but Mosaic and sharding, ~7 min),
#             suite_shards (the whole GPU suite but sharding, in parallel processes),
#             mosaic_tests (the Mosaic kernels alone, ~5 min), mosaic_shards (the
#             same and head_dim 256 in parallel processes, in a stream), mosaic_api
#             (backend mosaic/auto at the Triton path's bar, ~12 min; split in
#             mosaic_api_mosaic and mosaic_api_auto), mosaic_rest
#             (its GQA and 16k determinism cases), new (dropout, bias,
#             check_vma, shard_map), sharding (every GPU visible: 2x2 mesh on 4).
#             mosaic_fwd_tests (the Mosaic forward kernel alone, ~3 min),
#             d256_tests (head_dim 256, masks, bias, segments; ~6 min), d256_bias,
#             d256_bwd (the head_dim-256 Mosaic backward: tests, then vs Triton and cuDNN; ~5 min).
#   Speed:    overlap_ab (softmax_overlap off/on, ~2 min), persistent (the
#             persistent and ping-pong forward: tests, then A/B, ~6 min),
#             bwd_persistent (the persistent dQ and dK/dV kernels: tests, then A/B, ~9 min),
#             fused (dQ folded into the dK/dV kernel: tests, then d128 A/B, ~9 min), fused64 (its d64 A/B, ~2 min),
#             fused_traffic (the fused kernel with half or none of its reduce-adds, speed only, ~2 min),
#             profile_bwd, profile_fwd64 (Mosaic's profiler: where the warpgroups wait, ~3 / ~2 min),
#             profile_fused_bare (the fused kernel without dQ traffic, profiled at 4k, ~1.5 min),
#             d64_tiles (256-row Q tiles at d64, ~2 min), d64_consumers3 (three
#             consumer warpgroups in the d64 forward: tests, A/B; ~3 min),
#             d64_consumers3_unpadded (the same at 4k and without the padding copy, ~2 min),
#             d64_dq_consumers3 (three consumers in the d64 dQ kernel: tests, A/B; ~3 min),
#             dq_overlap64 / dq_overlap128 (the dQ kernel's softmax overlap, ~2 min each),
#             d64_causal4k (the three-consumer causal forward at 4k-8k, ~1 min),
#             registers64 / registers128 (the backward's fixed operands in registers: tests, A/B; ~4 / ~2 min),
#             fwd_registers (the forward's Q in registers: tests, A/B; ~3 min),
#             registers_ab (the three A/Bs above without their tests, ~6 min),
#             poly_ab (part of the exponentials as a polynomial: d64 fwd, bwd, d128 fwd; ~5 min),
#             dkv_ring128 (the d128 dK/dV kernel with 3-4 ring slots, not persistent; ~2 min),
#             power_probe (SM clock and power while the backward runs, ~1.5 min),
#             fused_ablation (the fused kernel without dQ traffic, hand-over, lockstep; ~5 min),
#             fused64_warp (the d64 fused kernel, persistent K/V, with and without the adder warp; ~3.5 min),
#             traffic64 (the d64 fused kernel with its adder warp and all, half or none of its reduce-adds; ~2.5 min),
#             adder_warp (the fused kernel's dQ additions in a warp of their own: A/B, ~3.5 min),
#             anatomy (cuDNN's and our forward+backward kernels from a profiler trace, power beside each; ~3 min),
#             elementwise_ab (the backward without its element-wise work, speed only; ~2.5 min),
#             ring3_128 (the d128 backward with 3 ring slots, persistent; ~2.5 min),
#             dkv_trace128 (profiler traces of the d128 backward kept, dK/dV softmax_overlap A/B; ~3 min),
#             fused64_kv (the d64 fused kernel with K and V in registers: A/B, ~3.5 min),
#             pair_share (each fused tile adding at every other step, a cluster pair's share; speed only, ~5 min),
#             three2k (the d64 forward's three consumers from 2k: tests, A/B at 512-2k, bench64; ~6 min),
#             fill_rounds (the d64 fused backward's rounds filled with heads split across them: A/B, ~4 min),
#             bench64_odd (the bench CLI at d64, 6144 and 12288, ~3 min),
#             adder_warps (the d64 fused backward with two warps adding dQ: A/B, ~3 min),
#             adder_warps128 (the same for the d128 fused kernel against the two kernels, ~4 min),
#             early_q (the persistent forward loading the next tile's Q early: A/B d64/d128, ~4 min),
#             balanced (the causal forward's tiles from a balanced table against pairs; early_q again; ~3 min),
#             balanced_bwd (the same for the d128 backward's two kernels; three d64 consumers causal 2k-4k; ~4 min),
#             three4k (the d64 causal forward at 4k, two consumers against three, kernel bench; ~1 min),
#             cli_ab64 (the same through the bench CLI, lab/tools/cli_ab.py, both orders, early_q beside; ~3 min),
#             bwd_ab128 (the d128 backward: dK/dV softmax_overlap, dQ on 128-row K/V blocks; ~3 min),
#             cli_ab128 (the d128 backward: dK/dV softmax_overlap and the fused kernel through the bench CLI; ~4 min),
#             overlap128 (the d128 dK/dV softmax_overlap, kernel bench, two runs; ~4 min),
#             early_vectors (the backward's lse and delta loaded before the wgmma wait: A/B d64, d128; ~4 min),
#             cli_ev128 (the same at d128 through the bench CLI, both masks, cuDNN beside; ~3 min),
#             ncu128 (Nsight Compute's counters: d128 forward+backward, ours and cuDNN; ~7 min),
#             ncu_cudnn128 (the same for cuDNN's kernels alone; ~3 min),
#             determinism (run-to-run bits of cuDNN and ours; cuDNN's deterministic backward through the CLI; ~4 min),
#             bench_det (the CLI's fwd+bwd, d128 and d64: flash2, cudnn, cudnn-deterministic; ~5 min),
#             cli_ev64 (early_vectors at d64 through the CLI; ~3 min),
#             gpt_flash (the example GPT, 1000 steps, seed 0, flash only, ~1 min),
#             fused64_default (that kernel, the d64 default, against the two kernels at 2k/8k, then bench64; ~6 min),
#             wgmma (lab/tools/wgmma_bench.py: A from shared memory or registers, ~1 min),
#             fused_unordered (the fused kernel without its order of additions, speed only, ~2 min), bwd_overlap (the
#             backward's: tests, then off/on; ~6 min), bench128 / bench64 (auto, Triton, cuDNN; ~4 / ~3 min), mosaic (the
#             Mosaic tests and kernel benches), features (window, segments vs
#             causal at 2k and 16k, ~2 min), gqa_vs_mha (~2 min), tune / tune256
#             (Triton tiles at d128 forward / all d256 kernels, ~4 min each),
#             ragged (Mosaic vs Triton at 1000/4000 beside 1024/4096, ~4 min).
#   Training: train (600 steps, seeds 5-6), train_1k (1000 steps, seeds 0-3, ~6 min),
#             train_1k_f32 (its float32-attention control, ~3 min).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
BENCH="python -m jax_flash2.bench --no-progress --iters 10 --warmup 2"

cli_rows() {  # the bench CLI's output filtered to its table rows, section headers and errors
  grep -E "^ +[0-9]+ |== |rror"
}

stage_new() {
  timeout 280 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests \
    -k "dropout or bias or check_vma or shard_map" 2>&1 | tee "$OUT/new_tests.log"
}

stage_mosaic() {
  # A hang (a barrier phase gone wrong) shows as the timeout; forward and
  # backward run apart so that one's hang leaves the other's result.
  timeout 150 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py -k "not bwd" 2>&1 | tee "$OUT/mosaic_tests.log" | tail -60
  timeout 120 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py -k bwd 2>&1 | tee "$OUT/mosaic_bwd_tests.log" | tail -60
  timeout 90 python lab/tools/mosaic_bench.py --seq 2048 8192 16384 --head-dim 64 128 2>&1 | tee "$OUT/mosaic_bench.log"
  timeout 90 python lab/tools/mosaic_bwd_bench.py --seq 2048 8192 16384 --head-dim 64 128 2>&1 | tee "$OUT/mosaic_bwd_bench.log"
  # The same through the bench CLI, against cuDNN (forward: Mosaic; backward: Triton).
  timeout 110 $BENCH --seqlens 2048 8192 16384 --head-dims 64 128 --modes fwd fwd+bwd \
    --impls flash2-mosaic flash2-triton cudnn --out "$OUT/mosaic_cli" 2>&1 | tail -50
}

stage_features() {
  # Window and segments against plain causal, fwd and fwd+bwd (ms decide the
  # window target; TFLOP/s over visible pairs the segments target), with
  # causal 2k as the packed case's yardstick.
  timeout 170 $BENCH --seqlens 2048 16384 --head-dims 128 --causal true --modes fwd fwd+bwd \
    --window none 1024,0 --segments 1 8 --impls flash2-triton cudnn --out "$OUT/features_mask" 2>&1 | grep -v "^$" | tail -60
}

stage_tune() {
  # Forward only: the issue-2 gaps are fwd 459 vs 470 (non-causal) and 407 vs 420 (causal) at 8k.
  timeout 240 python lab/tools/tune.py --head-dim 128 --seq 8192 --kernels fwd --out "$OUT" 2>&1 | tee "$OUT/tune_fwd.log" | grep -E "BEST|cudnn"
}

stage_tune256() {
  # head_dim 256 has never been swept: its tiles were sized to fit, not measured.
  timeout 240 python lab/tools/tune.py --head-dim 256 --seq 8192 --out "$OUT" 2>&1 | tee "$OUT/tune_d256.log" | grep -E "BEST|cudnn"
}

stage_sharding() {
  # Every GPU visible: the sharding tests build the largest mesh that fits.
  timeout 200 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_sharding.py 2>&1 | tee "$OUT/sharding_tests.log" | tail -30
}

train_runs() {  # train_runs STEPS DIR "ATTENTION..." SEED... : runs per seed (the README's model)
  local steps=$1 dir=$2 attentions=$3
  shift 3
  local t="python examples/train_gpt.py --steps $steps --seq-len 1024 --d-model 512 --heads 8 --layers 4 --batch 16"
  for seed in "$@"; do
    for attention in $attentions; do
      # 120 s: the Mosaic kernels take ~30 s to compile into the train step.
      timeout 120 $t --eval-every $((steps / 4)) --attention "$attention" --seed "$seed" --out "$OUT/$dir" 2>&1 | grep -E "final"
    done
  done
}

stage_train() {
  train_runs 600 train "flash xla" 5 6
}

stage_mosaic_tests() {
  timeout 400 python -m pytest -m gpu -q --maxfail=5 -rfE -p no:cacheprovider --durations=5 tests/test_mosaic.py 2>&1 | tee "$OUT/mosaic_tests.log" | tail -30
}

run_shards() {  # run_shards NAME -k-EXPRESSION PYTEST-ARGS...
  # The GPU tests PYTEST-ARGS collect, in SHARDS parallel pytest processes
  # (default 4): a test's ~11 s is mostly compilation, on the CPU, so four
  # shards take about a quarter of one process's time. The shards take the
  # visible GPUs in turn, each allocating memory on demand so that shards
  # sharing a GPU fit. SHARD_IDS: a file of test ids to run instead (e.g.
  # those a cut-off run left). Each shard stops at SHARD_LIMIT seconds (330).
  local name=$1 k=$2 n=${SHARDS:-4} i ids gpus
  shift 2
  if [[ -n ${SHARD_IDS:-} ]]; then
    grep "::" "$SHARD_IDS" >"$OUT/${name}_ids.txt"
  else
    python -m pytest -m gpu --collect-only -q -p no:cacheprovider -k "$k" "$@" | grep "::" >"$OUT/${name}_ids.txt"
  fi
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
  fi
  echo "$(wc -l <"$OUT/${name}_ids.txt") tests in $n shards on GPUs ${gpus[*]}"
  for ((i = 0; i < n; i++)); do
    mapfile -t ids < <(awk -v n="$n" -v i="$i" 'NR % n == i' "$OUT/${name}_ids.txt")
    ((${#ids[@]})) || continue  # no ids would run the whole directory
    CUDA_VISIBLE_DEVICES=${gpus[i % ${#gpus[@]}]} XLA_PYTHON_CLIENT_PREALLOCATE=false \
      timeout "${SHARD_LIMIT:-330}" python -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=3 "${ids[@]}" \
      >"$OUT/${name}_shard_$i.log" 2>&1 &
  done
  wait
  grep -hE "FAILED|ERROR" "$OUT"/"${name}"_shard_*.log; tail -qn 1 "$OUT"/"${name}"_shard_*.log
}

stage_mosaic_shards() {
  # Every Mosaic GPU test (both files) in shards (run_shards). SHARD_K narrows
  # the selection (default: all but the three-consumer tests, which
  # d64_consumers3 runs). Run it in a stream (N:mosaic_shards) to keep it to
  # one GPU.
  run_shards mosaic "${SHARD_K:-not three_consumers}" tests/test_mosaic.py tests/test_mosaic_wide.py
}

stage_suite_shards() {
  # The whole GPU suite but the sharding tests (which want every GPU in one
  # process: stage sharding) in shards over every visible GPU. ~300 tests;
  # SHARDS=16 on two H200s.
  run_shards suite "${SHARD_K:-}" tests --deselect tests/test_sharding.py
}

mosaic_api() {  # mosaic_api NAME -k-EXPRESSION
  timeout 540 python -m pytest -m gpu -q --maxfail=5 -rfE -p no:cacheprovider --durations=5 tests/test_gpu.py \
    -k "$2" 2>&1 | tee "$OUT/mosaic_api_$1.log" | tail -30
}

stage_mosaic_api() {
  # flash_attention(backend="mosaic" / "auto") against the float32 reference, the Triton path's bar.
  mosaic_api all mosaic
}

# The same, split for two GPUs: backend="mosaic" (with fp16, GQA and the 16k
# determinism case), and backend="auto" (at whole blocks the same kernels).
stage_mosaic_api_mosaic() { mosaic_api mosaic "mosaic and not auto"; }
stage_mosaic_api_auto() { mosaic_api auto "mosaic_bf16 and auto"; }
stage_mosaic_api_auto_v() {  # the same, each test named (-v)
  timeout 300 python -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_gpu.py -k "mosaic_bf16 and auto" 2>&1 \
    | tee "$OUT/mosaic_api_auto.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
}

stage_train_1k() {
  # 1000 steps: past the plateau's seed-dependent escape (steps 200-600), before
  # the small corpus is overfitted (validation loss is lowest at 750-1000;
  # 2000-step runs overfit it).
  train_runs 1000 train1k "flash xla" 0 1 2 3
}

stage_train_1k_f32() {
  # The control for the flash - XLA gap at 1000 steps: Flax's attention in
  # float32 (the math the kernels approximate) against bf16 XLA's rounding.
  train_runs 1000 train1k xla-f32 0 1 2 3
}

stage_mosaic_rest() {
  timeout 90 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "mosaic_grouped or mosaic_gradients" 2>&1 | tail -5
}

stage_bench128() {
  # The README table: jax_flash2 as users get it (auto), its Triton path, cuDNN and XLA, one run per mask.
  for causal in false true; do
    timeout 150 $BENCH --seqlens 2048 4096 8192 16384 --head-dims 128 --causal $causal --modes fwd fwd+bwd \
      --impls flash2 flash2-triton cudnn --out "$OUT/bench_d128_causal_$causal" 2>&1 | grep -E "^ +[0-9]+ |== "
  done
}

stage_bench64() {
  timeout 250 $BENCH --seqlens 2048 4096 8192 16384 --head-dims 64 --modes fwd fwd+bwd \
    --impls flash2 flash2-triton cudnn --out "$OUT/bench_d64" 2>&1 | grep -v "^$" | tail -30
}

stage_adder_warps() {
  # The d64 fused backward with two warps adding dQ (dq_adder_warps=2, one
  # per consumer's pieces) against one. Its tests first:
  #   SHARDS=2 SHARD_K=two_adder_warps bash lab/gpu_session.sh 0:mosaic_shards wait adder_warps
  # ~3 min.
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --variants default dq_adder_warps=2 \
    2>&1 | tee "$OUT/adder_warps.log"
}

stage_adder_warps128() {
  # The d128 fused kernel with two adder warps, one per consumer's half of
  # the columns (session 15: level with the two kernels without a mask,
  # 12-19% behind causal), against one and the two kernels (the d128 default); and taking turns at
  # whole-width pieces (dq_turns). Its tests first:
  #   SHARDS=4 SHARD_K="two_adder_warps and d128" bash lab/gpu_session.sh 0:mosaic_shards wait adder_warps128
  # ~5 min.
  local f=fused_dq=1+dq_adder_warp=1+dkv_persistent=0+stages=2
  timeout 230 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --variants default $f \
    $f+dq_adder_warps=2 $f+dq_adder_warps=2+dq_turns=1 2>&1 | tee "$OUT/adder_warps128.log"
}

stage_balanced() {
  # The causal persistent forward with its tiles from the balanced table
  # (MosaicConfig.balanced, the default from session 15) against the paired
  # schedule, each twice (the rounds' spread); then early_q again at d128,
  # whose first run (session 15, call 1) was 2-7% faster at 2k, 8k and 16k
  # but 5% slower at 4k. Its tests first:
  #   SHARDS=4 SHARD_K=gpu_balanced bash lab/gpu_session.sh 0:mosaic_shards wait balanced
  # ~3 min.
  timeout 150 python lab/tools/mosaic_bench.py --no-triton --per-length --causal yes --seq 2048 4096 8192 16384 \
    --head-dim 64 128 --variants default balanced=0 default balanced=0 2>&1 | tee "$OUT/balanced.log"
  timeout 120 python lab/tools/mosaic_bench.py --no-triton --per-length --seq 2048 4096 8192 16384 --head-dim 128 \
    --variants default early_q=1 default early_q=1 2>&1 | tee "$OUT/early_q128.log"
}

stage_balanced_bwd() {
  # The causal d128 backward (dQ and dK/dV kernels) with their tiles from
  # the balanced table (BackwardConfig.balanced, the default from session
  # 15) against pairs, each twice; then three consumers for the d64 causal
  # forward at 2k-4k, which lost to two with paired tiles (sessions 8, 13)
  # but whose 22 and 11 Q blocks a head paired unevenly. Its tests first:
  #   SHARDS=6 SHARD_K="bwd_gpu_persistent and causal or bwd_gpu_matches_reference and causal-128" \
  #     bash lab/gpu_session.sh 0:mosaic_shards wait balanced_bwd
  # ~4 min.
  timeout 220 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --causal yes \
    --variants default balanced=0 default balanced=0 2>&1 | tee "$OUT/balanced_bwd.log"
  timeout 90 python lab/tools/mosaic_bench.py --no-triton --per-length --causal yes --seq 2048 4096 --head-dim 64 \
    --variants default block_q=192+consumers=3 default block_q=192+consumers=3 2>&1 | tee "$OUT/three_causal.log"
}

stage_three4k() {
  # The d64 causal forward at 4k, two consumers (the default) against three,
  # in the kernel bench and then through the bench CLI's timing in the same
  # run (session 15: the two tools disagreed across runs). ~1.5 min.
  timeout 60 python lab/tools/mosaic_bench.py --no-triton --per-length --causal yes --seq 4096 --head-dim 64 \
    --variants default block_q=192+consumers=3 2>&1 | tee "$OUT/three4k.log"
}

stage_cli_ab64() {
  # The d64 causal forward at 4k through the bench CLI's own timing
  # (lab/tools/cli_ab.py), cuDNN in the same run: two consumers (the default)
  # against three, with and without early_q, in both orders (session 15:
  # the kernel bench and the CLI disagreed by 3-5%). ~3 min.
  local three=block_q=192+consumers=3
  for order in "two three" "three two"; do
    local args=()
    for name in $order; do
      [[ $name == two ]] && args+=(--fwd two=default --fwd two_q=early_q=1)
      [[ $name == three ]] && args+=(--fwd three=$three --fwd three_q=$three+early_q=1)
    done
    timeout 120 python lab/tools/cli_ab.py "${args[@]}" -- --seqlens 4096 --head-dims 64 --causal true --modes fwd \
      --iters 30 --no-check --no-progress --out "$OUT/cli_ab64_${order// /_}" 2>&1 | cli_rows
  done
}

stage_cli_ab128() {
  # The d128 forward+backward through the bench CLI without a mask: the two
  # kernels (the default) against the same with the dK/dV kernel's
  # softmax_overlap (session 16, kernel bench: 0-1.2% faster) and against
  # the fused kernel with two adder warps (session 15, kernel bench:
  # level), cuDNN in the same run. ~4 min.
  local fused=fused_dq=1+dq_adder_warp=1+dq_adder_warps=2+dkv_persistent=0+stages=2
  timeout 260 python lab/tools/cli_ab.py --bwd two=default --bwd overlap=softmax_overlap=1 --bwd fused=$fused -- \
    --seqlens 4096 16384 --head-dims 128 --causal false --modes fwd+bwd --no-check --no-progress \
    --out "$OUT/cli_ab128" 2>&1 | cli_rows
}

stage_overlap128() {
  # The d128 dK/dV kernel's softmax_overlap against the default, kernel
  # bench, 4k-16k, both masks, two runs (the tool keeps one row per variant
  # name). ~4 min.
  for run in 1 2; do
    timeout 120 python lab/tools/mosaic_bwd_bench.py --seq 4096 8192 16384 --head-dim 128 --variants default \
      softmax_overlap=1 2>&1 | tee "$OUT/overlap128_$run.log"
  done
}

stage_bwd_ab128() {
  # The d128 backward kernels, kernel bench: the default against the dK/dV
  # kernel's softmax_overlap (session 5: 1-11% slower, before persistent
  # CTAs) and the dQ kernel on 128-row K/V blocks (S = 64 x 128 per
  # consumer, Q and dO from shared memory, not persistent: no spills on
  # sm_90a without a mask, 36-60 B causal). ~3 min.
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --variants default \
    softmax_overlap=1 block_kv=128+dq_persistent=0+q_registers=0 2>&1 | tee "$OUT/bwd_ab128.log"
}

ncu_profile() {  # ncu_profile NAME KERNEL-REGEX LIMIT [lab/tools/ncu_profile.py ARGS]
  # Nsight Compute's counters (full set, clocks left alone) for the kernels
  # matching KERNEL-REGEX in one forward+backward of each implementation
  # (lab/tools/ncu_profile.py); the details, raw and per-SASS-instruction
  # (source) pages into $OUT/NAME_*.
  local name=$1 kernels=$2 limit=$3 ncu
  shift 3
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: $ncu"; [[ -n $ncu ]] || return
  PYTHONUNBUFFERED=1 timeout "$limit" "$ncu" --clock-control none --profile-from-start off --set full \
    -k "regex:$kernels" -f -o "$OUT/$name" python lab/tools/ncu_profile.py "$@" 2>&1 | grep -v "^==PROF==" | tail -15
  "$ncu" --import "$OUT/$name.ncu-rep" --page details >"$OUT/${name}_details.txt" 2>&1
  "$ncu" --import "$OUT/$name.ncu-rep" --page raw --csv >"$OUT/${name}_raw.csv" 2>&1
  "$ncu" --import "$OUT/$name.ncu-rep" --page source --print-source sass --csv >"$OUT/${name}_source.csv" 2>&1
  grep -E "^  [a-z_]|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Block Size|Dynamic Shared|Theoretical Occ" \
    "$OUT/${name}_details.txt" | head -60
  local size; size=$(stat -c %s "$OUT/$name.ncu-rep" 2>/dev/null || echo 0)
  ((size > 12000000)) && rm -f "$OUT/$name.ncu-rep"  # the device returns files of 16 MiB at most
}

stage_ncu128() {
  # Our default's d128 kernels (forward, dK/dV, dQ) and cuDNN's (fprop,
  # bprop) at 4k without a mask. What bounds each kernel: tensor pipe,
  # shared memory, stalls, per SASS instruction in the source page.
  # (Session 16 added the fused backward, whose profiling failed and ended
  # the process before cuDNN's turn; it is left out.) ~7 min: give it a
  # call of its own.
  ncu_profile ncu128 "flash2_(fwd|bwd_d)|sdpa|prop" 480 --seq 4096 --head-dim 128 --bwd two=default
}

stage_ncu_cudnn128() {
  # cuDNN's kernels alone (ours run unprofiled), d128 4k without a mask:
  # how its bprop (64x64x128 tiles, dQ summed in float32) feeds the tensor
  # pipe, its registers, CTAs per SM and reduce traffic. ~3 min.
  ncu_profile ncu_cudnn128 "prop|dot_do_o|convert_dq" 240 --seq 4096 --head-dim 128
}

stage_early_vectors() {
  # lse and delta loaded before the wait for S^T and dP^T in the dK/dV
  # kernel and the fused one (BackwardConfig.early_vectors; session 16's
  # Nsight Compute: ~7% of the d128 dK/dV consumers' time waits on those
  # loads; sm_90a: d128 8 B spilled without a mask, 200-260 B causal against
  # 76-148; d64 fused as before). Kernel bench, d64 and d128, both masks,
  # off against on (on in the d64 default since session 17). Its tests first:
  #   SHARDS=8 SHARD_K=bwd_gpu_early_vectors bash lab/gpu_session.sh 0:mosaic_shards wait early_vectors
  # ~4 min.
  timeout 230 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 128 --variants early_vectors=0 \
    early_vectors=1 2>&1 | tee "$OUT/early_vectors.log"
}

stage_cli_ev128() {
  # The d128 forward+backward through the bench CLI, both masks: the
  # default against early_vectors, cuDNN in the same run. ~3 min.
  timeout 190 python lab/tools/cli_ab.py --bwd two=default --bwd ev=early_vectors=1 -- \
    --seqlens 4096 16384 --head-dims 128 --causal false true --modes fwd+bwd --no-check --no-progress \
    --out "$OUT/cli_ev128" 2>&1 | cli_rows
}

stage_cli_ev64() {
  # The d64 forward+backward through the bench CLI, both masks, 2k-16k: the
  # fused kernel without early_vectors against with it (kernel bench: 1-2%
  # faster causal; on in the default since session 17), cuDNN in the same
  # run. ~3 min.
  timeout 200 python lab/tools/cli_ab.py --bwd off=early_vectors=0 --bwd ev=early_vectors=1 -- \
    --seqlens 2048 4096 8192 16384 --head-dims 64 --causal false true --modes fwd+bwd --no-check --no-progress \
    --out "$OUT/cli_ev64" 2>&1 | cli_rows
}

stage_determinism() {
  # Run-to-run bits of cuDNN's forward+backward and ours (d128 4k, both
  # masks), by default and with XLA's --xla_gpu_deterministic_ops (which
  # asks cuDNN for its deterministic backward; lab/tools/determinism_check.py),
  # then the bench CLI at d128 fwd+bwd under that flag: cuDNN at the same
  # guarantee as ours. ~4 min.
  local det=--xla_gpu_deterministic_ops=true
  for flags in "" "$det"; do
    for causal in "" --causal; do
      XLA_FLAGS="$flags" timeout 100 python lab/tools/determinism_check.py --impls cudnn flash2 --seq 4096 --head-dim 128 \
        --runs 10 $causal 2>&1 | grep -v "^WARNING\|^$" | tee -a "$OUT/determinism.log"
    done
  done
  XLA_FLAGS="$det" timeout 150 $BENCH --seqlens 2048 4096 8192 16384 --head-dims 128 --causal false true \
    --modes fwd+bwd --impls flash2 cudnn --no-check --no-progress --out "$OUT/bench_d128_deterministic" 2>&1 \
    | cli_rows
}

stage_bench_det() {
  # The bench CLI's forward+backward at d128 and d64 against cuDNN and
  # cuDNN's deterministic backward (impl cudnn-deterministic: compiled with
  # xla_gpu_deterministic_ops), both masks; first the run-to-run bits of
  # that implementation (lab/tools/determinism_check.py). ~5 min.
  timeout 80 python lab/tools/determinism_check.py --impls cudnn-deterministic --seq 4096 --head-dim 128 --runs 10 \
    2>&1 | grep -v "^WARNING\|^$" | tee "$OUT/determinism_impl.log"
  local d
  for d in 128 64; do
    timeout 200 $BENCH --seqlens 2048 4096 8192 16384 --head-dims $d --causal false true --modes fwd+bwd \
      --impls flash2 cudnn cudnn-deterministic --no-check --out "$OUT/bench_det_d$d" 2>&1 | cli_rows
  done
}

stage_early_q() {
  # The persistent forward loading each next tile's Q at the current tile's
  # start (MosaicConfig.early_q; session 15: within noise), against the
  # default, from the API's per-length defaults: d64
  # (causal 4k-8k at 0.96-0.97x cuDNN) and d128. Its tests first:
  #   SHARDS=4 SHARD_K=gpu_early_q bash lab/gpu_session.sh 0:mosaic_shards wait early_q
  # ~4 min.
  timeout 230 python lab/tools/mosaic_bench.py --no-triton --per-length --seq 2048 4096 8192 16384 --head-dim 64 128 \
    --variants default early_q=1 2>&1 | tee "$OUT/early_q.log"
}

stage_bench64_odd() {
  # The bench CLI at d64 at lengths whose K/V blocks per head do not divide
  # the SMs (6144, 12288: the fused backward's filled rounds, session 14). ~3 min.
  timeout 200 $BENCH --seqlens 6144 12288 --head-dims 64 --modes fwd fwd+bwd \
    --impls flash2 flash2-triton cudnn --out "$OUT/bench_d64_odd" 2>&1 | grep -v "^$" | tail -20
}

stage_gqa_vs_mha() {
  # The issue-5 target compares per query head: MHA and GQA 32/8 in one run.
  for kv in 32 8; do
    timeout 80 $BENCH --seqlens 4096 16384 --head-dims 64 --heads 32 --kv-heads $kv --modes fwd fwd+bwd \
      --impls flash2 flash2-triton --no-check --out "$OUT/gqa_kv$kv" 2>&1 | grep -E "^ +[0-9]+ " 
  done
}

stage_overlap_ab() {
  # MosaicConfig.softmax_overlap off and on, in one run, with the Triton forward.
  timeout 200 python lab/tools/mosaic_bench.py --variants softmax_overlap=0 default --seq 2048 8192 16384 \
    --head-dim 64 128 2>&1 | tee "$OUT/overlap_ab.log"
}

stage_persistent() {
  # MosaicConfig.persistent and .pingpong (session 5, CPU-checked): their GPU
  # tests, then the four combinations in one run (the short sequences are
  # where a tile's start and end weigh).
  timeout 200 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k "gpu_persistent or gpu_pingpong" 2>&1 | tee "$OUT/persistent_tests.log" | tail -20
  timeout 280 python lab/tools/mosaic_bench.py --no-triton --seq 2048 4096 8192 16384 --head-dim 64 128 \
    --variants default persistent=1 pingpong=1 persistent=1+pingpong=1 2>&1 | tee "$OUT/persistent_ab.log"
}

stage_bwd_overlap() {
  # BackwardConfig.softmax_overlap (session 4, CPU-checked only): its GPU tests,
  # then off/on in one run against the Triton backward.
  timeout 200 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k bwd_gpu_softmax_overlap 2>&1 | tee "$OUT/bwd_overlap_tests.log" | tail -20
  timeout 300 python lab/tools/mosaic_bwd_bench.py --variants kernels=2 kernels=2+softmax_overlap=1 --seq 2048 8192 16384 \
    --head-dim 64 128 2>&1 | tee "$OUT/bwd_overlap_ab.log"
}

stage_mosaic_fwd_tests() {
  # The Mosaic forward kernel's own GPU tests (default config and variants).
  timeout 300 python -m pytest -m gpu -q --maxfail=5 -rfE -p no:cacheprovider --durations=5 tests/test_mosaic.py \
    -k "not bwd and not backend" 2>&1 | tee "$OUT/mosaic_fwd_tests.log" | tail -30
}

stage_d256_tests() {
  # head_dim 256 (its swept tiles), masks and bias beside them, packed segments.
  timeout 330 python -m pytest -m gpu -q --maxfail=5 -rfE -p no:cacheprovider --durations=5 tests/test_gpu.py \
    -k "(bf16_matches_reference and 256) or dense_mask or bias or packed_segments" 2>&1 | tee "$OUT/d256_tests.log" | tail -30
}

stage_d256_bwd_tests() {
  # 14 tests, ~15 s each (session 7: 150 s ran 10 of them).
  timeout 330 python -m pytest -m gpu -v --maxfail=3 -rfE -p no:cacheprovider --durations=5 \
    tests/test_mosaic_wide.py 2>&1 | tee "$OUT/d256_bwd_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
}

stage_d256_cli() {
  # head_dim 256 through the bench CLI, Mosaic (both passes) against Triton
  # and cuDNN: decides config.hopper_choice at 256. ~3 min.
  timeout 200 $BENCH --seqlens 2048 8192 --head-dims 256 --modes fwd fwd+bwd --impls flash2-mosaic flash2-triton \
    cudnn --out "$OUT/d256_cli" 2>&1 | grep -v "^$" | tail -40
}

stage_d256_persistent() {
  # backward_wide.py's kernels as persistent CTAs (one set of outer tiles):
  # their GPU tests, then the A/B per kernel (dkv ms, dq ms). ~2 min.
  timeout 90 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic_wide.py -k persistent 2>&1 \
    | tee "$OUT/d256_persistent_tests.log" | tail -5
  timeout 100 python lab/tools/mosaic_bwd_bench.py --seq 2048 8192 --head-dim 256 --variants default dq_persistent=1 \
    dq_persistent=1+dkv_persistent=1 2>&1 | tee "$OUT/d256_persistent_ab.log"
}

stage_d256_bwd() {
  # The head_dim-256 Mosaic backward (backward_wide.py), never run on a GPU
  # before: its tests first (a hang, a barrier phase gone wrong, shows as the
  # timeout), then its kernels against the Triton backward, then the backward
  # pass through the bench CLI against cuDNN ("auto" stays on Triton at d256
  # until this says otherwise). ~5 min.
  stage_d256_bwd_tests
  timeout 120 python lab/tools/mosaic_bwd_bench.py --seq 2048 8192 --head-dim 256 2>&1 | tee "$OUT/d256_bwd_bench.log"
  timeout 120 $BENCH --seqlens 2048 8192 --head-dims 256 --modes bwd --impls flash2-mosaic flash2-triton cudnn \
    --out "$OUT/d256_bwd_cli" 2>&1 | grep -v "^$" | tail -30
}

stage_verify_fwd() {
  # The Mosaic forward's GPU tests beyond the default-config ones, named one
  # by one (-v): persistent (causal tiles in pairs, odd Q-block counts),
  # variants and the overlap, with the session-5 defaults.
  timeout 300 python -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k "gpu_persistent or gpu_variants or (gpu_softmax_overlap and not bwd)" 2>&1 | tee "$OUT/verify_fwd.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed"
}

stage_persistent_causal() {
  # The causal persistent schedule (tiles in pairs of equal work) against the
  # one-CTA-per-tile grid, kernel alone.
  timeout 150 python lab/tools/mosaic_bench.py --no-triton --causal yes --seq 2048 4096 8192 16384 --head-dim 64 128 \
    --variants persistent=0 default 2>&1 | tee "$OUT/persistent_causal_ab.log"
}

stage_bwd_persistent() {
  # BackwardConfig.dq_persistent and .dkv_persistent (session 5, CPU-checked):
  # their GPU tests, then A/B. At d128 the second buffers cost a ring slot
  # (stages 3 -> 2), so stages=2 alone is timed beside them.
  timeout 200 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k bwd_gpu_persistent 2>&1 | tee "$OUT/bwd_persistent_tests.log" | tail -20
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    stages=2 stages=2+dq_persistent=1 stages=2+dkv_persistent=1 stages=2+dq_persistent=1+dkv_persistent=1 2>&1 \
    | tee "$OUT/bwd_persistent_ab.log"
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 64 --variants default \
    dq_persistent=1 dkv_persistent=1 dq_persistent=1+dkv_persistent=1 2>&1 | tail -n +3 | tee -a "$OUT/bwd_persistent_ab.log"
}

stage_fused() {
  # BackwardConfig.fused_dq (session 6; its semaphores and TMA reduce-adds run
  # only here): GPU tests, split and turns (a deadlock shows as the timeout),
  # then the d128 A/B (split; turns lost in session 7) against the two-kernel
  # backward; fused64 has d64's.
  timeout 320 python -m pytest -m gpu -q --maxfail=2 -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k bwd_gpu_fused 2>&1 | tee "$OUT/fused_tests.log" | tail -20
  [ "${PIPESTATUS[0]}" = 124 ] && { echo "fused tests timed out (a deadlock?): no timing"; return; }
  # The fused kernel keeps one set of K/V tiles at d128 (shared memory), two at d64.
  timeout 220 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    fused_dq=1+dkv_persistent=0 2>&1 | tee "$OUT/fused_ab.log"
}

stage_bwd_stages3() {
  # A third ring slot in both d128 backward kernels beside the persistent
  # CTAs' second outer tiles (fits since session 7's measured reserve; the
  # profile had their consumers waiting 10-13% for the ring), its GPU test,
  # then the A/B (dkv ms and dq ms apart: the dK/dV kernel spills 160 B with
  # three slots, non-causal). ~3 min.
  timeout 60 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py -k d128_three_slots 2>&1 \
    | tee "$OUT/bwd_stages3_tests.log" | tail -3
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    stages=3 2>&1 | tee "$OUT/bwd_stages3_ab.log"
}

stage_fused_traffic() {
  # How fast the fused kernel would run with half (adders=2) or none
  # (adders=0) of its float32 reduce-adds into dQ (backward.dq_addition_
  # experiment; dQ comes out wrong, the max rel diff column says so): decides
  # whether two CTAs summing their pieces before one reduce-add (a cluster)
  # is worth building. ~2 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --variants default \
    fused_dq=1+dkv_persistent=0 fused_dq=1+dkv_persistent=0+adders=2 fused_dq=1+dkv_persistent=0+adders=0 2>&1 \
    | tee "$OUT/fused_traffic.log"
}

stage_fused_unordered() {
  # Half or none of the fused kernel's reduce-adds made it no faster (session
  # 8, call 1): is it their order? The same without the waits for it
  # (dq_addition_experiment(ordered=False): nondeterministic dQ, speed only),
  # with and without the reduce-adds. ~2 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --causal no --variants default \
    fused_dq=1+dkv_persistent=0 fused_dq=1+dkv_persistent=0+unordered=1 \
    fused_dq=1+dkv_persistent=0+unordered=1+adders=0 2>&1 | tee "$OUT/fused_unordered.log"
}

stage_d64_consumers3_unpadded() {
  # Three consumers at 4k (the threshold) and at 8k-16k without the padding
  # copy to multiples of 192 (whole 64-row tiles go unpadded since session 8).
  timeout 150 python lab/tools/mosaic_bench.py --no-triton --seq 4096 8192 16384 --head-dim 64 --variants default \
    consumers=3+block_q=192 2>&1 | tee "$OUT/d64_consumers3_unpadded.log"
}

stage_fused64() {
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 64 --variants default \
    fused_dq=1 2>&1 | tee "$OUT/fused64_ab.log"
}

stage_profile_bwd() {
  # Mosaic's profiler on the backward kernels (lab/tools/mosaic_profile.py): time
  # per named region and warpgroup, the two kernels against the fused one.
  for causal in "" "--causal"; do
    timeout 120 python lab/tools/mosaic_profile.py --seq 2048 --head-dim 128 $causal \
      --variants default fused_dq=1+dkv_persistent=0 2>&1 | tee -a "$OUT/profile_bwd.log"
  done
}

stage_profile_fused_bare() {
  # Where the fused kernel with no dQ traffic and no order (unordered=1+adders=0:
  # wrong dQ) loses 26% to the two kernels at 4k while winning 9% at 16k
  # (session 8, call 2). ~1.5 min.
  timeout 120 python lab/tools/mosaic_profile.py --seq 4096 --head-dim 128 --batch 1 --heads 8 \
    --variants default fused_dq=1+dkv_persistent=0+unordered=1+adders=0 2>&1 | tee "$OUT/profile_fused_bare.log"
}

stage_profile_fwd64() {
  # The d64 forward (0.95-0.97x cuDNN at 8k-16k): where its warpgroups wait.
  for causal in "" "--causal"; do
    timeout 90 python lab/tools/mosaic_profile.py --kernel forward --seq 8192 --head-dim 64 --heads 4 $causal \
      2>&1 | tee -a "$OUT/profile_fwd64.log"
  done
}

stage_bwd_tests() {
  # The two-kernel Mosaic backward's GPU tests (plain and variants).
  timeout 200 python -m pytest -m gpu -q --maxfail=3 -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k "bwd_gpu_matches or bwd_gpu_variants" 2>&1 | tee "$OUT/bwd_tests.log" | tail -20
}

stage_bwd_persistent_rest() {
  # The rows bwd_persistent's time limit cut (session 6): 8k causal, 16k.
  timeout 100 python lab/tools/mosaic_bwd_bench.py --seq 16384 --head-dim 128 --variants default \
    stages=2+dq_persistent=1+dkv_persistent=1 2>&1 | tee "$OUT/bwd_persistent_rest.log"
  timeout 100 python lab/tools/mosaic_bwd_bench.py --seq 8192 16384 --head-dim 64 --variants default \
    dq_persistent=1+dkv_persistent=1 2>&1 | tail -n +3 | tee -a "$OUT/bwd_persistent_rest.log"
}

stage_d64_consumers3() {
  # Three consumer warpgroups in the d64 forward (MosaicConfig.consumers,
  # session 7, CPU-checked): GPU tests, then the A/B against the default
  # (block_kv 64 compiles without spills in the causal kernel, 128 spills
  # 216 B). ~3 min.
  timeout 120 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py -k three_consumers 2>&1 \
    | tee "$OUT/d64_consumers3_tests.log" | tail -5
  timeout 150 python lab/tools/mosaic_bench.py --no-triton --seq 2048 8192 16384 --head-dim 64 --variants default \
    consumers=3+block_q=192 consumers=3+block_q=192+block_kv=64 2>&1 | tee "$OUT/d64_consumers3_ab.log"
}

stage_d64_dq_consumers3() {
  # Three consumer warpgroups in the d64 dQ kernel (BackwardConfig.dq_consumers;
  # block_kv 64, the 128 of the default spills 256-788 B with three): GPU
  # tests, then the A/B (dq ms). ~3 min.
  timeout 120 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py -k three_dq_consumers 2>&1 \
    | tee "$OUT/d64_dq_consumers3_tests.log" | tail -5
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 64 --variants \
    dq_consumers=2+block_kv=128 dq_consumers=3+block_kv=64 2>&1 | tee "$OUT/d64_dq_consumers3_ab.log"
}

dq_overlap() {  # dq_overlap HEAD_DIM
  # The softmax under dP's wgmma in the dQ kernel alone: session 5 timed
  # BackwardConfig.softmax_overlap in both kernels (dK/dV lost 1-11%, dQ
  # gained up to 11%); the dq ms column of softmax_overlap=1 is the dQ
  # kernel's part. ~2 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim "$1" --variants kernels=2 \
    kernels=2+softmax_overlap=1 2>&1 | tee "$OUT/dq_overlap$1.log"
}
stage_dq_overlap64() { dq_overlap 64; }
stage_dq_overlap128() { dq_overlap 128; }

stage_registers64() {
  # The dQ kernel's score products with Q and dO in registers
  # (BackwardConfig.q_registers, the default since session 9; kv_registers,
  # the dK/dV kernel's, was removed: ptxas 13.0 miscompiles it without a
  # causal mask, lab/NOTES.md session 10). GPU
  # tests, then the A/B at d64 (dkv ms, dq ms). ~3 min.
  timeout 150 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py -k "registers" 2>&1 \
    | tee "$OUT/registers_tests.log" | tail -5
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 64 --variants default \
    q_registers=0 2>&1 | tee "$OUT/registers64_ab.log"
}

stage_registers128() {
  # The same at d128, where only the dQ kernel's fit (no spills). ~2 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    q_registers=0 2>&1 | tee "$OUT/registers128_ab.log"
}

stage_fwd_registers() {
  # The forward's Q in registers for S = Q K^T (MosaicConfig.q_registers;
  # two consumers only: three spill): its GPU tests, then the A/B where two
  # consumers run (d64 up to 4k, d128). ~3 min.
  timeout 100 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py -k "q_registers and not bwd" \
    2>&1 | tee "$OUT/fwd_registers_tests.log" | tail -5
  timeout 80 python lab/tools/mosaic_bench.py --no-triton --seq 2048 4096 --head-dim 64 --variants default \
    q_registers=1 2>&1 | tee "$OUT/fwd_registers_ab.log"
  timeout 100 python lab/tools/mosaic_bench.py --no-triton --seq 2048 8192 16384 --head-dim 128 --variants default \
    q_registers=1 2>&1 | tee -a "$OUT/fwd_registers_ab.log"
}

stage_registers_ab() {
  # registers64, registers128 and fwd_registers without their tests (run
  # them first as N:mosaic_shards with SHARD_K=registers, in parallel): the
  # A/B of every operand held in registers, in one stream. ~6 min.
  timeout 170 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 64 --variants default \
    q_registers=0 2>&1 | tee "$OUT/registers64_ab.log"
  timeout 120 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    q_registers=0 2>&1 | tee "$OUT/registers128_ab.log"
  timeout 70 python lab/tools/mosaic_bench.py --no-triton --seq 2048 4096 --head-dim 64 --variants default \
    q_registers=1 2>&1 | tee "$OUT/fwd_registers_ab.log"
  timeout 80 python lab/tools/mosaic_bench.py --no-triton --seq 2048 8192 16384 --head-dim 128 --variants default \
    q_registers=1 2>&1 | tee -a "$OUT/fwd_registers_ab.log"
}

stage_poly_ab() {
  # Part of each tile's exponentials as a polynomial on the FP32 units
  # (MosaicConfig.poly_columns, BackwardConfig.dkv_/dq_poly_columns;
  # poly_exp2.py): the d64 forward, where the SFU's ex2 takes as long as the
  # matmuls, then the d64 backward and the d128 forward. Tests first as
  # N:mosaic_shards with SHARD_K=poly. ~5 min.
  timeout 170 python lab/tools/mosaic_bench.py --no-triton --seq 2048 4096 16384 --head-dim 64 --variants default \
    poly_columns=16 poly_columns=32 poly_columns=48 2>&1 | tee "$OUT/poly64_fwd_ab.log"
  timeout 110 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --variants default \
    dq_poly_columns=16 dkv_poly_columns=16 2>&1 | tee "$OUT/poly64_bwd_ab.log"
  timeout 60 python lab/tools/mosaic_bench.py --no-triton --seq 4096 16384 --head-dim 128 --variants default \
    poly_columns=32 2>&1 | tee "$OUT/poly128_fwd_ab.log"
}

stage_dkv_ring128() {
  # The d128 dK/dV kernel with more ring slots instead of the persistent
  # CTAs' second K/V tiles (their 64 KiB hold two more Q/dO slots): its
  # consumers waited 10-13% for the ring (session 8), and at 4 slots it
  # compiles without spills (session 9). Read the dkv column: the dQ kernel
  # is made plain too, to fit 4 slots. ~2 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 16384 --head-dim 128 --variants default \
    stages=3+dkv_persistent=0+dq_persistent=0 stages=4+dkv_persistent=0+dq_persistent=0 2>&1 \
    | tee "$OUT/dkv_ring128.log"
}

stage_dkv_trace128() {
  # Mosaic's profiler on the d128 backward at 4k (defaults), traces kept:
  # whether the two dK/dV consumers run their softmaxes at the same time
  # (tensor cores idle) or under each other's matmuls (lab/tools/trace_overlap.py
  # reads the traces). Also the dK/dV kernel's softmax_overlap with today's
  # other defaults (lost 1-11% in session 5). ~3 min.
  for causal in "" "--causal"; do
    timeout 100 python lab/tools/mosaic_profile.py --seq 4096 --head-dim 128 --batch 1 --heads 8 $causal \
      --variants default --keep "$OUT/traces${causal:+_causal}" 2>&1 | tee -a "$OUT/dkv_trace128.log"
  done
  timeout 100 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --variants default \
    softmax_overlap=1 2>&1 | tee -a "$OUT/dkv_trace128.log"
}

stage_ring3_128() {
  # Both d128 backward kernels persistent with three ring slots instead of
  # two (session 8: within 2% per kernel, when the dK/dV kernel spilled
  # 160 B; sm_90a now: 12 B non-causal, 68 B causal, as with two). The
  # session-10 traces: the dK/dV consumers wait 12% for Q/dO, the dQ
  # consumers 9-11% for K/V. ~2.5 min.
  timeout 170 python lab/tools/mosaic_bwd_bench.py --seq 2048 4096 8192 16384 --head-dim 128 --variants default \
    stages=3 2>&1 | tee "$OUT/ring3_128.log"
}

stage_elementwise_ab() {
  # The backward kernels with and without their element-wise work
  # (elementwise=0: P = S, dS = dP; wrong gradients, speed only): what the
  # exponentials, scaling and conversions cost beyond the matmuls and the
  # ring. ~2.5 min.
  timeout 170 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 128 --variants default \
    elementwise=0 2>&1 | tee "$OUT/elementwise_ab.log"
}

sample_power() {  # sample_power FILE: SM clock and power every ~0.1 s into $OUT/FILE, in the background
  # (epoch seconds, SM clock MHz, max SM clock MHz, power W, power limit W,
  # temperature C); the caller kills $! when done.
  (while true; do echo "$(date +%s.%N),$(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,\
temperature.gpu --format=csv,noheader,nounits)"; sleep 0.1; done) >"$OUT/$1" 2>&1 &
}

stage_power_probe() {
  # Whether the backward kernels run at a power-limited clock: the SM clock
  # and power draw (nvidia-smi every 100 ms, epoch seconds in the second
  # column) while dK/dV and dQ run back to back with and without their
  # element-wise work (lab/tools/power_probe.py prints each run's window). ~1.5 min.
  sample_power power_smi.csv
  local sampler=$!
  timeout 80 python lab/tools/power_probe.py --kernel dkv --variants default elementwise=0 2>&1 | tee "$OUT/power_probe.log"
  timeout 60 python lab/tools/power_probe.py --kernel dq --variants default 2>&1 | tee -a "$OUT/power_probe.log"
  kill $sampler
}

stage_anatomy() {
  # cuDNN's forward+backward beside ours: the kernels each runs and their
  # times (lab/tools/kernel_anatomy.py, from a profiler trace), then the SM clock
  # and power while each runs back to back at 8k (as power_probe). ~3 min.
  timeout 150 python lab/tools/kernel_anatomy.py --impls cudnn flash2-mosaic --seq 4096 16384 --head-dim 128 2>&1 \
    | tee "$OUT/anatomy.log"
  timeout 90 python lab/tools/kernel_anatomy.py --impls cudnn flash2-mosaic --seq 8192 --head-dim 128 --causal 2>&1 \
    | tee -a "$OUT/anatomy.log"
  sample_power anatomy_smi.csv
  local sampler=$!
  timeout 90 python lab/tools/power_probe.py --kernel cudnn flash2-mosaic --seq 8192 --seconds 5 2>&1 | tee "$OUT/anatomy_power.log"
  kill $sampler
}

stage_fused_ablation() {
  # Where the fused kernel's time goes without any dQ traffic (session 8:
  # 26% slower than the two kernels at 4k, 9% faster at 16k): its bare form
  # (unordered=1+adders=0), then without the hand-over of the pieces to the
  # producer (staging=0: no f32 staging store, no handshake; the producer
  # only loads), then also without the wait for the other consumer's dS^T
  # (lockstep=0). Speed only: dQ is wrong in all but the first two. ~5 min.
  local f=fused_dq=1+dkv_persistent=0
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --causal no --variants default $f \
    $f+unordered=1+adders=0 $f+staging=0 $f+staging=0+lockstep=0 2>&1 | tee "$OUT/fused_ablation128.log"
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --causal no --variants default \
    $f+unordered=1+adders=0 $f+staging=0 $f+staging=0+lockstep=0 2>&1 | tee "$OUT/fused_ablation64.log"
}

stage_adder_warp() {
  # The fused kernel with its additions of dQ in the producer's second warp
  # (dq_adder_warp), so that the loads stop waiting behind them, against the
  # serial producer and the two kernels. Run its GPU tests first:
  #   SHARDS=8 SHARD_K=adder_warp bash lab/gpu_session.sh 0:mosaic_shards wait adder_warp
  # ~3.5 min.
  local f=fused_dq=1+dkv_persistent=0
  timeout 110 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --causal no --variants default $f \
    $f+dq_adder_warp=1 2>&1 | tee "$OUT/adder_warp64.log"
  timeout 110 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --causal no --variants default $f \
    $f+dq_adder_warp=1 2>&1 | tee "$OUT/adder_warp128.log"
}

stage_fused64_warp() {
  # The d64 fused kernel as fused_backward_config has it (persistent CTAs
  # with a second set of K/V tiles, 4 ring slots), with and without the
  # adder warp, against the two kernels, both masks. ~3.5 min.
  timeout 200 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --variants default fused_dq=1 \
    fused_dq=1+dq_adder_warp=1 2>&1 | tee "$OUT/fused64.log"
}

stage_traffic64() {
  # The d64 fused kernel with its adder warp, with all, half (adders=2) or
  # none (adders=0) of its reduce-adds, and without any hand-over
  # (staging=0): what a cluster pair that halves the traffic could gain.
  # Speed only (dQ wrong but in the first). ~2.5 min.
  local f=fused_dq=1+dq_adder_warp=1
  timeout 170 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --causal no --variants default $f \
    $f+adders=2 $f+adders=0 $f+staging=0 2>&1 | tee "$OUT/traffic64.log"
}

stage_fused64_kv() {
  # The d64 fused kernel (adder warp) with K and V in registers for S^T and
  # dP^T (kv_registers), against it without and the two kernels, both
  # masks. Its GPU tests first:
  #   SHARDS=4 SHARD_K=fused_dq_kv_registers bash lab/gpu_session.sh 0:mosaic_shards wait fused64_kv
  # ~3.5 min.
  local f=fused_dq=1+dq_adder_warp=1
  timeout 230 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --variants default $f \
    $f+kv_registers=1 2>&1 | tee "$OUT/fused64_kv.log"
}

stage_fused64_default() {
  # The d64 default (the fused kernel, adder warp, K and V in registers)
  # against the two kernels at 2k and 8k, the lengths fused64_kv left out;
  # then the bench CLI at d64 (bench64). Its tests first:
  #   SHARDS=8 SHARD_IDS=lab/results/session12/call2_test_ids.txt bash lab/gpu_session.sh 0:mosaic_shards \
  #     wait fused64_default
  # ~6 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 2048 8192 --head-dim 64 --variants default \
    fused_dq=0+dq_adder_warp=0+kv_registers=0 2>&1 | tee "$OUT/fused64_default.log"
  stage_bench64
}

stage_pair_share() {
  # What a cluster pair taking turns at adding dQ would leave each CTA:
  # every tile adds at every other step, its neighbour at the others
  # (adders=2+alternate=1), against all (the kernel), half the tiles
  # (adders=2) and none (adders=0). d64: the default (fused); d128: the
  # fused kernel with its adder warp. Speed only (dQ wrong but in the
  # first two rows of each). ~5 min.
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --causal no --variants default \
    adders=2+alternate=1 adders=2 adders=0 2>&1 | tee "$OUT/pair_share64.log"
  local f=fused_dq=1+dkv_persistent=0+dq_adder_warp=1
  timeout 150 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 128 --causal no --variants default $f \
    $f+adders=2+alternate=1 $f+adders=0 2>&1 | tee "$OUT/pair_share128.log"
}

stage_three2k() {
  # The d64 forward with three consumers from 2k without a mask (the default
  # since session 13): its GPU tests, then two against three consumers at
  # 512-2k (kernel alone), then the bench CLI at d64 (bench64). ~6 min.
  timeout 120 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_mosaic.py \
    -k three_consumers_from_2k 2>&1 | tail -3
  timeout 60 python lab/tools/mosaic_bench.py --no-triton --seq 512 1024 2048 --head-dim 64 --causal no --variants \
    default consumers=3+block_q=192 2>&1 | tee "$OUT/three2k.log"
  stage_bench64
}

stage_fill_rounds() {
  # The d64 fused backward's schedule: rounds filled with heads split across
  # them (the default since session 14) against whole heads per round
  # (whole_heads=1), at lengths where whole heads leave SMs idle (6144:
  # 96 of 132 CTAs; 12288: 96), and at 4k/16k where the two agree. Its
  # tests first:
  #   SHARDS=3 SHARD_K="heads_across_rounds or fused_dq_kv_registers" bash lab/gpu_session.sh \
  #     0:mosaic_shards wait fill_rounds
  # ~4 min.
  timeout 300 python lab/tools/mosaic_bwd_bench.py --seq 6144 12288 --head-dim 64 --variants default whole_heads=1 \
    2>&1 | tee "$OUT/fill_rounds.log"
  timeout 120 python lab/tools/mosaic_bwd_bench.py --seq 4096 16384 --head-dim 64 --causal no --variants default \
    2>&1 | tee -a "$OUT/fill_rounds.log"
}

stage_gpt_flash() {
  # The example GPT (head_dim 64: the fused backward since session 12), 1000
  # steps, seed 0, flash only: against lab/results/examples/steps1000. ~1 min.
  train_runs 1000 gpt_flash flash 0
}

stage_wgmma() {
  # lab/tools/wgmma_bench.py: wgmma's throughput with A in shared memory or in
  # registers, N 64-256, one or two warpgroups per SM (tests session 8's
  # shared-memory model of the backward's score products). ~1 min.
  timeout 120 python lab/tools/wgmma_bench.py 2>&1 | tee "$OUT/wgmma.log"
}

stage_d64_causal4k() {
  # The three-consumer forward, causal at 4k (two consumers by default
  # there) with block_kv 64, which compiles without the 216 B of spills. ~1 min.
  timeout 90 python lab/tools/mosaic_bench.py --no-triton --seq 4096 8192 --head-dim 64 --causal yes --variants default \
    consumers=3+block_q=192 consumers=3+block_q=192+block_kv=64 2>&1 | tee "$OUT/d64_causal4k.log"
}

stage_d64_tiles() {
  # head_dim 64 forward (0.96-0.99x cuDNN at 8k-16k, session 5): 256-row Q
  # tiles over 64-row K/V blocks halve the K/V reads per FLOP and compile
  # without spills (non-causal; 80 B causal).
  timeout 200 python lab/tools/mosaic_bench.py --no-triton --seq 2048 8192 16384 --head-dim 64 \
    --variants default block_q=256+block_kv=64+stages=3 block_q=256+block_kv=64+stages=4 2>&1 | tee "$OUT/d64_tiles.log"
}

stage_d256_bias() {
  # The bias tests at head_dim 256 alone (the two-stage cap, session 4).
  timeout 200 python -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "bias and 256" 2>&1 \
    | tee "$OUT/d256_bias_tests.log" | tail -10
}

stage_ragged() {
  # auto keeps ragged lengths on the Triton kernels until this is timed: the
  # Mosaic kernels (padded to whole blocks inside) against Triton at 1000 and
  # 4000, with the whole-block 1024 and 4096 beside them.
  for causal in false true; do
    timeout 140 $BENCH --seqlens 1000 1024 4000 4096 --head-dims 64 128 --causal $causal --modes fwd fwd+bwd \
      --impls flash2-mosaic flash2-triton --no-check --out "$OUT/ragged_causal_$causal" 2>&1 | grep -E "^ +[0-9]+ |== "
  done
}

stage_wait() {
  wait  # for the background streams started before it (timing after them)
}

stage_all_tests() {
  # The Mosaic and sharding tests have their own stages.
  timeout 480 python -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=15 tests \
    --deselect tests/test_mosaic.py --deselect tests/test_sharding.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
}

run_stages() {  # run_stages STAGE+STAGE...
  local stage
  for stage in ${1//+/ }; do
    echo "== $stage $(date +%T)"
    "stage_$stage"
  done
  echo "== done $(date +%T)"
}

if [[ -n ${GPU_SESSION_STREAM:-} ]]; then
  run_stages "$1"  # one stream, started below by its parent
  exit
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import jax; print('jax', jax.__version__, jax.devices())"
[[ "$*" == *:* ]] && export XLA_PYTHON_CLIENT_PREALLOCATE=false
for arg in "$@"; do
  if [[ $arg == all:* ]]; then
    GPU_SESSION_STREAM=1 timeout "${STREAM_LIMIT:-570}" bash "$0" "${arg#*:}" >"$OUT/gpuall.log" 2>&1 &
  elif [[ $arg == *:* ]]; then
    # A stream stops at STREAM_LIMIT seconds whatever its stages' own limits.
    GPU_SESSION_STREAM=1 CUDA_VISIBLE_DEVICES=${arg%%:*} timeout "${STREAM_LIMIT:-570}" bash "$0" "${arg#*:}" \
      >"$OUT/gpu${arg%%:*}.log" 2>&1 &
  else
    run_stages "$arg"
  fi
done
wait
for log in "$OUT"/gpu*.log; do
  [[ -e $log ]] && { echo "######## $log"; grep -vE "^\s*$" "$log" | tail -25; }
done
tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/"
