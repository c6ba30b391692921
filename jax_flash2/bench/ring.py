"""`--ring`: ring attention's scaling, each device against one device doing its work alone.

Each cell runs jax_flash2.ring_attention under shard_map over a mesh of P
devices (axis "sp"; P = jax.device_count() or --devices), the sequence
S = P x tokens_per_device split along it, and times it as the other modes
do: the wall clock of back-to-back calls (timing.py) and, on GPUs, the
kernel time of each device from a profiler trace (the busiest device's; the
NCCL kernels' share apart, `comm_kernel_ms`). Beside it the same per-device
work runs unsharded on one device (`RingShape.single_kv_len`): one
flash_attention call whose visible (query, key) pairs are exactly those one
ring device attends, with no collective and no merge. Their FLOPs are
equal, so efficiency = single ms / ring ms is also the ring's per-device
TFLOP/s over the single device's.

The layout fixes the mask: ZIGZAG is causal (the layout that balances
causal work), CONTIGUOUS non-causal. With n =
tokens_per_device and c = n / 2 (one zigzag chunk), a device attends

- contiguous non-causal: its n queries to all S keys, n x S pairs; alone:
  q [batch, n] over k, v [batch, S], non-causal.
- zigzag causal: chunks r and 2P-1-r, (2P-1) c^2 + c (c+1) = 2P c^2 + c
  pairs on every device (the causal problem's S (S+1) / 2 pairs over P);
  alone: q [batch, n] over k, v [batch, (P+1) c], causal (bottom-right:
  query i sees keys j <= i + (P-1) c), sum over i of (i + (P-1) c + 1) =
  2P c^2 + c, tiled as the ring's work is: an n x n causal diagonal beside
  an unmasked n x (P-1) c block.

FLOPs (per device): 4 x batch x heads x head_dim per visible pair forward
(the FlashAttention convention over visible pairs, flops.py's "visible"),
x3.5 for fwd+bwd. Each (impl, dtype, head_dim, layout, strategy) group's
ring output and gradients are checked once against the unsharded float32
reference (check.reference_fwd_bwd) on its first row, its sequence cut
while the reference would be big.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jax_flash2.backends import Backend
from jax_flash2.bench import check as check_lib
from jax_flash2.bench import flops as flops_lib
from jax_flash2.bench import kernel_trace, timing
from jax_flash2.bench.progress import Progress
from jax_flash2.bench.spec import SHORT_DTYPE, TimedRun
from jax_flash2.ring import RingLayout, RingStrategy

AXIS = "sp"
SEQ = P(None, AXIS)  # [batch, seq, heads, head_dim] split along the sequence
RING_MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
# The step backend of each --ring implementation; interpret mode (no GPU) runs flash2 on the Triton kernels.
RING_IMPLS: dict[str, tuple[Backend, str]] = {
    "flash2": (Backend.AUTO, "ring_attention(backend='auto'): the flash kernels per step (Triton in interpret mode)"),
    "flash2-triton": (Backend.TRITON, "ring_attention(backend='triton')"),
    "flash2-mosaic": (Backend.MOSAIC,
                      "ring_attention(backend='mosaic'); steps the Mosaic kernels cannot take run Triton"),
    "xla": (Backend.XLA, "ring_attention(backend='xla'): plain XLA attention per step (quadratic memory per step)"),
}
GPU_RING_DEFAULTS = dict(tokens_per_device=(8192, 16384), head_dims=(128,), batch=1, heads=None, impls=("flash2",),
                         warmup=3, iters=20)
CPU_RING_DEFAULTS = dict(tokens_per_device=(32,), head_dims=(32,), batch=1, heads=2, impls=("xla",), warmup=1,
                         iters=2)
# Largest float32 score tensor [batch, heads, S, S] the check's reference may build (as check.py's).
_REFERENCE_SCORE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class RingShape:
  """One ring problem: q [batch, S, heads, head_dim], k and v [batch, S,
  kv_heads, head_dim], S = num_devices x tokens_per_device, split along S."""

  num_devices: int
  tokens_per_device: int
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  layout: RingLayout
  strategy: RingStrategy

  @property
  def causal(self) -> bool:
    return self.layout is RingLayout.ZIGZAG

  @property
  def seqlen(self) -> int:
    return self.num_devices * self.tokens_per_device

  @property
  def single_kv_len(self) -> int:
    """Keys of the one-device call that does one ring device's work (module docstring)."""
    if self.causal:
      return (self.num_devices + 1) * self.tokens_per_device // 2
    return self.seqlen

  @property
  def pairs_per_device(self) -> int:
    """Visible (query, key) pairs one device attends, the same on every device."""
    n, p = self.tokens_per_device, self.num_devices
    if self.causal:
      c = n // 2
      return 2 * p * c * c + c
    return n * self.seqlen

  def forward_flops(self) -> int:
    """Per device: 4 x batch x heads x head_dim per visible pair."""
    return 4 * self.batch * self.heads * self.head_dim * self.pairs_per_device

  def describe(self) -> str:
    mask = "causal" if self.causal else "full"
    heads = f"h{self.heads}" + (f"/{self.kv_heads}kv" if self.kv_heads != self.heads else "")
    return (f"P{self.num_devices} {self.layout.value} {mask} {self.strategy.value} n{self.tokens_per_device} "
            f"b{self.batch} {heads} d{self.head_dim} {SHORT_DTYPE.get(self.dtype, self.dtype)}")


