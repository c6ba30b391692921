"""Terminal tables, JSON, CSV and PNG plots of a run."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import enum
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from typing import Any, Iterable

from jax_flash2.bench.memory import summarize
from jax_flash2.bench.spec import (
    CELL_FIELDS,
    SHORT_DTYPE,
    CellResult,
    CheckResult,
    MemoryStep,
    SweepConfig,
    mask_text,
    varlen_text,
)

# 2: cells, checks and memory steps gained window_left, window_right and
# segments; cells gained flops_convention and visible_fraction.
# 3: cells gained kernel_ms and kernel_tflops; config gained left_out,
# kernel_time and save; metadata gained the CUDA, cuDNN, CUDA plugin and
# tokamax versions.
# 4: cells, checks and memory steps gained softcap and varlen; config gained
# softcaps and varlens.
# 5: --decode runs write "kind": "decode" with decode cells (bench/decode.py:
# DecodeCell: bytes, tb_s, copy_fraction, ...) and the copy bandwidth in the metadata.
# 6: "ms" from timed rounds of as many calls as fill timing.ROUND_SECONDS (at
# least 5), where every round was 5 calls (short calls read ~45 us of the
# round's start and sync on the H200).
SCHEMA_VERSION = 6
_MIB = 1 << 20


# ------------------------------------------------------------------ metadata


def _nvidia_smi() -> dict[str, str] | None:
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return None
  try:
    proc = subprocess.run(
        [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
    )
  except (OSError, subprocess.SubprocessError):
    return None
  if proc.returncode != 0 or not proc.stdout.strip():
    return None
  name, driver, memory = (part.strip() for part in (proc.stdout.strip().splitlines()[0].split(",") + ["", ""])[:3])
  return {"name": name, "driver_version": driver, "memory_total": memory}


def _package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _cuda_plugin() -> tuple[str | None, str | None]:
  """(distribution, version) of jax's CUDA plugin, or (None, None) without one."""
  for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
    if (version := _package_version(name)) is not None:
      return name, version
  return None, None


def _cuda_versions() -> dict[str, int | None]:
  """The CUDA runtime, cuDNN and CUPTI versions jax's CUDA plugin loaded
  (their integer encodings, e.g. cuDNN 9.10.2 as 91002), None without it."""
  from jax._src.lib import cuda_versions  # None where no CUDA plugin is installed

  out: dict[str, int | None] = {}
  for key, fn in (("cuda_runtime_version", "cuda_runtime_get_version"), ("cudnn_version", "cudnn_get_version"),
                  ("cupti_version", "cupti_get_version")):
    try:
      out[key] = int(getattr(cuda_versions, fn)())
    except Exception:  # noqa: BLE001 - no plugin, an older one without the function, or no library
      out[key] = None
  return out


def metadata(argv: list[str], now: datetime.datetime | None = None) -> dict[str, Any]:
  """Where and how the run happened: device, driver, library versions, date (UTC), command line."""
  import jax
  import jaxlib

  import jax_flash2

  now = now or datetime.datetime.now(datetime.timezone.utc)
  devices = jax.devices()
  smi = _nvidia_smi()
  plugin, plugin_version = _cuda_plugin()
  return {
      "date_utc": now.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": shlex.join(["jax-flash2-bench", *argv]),
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "compute_capability": getattr(devices[0], "compute_capability", None),
      "gpu_name": smi["name"] if smi else (devices[0].device_kind if jax.default_backend() == "gpu" else None),
      "driver_version": smi["driver_version"] if smi else None,
      "gpu_memory_total": smi["memory_total"] if smi else None,
      **_cuda_versions(),
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "jax_cuda_plugin": plugin,
      "jax_cuda_plugin_version": plugin_version,
      "jax_flash2_version": jax_flash2.__version__,
      "tokamax_version": _package_version("tokamax"),
      "python_version": sys.version.split()[0],
      "platform": platform.platform(),
      "hostname": platform.node(),
  }


# -------------------------------------------------------------------- tables


