"""Throughput of wgmma with its A operand in shared memory or in registers.

lab/NOTES.md (session 8) models the backward kernels' score products
(m64 n64, both operands in shared memory) as reading shared memory as fast
as the tensor cores consume it: 4 KiB per m64n64k16 step, 32 cycles at 128
bytes a cycle, against 32 cycles of tensor-core work. This measures it
alone: one CTA per SM, `warpgroups` warpgroups each issuing `iters` times
`unroll` products acc[64, N] += A[64, K] B[K, N] (bf16, float32
accumulator; K = 128, eight k16 steps a product) and waiting once per
`unroll`, with A from shared memory or loaded into registers once, B one
tile in shared memory for all warpgroups. TFLOP/s over all SMs; the H200's
dense bf16 peak is ~990 by the datasheet.

  python lab/tools/wgmma_bench.py                 # on a Hopper GPU
  python lab/tools/wgmma_bench.py --n 64 128 --warpgroups 3

(Three warpgroups at N = 256 with A in registers spill: 170 registers a
thread without setmaxnreg.)
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

ROWS, K = 64, 128


def _tiles(cols: int):
  """Tiling and swizzle of a bf16 tile `cols` wide (as the kernels' tiles)."""
  swizzle = plgpu.find_swizzle(cols * 16, "tile")
  return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def _kernel(*, num_ctas: int, warpgroups: int, n: int, iters: int, unroll: int, a_in_registers: bool):
  """acc += A B, `iters` x `unroll` times per warpgroup; the result (bf16)
  of each warpgroup of each CTA, so that nothing is optimised away."""

  def body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, out_smem, loaded):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(a_gmem, a_smem, loaded)
      plgpu.copy_gmem_to_smem(b_gmem, b_smem, loaded)

    plgpu.barrier_wait(loaded)
    a = plgpu.load(a_smem.at[wg], layout=plgpu.Layout.WGMMA) if a_in_registers else a_smem.at[wg]
    acc = plgpu.layout_cast(jnp.zeros((ROWS, n), jnp.float32), plgpu.Layout.WGMMA)

    def products(acc_ref):
      for _ in range(unroll):  # chained on one accumulator; one wait below
        plgpu.wgmma(acc_ref, a, b_smem)

    acc = lax.fori_loop(0, iters, lambda _, acc: pl.run_state(products)(plgpu.ACC.init(acc)), acc)
    out_smem.at[wg][...] = acc.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[lax.axis_index("cta"), wg])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_ctas, warpgroups, ROWS, n), jnp.bfloat16),
      scratch_types=[
          plgpu.SMEM((warpgroups, ROWS, K), jnp.bfloat16, transforms=_tiles(K)),
          plgpu.SMEM((K, n), jnp.bfloat16, transforms=_tiles(n)),
          plgpu.SMEM((warpgroups, ROWS, n), jnp.bfloat16, transforms=_tiles(n)),
          plgpu.Barrier(num_arrivals=2),
      ],
      grid=(num_ctas,),
      grid_names=("cta",),
      num_threads=warpgroups,
      thread_name="wg",
      kernel_name="wgmma_bench",
  )


def _median_ms(fn, *args, runs: int = 10) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--warpgroups", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--iters", type=int, default=4096)
  parser.add_argument("--unroll", type=int, default=4)
  args = parser.parse_args()
  num_ctas = jax.devices()[0].core_count
  print(f"{jax.devices()[0].device_kind}: {num_ctas} CTAs, m64 nN k{K}, {args.unroll} products per wait")
  print(f"{'N':>4} {'wgs':>4} {'A in':>10} {'ms':>8} {'TFLOP/s':>8}")
  for n in args.n:
    for warpgroups in args.warpgroups:
      a = jax.random.normal(jax.random.PRNGKey(0), (warpgroups, ROWS, K), jnp.bfloat16)
      b = jax.random.normal(jax.random.PRNGKey(1), (K, n), jnp.bfloat16)
      flops = 2 * ROWS * n * K * args.unroll * args.iters * warpgroups * num_ctas
      for a_in_registers in (False, True):
        kernel = _kernel(num_ctas=num_ctas, warpgroups=warpgroups, n=n, iters=args.iters, unroll=args.unroll,
                         a_in_registers=a_in_registers)
        ms = _median_ms(jax.jit(kernel), a, b)
        print(f"{n:>4} {warpgroups:>4} {'registers' if a_in_registers else 'smem':>10} {ms:8.3f} "
              f"{flops / ms / 1e9:8.0f}", flush=True)


if __name__ == "__main__":
  main()