@dataclasses.dataclass(frozen=True)
class RingSweepConfig(TimedRun):
  """The grid of a --ring run: dtypes x head_dims x layouts x strategies x
  tokens_per_device, each in `modes` for each of `impls` (RING_IMPLS), over
  `num_devices` devices (timing, checks and output: `TimedRun`)."""

  tokens_per_device: tuple[int, ...]
  num_devices: int
  layouts: tuple[RingLayout, ...]
  strategies: tuple[RingStrategy, ...]
  head_dims: tuple[int, ...]
  dtypes: tuple[str, ...]
  modes: tuple[str, ...]
  batch: int
  heads: int
  kv_heads: int
  impls: tuple[str, ...]
  keep_traces: bool = False  # with kernel_time and save: each ring cell's trace under out/traces/

  def __post_init__(self):
    super().__post_init__()
    for name, values, kind in (("layouts", self.layouts, RingLayout), ("strategies", self.strategies, RingStrategy)):
      if not values or not all(isinstance(v, kind) for v in values):
        raise ValueError(f"{name} must be a non-empty tuple of {kind.__name__}, got {values!r}")
    if not self.modes or set(self.modes) - set(RING_MODES):
      raise ValueError(f"modes must be some of {RING_MODES}, got {self.modes!r}")
    if not self.impls or set(self.impls) - set(RING_IMPLS):
      raise ValueError(f"impls must be some of {tuple(RING_IMPLS)}, got {self.impls!r}")
    for name, value in (("num_devices", self.num_devices), ("batch", self.batch), ("heads", self.heads),
                        ("kv_heads", self.kv_heads)):
      if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    if self.heads % self.kv_heads:
      raise ValueError(f"kv_heads {self.kv_heads} does not divide heads {self.heads}")
    if not self.tokens_per_device or min(self.tokens_per_device) < 1:
      raise ValueError(f"tokens_per_device must be positive, got {self.tokens_per_device!r}")
    if RingLayout.ZIGZAG in self.layouts and any(n % 2 for n in self.tokens_per_device):
      raise ValueError(f"the zigzag layout holds two chunks per device: tokens_per_device must be even, got "
                       f"{self.tokens_per_device!r}")

  def shape(self, dtype: str, head_dim: int, layout: RingLayout, strategy: RingStrategy, n: int) -> RingShape:
    return RingShape(self.num_devices, n, self.batch, self.heads, self.kv_heads, head_dim, dtype, layout, strategy)

  def groups(self) -> list[tuple[str, int, RingLayout, RingStrategy]]:
    return [(dt, d, lay, st) for dt in self.dtypes for d in self.head_dims for lay in self.layouts
            for st in self.strategies]

  def num_cells(self) -> int:
    return len(self.groups()) * len(self.tokens_per_device) * len(self.modes) * len(self.impls)

  def num_steps(self) -> int:
    """Progress steps: cells plus one check per group and impl."""
    return self.num_cells() + (len(self.groups()) * len(self.impls) if self.check else 0)