def _fmt_ms(ms: float) -> str:
  return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def _fmt_tflops(t: float) -> str:
  if t >= 10:
    return f"{t:.1f}"
  return f"{t:.2f}" if t >= 0.1 else f"{t:.2g}"


def _fmt_err(e: float | None) -> str:
  if e is None:
    return "-"
  if not math.isfinite(e):
    return str(e)
  return f"{e:.2e}"


def _fmt_mib(b: int | None) -> str:
  return "-" if b is None else f"{b / _MIB:.1f}"


def _cell_text(c: CellResult | None) -> tuple[str, ...] | str:
  """(ms, kernel ms, TFLOP/s, kernel TFLOP/s, vs cuDNN) of an ok cell, else what happened."""
  if c is None:
    return "-"
  if c.status == "ok":
    ratio = "-" if c.speed_vs_cudnn is None else f"{c.speed_vs_cudnn:.2f}x"
    kernel_ms = "-" if c.kernel_ms is None else _fmt_ms(c.kernel_ms)
    kernel_tflops = "-" if c.kernel_tflops is None else _fmt_tflops(c.kernel_tflops)
    return (_fmt_ms(c.ms), kernel_ms, _fmt_tflops(c.tflops), kernel_tflops, ratio)
  if c.status == "error":
    return f"error: {c.error or ''}"
  return c.status


def _mask(r: CellResult | CheckResult) -> str:
  """"causal", "non-causal", plus the window, segments, varlen lengths and softcap where set."""
  window = None if r.window_left is None and r.window_right is None else (r.window_left, r.window_right)
  return mask_text(r.causal, window, r.segments, r.softcap, r.varlen)


def _group(cells: Iterable[CellResult]) -> dict[tuple, dict[tuple[int, int, int], dict[str, CellResult]]]:
  """(dtype, head_dim, mask, mode) -> (seqlen, batch, heads) -> impl -> cell, in run order."""
  groups: dict[tuple, dict] = {}
  for c in cells:
    rows = groups.setdefault((c.dtype, c.head_dim, _mask(c), c.mode), {})
    rows.setdefault((c.seqlen, c.batch, c.heads, c.kv_heads), {})[c.impl] = c
  return groups


# Widths of format_table's columns: ms, kernel ms, TFLOP/s, kernel TFLOP/s, vs cuDNN.
_TABLE_COLUMNS = (("ms", 9), ("kern ms", 9), ("TFLOP/s", 8), ("kern TF/s", 9), ("vs cuDNN", 8))
TABLE_LEGEND = ("ms: wall clock per call (median); kern: GPU kernel time per call, from a profiler trace "
                "('-': none traced); TFLOP/s from each")


def format_table(cells: list[CellResult], impls: Iterable[str]) -> str:
  """One block per (dtype, head_dim, mask, mode); implementations side by side.

  Each implementation shows its wall-clock ms (median) and kernel ms, the
  TFLOP/s of each and, when cuDNN is in the run, its speed relative to cuDNN
  (cuDNN ms / its ms: above 1 is faster than cuDNN), or the reason the cell
  did not run.
  """
  impls = list(impls)
  columns = _TABLE_COLUMNS if "cudnn" in impls else _TABLE_COLUMNS[:-1]
  width = sum(w for _, w in columns) + len(columns) - 1
  lines = [TABLE_LEGEND, ""]
  for (dtype, head_dim, mask, mode), rows in _group(cells).items():
    lines.append(f"== {mode}  head_dim {head_dim}  {mask}  {SHORT_DTYPE.get(dtype, dtype)} ==")
    left = f"{'seq':>6} {'batch':>5} {'heads':>7}"
    lines.append(left + " | " + " | ".join(f"{name:^{width}}" for name in impls))
    sub = " ".join(f"{title:>{w}}" for title, w in columns)
    lines.append(" " * len(left) + " | " + " | ".join(sub for _ in impls))
    for (seqlen, batch, heads, kv_heads), by_impl in rows.items():
      h = f"{heads}" if heads == kv_heads else f"{heads}/{kv_heads}"
      parts = []
      for name in impls:
        text = _cell_text(by_impl.get(name))
        if isinstance(text, tuple):
          parts.append(" ".join(f"{t:>{w}}" for t, (_, w) in zip(text, columns)))
        else:
          parts.append(f"{text[:width]:>{width}}")
      lines.append(f"{seqlen:>6} {batch:>5} {h:>7} | " + " | ".join(parts))
    lines.append("")
  return "\n".join(lines)


