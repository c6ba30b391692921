"""Throughput of TMA stores and float32 reduce-adds from shared to global memory.

The fused backward (BackwardConfig.fused_dq) adds a 16 KiB float32 piece of dQ
per consumer and step into global memory with a TMA reduce-add; its producer
spends most of its time waiting for the TMA engine to have read those pieces
(bench/NOTES.md, session 7). This measures the rate on its own: one CTA per SM,
each sending `iters` 64 x 64 float32 tiles from shared memory to its own
region of global memory (as large as the fused kernel's dQ), as plain stores
and as reduce-adds, waiting for the reads with `depth` copies in flight (the
fused kernel: 1).

  python tools/tma_reduce_bench.py            # on a Hopper GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = COLS = 64


def _sender(*, num_ctas: int, iters: int, regions: int, depth: int, reduce: bool):
  """A kernel writing num_ctas * iters tiles into a [num_ctas * regions, 64,
  64] float32 array: CTA c sends its i-th tile to tile c * regions + i % regions."""

  def body(out_ref, tile):
    cta = lax.axis_index("cta")

    @pl.loop(0, iters)
    def _(i):
      target = out_ref.at[cta * regions + lax.rem(i, jnp.int32(regions))]
      plgpu.copy_smem_to_gmem(tile, target, reduction_op="add" if reduce else None)
      plgpu.wait_smem_to_gmem(depth - 1, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_ctas * regions, ROWS, COLS), jnp.float32),
      scratch_types=[plgpu.SMEM((ROWS, COLS), jnp.float32)],
      grid=(num_ctas,),
      grid_names=("cta",),
      kernel_name="tma_reduce_bench",
  )


def _median_ms(fn, runs: int = 10) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=512, help="tiles per CTA")
  parser.add_argument("--regions", type=int, default=64, help="distinct 16 KiB targets per CTA")
  parser.add_argument("--depth", type=int, nargs="+", default=[1, 2, 8])
  args = parser.parse_args()
  num_ctas = jax.devices()[0].core_count
  tile_bytes = ROWS * COLS * 4
  total = num_ctas * args.iters * tile_bytes
  print(f"{jax.devices()[0].device_kind}: {num_ctas} CTAs x {args.iters} tiles of {tile_bytes // 1024} KiB "
        f"({total / 2**20:.0f} MiB) into {num_ctas * args.regions * tile_bytes / 2**20:.0f} MiB")
  print(f"{'op':>7} {'depth':>5} {'ms':>8} {'TB/s':>6} {'us/tile/SM':>10}")
  for reduce in (False, True):
    for depth in args.depth:
      kernel = _sender(num_ctas=num_ctas, iters=args.iters, regions=args.regions, depth=depth, reduce=reduce)
      ms = _median_ms(jax.jit(kernel))
      print(f"{'add' if reduce else 'store':>7} {depth:>5} {ms:8.3f} {total / ms / 1e9:6.2f} "
            f"{ms * 1e3 / args.iters:10.3f}", flush=True)


if __name__ == "__main__":
  main()
