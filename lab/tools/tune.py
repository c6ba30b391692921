"""Sweep the Triton-lowering kernels' tiles, warps and stages on the GPU.

Times each kernel alone (forward, backward dK/dV, backward dQ) for every
candidate config, with cuDNN timed in the same run as the yardstick, and
prints TFLOP/s by the FlashAttention convention. Results feed the table in
jax_flash2/config.py; bench/NOTES.md records what was learnt.

    python bench/tune.py --head-dim 128 --seq 8192 --kernels fwd,dkv,dq --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from jax_flash2.bench import timing
from jax_flash2.config import KernelConfig, padded_head_dim
from jax_flash2.triton import backward as tb
from jax_flash2.triton import forward as tf
from jax_flash2.triton.tiles import OptionalInputs, Problem

NO_OPTIONAL = OptionalInputs()


def candidates(kernel: str, d: int):
  blocks_q = (64, 128) if kernel != "dkv" else (32, 64, 128)
  blocks_k = (32, 64, 128) if kernel != "dkv" else (64, 128)
  stages = (2, 3, 4) if kernel == "fwd" else (1, 2, 3)
  for bq, bk, w, s in itertools.product(blocks_q, blocks_k, (4, 8), stages):
    if d >= 256 and bq * bk > 64 * 64:
      continue
    yield KernelConfig(bq, bk, w, s)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--kernels", default="fwd,dkv,dq")
  parser.add_argument("--causal", default="false,true")
  parser.add_argument("--configs", default="", help="explicit bq,bk,w,s;... instead of the sweep")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  d = args.head_dim
  batch, heads = max(1, args.tokens // args.seq), args.hidden // d
  shape = (batch, args.seq, heads, d)
  key = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in key)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, shape {shape} bf16", flush=True)
  records = []
  for causal in [c == "true" for c in args.causal.split(",")]:
    fwd_flop = 4 * batch * heads * args.seq * args.seq * d / (2 if causal else 1)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    cudnn_fb = jax.grad(lambda q, k, v: jnp.vdot(cudnn(q, k, v), do).real.astype(jnp.float32), (0, 1, 2))
    ms_f, ms_fb = timing.time_fn_ms(cudnn, q, k, v), timing.time_fn_ms(cudnn_fb, q, k, v)
    print(f"causal={causal} cudnn fwd {ms_f:.3f} ms {fwd_flop / ms_f / 1e9:.0f} TF/s | "
          f"fwd+bwd {ms_fb:.3f} ms {3.5 * fwd_flop / ms_fb / 1e9:.0f} TF/s", flush=True)
    records.append(dict(impl="cudnn", causal=causal, fwd_ms=ms_f, fwdbwd_ms=ms_fb))
    problem = Problem(
        seq_q=args.seq, seq_k=args.seq, head_dim=d, head_dim_padded=padded_head_dim(d),
        window_left=None, window_right=0 if causal else None, softmax_scale=d**-0.5, dtype="bfloat16",
    )
    out, lse = tf.forward(q, k, v, NO_OPTIONAL, problem, KernelConfig(64, 64, 4, 2))
    delta = tb.compute_delta(out, do, problem)
    for kernel in args.kernels.split(","):
      if args.configs:
        configs = [KernelConfig(*map(int, c.split(","))) for c in args.configs.split(";")]
      else:
        configs = list(candidates(kernel, d))
      flop = fwd_flop * (1.0 if kernel == "fwd" else 1.25)  # dkv and dq: half of bwd's 2.5x each
      best = None
      for cfg in configs:
        if kernel == "fwd":
          fn = lambda q, k, v, cfg=cfg: tf.forward(q, k, v, NO_OPTIONAL, problem, cfg)
        elif kernel == "dkv":
          fn = lambda q, k, v, cfg=cfg: tb.compute_dkv(q, k, v, do, lse, delta, NO_OPTIONAL, problem, cfg)
        else:
          fn = lambda q, k, v, cfg=cfg: tb.compute_dq(q, k, v, do, lse, delta, NO_OPTIONAL, problem, cfg)
        try:
          ms = timing.time_fn_ms(fn, q, k, v)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
          print(f"  {kernel} {cfg}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
          continue
        tflops = flop / ms / 1e9
        records.append(dict(impl=kernel, causal=causal, config=cfg.__dict__, ms=ms, tflops=tflops))
        print(f"  {kernel} bq={cfg.block_q} bk={cfg.block_k} w={cfg.num_warps} s={cfg.num_stages}: "
              f"{ms:.3f} ms {tflops:.0f} TF/s", flush=True)
        if best is None or ms < best[0]:
          best = (ms, cfg)
      if best:
        print(f"BEST {kernel} causal={causal}: {best[1]} {flop / best[0] / 1e9:.0f} TF/s", flush=True)
  if args.out:
    with open(f"{args.out}/tune_d{d}_s{args.seq}.json", "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, shape=shape, records=records), f, indent=1)


if __name__ == "__main__":
  main()