def format_memory_table(cells: list[CellResult], impls: Iterable[str]) -> str:
  """fwd+bwd memory in MiB: XLA's compiled footprint and the device high-water mark.

  "device peak" is the process-wide peak_bytes_in_use after the cell; a "*"
  marks a mark that rose during the cell (so it is that cell's own peak),
  otherwise the cell needed at most that much.
  """
  impls = list(impls)
  fb = [c for c in cells if c.mode == "fwd+bwd"]
  if not fb:
    return ""
  width = 24
  lines = ["fwd+bwd memory, MiB (compiled = XLA argument+output+temp bytes of the executable; "
           "device peak = process high-water mark, * = set by this cell; min = inputs+outputs+lse)"]
  for (dtype, head_dim, mask, _), rows in _group(fb).items():
    lines.append(f"== fwd+bwd memory  head_dim {head_dim}  {mask}  {SHORT_DTYPE.get(dtype, dtype)} ==")
    left = f"{'seq':>6} {'batch':>5} {'min':>9}"
    lines.append(left + " | " + " | ".join(f"{name:^{width}}" for name in impls))
    sub = f"{'compiled':>11} {'device peak':>12}"
    lines.append(" " * len(left) + " | " + " | ".join(f"{sub:>{width}}" for _ in impls))
    for (seqlen, batch, _, _), by_impl in rows.items():
      any_cell = next(iter(by_impl.values()))
      parts = []
      for name in impls:
        c = by_impl.get(name)
        if c is None:
          parts.append(f"{'-':>{width}}")
        elif c.status != "ok":
          parts.append(f"{c.status[:width]:>{width}}")
        else:
          peak = _fmt_mib(c.device_peak_bytes) + ("*" if c.device_peak_new else "")
          parts.append(f"{_fmt_mib(c.compiled_bytes):>11} {peak:>12}")
      lines.append(f"{seqlen:>6} {batch:>5} {_fmt_mib(any_cell.min_bytes):>9} | " + " | ".join(parts))
    lines.append("")
  return "\n".join(lines)


def format_checks(checks: list[CheckResult]) -> str:
  """Relative error ||x - ref|| / ||ref|| against the float32 reference."""
  if not checks:
    return ""
  width = max(10, *(len(_mask(r)) for r in checks))
  iw = max(15, *(len(r.impl) for r in checks))
  lines = [
      "Accuracy vs float32 reference, ||x - ref|| / ||ref||:",
      f"{'impl':<{iw}} {'dtype':>5} {'hd':>4} {'mask':>{width}} {'shape (b,s,h)':>16} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}",
  ]
  for r in checks:
    h = f"{r.heads}" if r.heads == r.kv_heads else f"{r.heads}/{r.kv_heads}"
    where = f"{r.batch},{r.seqlen},{h}"
    head = f"{r.impl:<{iw}} {SHORT_DTYPE.get(r.dtype, r.dtype):>5} {r.head_dim:>4} {_mask(r):>{width}} {where:>16}"
    if r.status == "ok":
      errs = (r.rel_err_out, r.rel_err_dq, r.rel_err_dk, r.rel_err_dv)
      lines.append(head + " " + " ".join(f"{_fmt_err(e):>9}" for e in errs))
    else:
      text = r.status if r.status != "error" else f"error: {r.error}"
      lines.append(head + " " + text)
  return "\n".join(lines) + "\n"


