"""Where the Mosaic kernels' warpgroups spend their time, from Mosaic GPU's profiler.

  PYTHONPATH=. python lab/tools/mosaic_profile.py --seq 2048 --head-dim 128 [--causal] \\
      [--variants default fused_dq=1+dkv_persistent=0+stages=2] [--batch 1 --heads 8] [--keep DIR]
  PYTHONPATH=. python lab/tools/mosaic_profile.py --kernel forward --head-dim 64 --seq 8192 --heads 4
  PYTHONPATH=. python lab/tools/mosaic_profile.py --seq 16384 --heads 16 --causal --window 1024 0   # or --segments 8

Runs flash_attention(..., backend="mosaic", mosaic_config=...) once per
variant (a MosaicBackwardConfig for --kernel backward, which runs jax.vjp:
the forward and the backward kernels; a MosaicForwardConfig for --kernel
forward), with every Mosaic GPU kernel traced inside compiled with Mosaic
GPU's profiler: this tool swaps jax.experimental.pallas.mosaic_gpu's
CompilerParams for one that adds profile_space / profile_dir while it
traces (the kernels build theirs at trace time), so the product has no
profiling switch of its own. Each kernel writes a Perfetto trace of the
named regions (jax.named_scope in the kernel bodies) of every warpgroup of
every CTA (open one in ui.perfetto.dev; --keep keeps them). Prints, per
kernel and warpgroup role (consumer 0 and 1, producer), the mean time per
CTA in each region, inclusive of regions inside it, and its share of the
warpgroup's time from its first event to its last. Profiled kernels run
somewhat slower (a clock read per region boundary). Each CTA buffers
--events events per warpgroup in its shared memory (48 bytes an event),
which the kernels nearly fill: 512 fit beside the d128 kernels, a dozen
steps' worth; the rest are dropped, so the summary is of each CTA's first
steps. Variants use lab/tools/cli_ab.py's syntax.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import pathlib
import sys
import tempfile

ROLES = ("consumer 0", "consumer 1", "producer")  # warpgroup order: the consumers, then the producer


def region_intervals(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
  """{region: [(start, end), ...]} from one warpgroup's B/E events (nested
  regions each get their own interval)."""
  by_region = collections.defaultdict(list)
  open_regions = []
  for event in sorted(events, key=lambda e: e["ts"]):
    if event["ph"] == "B":
      open_regions.append(event)
    elif event["ph"] == "E" and open_regions:
      begin = open_regions.pop()
      by_region[begin["name"]].append((begin["ts"], event["ts"]))
  return by_region


def summarize(trace: dict, warpgroups: int = len(ROLES)) -> dict[str, dict[str, tuple[float, float]]]:
  """{role: {region: (mean microseconds per CTA, share of the span)}} from a
  Mosaic GPU profiler trace (Perfetto JSON: B/E events per warpgroup, tid =
  1 + warpgroup + warpgroups * CTA, ts in microseconds). A region nested in
  another counts in both; "(span)" is the warpgroup's first-to-last time."""
  by_tid = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_tid[event["tid"]].append(event)
  totals = collections.defaultdict(lambda: collections.defaultdict(float))  # role -> region -> us
  spans = collections.defaultdict(float)
  counts = collections.Counter()
  for tid, events in by_tid.items():
    role = ROLES[(tid - 1) % warpgroups] if warpgroups == len(ROLES) else f"warpgroup {(tid - 1) % warpgroups}"
    for name, intervals in region_intervals(events).items():
      totals[role][name] += sum(end - start for start, end in intervals)
    spans[role] += max(e["ts"] for e in events) - min(e["ts"] for e in events)
    counts[role] += 1
  summary = {}
  for role in sorted(totals, key=lambda r: (r not in ROLES, ROLES.index(r) if r in ROLES else r)):
    span = spans[role] / counts[role]
    regions = {name: (t / counts[role], t / spans[role]) for name, t in totals[role].items()}
    summary[role] = {"(span)": (span, 1.0), **dict(sorted(regions.items(), key=lambda kv: -kv[1][0]))}
  return summary


