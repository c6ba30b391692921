"""How the two consumer warpgroups of a Mosaic kernel overlap, from its profiler traces.

  python lab/tools/trace_overlap.py TRACE.json [TRACE.json ...] [--busy scores grads] [--warpgroups 3]

Reads traces written by lab/tools/mosaic_profile.py (--keep) and prints, per
trace, averaged over CTAs from the first event of either consumer to the last:
  - for each named region, the share of time each consumer spends in it and
    the share both spend in it at once (two consumers in `softmax` at once:
    the tensor cores have only what either issued before);
  - `neither busy`: the share of time in which neither consumer is inside a
    `--busy` region. In the backward kernels' plain steps a consumer issues
    its matmuls and waits for them inside `scores` and `grads`, so outside
    those no matmul of either consumer is in flight: the tensor cores idle.
Only each CTA's first events are traced (the profiler's buffer), so this
describes the first steps of each CTA.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mosaic_profile import region_intervals  # noqa: E402  (lab/tools/: the same B/E pairing as its summary)


def _union(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def _length(intervals) -> float:
  return sum(end - start for start, end in intervals)


def _intersection(a, b):
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      out.append([start, end])
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def overlap(trace: dict, *, warpgroups: int = 3, busy: tuple[str, ...] = ("scores", "grads")) -> dict[str, float]:
  """{measure: share of the consumers' span, averaged over CTAs} (see the module docstring)."""
  by_tid = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    if event.get("ph") in ("B", "E"):
      by_tid[event["tid"]].append(event)
  ctas = collections.defaultdict(dict)  # cta -> consumer -> {region: intervals}
  for tid, events in by_tid.items():
    cta, role = divmod(tid - 1, warpgroups)
    if role < 2:
      ctas[cta][role] = region_intervals(events)
  totals, count = collections.Counter(), 0
  for regions in ctas.values():
    if len(regions) != 2:
      continue
    everything = [iv for role in regions.values() for ivs in role.values() for iv in ivs]
    span = max(e for _, e in everything) - min(s for s, _ in everything)
    if span <= 0:
      continue
    count += 1
    names = set(regions[0]) | set(regions[1])
    for name in names:
      a, b = _union(regions[0].get(name, [])), _union(regions[1].get(name, []))
      totals[f"{name}: consumer 0"] += _length(a) / span
      totals[f"{name}: consumer 1"] += _length(b) / span
      totals[f"{name}: both"] += _length(_intersection(a, b)) / span
    busy_any = _union([iv for role in regions.values() for name in busy for iv in role.get(name, [])])
    totals["neither busy"] += 1 - _length(busy_any) / span
  return {name: value / max(count, 1) for name, value in sorted(totals.items())} | {"CTAs": count}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("traces", nargs="+")
  parser.add_argument("--warpgroups", type=int, default=3, help="warpgroups per CTA in the trace (consumers first)")
  parser.add_argument("--busy", nargs="*", default=["scores", "grads"],
                      help="regions inside which a consumer's matmuls are in flight")
  args = parser.parse_args()
  for path in args.traces:
    result = overlap(json.loads(pathlib.Path(path).read_text()), warpgroups=args.warpgroups, busy=tuple(args.busy))
    print(path)
    for name, value in result.items():
      print(f"  {name:<28} {value:>7.1%}" if name != "CTAs" else f"  {name:<28} {value:>7}")


if __name__ == "__main__":
  main()