@dataclasses.dataclass(frozen=True)
class RingCell:
  """One (impl, ring shape, mode) cell; layout and strategy by their names.

  ms / ms_min / kernel_ms: the ring as CellResult's (kernel_ms: the busiest
  device's activities per call; comm_kernel_ms: its NCCL kernels' share,
  which overlaps the compute where the overlap works). compiled_bytes: the
  ring executable's argument + output + temp - alias bytes per device (XLA's
  memory analysis of the SPMD program). single_*: the same
  per-device work on one device alone (`RingShape.single_kv_len` keys).
  flops: per device, by visible pairs (`pairs_per_device`); tflops figures
  per device. efficiency: single_ms / ms (kernel_efficiency likewise from
  kernel times). rel_err_out / rel_err_grad: the ring against the
  unsharded float32 reference on its group's check, run with
  check_tokens_per_device tokens per device.
  """

  impl: str
  mode: str
  num_devices: int
  tokens_per_device: int
  seqlen: int
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  layout: str
  strategy: str
  causal: bool
  status: str
  error: str | None = None
  pairs_per_device: int | None = None
  single_kv_len: int | None = None
  flops: int | None = None
  ms: float | None = None
  ms_min: float | None = None
  kernel_ms: float | None = None
  comm_kernel_ms: float | None = None
  iters: int | None = None
  compiled_bytes: int | None = None
  tflops: float | None = None
  kernel_tflops: float | None = None
  single_status: str | None = None
  single_error: str | None = None
  single_ms: float | None = None
  single_kernel_ms: float | None = None
  single_tflops: float | None = None
  single_kernel_tflops: float | None = None
  efficiency: float | None = None
  kernel_efficiency: float | None = None
  check_tokens_per_device: int | None = None
  rel_err_out: float | None = None
  rel_err_grad: float | None = None


RING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RingCell))


@dataclasses.dataclass(frozen=True)
class RingCheck:
  """The ring's out and gradients against the unsharded float32 reference."""

  impl: str
  shape: RingShape
  status: str
  error: str | None = None
  rel_err_out: float | None = None
  rel_err_grad: float | None = None  # the largest of dq, dk, dv


# -------------------------------------------------------------- programs


def mesh_of(num_devices: int) -> jax.sharding.Mesh:
  """A one-axis ("sp") mesh of the first `num_devices` devices."""
  if num_devices > jax.device_count():
    raise ValueError(f"{num_devices} devices asked for, {jax.device_count()} here")
  return jax.make_mesh((num_devices,), (AXIS,), (AxisType.Auto,), devices=jax.devices()[:num_devices])


def _backend(impl: str, interpret: bool) -> tuple[Backend, bool]:
  """(backend, interpret) of `impl`'s steps: interpret mode is for the
  kernels only, and under it "auto" (which would fall back to XLA with a
  warning) runs the Triton kernels themselves."""
  backend = RING_IMPLS[impl][0]
  if backend is Backend.XLA:
    return backend, False
  return (Backend.TRITON if interpret and backend is Backend.AUTO else backend), interpret


def ring_fn(shape: RingShape, impl: str, interpret: bool, mesh: jax.sharding.Mesh) -> Callable[..., jax.Array]:
  """(q, k, v) of the whole sequence, split along it over `mesh` -> out."""
  from jax_flash2 import ring_attention

  backend, interpret = _backend(impl, interpret)
  attend = lambda q, k, v: ring_attention(q, k, v, axis_name=AXIS, causal=shape.causal, layout=shape.layout,
                                          strategy=shape.strategy, backend=backend, interpret=interpret)
  # Interpret-mode Pallas cannot run a backward under check_vma (docs/ring_attention.md, Limits).
  return jax.shard_map(attend, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=not interpret)


def single_fn(shape: RingShape, impl: str, interpret: bool) -> Callable[..., jax.Array]:
  """(q [batch, n], k, v [batch, single_kv_len]) on one device -> out: one ring device's work alone."""
  from jax_flash2 import flash_attention

  backend, interpret = _backend(impl, interpret)
  return lambda q, k, v: flash_attention(q, k, v, causal=shape.causal, backend=backend, interpret=interpret)