def format_summary(summary: dict[str, dict[str, tuple[float, float]]]) -> str:
  lines = []
  for role, regions in summary.items():
    lines.append(f"  {role}")
    lines += [f"    {name:<14} {us:>10.1f} us {share:>6.1%}" for name, (us, share) in regions.items()]
  return "\n".join(lines)


@contextlib.contextmanager
def profiled(events: int, directory: str):
  """Mosaic GPU kernels traced inside are compiled with the profiler:
  jax.experimental.pallas.mosaic_gpu.CompilerParams, which the kernels call
  at trace time, takes profile_space=events, profile_dir=directory and
  profile_bounds_check=True (a kernel with more events than room keeps its
  first ones) on top of whatever the kernel asks for."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  original = plgpu.CompilerParams

  def with_profiler(*args, **kwargs):
    kwargs.update(profile_space=events, profile_dir=directory, profile_bounds_check=True)
    return original(*args, **kwargs)

  plgpu.CompilerParams = with_profiler
  try:
    yield
  finally:
    plgpu.CompilerParams = original


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", choices=["backward", "forward"], default="backward")
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--window", nargs=2, type=int, default=None, metavar=("LEFT", "RIGHT"),
                      help="window_size (with --causal, RIGHT is capped at 0)")
  parser.add_argument("--segments", type=int, default=None, help="equal packed sequences as segment ids")
  parser.add_argument("--variants", nargs="*", default=["default"],
                      help="configs: 'default', or fields set on it as NAME=VALUE joined by '+'")
  parser.add_argument("--events", type=int, default=512, help="profiler events per warpgroup")
  parser.add_argument("--keep", default=None, help="keep the traces in this directory")
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp

  from jax_flash2 import defaults, flash_attention
  from jax_flash2.config import MosaicConfig

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import cli_ab  # lab/tools/: the variant syntax

  shape = (args.batch, args.seq, args.heads, args.head_dim)
  options = dict(causal=args.causal)
  if args.window is not None:
    options["window_size"] = tuple(args.window)
  if args.segments is not None:
    ids = jnp.repeat(jnp.arange(args.segments, dtype=jnp.int32), args.seq // args.segments)
    options["q_segment_ids"] = options["kv_segment_ids"] = jnp.broadcast_to(ids, (args.batch, args.seq))
  plain, segments = len(options) == 1, args.segments is not None
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.PRNGKey(0), 4))
  print(jax.devices()[0].device_kind, f"batch {args.batch}, seq {args.seq}, heads {args.heads}, "
        f"head_dim {args.head_dim}, {'causal' if args.causal else 'non-causal'}, window {args.window}, "
        f"segments {args.segments}")
  for spec in args.variants:
    directory = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="mosaic_profile_")) / spec.replace("=", "-")
    directory.mkdir(parents=True, exist_ok=True)
    if args.kernel == "forward":
      config = MosaicConfig(forward=cli_ab._variant(
          defaults.mosaic_forward(args.head_dim, seq_q=args.seq, causal=args.causal, segments=segments), spec))
      step = lambda q, k, v, do: flash_attention(q, k, v, **options, return_lse=True, backend="mosaic",
                                                 mosaic_config=config)
    else:
      config = MosaicConfig(backward=cli_ab._variant(
          defaults.mosaic_backward(args.head_dim, fused=plain, segments=segments), spec))

      def step(q, k, v, do, config=config):
        attn = lambda q, k, v: flash_attention(q, k, v, **options, backend="mosaic", mosaic_config=config)
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    with profiled(args.events, str(directory)):
      jax.block_until_ready(jax.jit(step)(q, k, v, do))  # traced, compiled and run inside
    jax.effects_barrier()  # the traces are written by host callbacks
    print(f"== {spec}")
    for path in sorted(directory.glob("*-trace.json")):
      print(f" {path.name.split('-')[0]}")
      print(format_summary(summarize(json.loads(path.read_text()))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
