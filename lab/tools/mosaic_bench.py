"""Times the Mosaic GPU forward's config variants against the Triton-lowering forward on a Hopper GPU.

  PYTHONPATH=. python lab/tools/mosaic_bench.py                  # d64 and d128, 1k..16k, causal and not
  PYTHONPATH=. python lab/tools/mosaic_bench.py --seq 8192 --head-dim 128 --stages 2 --block-kv 128
  PYTHONPATH=. python lab/tools/mosaic_bench.py --variants softmax_overlap=0 default   # MosaicForwardConfig A/B
  PYTHONPATH=. python lab/tools/mosaic_bench.py --no-triton --variants default persistent=0 consumers=3+block_q=192

Each variant is a MosaicForwardConfig: the measured default for the row's
shape (jax_flash2.defaults.mosaic_forward, which depends on seq_q and the
mask) with the variant's fields set (NAME=VALUE joined by '+', booleans
0/1; lab/tools/cli_ab.py's syntax), then --block-kv and --stages. Timed
through the public API, jax.jit of flash_attention(q, k, v, causal=...,
return_lse=True, backend="mosaic", mosaic_config=MosaicConfig(forward=...)):
the forward kernel and nothing else at whole-block lengths (ragged ones
add the padding copies).

Same convention as the bench: 16384 tokens per batch (batch = 16384 // seq),
hidden 2048 (heads = 2048 // head_dim), bf16, TFLOP/s = 4 B H S^2 D / time
(halved when causal). Each function is compiled ahead, warmed up, then timed
as rounds of 10 calls launched back to back on one input set (the bench CLI
rotates over two in rounds of 5: the two methods differ by a few %, so
decide close calls with lab/tools/cli_ab.py); the median round is reported.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jax_flash2 import defaults, flash_attention
from jax_flash2.bench import timing
from jax_flash2.bench.flops import forward_flops
from jax_flash2.config import MosaicConfig

import cli_ab  # lab/tools/: the variant syntax


def _time_ms(fn, args) -> float:
  return timing.time_fn_ms(fn, *args, warmup=3, iters=10, calls_per_round=10)


def _variant(config, spec: str):
  """config with the fields of `spec` ('default', or 'name=value+...', e.g.
  'persistent=0+block_q=256'; booleans as 0/1) set."""
  return cli_ab._variant(config, spec)


def start_config(head_dim: int, seq: int, causal: bool, *, block_kv: int | None = None,
                 stages: int | None = None):
  """A row's config before its variant: the measured default for the shape, with --block-kv and --stages."""
  config = defaults.mosaic_forward(head_dim, seq_q=seq, causal=causal)
  return dataclasses.replace(config, block_kv=block_kv or config.block_kv, stages=stages or config.stages)


def mosaic_forward_fn(causal: bool, config, *, interpret: bool = False):
  """(q, k, v) -> (out, lse) on the Mosaic forward tiled by config, through the public API."""

  def fwd(q, k, v):
    return flash_attention(q, k, v, causal=causal, return_lse=True, backend="mosaic",
                           mosaic_config=MosaicConfig(forward=config), interpret=interpret)

  return fwd


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
  parser.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--block-kv", type=int, default=None)
  parser.add_argument("--stages", type=int, default=None)
  parser.add_argument("--no-triton", action="store_true", help="time the Mosaic forward only")
  parser.add_argument("--per-length", action="store_true",
                      help="accepted for old command lines: rows always start from the per-length default")
  parser.add_argument("--variants", nargs="*", default=["default"],
                      help="forward configs to time side by side: 'default', or MosaicForwardConfig fields set "
                           "on the default, as NAME=VALUE joined by '+' (booleans 0/1)")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind)
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  header = f"{'d':>4} {'seq':>6} {'causal':>6}" + "".join(f" {name + ' ms':>24} {'TFLOP/s':>8}" for name in args.variants)
  print(header + ("" if args.no_triton else f" {'triton ms':>10} {'TFLOP/s':>8}"))
  for head_dim in args.head_dim:
    for seq in args.seq:
      batch, heads = max(16384 // seq, 1), 2048 // head_dim
      keys = jax.random.split(jax.random.PRNGKey(seq), 3)
      q, k, v = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16) for key in keys)
      for causal in causals:
        flops = forward_flops(batch, heads, seq, seq, head_dim, causal)
        row = f"{head_dim:>4} {seq:>6} {str(causal):>6}"
        base = start_config(head_dim, seq, causal, block_kv=args.block_kv, stages=args.stages)
        for variant in args.variants:
          ms = _time_ms(mosaic_forward_fn(causal, _variant(base, variant)), (q, k, v))
          row += f" {ms:>24.3f} {flops / ms / 1e9:>8.0f}"
        if not args.no_triton:
          tms = _time_ms(
              lambda q, k, v: flash_attention(q, k, v, causal=causal, return_lse=True, backend="triton"), (q, k, v)
          )
          row += f" {tms:>10.3f} {flops / tms / 1e9:>8.0f}"
        print(row, flush=True)


if __name__ == "__main__":
  main()
