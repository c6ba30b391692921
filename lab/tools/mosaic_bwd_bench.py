"""Times the Mosaic GPU backward's config variants against the Triton-lowering backward on a Hopper GPU.

  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py                      # d64 and d128, 1k..16k, causal and not
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --seq 8192 --head-dim 128 --block-q 64 --stages 3
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --variants default kernels=2   # fused against two kernels (d64)
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --head-dim 128 --variants default fused_dq=1+dkv_persistent=0+stages=2
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --head-dim 256 --seq 2048 8192      # the wide kernels

Each variant is a MosaicBackwardConfig: the measured default for the head_dim
(jax_flash2.defaults.mosaic_backward) with --block-q, --block-kv, --stages
and then the variant's fields set (NAME=VALUE joined by '+', booleans 0/1;
`kernels=2` for the dK/dV and dQ kernels, `kernels=1` for the fused one;
lab/tools/cli_ab.py's syntax). Timed through the public API on the same
Mosaic forward for every variant: jax.vjp of flash_attention(...,
backend="mosaic", mosaic_config=MosaicConfig(backward=...)) less the
forward alone, so each row's backward includes delta = rowsum(dO * O) and,
for the fused kernel, dQ's conversion. The Triton backward is timed the same
way (backend="triton"). Also prints the largest relative difference of the
variant's gradients to the Triton kernels'.

The per-kernel times (dK/dV and dQ apart) of this tool's earlier form came
from the kernels' internal entry points; through the public API use
lab/tools/kernel_anatomy.py (a profiler trace of a registered variant) for
them. The measurement switches it also took (dQ additions skipped, reordered
or unstaged, the element-wise work removed, the fused schedule's rounds
unfilled) were removed from the kernels: lab/variants.md.

Bench convention (as lab/tools/mosaic_bench.py): 16384 tokens per batch, hidden
2048, bf16; backward TFLOP/s = 2.5 x forward FLOPs / time (5 matmuls; the
two-kernel backward recomputes S and dP in both kernels, 7 matmuls, not
counted).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import defaults, flash_attention
from jax_flash2.bench.flops import forward_flops
from jax_flash2.config import MosaicConfig

import cli_ab  # lab/tools/: the variant syntax
import mosaic_bench  # lab/tools/: its timer

_time_ms = mosaic_bench._time_ms


def _variant(config, spec: str):
  """config (a MosaicBackwardConfig) with spec's fields set (and kernels=1 or 2)."""
  return cli_ab._variant(config, spec)


def start_config(head_dim: int, *, block_q: int | None = None, block_kv: int | None = None,
                 stages: int | None = None):
  config = defaults.mosaic_backward(head_dim)
  return dataclasses.replace(config, block_q=block_q or config.block_q, block_kv=block_kv or config.block_kv,
                             stages=stages or config.stages)


def grads_fn(causal: bool, backend: str, backward=None, *, interpret: bool = False):
  """(q, k, v, do) -> (dq, dk, dv) of flash_attention on `backend`, the
  Mosaic backward tiled by `backward` (None: the default)."""
  config = MosaicConfig(backward=backward) if backward is not None else None

  def attn(q, k, v):
    return flash_attention(q, k, v, causal=causal, backend=backend, mosaic_config=config, interpret=interpret)

  def grads(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  return grads


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
  parser.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--block-q", type=int, default=None)
  parser.add_argument("--block-kv", type=int, default=None)
  parser.add_argument("--stages", type=int, default=None)
  parser.add_argument("--variants", nargs="*", default=["default"],
                      help="backward configs to time, a row each: 'default', or MosaicBackwardConfig fields set on "
                           "the default as NAME=VALUE joined by '+' (booleans 0/1), kernels=1 or kernels=2")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind)
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  width = max(map(len, args.variants))
  print(f"{'d':>4} {'seq':>6} {'causal':>6} {'variant':>{width}} {'mosaic ms':>10} {'TFLOP/s':>8}"
        f" {'triton ms':>10} {'TFLOP/s':>8} {'max rel diff':>12}")
  for head_dim in args.head_dim:
    base = start_config(head_dim, block_q=args.block_q, block_kv=args.block_kv, stages=args.stages)
    variants = {spec: _variant(base, spec) for spec in args.variants}
    for seq in args.seq:
      batch, heads = max(16384 // seq, 1), 2048 // head_dim
      keys = jax.random.split(jax.random.PRNGKey(seq), 4)
      q, k, v, do = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16) for key in keys)
      for causal in causals:
        flops = 5 * forward_flops(batch, heads, seq, seq, head_dim, causal) // 2

        def forward(backend):
          return lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=backend)

        triton = grads_fn(causal, "triton")
        tms = _time_ms(triton, (q, k, v, do)) - _time_ms(forward("triton"), (q, k, v))
        want = jax.jit(triton)(q, k, v, do)
        mosaic_fwd_ms = _time_ms(forward("mosaic"), (q, k, v))
        for spec, variant in variants.items():
          grads = grads_fn(causal, "mosaic", variant)
          ms = _time_ms(grads, (q, k, v, do)) - mosaic_fwd_ms
          got = jax.jit(grads)(q, k, v, do)
          diff = max(
              float(np.linalg.norm(np.asarray(g, np.float32) - np.asarray(w, np.float32))
                    / np.linalg.norm(np.asarray(w, np.float32)))
              for g, w in zip(got, want)
          )
          print(f"{head_dim:>4} {seq:>6} {str(causal):>6} {spec:>{width}} {ms:>10.3f} {flops / ms / 1e9:>8.0f}"
                f" {tms:>10.3f} {flops / tms / 1e9:>8.0f} {diff:>12.2e}", flush=True)


if __name__ == "__main__":
  main()
