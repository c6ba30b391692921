"""Runs forward+backward once per implementation inside a profiler range, for Nsight Compute.

  ncu --clock-control none --profile-from-start off --set full -k regex:'flash2_(fwd|bwd_d)|sdpa' \\
      -o prof python lab/tools/ncu_profile.py --seq 4096 --head-dim 128 \\
      --bwd two=default --bwd fused=fused_dq=1+dkv_persistent=0+stages=2
  ncu --import prof.ncu-rep --page details

Every implementation is compiled and run once first, outside the range
(cuProfilerStart / cuProfilerStop through the CUDA driver), so that ncu,
started with --profile-from-start off, sees one forward+backward of each and
nothing of the compilation. `--bwd NAME=SPEC` / `--fwd NAME=SPEC` name
Mosaic config variants as lab/tools/cli_ab.py does (none: flash2-mosaic's
defaults); cuDNN runs last unless --no-cudnn. Each is built as
lab/tools/kernel_anatomy.py builds the bench CLI's problem (16384 tokens per
batch, hidden 2048, bf16).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import jax

import cli_ab  # lab/tools/
import kernel_anatomy  # lab/tools/


class _ProfilerRange:
  """cuProfilerStart/Stop on the device's primary context (the one JAX uses)."""

  def __init__(self):
    self.cuda = ctypes.CDLL("libcuda.so.1")
    self.ctx = ctypes.c_void_p()
    self._check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0), "cuDevicePrimaryCtxRetain")

  def _check(self, status: int, what: str) -> None:
    if status:
      raise RuntimeError(f"{what} failed with CUresult {status}")

  def __enter__(self):
    self._check(self.cuda.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
    self._check(self.cuda.cuProfilerStart(), "cuProfilerStart")

  def __exit__(self, *exc):
    self._check(self.cuda.cuProfilerStop(), "cuProfilerStop")
    self._check(self.cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--fwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--bwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--no-cudnn", action="store_true")
  args = parser.parse_args(argv)
  fwd, bwd = cli_ab._specs(args.fwd, "--fwd"), cli_ab._specs(args.bwd, "--bwd")
  names = [cli_ab._register(name, fwd.get(name), bwd.get(name)) for name in dict.fromkeys([*fwd, *bwd])]
  names = (names or ["flash2-mosaic"]) + ([] if args.no_cudnn else ["cudnn"])
  steps = {name: kernel_anatomy.fwd_bwd_step(name, args.seq, args.head_dim, args.causal) for name in names}
  for step, step_args in steps.values():  # compilation, module loads, cuDNN plans: outside the range
    jax.block_until_ready(step(*step_args))
  with _ProfilerRange():
    for name, (step, step_args) in steps.items():
      print(f"profiling {name}", flush=True)
      jax.block_until_ready(step(*step_args))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