def format_memory_probe(steps: list[MemoryStep]) -> str:
  if not steps:
    return ""
  s0 = steps[0]
  lines = [
      f"Memory probe: longest fwd+bwd sequence (batch {s0.batch}, {s0.heads} heads, head_dim {s0.head_dim}, "
      f"{'causal' if s0.causal else 'non-causal'}, {SHORT_DTYPE.get(s0.dtype, s0.dtype)}); MiB",
      f"{'impl':<15} {'max seq':>8} {'compiled':>10} {'device peak':>12} {'min':>9}  first failure",
  ]
  for impl, entry in summarize(steps).items():
    ok: MemoryStep | None = entry["ok_step"]
    fail: MemoryStep | None = entry["first_failure"]
    fail_text = "-" if fail is None else f"seq {fail.seqlen}: {fail.status}" + (
        f" ({fail.error})" if fail.status == "error" or fail.status == "unsupported" else ""
    )
    if ok is None:
      lines.append(f"{impl:<15} {'none':>8} {'-':>10} {'-':>12} {'-':>9}  {fail_text}")
      continue
    peak = _fmt_mib(ok.device_peak_bytes) + ("*" if ok.device_peak_new else "")
    lines.append(
        f"{impl:<15} {ok.seqlen:>8} {_fmt_mib(ok.compiled_bytes):>10} {peak:>12} {_fmt_mib(ok.min_bytes):>9}  {fail_text}"
    )
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------ JSON, CSV, PNG


