"""Throughput of TMA stores and float32 reduce-adds from shared to global memory.

The fused backward (BackwardConfig.fused_dq) adds a 16 KiB float32 piece of dQ
per consumer and step into global memory with a TMA reduce-add; its producer
spends most of its time waiting for the TMA engine to have read those pieces
(lab/NOTES.md, session 7). This measures the rate on its own: one CTA per SM,
each sending `iters` 64 x 64 float32 tiles from shared memory to its own
region of global memory (as large as the fused kernel's dQ), as plain stores
and as reduce-adds, waiting for the reads with `depth` copies in flight (the
fused kernel: 1).

With `--red`, the same tiles are also added by the threads themselves
instead of the TMA engine: `--red` warps of the CTA read the tile from shared
memory (ld.shared.v4) and add it with vector reductions
(red.global.add.v4.f32, sm_90), the other way a dQ adder warp could add its
pieces (session 13); `--ctas` runs fewer CTAs than SMs, to tell the
engine's own rate from the machine's.

  python lab/tools/tma_reduce_bench.py            # on a Hopper GPU
  python lab/tools/tma_reduce_bench.py --ctas 1 16 132 --red 1 4
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
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf

ROWS = COLS = 64


def _kernel(send, *, num_ctas: int, iters: int, regions: int, name: str, finish=lambda: None):
  """A kernel writing num_ctas * iters tiles into a [num_ctas * regions, 64,
  64] float32 array: CTA c sends (`send(tile, target)`) its i-th tile to tile
  c * regions + i % regions, then calls `finish`."""

  def body(out_ref, tile):
    cta = lax.axis_index("cta")

    @pl.loop(0, iters)
    def _(i):
      send(tile, out_ref.at[cta * regions + lax.rem(i, jnp.int32(regions))])

    finish()

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_ctas * regions, ROWS, COLS), jnp.float32),
      scratch_types=[plgpu.SMEM((ROWS, COLS), jnp.float32)],
      grid=(num_ctas,),
      grid_names=("cta",),
      kernel_name=name,
  )


def _sender(*, depth: int, reduce: bool, **sizes):
  """The TMA engine's stores or reduce-adds, `depth` in flight."""

  def send(tile, target):
    plgpu.copy_smem_to_gmem(tile, target, reduction_op="add" if reduce else None)
    plgpu.wait_smem_to_gmem(depth - 1, wait_read_only=True)

  return _kernel(send, finish=lambda: plgpu.wait_smem_to_gmem(0), name="tma_reduce_bench", **sizes)


VEC = 4  # float32 per ld.shared.v4 / red.v4
CHUNK = 8  # vectors in flight per thread between loads and reductions


def _red_tile(warps: int):
  """An inline Mosaic GPU function: the first `warps` warps of the
  warpgroup add a [64, 64] float32 shared-memory tile into a global one,
  each thread VEC floats at a time, CHUNK loads before their reductions."""
  threads = 32 * warps
  per_thread = ROWS * COLS // (VEC * threads)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def red(ctx, src, dst):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    tid = arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(128, i32))
    src_ptr = mgpu.utils.memref_ptr(src)
    dst_ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu.utils.memref_ptr(dst))
    active = arith.cmpi(arith.CmpIPredicate.ult, tid, mgpu.utils.c(threads, i32))
    if_op = scf.IfOp(active)
    with ir.InsertionPoint(if_op.then_block):
      base = arith.muli(tid, mgpu.utils.c(VEC, i32))
      for start in range(0, per_thread, CHUNK):
        operands, loads, reds = [], [], []
        for j in range(start, min(start + CHUNK, per_thread)):
          offset = arith.addi(base, mgpu.utils.c(j * VEC * threads, i32))
          operands += [mgpu.utils.getelementptr(src_ptr, [offset], f32),
                       mgpu.utils.getelementptr(dst_ptr, [offset], f32)]
          n = len(loads)
          s_op, d_op = 2 * n, 2 * n + 1
          regs = ", ".join(f"r{n}_{e}" for e in range(VEC))
          loads.append(f".reg .f32 {regs}; ld.shared.v4.f32 {{{regs}}}, [${s_op}];")
          reds.append(f"red.relaxed.gpu.global.add.v4.f32 [${d_op}], {{{regs}}};")
        asm = "{ " + " ".join(loads) + " " + " ".join(reds) + " }"
        constraints = ",".join(["r", "l"] * (len(operands) // 2))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), operands, asm, constraints, has_side_effects=True)
      scf.yield_([])

  return red


def _red_sender(*, warps: int, **sizes):
  """As _sender, the tiles added by `warps` warps' vector reductions."""
  return _kernel(_red_tile(warps), name="red_bench", **sizes)


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
  parser.add_argument("--ctas", type=int, nargs="+", default=[0], help="CTAs (0: one per SM)")
  parser.add_argument("--red", type=int, nargs="*", default=[], help="also: warps adding by red.v4")
  args = parser.parse_args()
  tile_bytes = ROWS * COLS * 4
  print(f"{'ctas':>5} {'op':>7} {'depth':>5} {'ms':>8} {'TB/s':>6} {'us/tile/SM':>10}")
  for num_ctas in args.ctas:
    num_ctas = num_ctas or jax.devices()[0].core_count
    total = num_ctas * args.iters * tile_bytes
    print(f"{jax.devices()[0].device_kind}: {num_ctas} CTAs x {args.iters} tiles of {tile_bytes // 1024} KiB "
          f"({total / 2**20:.0f} MiB) into {num_ctas * args.regions * tile_bytes / 2**20:.0f} MiB")
    kernels = [("add" if reduce else "store", depth,
                _sender(num_ctas=num_ctas, iters=args.iters, regions=args.regions, depth=depth, reduce=reduce))
               for reduce in (False, True) for depth in args.depth]
    kernels += [(f"red{warps}w", "-", _red_sender(num_ctas=num_ctas, iters=args.iters, regions=args.regions,
                                                  warps=warps)) for warps in args.red]
    for op, depth, kernel in kernels:
      ms = _median_ms(jax.jit(kernel))
      print(f"{num_ctas:>5} {op:>7} {depth:>5} {ms:8.3f} {total / ms / 1e9:6.2f} {ms * 1e3 / args.iters:10.3f}",
            flush=True)


if __name__ == "__main__":
  main()
