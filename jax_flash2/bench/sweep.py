"""Running the grid: accuracy checks first, then every (impl, shape, mode) cell."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax_flash2.bench import check as check_lib
from jax_flash2.bench import flops as flops_lib
from jax_flash2.bench import impls as impls_lib
from jax_flash2.bench import kernel_trace, timing
from jax_flash2.bench.progress import Progress
from jax_flash2.bench.spec import CellResult, CheckResult, Shape, SweepConfig


def run_check(
    impl: impls_lib.Impl, shape: Shape, inputs: timing.Inputs, opts: impls_lib.Options, seed: int
) -> tuple[CheckResult, Any]:
  """Checks out, dq, dk, dv of `impl` against the float32 reference.

  Runs on `check_lib.check_shape(shape)` (cut down when the reference would be
  big). Returns the result and, when the check shape is the sweep shape, the
  compiled fwd+bwd executable so the fwd+bwd cell can reuse it.
  """
  cshape = check_lib.check_shape(shape)
  fields = dataclasses.asdict(cshape)
  reason = impl.supports(cshape, opts)
  if reason is not None:
    return CheckResult(impl=impl.name, status="unsupported", error=reason, **fields), None
  x = inputs if cshape == shape else timing.make_inputs(cshape, seed + 1000)
  compiled = None
  try:
    attn = impl.factory(cshape, opts)
    prepared = timing.prepare(attn, "fwd+bwd", [x], compiler_options=impl.compiler_options)
    compiled = prepared.compiled
    got = prepared(0)
    want = check_lib.reference_fwd_bwd_jit(
        x.q, x.k, x.v, x.dout, causal=cshape.causal, window=cshape.window, segments=cshape.segments,
        sinks=opts.sinks, softcap=cshape.softcap, varlen=cshape.varlen,
    )
    errs = [float(e) for e in check_lib.relative_errors(tuple(got), tuple(want))]
    del got, want, prepared
  except Exception as exc:  # noqa: BLE001 - every failure becomes a table entry
    status, short = timing.classify(exc)
    return CheckResult(impl=impl.name, status=status, error=short, **fields), None
  finally:
    timing.free()
  status, error = "ok", None
  if not all(math.isfinite(e) for e in errs):
    status, error = "error", "non-finite values in out or gradients"
  result = CheckResult(
      impl=impl.name,
      status=status,
      error=error,
      rel_err_out=errs[0],
      rel_err_dq=errs[1],
      rel_err_dk=errs[2],
      rel_err_dv=errs[3],
      **fields,
  )
  return result, compiled if cshape == shape else None


def _shape_fields(shape: Shape) -> dict[str, Any]:
  """A cell's shape fields plus how its FLOPs are counted (see flops.py)."""
  return dict(
      **dataclasses.asdict(shape),
      flops_convention=flops_lib.flops_convention(shape),
      visible_fraction=flops_lib.visible_fraction(shape),
  )


def _kernel_ms(prepared: timing.Prepared) -> float | None:
  """GPU time per call from a profiler trace of one round, or None.

  Run after the timed rounds, so that the profiler's overhead stays out of
  them; a profiler that fails (CUPTI unavailable, another trace running)
  costs the cell its kernel time only, not its wall-clock time.
  """
  try:
    return kernel_trace.device_ms_per_call(prepared, timing.CALLS_PER_ROUND)
  except Exception:  # noqa: BLE001 - see the docstring
    return None


def run_cell(
    impl: impls_lib.Impl,
    shape: Shape,
    mode: str,
    inputs: list[timing.Inputs],
    opts: impls_lib.Options,
    cfg: SweepConfig,
    compiled: Any = None,
) -> CellResult:
  """Compiles and times one cell; any failure is caught and becomes its status."""
  fields = dict(impl=impl.name, mode=mode, **_shape_fields(shape))
  flops = flops_lib.mode_flops(shape, mode)
  memory_fields: dict[str, Any] = {}
  if mode == "fwd+bwd":
    memory_fields["min_bytes"] = flops_lib.min_fwd_bwd_bytes(shape)
  reason = impl.supports(shape, opts)
  if reason is not None:
    return CellResult(status="unsupported", error=reason, flops=flops, **fields, **memory_fields)
  prepared = None
  try:
    attn = impl.factory(shape, opts)
    prepared = timing.prepare(attn, mode, inputs, compiled, impl.compiler_options)
    peak_before = timing.device_peak_bytes()
    times = timing.time_calls(prepared, cfg.warmup, cfg.iters)
    peak_after = timing.device_peak_bytes()
    kernel_ms = _kernel_ms(prepared) if cfg.kernel_time else None
    if mode == "fwd+bwd":
      total, temp = timing.compiled_memory(prepared.compiled)
      memory_fields.update(compiled_bytes=total, compiled_temp_bytes=temp, device_peak_bytes=peak_after)
      if peak_after is not None and peak_before is not None:
        memory_fields["device_peak_new"] = peak_after > peak_before
  except Exception as exc:  # noqa: BLE001 - every failure becomes a table entry
    status, short = timing.classify(exc)
    return CellResult(status=status, error=short, flops=flops, **fields, **memory_fields)
  finally:
    del prepared
    timing.free()
  ms = timing.median_ms(times)
  return CellResult(
      status="ok",
      ms=ms,
      ms_min=min(times) * 1e3,
      iters=len(times),
      kernel_ms=kernel_ms,
      flops=flops,
      tflops=flops_lib.tflops_per_s(flops, ms),
      kernel_tflops=flops_lib.tflops_per_s(flops, kernel_ms) if kernel_ms is not None else None,
      **fields,
      **memory_fields,
  )


