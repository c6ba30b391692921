"""Where the CPU suite's time goes, per test: a pytest plugin, and its summary.

Plugin (not loaded by the suite; name it with -p):

    CSTATS_DIR=/tmp/cstats PYTHONPATH=lab/tools python -m pytest -q -n 2 -p ci_compile_stats

writes one JSON line per test to $CSTATS_DIR/<xdist worker>.jsonl: wall and
process CPU seconds (setup, call and teardown), jax's tracing, lowering and
XLA backend-compile seconds and counts (jax.monitoring's durations) by
function name, and a hash of every module XLA compiled (its text without
symbol names and pointers) with the compile's seconds. jax is touched only
once the first test runs: conftest.py must set XLA_FLAGS before jax loads.

Summary:

    python lab/tools/ci_compile_stats.py /tmp/cstats

prints per file: tests, wall, CPU, compile, lowering, tracing seconds and
compiles; compile seconds by program name; and the modules compiled in more
than one test (what folding identical programs could still save).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import threading
import time

_current = {"id": None}
_acc: dict = collections.defaultdict(lambda: collections.defaultdict(float))
_lock = threading.Lock()
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_installed: list = []


def _listener(event, duration, **kwargs):
  name = _EVENTS.get(event)
  if name is None or _current["id"] is None:
    return
  with _lock:
    acc = _acc[_current["id"]]
    acc[name] += duration
    acc["n_" + name] += 1
    by_name = acc.setdefault(name + "_by_name", collections.Counter())
    by_name[kwargs.get("fun_name", "?")] += duration


def _install():
  if _installed:
    return
  _installed.append(True)
  from jax._src import compiler, monitoring

  monitoring.register_event_duration_secs_listener(_listener)
  compile_and_load = compiler.backend_compile_and_load

  def hashed(backend, module, *args, **kwargs):
    start = time.perf_counter()
    result = compile_and_load(backend, module, *args, **kwargs)
    seconds = time.perf_counter() - start
    try:
      text = module.operation.get_asm(enable_debug_info=False, large_elements_limit=16)
      text = re.sub(r"@[\w.$-]+", "@F", re.sub(r"\d{7,}", "N", text))
      digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    except Exception:  # noqa: BLE001 - a hash is a nicety
      digest = "?"
    if _current["id"] is not None:
      with _lock:
        _acc[_current["id"]].setdefault("modules", []).append((digest, round(seconds, 3)))
    return result

  compiler.backend_compile_and_load = hashed


def _hookwrapper(fn):
  import pytest

  return pytest.hookimpl(hookwrapper=True)(fn)


try:
  import pytest as _pytest  # noqa: F401
except ImportError:  # the summary alone
  pass
else:

  @_hookwrapper
  def pytest_runtest_protocol(item, nextitem):
    _install()
    _current["id"] = item.nodeid
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    record = {k: dict(v) if isinstance(v, collections.Counter) else v if isinstance(v, list) else round(v, 3)
              for k, v in _acc.pop(item.nodeid, {}).items()}
    record.update(id=item.nodeid, wall=round(time.perf_counter() - wall, 3), cpu=round(time.process_time() - cpu, 3))
    _current["id"] = None
    folder = os.environ.get("CSTATS_DIR", "cstats")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")


def summary(folder: str) -> None:
  import glob

  records = [json.loads(line) for path in glob.glob(os.path.join(folder, "*.jsonl")) for line in open(path)]
  files = collections.defaultdict(collections.Counter)
  for r in records:
    c = files[r["id"].split("::")[0]]
    c["tests"] += 1
    for key in ("wall", "cpu", "compile", "lower", "trace", "n_compile"):
      c[key] += r.get(key, 0)
  keys = ("tests", "wall", "cpu", "compile", "lower", "trace", "n_compile")
  print(f"{'file':36s}" + "".join(f"{k:>10s}" for k in keys))
  total = collections.Counter()
  for name, c in sorted(files.items(), key=lambda x: -x[1]["cpu"]):
    total.update(c)
    print(f"{name:36s}" + "".join(f"{c[k]:10.1f}" for k in keys))
  print(f"{'total':36s}" + "".join(f"{total[k]:10.1f}" for k in keys))
  by_name, count = collections.Counter(), collections.Counter()
  for r in records:
    for name, seconds in r.get("compile_by_name", {}).items():
      by_name[name] += seconds
      count[name] += 1
  print("\nbackend compile by program name")
  for name, seconds in by_name.most_common(15):
    print(f"{seconds:8.1f} s {count[name]:5d}  {name}")
  uses = collections.defaultdict(list)
  for r in records:
    for digest, seconds in r.get("modules", []):
      uses[digest].append((seconds, r["id"]))
  repeated = sorted(((sum(s for s, _ in u) - max(s for s, _ in u), u) for u in uses.values() if len(u) > 1),
                    key=lambda x: -x[0])
  print(f"\nmodules compiled in more than one test: {len(repeated)}, "
        f"{sum(x for x, _ in repeated):.1f} s beyond one compile each")
  for extra, u in repeated[:15]:
    print(f"{extra:6.2f} s x{len(u)}  {u[0][1]}  |  {u[1][1]}")


if __name__ == "__main__":
  import sys

  summary(sys.argv[1])
