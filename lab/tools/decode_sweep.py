"""Sweeps the split-KV decode kernel's config (block_k, splits, warps, stages)
on the GPU at the bench's decode shapes; kernel time from a profiler trace,
split into the split kernel and the rest (the combine), bandwidth over the
bytes the bench counts. Lab equipment: not part of the product.

  python lab/tools/decode_sweep.py [--quick | --defaults] > sweep.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import tempfile

import jax
import numpy as np

from jax_flash2 import backends
from jax_flash2.backends import DecodeCall, PassPlan
from jax_flash2.bench import decode as bench_decode
from jax_flash2.bench import kernel_trace
from jax_flash2.config import DecodeConfig
from jax_flash2.decode import _decide

CALLS = 20


def kernel_ms(fn, inputs):
  """(split kernel ms, other kernels ms) per call, over CALLS calls rotating
  inputs; "other" is everything but the split kernel (the combine kernel,
  any XLA around the two)."""
  jax.block_until_ready(fn(*inputs[0]))
  with tempfile.TemporaryDirectory() as log_dir:
    path = kernel_trace.profile(lambda i: fn(*inputs[i % len(inputs)]), CALLS, log_dir)
    acts = kernel_trace.device_activities(kernel_trace.read_trace(path)) if path else []
  is_split = lambda a: "flash2_decode" in a.name and "combine" not in a.name
  split = sum(a.duration_us for a in acts if is_split(a))
  other = sum(a.duration_us for a in acts if not is_split(a))
  return split / CALLS / 1e3, other / CALLS / 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--defaults", action="store_true", help="only each shape's default config")
  args = ap.parse_args()
  shapes = [
      bench_decode.DecodeShape(8, 8192, 32, 4, 128, 1, "bfloat16"),
      bench_decode.DecodeShape(8, 32768, 32, 4, 128, 1, "bfloat16"),
      bench_decode.DecodeShape(1, 131072, 32, 4, 128, 1, "bfloat16"),
      bench_decode.DecodeShape(8, 32768, 32, 4, 128, 1, "bfloat16", page_size=64),
  ]
  copy = bench_decode.copy_bandwidth("gpu", kernel_time=True)
  print(f"copy: {copy['copy_kernel_tb_s']:.2f} TB/s kernel, {copy['copy_tb_s']:.2f} wall", flush=True)
  rows = []
  for shape in shapes:
    inputs = [bench_decode.make_inputs(shape, seed) for seed in range(2)]
    q, k, v, lens, table = inputs[0]
    p, auto = _decide(q, k, v, lens, block_table=table)
    want = np.asarray(bench_decode.reference_out(inputs[0]), np.float64)
    nbytes = bench_decode.bytes_moved(shape)
    base = auto.config.num_splits
    splits = sorted({base, 2 * base, 4 * base, 8 * base})
    block_ks = (64,) if shape.page_size else (64, 128)
    grid = itertools.product(block_ks, splits, (4, 8), (2, 3))
    if args.defaults:
      c = auto.config
      grid = [(c.block_k, c.num_splits, c.num_warps, c.num_stages)]
    elif args.quick:
      grid = itertools.product((64,), splits, (4,), (2,))
    print(f"\n{shape.describe()}: auto {auto.config}; {nbytes / 1e6:.1f} MB", flush=True)
    for block_k, s, warps, stages in grid:
      cfg = DecodeConfig(block_k, s, warps, stages)
      call = DecodeCall(p, PassPlan("triton", cfg))
      fn = jax.jit(lambda q, k, v, lens, table, call=call: backends.decode(q, k, v, lens, table, None, None, call)[0])
      try:
        out = np.asarray(fn(*inputs[0]), np.float64)
        err = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        split_ms, other_ms = kernel_ms(fn, inputs)
      except Exception as exc:  # noqa: BLE001 - a failed config is a row
        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        continue
      total = split_ms + other_ms
      tb = nbytes / (total * 1e-3) / 1e12
      rows.append((shape.describe(), dataclasses.astuple(cfg), total, tb, err))
      print(f"  bk {block_k:3d} splits {s:3d} warps {warps} stages {stages}: {split_ms * 1e3:7.1f} us + "
            f"{other_ms * 1e3:5.1f} us = {tb:.2f} TB/s ({tb / copy['copy_kernel_tb_s']:.0%}) err {err:.1e}",
            flush=True)
  print("\nbest per shape:")
  for name in dict.fromkeys(r[0] for r in rows):
    best = min((r for r in rows if r[0] == name), key=lambda r: r[2])
    print(f"  {name}: {best[1]} {best[2] * 1e3:.1f} us {best[3]:.2f} TB/s")


if __name__ == "__main__":
  sys.exit(main())
