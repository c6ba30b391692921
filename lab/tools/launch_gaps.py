"""Where a call's wall clock goes beyond its kernels: device idle gaps and host launch work.

  python lab/tools/launch_gaps.py --seqlen 2048 --batch 8 --causal --mode fwd --out DIR
  python lab/tools/launch_gaps.py --summarize DIR/*.trace.json.gz

Compiles one flash_attention call (or forward+backward), warms it up, times
`--calls` back-to-back calls by wall clock (as the bench does), then runs the
same calls under jax.profiler and keeps the trace (DIR/NAME.trace.json.gz).
The summary prints, per call: wall time, device busy time (union of the
GPU activities), the idle gaps between consecutive activities (largest
first, with the kernels on either side), and the host's events by total
time (the launch API calls, XLA's thunks, the custom calls' host work), with
each kernel's launch-to-start latency where the trace links them by
correlation id. A GPU idle gap that matches a host span per launch means the
host cannot run ahead of the kernels.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import shutil
import statistics
import tempfile
import time


def _load(path):
  with gzip.open(path, "rt") as f:
    return json.load(f)


def summarize(path: str, calls: int | None = None, top: int = 25) -> None:
  trace = _load(path)
  events = trace.get("traceEvents", [])
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M":
      name = e.get("args", {}).get("name", "")
      if e.get("name") == "process_name":
        procs[e.get("pid")] = name
      elif e.get("name") == "thread_name":
        threads[e.get("pid"), e.get("tid")] = name
  device = [e for e in events if e.get("ph") == "X" and procs.get(e.get("pid"), "").startswith("/device:GPU")
            and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream #")]
  host = [e for e in events if e.get("ph") == "X" and procs.get(e.get("pid"), "").startswith("/host")]
  device.sort(key=lambda e: e["ts"])
  print(f"== {path}")
  if not device:
    print("no device activity")
    return
  start, end = device[0]["ts"], max(e["ts"] + e["dur"] for e in device)
  busy, cur_s, cur_e = 0.0, None, None
  for e in device:
    s, t = e["ts"], e["ts"] + e["dur"]
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        busy += cur_e - cur_s
      cur_s, cur_e = s, t
    else:
      cur_e = max(cur_e, t)
  busy += cur_e - cur_s
  n = calls or 1
  print(f"device span {end - start:.1f} us, busy {busy:.1f} us, idle {end - start - busy:.1f} us"
        f" ({n} calls: busy {busy / n:.1f} us/call, span {(end - start) / n:.1f} us/call)")
  kernels = collections.defaultdict(list)
  for e in device:
    kernels[e["name"][:70]].append(e["dur"])
  print("device activities (count, mean us, total us):")
  for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {len(durs):4d} {statistics.mean(durs):9.1f} {sum(durs):10.1f}  {name}")
  gaps = []
  prev_end, prev_name = None, None
  for e in device:
    if prev_end is not None and e["ts"] > prev_end:
      gaps.append((e["ts"] - prev_end, prev_name, e["name"][:40]))
    if prev_end is None or e["ts"] + e["dur"] > prev_end:
      prev_end, prev_name = e["ts"] + e["dur"], e["name"][:40]
  gaps.sort(reverse=True)
  print(f"idle gaps: {len(gaps)}, total {sum(g[0] for g in gaps):.1f} us; largest:")
  for g, a, b in gaps[:12]:
    print(f"  {g:8.1f} us  after {a}  before {b}")
  # Launch-to-start latency by correlation id.
  by_corr = {}
  for e in host:
    c = e.get("args", {}).get("correlation_id")
    if c is not None:
      by_corr[str(c)] = e
  lat = collections.defaultdict(list)
  for e in device:
    c = e.get("args", {}).get("correlation_id")
    h = by_corr.get(str(c)) if c is not None else None
    if h is not None:
      lat[e["name"][:50]].append((e["ts"] - h["ts"], h["name"], h["dur"]))
  if lat:
    print("launch call -> kernel start (mean us; the host call's name and mean us):")
    for name, xs in lat.items():
      print(f"  {statistics.mean(x[0] for x in xs):9.1f}  {xs[0][1]} {statistics.mean(x[2] for x in xs):7.1f}  {name}")
  totals = collections.defaultdict(lambda: [0, 0.0])
  for e in host:
    t = totals[e["name"][:80]]
    t[0] += 1
    t[1] += e.get("dur", 0.0)
  print(f"host events by total time (count, total us, mean us) over {n} calls:")
  for name, (c, tot) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"  {c:5d} {tot:10.1f} {tot / c:8.1f}  {name}")
  host_span = (min(e["ts"] for e in host), max(e["ts"] + e.get("dur", 0) for e in host)) if host else (0, 0)
  print(f"host span {host_span[1] - host_span[0]:.1f} us")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--summarize", nargs="*")
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--window", type=int, nargs=2)
  ap.add_argument("--segments", type=int)
  ap.add_argument("--mode", choices=["fwd", "fwd+bwd"], default="fwd")
  ap.add_argument("--backend", default="auto")
  ap.add_argument("--decode", type=int, metavar="CACHE_LEN",
                  help="time flash_decode instead: one query of --heads heads over a full cache of"
                       " CACHE_LEN keys and --kv-heads heads")
  ap.add_argument("--kv-heads", type=int)
  ap.add_argument("--out", default="gaps_out")
  ap.add_argument("--name")
  args = ap.parse_args()
  if args.summarize:
    for p in args.summarize:
      summarize(p, args.calls)
    return

  import jax
  import jax.numpy as jnp
  import jax_flash2
  from jax_flash2.bench.kernel_trace import newest_trace_file

  b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys)
  kw = dict(causal=args.causal, backend=args.backend)
  if args.window:
    kw["window_size"] = tuple(args.window)
  if args.segments:
    ids = jnp.repeat(jnp.arange(args.segments, dtype=jnp.int32), s // args.segments)[None].repeat(b, 0)
    kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
  attn = lambda q, k, v: jax_flash2.flash_attention(q, k, v, **kw)
  if args.decode:
    kvh = args.kv_heads or h
    q1 = q[:, :1]
    kc, vc = (jax.random.normal(kk, (b, args.decode, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[:2])
    lens = jnp.full((b,), args.decode, jnp.int32)
    fn = lambda q, kc, vc, lens: jax_flash2.flash_decode(q, kc, vc, lens, backend=args.backend)
    xs = (q1, kc, vc, lens)
  elif args.mode == "fwd":
    fn, xs = attn, (q, k, v)
  else:
    def fn(q, k, v, do):
      out, pull = jax.vjp(attn, q, k, v)
      return (out, *pull(do))
    xs = (q, k, v, do)
  compiled = jax.jit(fn).lower(*xs).compile()
  for _ in range(3):
    jax.block_until_ready(compiled(*xs))
  walls = []
  for _ in range(7):
    t0 = time.perf_counter()
    jax.block_until_ready([compiled(*xs) for _ in range(args.calls)])
    walls.append((time.perf_counter() - t0) / args.calls * 1e6)
  # Host time to dispatch one call (returns before the GPU finishes).
  t0 = time.perf_counter()
  rs = [compiled(*xs) for _ in range(args.calls)]
  dispatch = (time.perf_counter() - t0) / args.calls * 1e6
  jax.block_until_ready(rs)
  name = args.name or (f"decode_b{b}_cache{args.decode}_d{d}" if args.decode else
                       f"{args.mode}_b{b}_s{s}_d{d}{'_causal' if args.causal else ''}")
  print(f"{name}: wall {statistics.median(walls):.1f} us/call (rounds of {args.calls}), host dispatch {dispatch:.1f} us/call")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      jax.block_until_ready([compiled(*xs) for _ in range(args.calls)])
    path = newest_trace_file(tmp)
    dest = out / f"{name}.trace.json.gz"
    shutil.copyfile(path, dest)
  summarize(str(dest), args.calls, top=15)


if __name__ == "__main__":
  main()
