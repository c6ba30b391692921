#!/usr/bin/env bash
# Issue 27's speed misses on one H200: the Mosaic tilings one at a time on the
# window and packed cases (lab/tools/mosaic_options_sweep.py), then what a
# softcap costs and what cuts it (lab/tools/softcap_ab.py). Logs in $OUT.
#   bash lab/gpu_options_ab.sh [sweep] [packed] [ragged] [softcap128] [softcappoly] [earlyrows] [softcap64] [segtests] [segrecord]
#     [profile] [patchab] [patchtests] [consumers3] [f32seeds] [stages3] [stagger]
# patchab and patchtests take PATCH (default lab/patches/dq_delta_fold.diff)
# (patchab: CASES, patch_ab.py's --cases, default its own) and PATCH_TESTS
# (a pytest -k expression; default the bf16 option and
# segment-id tests of the Mosaic kernels at head_dim 64 and 128).
set -uo pipefail
OUT=${OUT:-gpu_out}
PATCH=${PATCH:-lab/patches/dq_delta_fold.diff}
PATCH_TESTS=${PATCH_TESTS:-(mosaic_options_match and not 256 and bf16) or (mosaic_segment_ids and 128 and bf16)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v "^WARNING\|^I0000\|^E0000\|^W0000"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
python -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
for stage in "$@"; do
  case $stage in
    sweep) timeout 330 python lab/tools/mosaic_options_sweep.py 2>&1 | quiet | tee "$OUT/options_sweep.log" ;;
    packed) timeout 270 python lab/tools/mosaic_options_sweep.py --cases packed --modes fwd fwd+bwd --variants \
              default balanced=False persistent=False "bwd dq_persistent=False" "bwd dkv_persistent=False" \
              "persistent=False all" 2>&1 | quiet | tee "$OUT/packed_sweep.log" ;;
    ragged) timeout 150 python lab/tools/mosaic_options_sweep.py --cases ragged causal --modes fwd fwd+bwd \
              --variants default "persistent=False all" 2>&1 | quiet | tee "$OUT/ragged_sweep.log" ;;
    consumers3)  # 192-row forward tiles at d128 (three consumers, 64-row K/V blocks) against the defaults
      timeout 300 python lab/tools/mosaic_options_sweep.py --cases window packed --modes fwd fwd+bwd --variants \
        default "consumers=3 block_kv=64 stages=4" 2>&1 | quiet | tee "$OUT/consumers3_sweep.log" ;;
    stages3)  # d128 forward: one Q set and three K/V slots (fits since reduction_scratch_bytes=0), outputs checked
      timeout 420 python lab/tools/mosaic_options_sweep.py --cases window packed causal --modes fwd fwd+bwd --check \
        --variants default "persistent=False stages=3" 2>&1 | quiet | tee "$OUT/stages3_sweep.log" ;;
    stagger)  # the consumers of the forward, dQ and dK/dV kernels half a step apart (lab/patches/consumers_stagger.diff), alternating
      timeout 290 python lab/tools/patch_ab.py lab/patches/consumers_stagger.diff --cases window causal packed \
        --modes fwd fwd+bwd --rounds 3 2>&1 | quiet | tee "$OUT/stagger_ab.log" ;;
    f32seeds)  # test_float32's cases over 10 input seeds, compiled: each array's error ratio to plain float32
      PYTHONPATH=.:tests timeout 240 python lab/tools/float32_rule_seeds.py --seeds 10 2>&1 | quiet \
        | tee "$OUT/float32_seeds.log" ;;
    softcap128) timeout 300 python lab/tools/softcap_ab.py --head-dims 128 2>&1 | quiet | tee "$OUT/softcap_d128.log" ;;
    softcappoly) timeout 300 python lab/tools/softcap_ab.py --head-dims 128 64 --variants product poly16 poly32 2>&1 \
                   | quiet | tee "$OUT/softcap_poly.log" ;;
    earlyrows) timeout 540 python lab/tools/early_rows_ab.py --cases window packed short 2>&1 | quiet \
                 | tee "$OUT/early_rows.log" ;;
    softcap64) timeout 300 python lab/tools/softcap_ab.py --head-dims 64 2>&1 | quiet | tee "$OUT/softcap_d64.log" ;;
    # One process: xdist workers share the one GPU and its compiles (4 workers ran ~100 s a test).
    segtests) timeout 500 python -m pytest -q -m gpu tests/test_gpu.py -k "segment_ids or varlen" -p no:cacheprovider \
                -n 0 -rA --durations=20 2>&1 | quiet | tee "$OUT/segment_tests.log" | tail -n 40 ;;
    segrecord)  # packed and varlen with one CTA a tile under segment ids, plain causal in the same run
      mkdir -p "$OUT/bench"
      timeout 150 python -m jax_flash2.bench --head-dims 128 --seqlens 16k --causal true --segments 1 8 \
        --modes fwd fwd+bwd --impls flash2 --iters 10 --warmup 2 --no-progress --no-plot \
        --out "$OUT/bench/mosaic-segments-onecta" 2>&1 | quiet | tail -n 12
      timeout 120 python -m jax_flash2.bench --head-dims 128 --causal true \
        --varlen 1024,3072,512,4096,2560,1536,2048,1536 --modes fwd fwd+bwd --impls flash2 flash2-segids \
        --iters 10 --warmup 2 --no-progress --no-plot --out "$OUT/bench/mosaic-varlen-onecta" 2>&1 | quiet | tail -n 12
      tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -r "$OUT/bench" ;;
    profile)  # where the window's short loops lose time: Mosaic's profiler, causal against window (1024, 0)
      for kernel in forward backward; do
        for band in "" "--window 1024 0"; do
          timeout 150 python lab/tools/mosaic_profile.py --kernel $kernel --seq 16384 --heads 16 --causal $band 2>&1 \
            | quiet | tee -a "$OUT/profile.log" | tail -n 30
        done
      done ;;
    patchab)  # $PATCH against the product in one process, alternating (lab/tools/patch_ab.py)
      timeout 330 python lab/tools/patch_ab.py "$PATCH" ${CASES:+--cases $CASES} 2>&1 | quiet | tee "$OUT/patch_ab.log" ;;
    patchtests)  # the GPU tests of the kernels $PATCH touches, on a patched copy of the tree
      copy=$(mktemp -d) out=$(cd "$OUT" && pwd) patch_file=$(realpath "$PATCH")
      tar --exclude=./.git --exclude="./$OUT" -cf - . | tar -xf - -C "$copy"
      if (cd "$copy" && git apply "$patch_file"); then
        (cd "$copy" && timeout 240 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -n 0 -rA \
           -k "$PATCH_TESTS" 2>&1 | quiet | tail -n 25 | tee "$out/patch_tests.log")
      else
        echo "patchtests: $PATCH does not apply" | tee "$out/patch_tests.log"
      fi
      rm -rf "$copy" ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