def _draw(seed: int, seq_q: int, seq_k: int, shape: RingShape, sharding) -> timing.Inputs:
  """Random normal q, k, v, dout, placed as `sharding` says. On a GPU one
  jitted draw makes them in place (no full-size host copy); on a CPU numpy
  draws them, since compiling a sampler per shape costs more there than the
  tiny cells themselves (as in tests/conftest.py)."""
  dtype = jnp.dtype(shape.dtype)
  q_size = (shape.batch, seq_q, shape.heads, shape.head_dim)
  kv_size = (shape.batch, seq_k, shape.kv_heads, shape.head_dim)
  sizes = (q_size, kv_size, kv_size, q_size)
  if jax.default_backend() == "cpu":
    rng = np.random.default_rng(seed)
    arrays = [jax.device_put(rng.standard_normal(size, np.float32).astype(dtype), sharding) for size in sizes]
  else:
    def draw(key):
      return [jax.random.normal(k, size, jnp.float32).astype(dtype)
              for k, size in zip(jax.random.split(key, 4), sizes)]

    arrays = jax.jit(draw, out_shardings=[sharding] * 4)(jax.random.PRNGKey(seed))
  x = timing.Inputs(*arrays)
  jax.block_until_ready(dataclasses.astuple(x))
  return x


def ring_inputs(shape: RingShape, seed: int, mesh: jax.sharding.Mesh) -> timing.Inputs:
  return _draw(seed, shape.seqlen, shape.seqlen, shape, NamedSharding(mesh, SEQ))


def single_inputs(shape: RingShape, seed: int) -> timing.Inputs:
  return _draw(seed, shape.tokens_per_device, shape.single_kv_len, shape, SingleDeviceSharding(jax.devices()[0]))


# -------------------------------------------------------------- check


