#!/usr/bin/env bash
# Second GPU round: the full GPU test matrix, then causal and head_dim-64 tuning
# over the configs the first sweep ranked highest.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 290 python3 -m pytest -m gpu tests/test_gpu.py -q -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
FWD="128,128,8,3;128,64,4,2;128,64,8,3;128,64,4,3;64,64,4,3;128,32,8,3"
DKV="64,128,8,3;64,64,4,2;32,64,4,3;64,128,4,3;128,128,8,2"
DQ="128,64,8,3;128,128,8,2;64,64,4,2;128,32,8,3;64,128,4,3"
for d in 128 64; do
  for kern in fwd dkv dq; do
    case $kern in fwd) c=$FWD;; dkv) c=$DKV;; dq) c=$DQ;; esac
    timeout 100 python3 bench/tune.py --head-dim $d --kernels $kern --configs "$c" 2>&1 | tee -a "$OUT/tune.log" | grep -E "BEST|cudnn"
  done
done
