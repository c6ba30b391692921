"""Which GPU kernels an attention implementation's forward+backward runs, and how long each takes.

  PYTHONPATH=. python lab/tools/kernel_anatomy.py --impls cudnn flash2-mosaic --seq 4096 16384 --head-dim 128

Traces an implementation's forward+backward as the bench CLI builds and runs
it (jax_flash2.bench: SweepConfig.shape, impls, timing.fwd_bwd_fn; 16k tokens, hidden 2048,
bf16) with jax.profiler after a warm-up, reads the trace's GPU kernel events
(the Chrome-format *.trace.json.gz that the profiler writes) and prints, per
kernel name, the launches per call and the mean time per call in
microseconds, heaviest first. What it is for: whether cuDNN's backward is one
kernel computing dQ as well (dQ added across K/V tiles, five matmul units per
block) or several (lab/NOTES.md, session 11). On a machine without a GPU
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

from jax_flash2.bench import impls, timing
from jax_flash2.bench.spec import SweepConfig

CALLS = 5  # traced calls; the table is per call


def fwd_bwd_step(impl: str, seq: int, head_dim: int, causal: bool):
  """(step, args): the jitted forward+backward of bench implementation
  `impl` (e.g. cudnn, flash2-mosaic) on the bench convention's problem at
  `seq`, and its inputs; step(*args) runs it once."""
  sweep = SweepConfig(seqlens=(seq,), head_dims=(head_dim,), causal=(causal,), dtypes=("bfloat16",),
                      modes=("fwd+bwd",), impls=(impl,))
  shape = sweep.shape("bfloat16", head_dim, causal, seq)
  entry = impls.get(impl)
  attn = entry.factory(shape, impls.Options(platform=jax.default_backend()))
  x = timing.make_inputs(shape, seed=0)
  args = (x.q, x.k, x.v, x.dout)
  step = jax.jit(timing.fwd_bwd_fn(attn)).lower(*args).compile(compiler_options=entry.compiler_options)
  return step, args


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
  parser.add_argument("--impls", nargs="+", default=["cudnn", "flash2-mosaic"],
                      help="bench implementations (jax_flash2.bench.impls)")
  parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  for seq in args.seq:
    for impl in args.impls:
      step, step_args = fwd_bwd_step(impl, seq, args.head_dim, args.causal)
      for _ in range(3):
        jax.block_until_ready(step(*step_args))
      with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
          for _ in range(CALLS):
            jax.block_until_ready(step(*step_args))
        times = gpu_kernel_times(pathlib.Path(trace_dir))
      shape = step_args[0].shape
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
