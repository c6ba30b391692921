"""Runs one backward kernel for a few seconds per variant, for a clock and power log taken beside it.

  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit --format=csv -lms 100 > smi.csv &
  PYTHONPATH=. python tools/power_probe.py --kernel dkv --variants default elementwise=0 --seconds 4

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
import mosaic_bwd_bench  # noqa: E402  (tools/: its variant parser, with the measurement experiments)

from jax_flash2 import flash_attention  # noqa: E402
from jax_flash2.mosaic import backward as mosaic_bwd  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", choices=["dkv", "dq"], default="dkv")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--variants", nargs="*", default=["default", "elementwise=0"])
  parser.add_argument("--seconds", type=float, default=4.0)
  args = parser.parse_args()
  batch, heads = max(16384 // args.seq, 1), 2048 // args.head_dim
  shape = (batch, args.seq, heads, args.head_dim)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.PRNGKey(0), 4))
  out, lse = flash_attention(q, k, v, causal=args.causal, return_lse=True, backend="triton")
  delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
  print(jax.devices()[0].device_kind, args.kernel, shape, "causal" if args.causal else "non-causal", flush=True)
  for spec in args.variants:
    config, experiment = mosaic_bwd_bench._variant(mosaic_bwd.default_backward_config(args.head_dim), spec)
    with experiment():
      fn = jax.jit(lambda *a, config=config: getattr(mosaic_bwd, args.kernel)(*a, causal=args.causal, config=config))
      jax.block_until_ready(fn(q, k, v, do, lse, delta))
    time.sleep(1.0)  # a gap in the log between variants
    start, calls = time.time(), 0
    while time.time() - start < args.seconds:
      jax.block_until_ready([fn(q, k, v, do, lse, delta) for _ in range(20)])
      calls += 20
    end = time.time()
    print(f"{spec:>16}: {start:.3f} .. {end:.3f}  {1e3 * (end - start) / calls:.3f} ms per call", flush=True)


if __name__ == "__main__":
  main()