def run_sweep(cfg: SweepConfig, progress: Progress | None = None) -> tuple[list[CellResult], list[CheckResult]]:
  """All cells of `cfg` (and, unless cfg.check is off, one check per impl and group)."""
  opts = impls_lib.run_options(cfg)
  impls = [impls_lib.get(name) for name in cfg.impls]
  progress = progress or Progress(0, enabled=False)
  cells: list[CellResult] = []
  checks: list[CheckResult] = []
  for dtype, head_dim, causal, window, segments, softcap in cfg.groups():
    for index, (seqlen, varlen) in enumerate(cfg.rows()):
      shape = cfg.shape(dtype, head_dim, causal, seqlen, window, segments, softcap, varlen)
      inputs: list[timing.Inputs] | None = None
      try:
        inputs = [timing.make_inputs(shape, cfg.seed + i) for i in range(cfg.input_sets)]
      except Exception as exc:  # noqa: BLE001 - e.g. the inputs alone do not fit
        status, short = timing.classify(exc)
        for impl in impls:
          for mode in cfg.modes:
            fields = dict(impl=impl.name, mode=mode, **_shape_fields(shape))
            cells.append(
                CellResult(status=status, error=f"inputs: {short}", flops=flops_lib.mode_flops(shape, mode), **fields)
            )
            progress.update(f"{impl.name} {mode} {shape.describe()}")
        timing.free()
        continue
      for impl in impls:
        reuse = None
        if index == 0 and cfg.check:
          result, reuse = run_check(impl, shape, inputs[0], opts, cfg.seed)
          checks.append(result)
          progress.update(f"check {impl.name} {result.status}")
        for mode in cfg.modes:
          cells.append(
              run_cell(impl, shape, mode, inputs, opts, cfg, compiled=reuse if mode == "fwd+bwd" else None)
          )
          progress.update(f"{impl.name} {mode} {shape.describe()}")
        del reuse
      del inputs
      timing.free()
  return annotate(cells, checks), checks


def num_steps(cfg: SweepConfig) -> int:
  """Progress steps of `run_sweep`: cells plus checks."""
  checks = len(cfg.groups()) * len(cfg.impls) if cfg.check and cfg.rows() else 0
  return cfg.num_cells() + checks


def annotate(cells: list[CellResult], checks: list[CheckResult]) -> list[CellResult]:
  """Adds speed_vs_cudnn (cuDNN ms / cell ms) and the check errors to each cell."""
  def mask(r: CellResult | CheckResult) -> tuple:
    # A group's check ran on its first row (its varlen lengths perhaps cut): it stands for every row.
    return (r.causal, r.window_left, r.window_right, r.segments, r.softcap, r.varlen is not None)

  cudnn_ms = {
      (c.dtype, c.batch, c.heads, c.kv_heads, c.seqlen, c.varlen, c.head_dim, *mask(c), c.mode): c.ms
      for c in cells
      if c.impl == "cudnn" and c.status == "ok"
  }
  errs = {(r.impl, r.dtype, r.head_dim, *mask(r)): r for r in checks if r.status == "ok"}
  out = []
  for c in cells:
    key = (c.dtype, c.batch, c.heads, c.kv_heads, c.seqlen, c.varlen, c.head_dim, *mask(c), c.mode)
    updates: dict[str, Any] = {}
    if c.status == "ok" and key in cudnn_ms:
      updates["speed_vs_cudnn"] = cudnn_ms[key] / c.ms
    r = errs.get((c.impl, c.dtype, c.head_dim, *mask(c)))
    if r is not None:
      updates["rel_err_out"] = r.rel_err_out
      updates["rel_err_grad"] = r.rel_err_grad
    out.append(dataclasses.replace(c, **updates))
  return out
