"""Which GPU kernels an attention implementation's forward+backward runs, and how long each takes.

  PYTHONPATH=. python tools/kernel_anatomy.py --impls cudnn mosaic --seq 4096 16384 --head-dim 128

Traces a jitted forward+backward (grad of sum(out * dO) with respect to q, k
and v) with jax.profiler after a warm-up, reads the trace's GPU kernel events
(the Chrome-format *.trace.json.gz that the profiler writes) and prints, per
kernel name, the launches per call and the mean time per call in
microseconds, heaviest first. What it is for: whether cuDNN's backward is one
kernel computing dQ as well (dQ added across K/V tiles, five matmul units per
block) or several (bench/NOTES.md, session 11). On a machine without a GPU
it finds no device events and says so.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp

from jax_flash2 import flash_attention

CALLS = 5  # traced calls; the table is per call


def _attention(impl: str, causal: bool):
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=impl)


def gpu_kernel_times(trace_dir: pathlib.Path) -> dict[str, list[float]]:
  """Durations (us) of every event on a GPU device's timelines, by name."""
  trace_file = max(trace_dir.glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
  with gzip.open(trace_file, "rb") as f:
    events = json.load(f)["traceEvents"]
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name" and "/device:GPU" in e["args"].get("name", "")}
  times = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids:
      times[e["name"]].append(float(e.get("dur", 0.0)))
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["cudnn", "mosaic"], help="cudnn or a flash_attention backend")
  parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  for seq in args.seq:
    batch, heads = max(16384 // seq, 1), 2048 // args.head_dim
    shape = (batch, seq, heads, args.head_dim)
    q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.PRNGKey(0), 4))
    for impl in args.impls:
      attention = _attention(impl, args.causal)
      step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))
      for _ in range(3):
        jax.block_until_ready(step(q, k, v))
      with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
          for _ in range(CALLS):
            jax.block_until_ready(step(q, k, v))
        times = gpu_kernel_times(pathlib.Path(trace_dir))
      print(f"\n{impl}  shape {shape}  {'causal' if args.causal else 'non-causal'}  fwd+bwd, per call:")
      if not times:
        print("  no GPU kernel events in the trace")
        continue
      total = sum(map(sum, times.values())) / CALLS
      for name, durations in sorted(times.items(), key=lambda item: -sum(item[1])):
        per_call = sum(durations) / CALLS
        print(f"  {len(durations) / CALLS:5.1f} x {per_call:9.1f} us  {100 * per_call / total:5.1f}%  {name[:150]}")
      print(f"  total {total:.1f} us")


if __name__ == "__main__":
  main()
