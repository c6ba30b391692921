"""Runs one backward kernel for a few seconds per variant, for a clock and power log taken beside it.

  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit --format=csv -lms 100 > smi.csv &
  PYTHONPATH=. python lab/tools/power_probe.py --kernel dkv --variants default elementwise=0 --seconds 4
  PYTHONPATH=. python lab/tools/power_probe.py --kernel cudnn flash2-mosaic   # forward+backward of each, side by side

Prints, per variant, the wall-clock window (time.time(), to match the log's
timestamps) in which the kernel ran back to back, and its mean time per
call. Whether a kernel is held back by the GPU's power limit (a lower SM
clock while it runs) is read from the log, not from here.
"""

from __future__ import annotations

import argparse
import sys
import time
import pathlib

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kernel_anatomy  # noqa: E402  (tools/: the bench implementations' forward+backward)
import mosaic_bwd_bench  # noqa: E402  (tools/: its variant parser, with the measurement experiments)

from jax_flash2 import flash_attention  # noqa: E402
from jax_flash2.mosaic import backward as mosaic_bwd  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", nargs="+", default=["dkv"],
                      help="dkv or dq (the Mosaic backward kernels, per variant), or a bench implementation "
                           "(jax_flash2.bench.impls, e.g. cudnn, flash2-mosaic: its forward+backward, variants "
                           "ignored)")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--variants", nargs="*", default=["default", "elementwise=0"])
  parser.add_argument("--seconds", type=float, default=4.0)
  args = parser.parse_args()
  batch, heads = max(16384 // args.seq, 1), 2048 // args.head_dim
  shape = (batch, args.seq, heads, args.head_dim)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.PRNGKey(0), 4))
  print(jax.devices()[0].device_kind, shape, "causal" if args.causal else "non-causal", flush=True)
  for kernel in args.kernel:
    if kernel in ("dkv", "dq"):
      out, lse = flash_attention(q, k, v, causal=args.causal, return_lse=True, backend="triton")
      delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
      for spec in args.variants:
        config, experiment = mosaic_bwd_bench._variant(mosaic_bwd.default_backward_config(args.head_dim), spec)
        with experiment():
          fn = jax.jit(lambda *a, config=config, kernel=kernel: getattr(mosaic_bwd, kernel)(
              *a, causal=args.causal, config=config))
          jax.block_until_ready(fn(q, k, v, do, lse, delta))
        _run_back_to_back(f"{kernel} {spec}", fn, (q, k, v, do, lse, delta), args.seconds)
    else:
      fn, fn_args = kernel_anatomy.fwd_bwd_step(kernel, args.seq, args.head_dim, args.causal)
      jax.block_until_ready(fn(*fn_args))
      _run_back_to_back(f"{kernel} fwd+bwd", fn, fn_args, args.seconds)


def _run_back_to_back(label: str, fn, args, seconds: float) -> None:
  """Calls fn(*args) in batches of 20 for `seconds`; prints the window."""
  time.sleep(1.0)  # a gap in the log between runs
  start, calls = time.time(), 0
  while time.time() - start < seconds:
    jax.block_until_ready([fn(*args) for _ in range(20)])
    calls += 20
  end = time.time()
  print(f"{label:>24}: {start:.3f} .. {end:.3f}  {1e3 * (end - start) / calls:.3f} ms per call", flush=True)


if __name__ == "__main__":
  main()