def check_shape(shape: RingShape) -> RingShape:
  """`shape` with batch, then tokens per device, cut (halved, staying even
  for zigzag) until the reference's float32 scores fit _REFERENCE_SCORE_BYTES."""
  per_batch = shape.heads * shape.seqlen**2 * 4
  batch = max(1, min(shape.batch, _REFERENCE_SCORE_BYTES // per_batch))
  n, chunks = shape.tokens_per_device, 2 if shape.causal else 1
  while (batch * shape.heads * (shape.num_devices * n) ** 2 * 4 > _REFERENCE_SCORE_BYTES and n // 2 >= chunks
         and (n // 2) % chunks == 0):
    n //= 2
  return dataclasses.replace(shape, batch=batch, tokens_per_device=n)


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_check(impl: str, shape: RingShape, cfg: RingSweepConfig, mesh) -> tuple[RingCheck, Any]:
  """The ring's (out, dq, dk, dv) of a sequence in true order (permuted into
  the layout and back) against the unsharded float32 reference. Returns
  the check and, where the check shape is `shape`, the compiled fwd+bwd
  program for the fwd+bwd cell to reuse (random inputs in any order time
  alike)."""
  from jax_flash2 import zigzag_order

  cshape = check_shape(shape)
  compiled = None
  try:
    x = _draw(cfg.seed + 1000, cshape.seqlen, cshape.seqlen, cshape, SingleDeviceSharding(jax.devices()[0]))
    want = check_lib.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=cshape.causal)
    want = [np.asarray(w, np.float32) for w in want]
    if cshape.layout is RingLayout.ZIGZAG:
      perm, inverse = zigzag_order(cshape.seqlen, cshape.num_devices)
    else:
      perm = inverse = np.arange(cshape.seqlen)
    # Permuted on the host (small arrays): eager jnp ops would each compile a program.
    split = NamedSharding(mesh, SEQ)
    xs = timing.Inputs(*(jax.device_put(np.asarray(a)[:, perm], split) for a in dataclasses.astuple(x)))
    prepared = timing.prepare(ring_fn(cshape, impl, cfg.interpret, mesh), "fwd+bwd", [xs])
    got = [np.asarray(g).astype(np.float32)[:, inverse] for g in prepared(0)]
    errs = [_rel(g, w) for g, w in zip(got, want)]
    compiled = prepared.compiled if cshape == shape else None
    del x, xs, prepared, got, want
  except Exception as exc:  # noqa: BLE001 - every failure becomes a table entry
    status, short = timing.classify(exc)
    return RingCheck(impl, cshape, status, short), None
  finally:
    timing.free()
  if not all(math.isfinite(e) for e in errs):
    return RingCheck(impl, cshape, "error", "non-finite values in out or gradients"), None
  return RingCheck(impl, cshape, "ok", rel_err_out=errs[0], rel_err_grad=max(errs[1:])), compiled


# -------------------------------------------------------------- cells


def _timed(fn, mode: str, inputs: list[timing.Inputs], cfg: RingSweepConfig, compiled: Any = None,
           keep: str | None = None) -> tuple[list[float], float | None, float | None, int | None]:
  """(per-call seconds of each round, kernel ms of the busiest device, its
  NCCL share, the executable's bytes: per device for an SPMD program)."""
  prepared = timing.prepare(fn, mode, inputs, compiled)
  try:
    nbytes = timing.compiled_memory(prepared.compiled)[0]
    times = timing.time_calls(prepared, cfg.warmup, cfg.iters)
    kernel = comm = None
    if cfg.kernel_time:
      try:
        by_device = kernel_trace.device_ms_by_device(prepared, timing.CALLS_PER_ROUND, keep)
      except Exception:  # noqa: BLE001 - a failed trace costs the kernel time only
        by_device = {}
      if by_device:
        busiest = max(by_device.values(), key=lambda t: t.total_ms)
        kernel, comm = busiest.total_ms, busiest.comm_ms
    return times, kernel, comm, nbytes
  finally:
    del prepared
    timing.free()


def run_cell(impl: str, shape: RingShape, mode: str, cfg: RingSweepConfig, mesh, inputs: list[timing.Inputs],
             compiled: Any = None) -> RingCell:
  """Times the ring and the single-device run of one cell; failures become its status."""
  forward = shape.forward_flops()
  flops = flops_lib.forward_to_mode(forward, mode)
  fields = dict(impl=impl, mode=mode, num_devices=shape.num_devices, tokens_per_device=shape.tokens_per_device,
                seqlen=shape.seqlen, batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
                head_dim=shape.head_dim, dtype=shape.dtype, layout=shape.layout.value, strategy=shape.strategy.value,
                causal=shape.causal, pairs_per_device=shape.pairs_per_device, single_kv_len=shape.single_kv_len,
                flops=flops)
  try:
    keep = None
    if cfg.keep_traces and cfg.save and cfg.out:
      keep = os.path.join(cfg.out, "traces", f"{impl}_{mode}_{shape.describe().replace(' ', '_')}.trace.json.gz")
    fn = ring_fn(shape, impl, cfg.interpret, mesh)
    times, kernel_ms, comm_ms, nbytes = _timed(fn, mode, inputs, cfg, compiled, keep)
  except Exception as exc:  # noqa: BLE001 - every failure becomes a table entry
    status, short = timing.classify(exc)
    return RingCell(status=status, error=short, **fields)
  ms = timing.median_ms(times)
  tf = lambda t: None if t is None or t <= 0 else flops_lib.tflops_per_s(flops, t)
  ratio = lambda a, b: None if a is None or b is None or b <= 0 else a / b
  single: dict[str, Any] = {}
  try:
    alone = [single_inputs(shape, cfg.seed + i) for i in range(cfg.input_sets)]
    s_times, s_kernel, _, _ = _timed(single_fn(shape, impl, cfg.interpret), mode, alone, cfg)
    del alone
    s_ms = timing.median_ms(s_times)
    single = dict(single_status="ok", single_ms=s_ms, single_kernel_ms=s_kernel, single_tflops=tf(s_ms),
                  single_kernel_tflops=tf(s_kernel), efficiency=ratio(s_ms, ms),
                  kernel_efficiency=ratio(s_kernel, kernel_ms))
  except Exception as exc:  # noqa: BLE001 - the ring's own figures stand without it
    status, short = timing.classify(exc)
    single = dict(single_status=status, single_error=short)
  finally:
    timing.free()
  return RingCell(status="ok", ms=ms, ms_min=min(times) * 1e3, kernel_ms=kernel_ms, comm_kernel_ms=comm_ms,
                  iters=len(times), compiled_bytes=nbytes, tflops=tf(ms), kernel_tflops=tf(kernel_ms), **single,
                  **fields)


def run_ring(cfg: RingSweepConfig, progress: Progress | None = None) -> tuple[list[RingCell], list[RingCheck]]:
  """Every cell of `cfg` (and, unless cfg.check is off, one check per group and impl on its first row)."""
  progress = progress or Progress(0, enabled=False)
  mesh = mesh_of(cfg.num_devices)
  cells: list[RingCell] = []
  checks: list[RingCheck] = []
  for dtype, head_dim, layout, strategy in cfg.groups():
    for index, n in enumerate(cfg.tokens_per_device):
      shape = cfg.shape(dtype, head_dim, layout, strategy, n)
      try:
        inputs = [ring_inputs(shape, cfg.seed + i, mesh) for i in range(cfg.input_sets)]
      except Exception as exc:  # noqa: BLE001 - e.g. the inputs alone do not fit
        status, short = timing.classify(exc)
        for impl in cfg.impls:
          for mode in cfg.modes:
            cells.append(RingCell(impl=impl, mode=mode, num_devices=shape.num_devices, tokens_per_device=n,
                                  seqlen=shape.seqlen, batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
                                  head_dim=head_dim, dtype=dtype, layout=layout.value, strategy=strategy.value,
                                  causal=shape.causal, status=status, error=f"inputs: {short}"))
            progress.update(f"{impl} {mode} {shape.describe()}")
        timing.free()
        continue
      for impl in cfg.impls:
        reuse = None
        if index == 0 and cfg.check:
          result, reuse = run_check(impl, shape, cfg, mesh)
          checks.append(result)
          progress.update(f"check {impl} {result.status}")
        for mode in cfg.modes:
          cells.append(run_cell(impl, shape, mode, cfg, mesh, inputs, reuse if mode == "fwd+bwd" else None))
          progress.update(f"{impl} {mode} {shape.describe()}")
        del reuse
      del inputs
      timing.free()
  return annotate(cells, checks), checks


def annotate(cells: list[RingCell], checks: list[RingCheck]) -> list[RingCell]:
  """Each cell with its group's check errors (a group's check stands for all its rows)."""
  key = lambda impl, dtype, head_dim, layout, strategy: (impl, dtype, head_dim, layout, strategy)
  done = {key(r.impl, r.shape.dtype, r.shape.head_dim, r.shape.layout.value, r.shape.strategy.value): r
          for r in checks if r.status == "ok"}
  out = []
  for c in cells:
    r = done.get(key(c.impl, c.dtype, c.head_dim, c.layout, c.strategy))
    out.append(c if r is None else dataclasses.replace(
        c, rel_err_out=r.rel_err_out, rel_err_grad=r.rel_err_grad, check_tokens_per_device=r.shape.tokens_per_device))
  return out


# -------------------------------------------------------------- output

_COLUMNS = (("ms", 9), ("kern ms", 9), ("comm ms", 9), ("1-dev ms", 9), ("1-dev kern", 10), ("TF/s/dev", 9),
            ("eff %", 6), ("kern eff %", 10), ("rel err", 8))


def _fmt(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def format_checks(checks: list[RingCheck]) -> str:
  lines = ["Ring vs unsharded float32 reference (out; largest of dq, dk, dv):"]
  for r in checks:
    where = f"{r.impl:<14} {r.shape.describe()}"
    if r.status == "ok":
      lines.append(f"  {where}: out {r.rel_err_out:.1e}, grad {r.rel_err_grad:.1e}")
    else:
      lines.append(f"  {where}: {r.status}: {r.error}")
  return "\n".join(lines) + "\n"


def format_table(cells: list[RingCell], tiny: bool) -> str:
  lines = ["ring: per device; 1-dev = the same per-device work on one device alone; eff = 1-dev ms / ring ms "
           "(kern eff from kernel times); FLOPs over visible pairs" + (" (host figures: no GPU)" if tiny else "")]
  head = f"{'impl':<14} {'mode':<8} {'tok/dev':>7} " + " ".join(f"{name:>{w}}" for name, w in _COLUMNS)
  last = None
  for c in cells:
    group = (c.dtype, c.head_dim, c.layout, c.strategy, c.num_devices, c.batch, c.heads, c.kv_heads)
    if group != last:
      mask = "causal" if c.causal else "non-causal"
      heads = f"{c.heads}" + (f"/{c.kv_heads}kv" if c.kv_heads != c.heads else "")
      lines += ["", f"== P {c.num_devices}  {c.layout} {mask}  {c.strategy}  {SHORT_DTYPE.get(c.dtype, c.dtype)} "
                f"d{c.head_dim} b{c.batch} h{heads} ==", head]
      last = group
    row = f"{c.impl:<14} {c.mode:<8} {c.tokens_per_device:>7} "
    if c.status != "ok":
      lines.append(row + f"{c.status}: {c.error}")
      continue
    pct = lambda x: None if x is None else 100 * x
    values = (_fmt(c.ms, ".3f"), _fmt(c.kernel_ms, ".3f"), _fmt(c.comm_kernel_ms, ".3f"), _fmt(c.single_ms, ".3f"),
              _fmt(c.single_kernel_ms, ".3f"), _fmt(c.kernel_tflops if c.kernel_tflops is not None else c.tflops,
                                                    ".3g"),
              _fmt(pct(c.efficiency), ".0f"), _fmt(pct(c.kernel_efficiency), ".0f"),
              _fmt(max(c.rel_err_out, c.rel_err_grad) if c.rel_err_out is not None else None, ".1e"))
    lines.append(row + " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, _COLUMNS)))
    if c.single_status not in (None, "ok"):
      lines.append(f"{'':<31}1-dev: {c.single_status}: {c.single_error}")
  return "\n".join(lines) + "\n"


NOTES = {
    "per_device_work": "one ring device's attention: contiguous non-causal, its n = tokens_per_device queries over "
    "all S = P n keys (n S pairs); zigzag causal, its chunks r and 2P-1-r of c = n/2 tokens each under the causal "
    "mask, 2P c^2 + c pairs, the causal problem's S(S+1)/2 pairs over P, equal on every device (pairs_per_device)",
    "single_device": "the same per-device work alone on one device, no collective and no merge: one "
    "flash_attention call, q [batch, n] over k, v [batch, single_kv_len]; contiguous non-causal: S keys, "
    "non-causal; zigzag causal: (P+1) c keys, causal aligned bottom-right (query i sees keys j <= i + (P-1) c), "
    "which is 2P c^2 + c pairs, tiled as the ring's (an n x n causal diagonal beside an n x (P-1) c unmasked block)",
    "flops": "per device: 4 * batch * heads * head_dim * pairs_per_device forward (the FlashAttention convention "
    "over visible pairs), x3.5 for fwd+bwd; equal for the ring and its single-device run",
    "efficiency": "single_ms / ms = per-device TFLOP/s over single-device TFLOP/s; kernel_efficiency: "
    "single_kernel_ms / kernel_ms",
    "kernel_ms": "the busiest device's summed GPU activities per call from a profiler trace; comm_kernel_ms: its "
    "NCCL kernels' share, which runs on a stream of its own and counts in full even where it overlaps the compute",
    "compiled_bytes": "per device: argument + output + temp - alias bytes of the ring's executable (XLA's "
    "memory_analysis of the SPMD program)",
    "rel_err": "||x - ref|| / ||ref|| of the ring (permuted back to true order) against the unsharded float32 "
    "reference, on the group's first row cut to check_tokens_per_device; rel_err_grad the largest of dq, dk, dv",
}


def write_results(out_dir: str, meta: dict[str, Any], cfg: RingSweepConfig, cells: list[RingCell],
                  checks: list[RingCheck]) -> list[str]:
  """results.json (report.SCHEMA_VERSION, "kind": "ring") and results.csv in `out_dir`."""
  import csv

  from jax_flash2.bench import report

  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.csv")]
  doc = {
      "schema_version": report.SCHEMA_VERSION,
      "kind": "ring",
      "metadata": meta,
      "config": dataclasses.asdict(cfg),
      "notes": dict(tiny_cpu_run=cfg.tiny, **NOTES),
      "checks": [dict(impl=r.impl, status=r.status, error=r.error, rel_err_out=r.rel_err_out,
                      rel_err_grad=r.rel_err_grad, **dataclasses.asdict(r.shape)) for r in checks],
      "cells": [dataclasses.asdict(c) for c in cells],
  }
  with open(paths[0], "w") as f:
    json.dump(report._clean(doc), f, indent=1, allow_nan=False)
  with open(paths[1], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(RING_FIELDS))
    writer.writeheader()
    for c in cells:
      writer.writerow({k: ("" if v is None else v) for k, v in report._clean(dataclasses.asdict(c)).items()})
  return paths
