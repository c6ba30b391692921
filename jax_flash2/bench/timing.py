"""Building, compiling and timing one mode of one implementation.

Every timed function is compiled ahead of time (`jax.jit(...).lower().compile()`)
and run `warmup` times. Then `iters` rounds are timed: each round launches
calls back to back and synchronises once (``time.perf_counter`` around the
round, `jax.block_until_ready` on its last call), giving one per-call time;
the median over rounds is reported. Launching back to back keeps host
dispatch off the GPU's critical path, as a training loop does; timing each
call alone adds the dispatch gap to every call (on the H200 that read cuDNN
10-15% slow, and noisily). A round also pays a fixed start and sync (about
0.22 ms on the H200), so it launches as many calls as fill `ROUND_SECONDS`
(at least `CALLS_PER_ROUND`): short calls then read their steady-state time
rather than a share of that latency. Calls rotate over a few independent
sets of random normal inputs so that no run reads inputs a previous run left
in L2.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_flash2.bench.impls import AttentionFn
from jax_flash2.bench.spec import Shape


@dataclasses.dataclass(frozen=True)
class Inputs:
  """q, k, v and an output cotangent dout, random normal, in the shape's dtype."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  dout: jax.Array


def make_inputs(shape: Shape, seed: int) -> Inputs:
  dtype = jnp.dtype(shape.dtype)
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  draw = lambda key, s: jax.random.normal(key, s, jnp.float32).astype(dtype)
  x = Inputs(
      q=draw(kq, shape.q_shape),
      k=draw(kk, shape.kv_shape),
      v=draw(kv, shape.kv_shape),
      dout=draw(kd, shape.q_shape),
  )
  jax.block_until_ready(dataclasses.astuple(x))
  return x


def fwd_bwd_fn(attn: AttentionFn) -> Callable[..., tuple[jax.Array, ...]]:
  """(q, k, v, dout) -> (out, dq, dk, dv): forward and backward in one function."""

  def f(q, k, v, dout):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(dout))

  return f


def _apply(fn, *args):
  return fn(*args)


@dataclasses.dataclass
class Prepared:
  """A compiled function and the argument tuples the timed calls rotate over."""

  compiled: Any  # jax.stages.Compiled
  args: list[tuple]

  def __call__(self, i: int):
    return self.compiled(*self.args[i % len(self.args)])


def prepare(attn: AttentionFn, mode: str, inputs: list[Inputs], compiled: Any = None,
            compiler_options: Mapping[str, Any] | None = None) -> Prepared:
  """Compiles `mode` of `attn` (with XLA's `compiler_options`, if any) and
  lays out its arguments.

  fwd: attn(q, k, v). bwd: the pullback of ``jax.vjp(attn, q, k, v)``, built
  once here (the forward runs here, outside any timed region) and applied to
  each input set's cotangent. fwd+bwd: `fwd_bwd_fn`. `compiled` reuses an
  executable compiled earlier for the same shape and mode.
  """
  if mode == "fwd":
    args = [(x.q, x.k, x.v) for x in inputs]
    fn = attn
  elif mode == "bwd":
    x0 = inputs[0]
    _, pullback = jax.vjp(attn, x0.q, x0.k, x0.v)
    args = [(pullback, x.dout) for x in inputs]
    fn = _apply
  elif mode == "fwd+bwd":
    args = [(x.q, x.k, x.v, x.dout) for x in inputs]
    fn = fwd_bwd_fn(attn)
  else:
    raise ValueError(f"unknown mode {mode!r}")
  if compiled is None:
    compiled = jax.jit(fn).lower(*args[0]).compile(compiler_options=compiler_options)
  return Prepared(compiled=compiled, args=args)


# The fewest calls a timed round launches (and the calls a kernel-time trace
# holds), and the time a round's calls should fill, within a most.
CALLS_PER_ROUND = 5
ROUND_SECONDS = 0.02
MAX_CALLS_PER_ROUND = 200


def round_size(call_seconds: float | None) -> int:
  """Calls a timed round launches, from one synchronised call's seconds
  (None: unknown, the fewest)."""
  if call_seconds is None:
    return CALLS_PER_ROUND
  return min(MAX_CALLS_PER_ROUND, max(CALLS_PER_ROUND, math.ceil(ROUND_SECONDS / max(call_seconds, 1e-9))))


def time_calls(prepared: Prepared, warmup: int, iters: int, calls_per_round: int | None = None) -> list[float]:
  """Per-call seconds of each of `iters` timed rounds, after `warmup` untimed
  calls; calls_per_round None: sized by the last warm-up call (`round_size`)."""
  call_seconds = None
  for i in range(warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(prepared(i))
    call_seconds = time.perf_counter() - t0
  calls = calls_per_round or round_size(call_seconds)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    for i in range(calls):
      # Only the last call's outputs are held: the runtime frees each
      # earlier one's buffers once its call has run, as a training loop
      # does, and one stream runs the calls in order.
      result = prepared(i)
    jax.block_until_ready(result)
    times.append((time.perf_counter() - t0) / calls)
    del result
  return times


def median_ms(times: list[float]) -> float:
  return statistics.median(times) * 1e3


def time_fn_ms(fn: Callable[..., Any], *args, warmup: int = 2, iters: int = 7,
               calls_per_round: int | None = None) -> float:
  """Median per-call milliseconds of jax.jit(fn)(*args) by the bench's method
  (compiled ahead, `warmup` untimed calls, `iters` rounds of back-to-back
  calls): for the tools that time one kernel outside a sweep."""
  prepared = Prepared(compiled=jax.jit(fn).lower(*args).compile(), args=[args])
  return median_ms(time_calls(prepared, warmup=warmup, iters=iters, calls_per_round=calls_per_round))


def compiled_memory(compiled: Any) -> tuple[int | None, int | None]:
  """(argument + output + temp - alias bytes, temp bytes) from XLA's memory analysis."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # not every backend implements it
    return None, None
  if stats is None:
    return None, None
  total = (
      stats.argument_size_in_bytes
      + stats.output_size_in_bytes
      + stats.temp_size_in_bytes
      - stats.alias_size_in_bytes
  )
  return int(total), int(stats.temp_size_in_bytes)


def device_peak_bytes() -> int | None:
  """The device's peak_bytes_in_use so far in this process (never reset), or None."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:
    return None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return int(stats["peak_bytes_in_use"])


_OOM_MARKERS = ("resource_exhausted", "out of memory", "oom when allocating", "failed to allocate")
_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "not implemented")


def classify(exc: BaseException) -> tuple[str, str]:
  """(status, short message) of an exception: "OOM", "unsupported" or "error"."""
  text = f"{type(exc).__name__}: {exc}"
  low = text.lower()
  first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
  short = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
  if len(short) > 160:
    short = short[:157] + "..."
  if any(m in low for m in _OOM_MARKERS):
    return "OOM", short
  if isinstance(exc, NotImplementedError) or any(m in low for m in _UNSUPPORTED_MARKERS):
    return "unsupported", short
  return "error", short


def free() -> None:
  """Drops Python garbage so device buffers of a finished cell go back."""
  gc.collect()
