"""What the lab's A/B scripts time: one compile of a function, the bench's
wall clock per call and its GPU kernel time per call (lab equipment)."""

from __future__ import annotations

import jax

from jax_flash2.bench import kernel_trace, timing

TRACED_CALLS = 10


def wall_and_kernel_ms(fn, *args, warmup: int = 2, iters: int = 9) -> tuple[float, float | None]:
  """(median wall ms per call over `iters` of the bench's timed rounds, GPU
  ms per call over TRACED_CALLS profiled calls) of fn(*args), compiled once
  for both (a variant patched in at trace time must be in force here)."""
  prepared = timing.Prepared(compiled=jax.jit(fn).lower(*args).compile(), args=[args])
  wall = timing.median_ms(timing.time_calls(prepared, warmup, iters))
  return wall, kernel_trace.device_ms_per_call(prepared, TRACED_CALLS)


def cell(mode: str, wall: float, kernel: float, base: dict) -> str:
  """A printed result, its kernel time against the first one of its mode
  (recorded in `base`)."""
  base.setdefault(mode, kernel)
  return f"{mode} wall {wall:7.3f} kernel {kernel:7.3f} ({kernel / base[mode] - 1:+.1%})"
