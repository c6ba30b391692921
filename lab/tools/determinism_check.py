"""Whether an attention implementation's forward+backward gives the same bits on every run.

  PYTHONPATH=. python lab/tools/determinism_check.py --impls cudnn cudnn-deterministic flash2 --seq 4096 --head-dim 128

Runs each implementation's jitted forward+backward (as the bench CLI builds
it: lab/tools/kernel_anatomy.fwd_bwd_step) RUNS times on the same inputs and
compares out, dq, dk and dv with the first run's bits: per output, how many
runs differed and the largest absolute difference. What it is for: cuDNN's
backward sums dQ across K/V tiles with reduce-adds whose order is left to
the hardware, where jax_flash2's backward (no atomics, or additions in a
fixed order) promises the same bits; compiled with XLA's
xla_gpu_deterministic_ops (the bench implementation cudnn-deterministic, or
XLA_FLAGS=--xla_gpu_deterministic_ops=true for the whole process) cuDNN
runs its deterministic backward, whose speed is then the yardstick at equal
guarantees. The kernels each run launched are listed from a profiler
trace, so which backward cuDNN chose shows.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import kernel_anatomy  # lab/tools/

RUNS = 10
OUTPUTS = ("out", "dq", "dk", "dv")


def compare_runs(step, args, runs: int = RUNS) -> dict[str, tuple[int, float]]:
  """{output: (runs whose bits differ from the first run's, largest |difference|)}."""
  first = [np.asarray(x.astype(jnp.float32)) for x in jax.block_until_ready(step(*args))]
  differing = dict.fromkeys(OUTPUTS, 0)
  largest = dict.fromkeys(OUTPUTS, 0.0)
  for _ in range(runs - 1):
    again = [np.asarray(x.astype(jnp.float32)) for x in jax.block_until_ready(step(*args))]
    for name, a, b in zip(OUTPUTS, first, again):
      if not np.array_equal(a, b):
        differing[name] += 1
        largest[name] = max(largest[name], float(np.max(np.abs(a - b))))
  return {name: (differing[name], largest[name]) for name in OUTPUTS}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["cudnn", "flash2-mosaic"])
  parser.add_argument("--seq", type=int, nargs="+", default=[4096])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--runs", type=int, default=RUNS)
  args = parser.parse_args()
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, {jax.devices()[0].device_kind}")
  for seq in args.seq:
    for impl in args.impls:
      step, step_args = kernel_anatomy.fwd_bwd_step(impl, seq, args.head_dim, args.causal)
      result = compare_runs(step, step_args, args.runs)
      with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
          jax.block_until_ready(step(*step_args))
        kernels = sorted(kernel_anatomy.gpu_kernel_times(pathlib.Path(trace_dir)))
      mask = "causal" if args.causal else "full"
      cells = "  ".join(f"{name} {n}/{args.runs - 1} runs differ (max {d:.3g})" for name, (n, d) in result.items())
      print(f"{impl:>14} seq {seq} d{args.head_dim} {mask}: {cells}")
      for name in kernels:
        print(f"{'':>16}kernel {name[:110]}")


if __name__ == "__main__":
  main()
