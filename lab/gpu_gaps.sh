#!/usr/bin/env bash
# Wall clock against kernel time: profiler traces of back-to-back calls
# (lab/tools/launch_gaps.py) for the cases whose wall clock trails their
# kernels (lab/NOTES "Next (session 23)"), once as is and once with XLA's
# command buffers off. Traces and logs go into $OUT/gaps.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT/gaps"
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
g() { timeout 120 python lab/tools/launch_gaps.py --out "$OUT/gaps" "$@" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"; }
g --name fwd_2kx8 --batch 8 --seqlen 2048 --causal --mode fwd
g --name fwdbwd_2kx8 --batch 8 --seqlen 2048 --causal --mode fwd+bwd
g --name fwd_win16k --seqlen 16384 --causal --window 1024 0 --mode fwd
g --name fwdbwd_win16k --seqlen 16384 --causal --window 1024 0 --mode fwd+bwd
g --name fwd_causal16k --seqlen 16384 --causal --mode fwd
g --name fwdbwd_seg8 --seqlen 16384 --causal --segments 8 --mode fwd+bwd
g --name decode_b8_8k --batch 8 --heads 32 --kv-heads 4 --decode 8192
g --name decode_b1_128k --batch 1 --heads 32 --kv-heads 4 --decode 131072
XLA_FLAGS=--xla_gpu_enable_command_buffer= g --name fwd_2kx8_nocmdbuf --batch 8 --seqlen 2048 --causal --mode fwd
tar czf "$OUT/gaps.tgz" -C "$OUT" gaps && rm -r "$OUT/gaps"
