"""Each Mosaic kernel's shared memory as Mosaic GPU counts it, against the
estimate `check_smem` refuses configs by (the modules' *smem_bytes, their
reserve included), on a CPU: lowering for CUDA runs Mosaic's Python half,
which sums the kernel's buffers (`core._smem_tree_size`, alignment and
barriers included) and refuses a kernel over 227 KiB; this tool records
that sum for every kernel it lowers.

  JAX_PLATFORMS=cpu PYTHONPATH=. python lab/tools/smem_count.py [--head-dims 64 128 256]

A kernel whose estimate is below Mosaic's count can pass `check_smem` and
then meet Mosaic's own error instead of ours; one far above refuses configs
that fit. Lab equipment: not part of the product.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core

from jax_flash2 import defaults
from jax_flash2.mosaic import backward, backward_fused, backward_wide, common, forward


def _counted(fn, *structs):
  """Mosaic's shared-memory sums of the kernels `fn` lowers, in order."""
  counts, original = [], core._smem_tree_size

  def record(buffers):
    counts.append(original(buffers))
    return counts[-1]

  core._smem_tree_size = record
  try:
    jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",))
  finally:
    core._smem_tree_size = original
  return counts


def _cases(head_dim: int):
  """(name, fn of (q, k, v, do, lse, delta), estimate) at the kernels'
  default tilings and their variants near the limit."""
  dtype = jnp.bfloat16
  fwd = defaults.mosaic_forward(head_dim, seq_q=4096, causal=True)
  yield "forward", lambda q, k, v, *_: forward.forward(q, k, v, causal=True, config=fwd), \
      forward.smem_bytes(fwd, head_dim, dtype)
  if head_dim in common.WIDE_HEAD_DIMS:
    bwd = defaults.mosaic_backward(head_dim)
    yield "wide dkv", lambda *a: backward_wide.dkv(*a, causal=True, config=bwd), \
        backward_wide.dkv_smem_bytes(bwd, head_dim, dtype)
    yield "wide dq", lambda *a: backward_wide.dq(*a, causal=True, config=bwd), \
        backward_wide.dq_smem_bytes(bwd, head_dim, dtype)
    return
  two = defaults.mosaic_backward(head_dim, fused=False)
  for name, config in (("", two), (" one CTA a tile", dataclasses.replace(two, dq_persistent=False,
                                                                           dkv_persistent=False))):
    yield "dkv" + name, lambda *a, c=config: backward.dkv(*a, causal=True, config=c), \
        backward.dkv_smem_bytes(config, head_dim, dtype)
    yield "dq" + name, lambda *a, c=config: backward.dq(*a, causal=True, config=c), \
        backward.dq_smem_bytes(config, head_dim, dtype)
  if head_dim == 64:
    fused = defaults.mosaic_backward(head_dim)
    yield "fused", lambda *a: backward_fused.backward(*a, causal=True, config=fused), \
        backward_fused.smem_bytes(fused, head_dim, dtype)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128, 256])
  args = ap.parse_args()
  batch, seq, heads = 1, 4096, 4
  print(f"{'kernel':28s} {'Mosaic':>8s} {'estimate':>9s} {'estimate - Mosaic':>18s}  (limit {common.SMEM_LIMIT})")
  for head_dim in args.head_dims:
    x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)
    for name, fn, estimate in _cases(head_dim):
      counts = _counted(fn, x, x, x, x, vec, vec)
      for count in counts:
        print(f"d{head_dim} {name:24s} {count:8d} {estimate:9d} {estimate - count:+18d}", flush=True)


if __name__ == "__main__":
  main()