def _clean(value: Any) -> Any:
  """JSON-safe: non-finite floats become None, enums their values."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, dict):
    return {k: _clean(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_clean(v) for v in value]
  return value


def write_json(
    path: str,
    meta: dict[str, Any],
    cfg: SweepConfig,
    cells: list[CellResult],
    checks: list[CheckResult],
    memory_steps: list[MemoryStep],
) -> None:
  doc = {
      "schema_version": SCHEMA_VERSION,
      "metadata": meta,
      "config": dataclasses.asdict(cfg),
      "notes": {
          "tiny_cpu_run": cfg.tiny,
          "ms": "median over iters rounds of the per-call time of back-to-back calls synchronised once per round, "
          "each round as many calls as fill timing.ROUND_SECONDS (at least timing.CALLS_PER_ROUND), so that the "
          "round's fixed start and sync stay out of short calls' time",
          "kernel_ms": "GPU time per call: the summed durations of the kernels, memsets and copies on the GPU's "
          "streams in a jax.profiler trace of timing.CALLS_PER_ROUND back-to-back calls after the timed rounds, "
          "divided by the calls; null without a GPU (config.kernel_time false) or where the trace holds none",
          "kernel_tflops": "flops / kernel_ms",
          "config.left_out": "implementations asked for (requested) or defaults that cannot run on this machine, "
          "and why",
          "tflops": "flops / ms; flops by the cell's flops_convention: dense = fwd 4*B*H*S*S*D, causal-half = "
          "half that (plain causal, FlashAttention convention), visible = 4*D*B*H per visible (query, key) pair "
          "(windows, segments, varlen); bwd 2.5x fwd, fwd+bwd 3.5x",
          "visible_fraction": "visible (query, key) pairs / S*S, exact",
          "window_left, window_right": "local window: key j visible to query i iff i-left <= j <= i+right "
          "(null: unbounded; both null: no window), combined with causal",
          "segments": "each row packs this many equal contiguous sequences (1: no segment ids)",
          "softcap": "scores become softcap * tanh(scores / softcap) (null: none); FLOPs unchanged",
          "varlen": "lengths of the sequences packed end to end into the cell's one row (batch 1, seqlen their "
          "sum), self-attention within each: flash_attention_varlen, or for a -segids implementation "
          "flash_attention with them as segment ids (null: not packed; the CSV spells them 1024,3072,512)",
          "speed_vs_cudnn": "cuDNN ms / this ms (> 1: faster than cuDNN)",
          "compiled_bytes": "XLA memory_analysis of the fwd+bwd executable: argument+output+temp-alias",
          "device_peak_bytes": "process-wide peak_bytes_in_use after the cell (never reset); "
          "the cell's own peak only where device_peak_new is true",
          "min_bytes": "q,k,v,dout + out,dq,dk,dv (input dtype) + float32 lse",
      },
      "checks": [r.to_record() | {"rel_err_grad": r.rel_err_grad} for r in checks],
      "cells": [c.to_record() for c in cells],
      "memory_probe": [s.to_record() for s in memory_steps],
  }
  with open(path, "w") as f:
    json.dump(_clean(doc), f, indent=1, allow_nan=False)


def write_csv(path: str, cells: list[CellResult]) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(CELL_FIELDS))
    writer.writeheader()
    for c in cells:
      record = _clean(c.to_record())
      if record["varlen"] is not None:
        record["varlen"] = varlen_text(record["varlen"])
      writer.writerow({k: ("" if v is None else v) for k, v in record.items()})


def write_plots(out_dir: str, cells: list[CellResult], impls: Iterable[str], title: str = "") -> list[str]:
  """TFLOP/s against sequence length: one panel per head_dim x mask (causal,
  window, segments, varlen lengths, softcap) x mode, one line per implementation (solid: wall clock;
  dashed: kernel time, where traced). One PNG per dtype. Returns the files
  written."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  impls = list(impls)
  written = []
  for dtype in dict.fromkeys(c.dtype for c in cells):
    dcells = [c for c in cells if c.dtype == dtype]
    rows = list(dict.fromkeys((c.head_dim, _mask(c)) for c in dcells))
    modes = list(dict.fromkeys(c.mode for c in dcells))
    fig, axes = plt.subplots(
        len(rows), len(modes), figsize=(4.2 * len(modes), 3.2 * len(rows)), squeeze=False, constrained_layout=True
    )
    for i, (head_dim, mask) in enumerate(rows):
      for j, mode in enumerate(modes):
        ax = axes[i][j]
        panel = [c for c in dcells if c.head_dim == head_dim and _mask(c) == mask and c.mode == mode]
        for name in impls:
          ok = sorted((c for c in panel if c.impl == name and c.status == "ok"), key=lambda c: c.seqlen)
          if not ok:
            continue
          (line,) = ax.plot([c.seqlen for c in ok], [c.tflops for c in ok], marker="o", label=name)
          if kernel := [c for c in ok if c.kernel_tflops is not None]:
            ax.plot([c.seqlen for c in kernel], [c.kernel_tflops for c in kernel], marker=".", linestyle="--",
                    color=line.get_color(), label=f"{name} (kernel)")
        ax.set_xscale("log", base=2)
        seqs = sorted({c.seqlen for c in panel})
        ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s) for s in seqs])
        ax.minorticks_off()
        ax.set_title(f"{mode}, d={head_dim}, {mask}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
          ax.legend(fontsize=7)
    fig.suptitle(f"{title} {SHORT_DTYPE.get(dtype, dtype)}".strip())
    path = os.path.join(out_dir, f"tflops_{SHORT_DTYPE.get(dtype, dtype)}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


# ------------------------------------------------------------------ folders


def make_dated_dir(parent: str, now: datetime.datetime) -> str:
  """Creates `parent`/<UTC date-time of `now`> (20261202T031532Z; -2, -3, ...
  appended where a run of the same second took the name) and returns it."""
  base = os.path.join(parent, now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
  path, n = base, 1
  while True:
    try:
      os.makedirs(path)
      return path
    except FileExistsError:
      n += 1
      path = f"{base}-{n}"


def write_results(
    out_dir: str,
    meta: dict[str, Any],
    cfg: SweepConfig,
    cells: list[CellResult],
    checks: list[CheckResult],
    memory_steps: list[MemoryStep],
) -> tuple[list[str], str | None]:
  """Writes results.json, results.csv and (cfg.plot, matplotlib installed)
  the plots into `out_dir`; returns (the files written, why plots were not)."""
  os.makedirs(out_dir, exist_ok=True)
  written = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.csv")]
  write_json(written[0], meta, cfg, cells, checks, memory_steps)
  write_csv(written[1], cells)
  if not (cfg.plot and cells):
    return written, None
  title = meta["device_kind"] + (" (CPU/interpret, not GPU figures)" if cfg.tiny else "")
  try:
    written += write_plots(out_dir, cells, cfg.impls, title=title)
  except ImportError:
    return written, "matplotlib is not installed (pip install 'jax_flash2[bench]'): no plots"
  return written, None
