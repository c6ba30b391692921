"""GPU kernel time of a call, read from a `jax.profiler` trace.

`jax.profiler.trace(log_dir)` writes ``plugins/profile/<run>/<host>.trace.json.gz``
under `log_dir`: gzipped Chrome trace-event JSON, ``{"traceEvents": [...]}``.
Each device is a process whose ``process_name`` metadata event names it
(``/device:GPU:0``); on it, each CUDA stream is a thread whose ``thread_name``
starts with ``Stream #`` (``Stream #13(Compute,Memset)``), and every kernel,
memset and copy that ran on it is a complete event (``"ph": "X"``) with its
start ``ts`` and duration ``dur`` in microseconds. Other threads of a device
(``XLA Ops``, ``XLA Modules``, ``Steps`` where a converter derives them) span
the same work again, and the host process (``/host:CPU``) holds the
launches, so both are left out. A CPU run has no device process: no
activities.

The device time of a call is the sum of its activities' durations, the
figure kernel-time results are published as: free of the host's launch and
dispatch time that a wall clock includes (activities that overlap on
several streams each count in full).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import jax

_DEVICE_PREFIX = "/device:GPU"
_STREAM_PREFIX = "Stream #"


@dataclasses.dataclass(frozen=True)
class DeviceActivity:
  """One kernel, memset or copy on a GPU stream."""

  name: str  # the kernel's name, e.g. "flash2_fwd_mosaic", or "Memset"
  device: str  # the process name, e.g. "/device:GPU:0"
  stream: str  # the thread name, e.g. "Stream #13(Compute)"
  start_us: float
  duration_us: float


def newest_trace_file(log_dir: str | pathlib.Path) -> pathlib.Path | None:
  """The latest ``plugins/profile/*/*.trace.json.gz`` under `log_dir`, or None."""
  files = list(pathlib.Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
  return max(files, key=lambda p: p.stat().st_mtime) if files else None


def read_trace(path: str | pathlib.Path) -> dict[str, Any]:
  with gzip.open(path, "rt") as f:
    return json.load(f)


def device_activities(trace: Mapping[str, Any]) -> list[DeviceActivity]:
  """The complete events on the GPU streams of `trace` (a parsed trace file), in file order."""
  events = trace.get("traceEvents", [])
  devices: dict[Any, str] = {}
  threads: dict[tuple[Any, Any], str] = {}
  for e in events:
    if e.get("ph") != "M":
      continue
    name = e.get("args", {}).get("name", "")
    if e.get("name") == "process_name" and name.startswith(_DEVICE_PREFIX):
      devices[e.get("pid")] = name
    elif e.get("name") == "thread_name":
      threads[e.get("pid"), e.get("tid")] = name
  streams = {key: name for key, name in threads.items() if key[0] in devices and name.startswith(_STREAM_PREFIX)}
  return [
      DeviceActivity(e.get("name", ""), devices[key[0]], streams[key], float(e.get("ts", 0.0)), float(e.get("dur", 0.0)))
      for e in events
      if e.get("ph") == "X" and (key := (e.get("pid"), e.get("tid"))) in streams
  ]


def profile(call: Callable[[int], Any], calls: int, log_dir: str | pathlib.Path) -> pathlib.Path | None:
  """Runs ``call(0) .. call(calls - 1)`` back to back under the profiler,
  synchronising once at the end; returns the trace file written under
  `log_dir` (None if the profiler wrote none)."""
  with jax.profiler.trace(str(log_dir)):
    jax.block_until_ready([call(i) for i in range(calls)])
  return newest_trace_file(log_dir)


def device_ms_per_call(call: Callable[[int], Any], calls: int) -> float | None:
  """Milliseconds of GPU activity per call over `calls` profiled calls, or
  None where the trace holds none (no GPU, or the profiler cannot see it).

  `call` should be warm (compiled and run before), or the trace holds the
  first run's extra work."""
  with tempfile.TemporaryDirectory(prefix="jax_flash2_bench_trace_") as log_dir:
    path = profile(call, calls, log_dir)
    activities = device_activities(read_trace(path)) if path is not None else []
  if not activities:
    return None
  return sum(a.duration_us for a in activities) / calls / 1e3


@dataclasses.dataclass(frozen=True)
class DeviceTime:
  """Milliseconds per call of one device's activities: all of them, and the
  collectives' (NCCL kernels) among them."""

  total_ms: float
  comm_ms: float


def device_ms_by_device(call: Callable[[int], Any], calls: int, keep: str | None = None) -> dict[str, DeviceTime]:
  """`device_ms_per_call` for each device of a multi-device call
  ({"/device:GPU:0": DeviceTime, ...}; empty where the trace holds no
  activity). A collective's kernel runs on a stream of its own, so where it
  overlaps the compute it counts in full in total_ms: total_ms - comm_ms is
  then the compute, and comm_ms the transfers' own time. keep: a path to
  copy the trace file to (for reading the steps' overlap in Perfetto)."""
  with tempfile.TemporaryDirectory(prefix="jax_flash2_bench_trace_") as log_dir:
    path = profile(call, calls, log_dir)
    activities = device_activities(read_trace(path)) if path is not None else []
    if keep is not None and path is not None:
      pathlib.Path(keep).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(path, keep)
  out: dict[str, list[float]] = {}
  for a in activities:
    totals = out.setdefault(a.device, [0.0, 0.0])
    totals[0] += a.duration_us
    if "nccl" in a.name.lower():
      totals[1] += a.duration_us
  return {device: DeviceTime(t / calls / 1e3, c / calls / 1e3) for device, (t, c) in sorted(out.items())}
