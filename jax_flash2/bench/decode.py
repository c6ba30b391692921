"""`--decode`: attention of a few new queries over a KV cache, timed by bytes read.

A decoding step reads the whole cache once and does little arithmetic, so
each cell reports the bandwidth it achieved: the bytes it must read (K and
V over every sequence's cache, the block table of a paged cache, q) and
write (out), over its wall and kernel time (`bytes_moved`), in TB/s and as
a fraction of the device's copy bandwidth, measured once per run
(`copy_bandwidth`). Every sequence holds cache_len keys (cache_seqlens all
cache_len); a paged cache (page_size set) lays them in pages in a shuffled
order through a block_table. Each cell's output is checked against the
float32 reference (reference.decode_attention) on its first input set.

Implementations (`DECODE_IMPLS`): flash2 (jax_flash2.flash_decode, its
split-KV kernel, num_splits by default), xla (jax.nn.dot_product_attention's
XLA attention in the input dtype over the cache gathered through the table,
key_value_seq_lengths and decoding's causal mask), cudnn (one query row) and
tokamax (a mask where q_len > 1), their dot_product_attention over a
contiguous cache with key_value_seq_lengths.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2.bench import kernel_trace, timing
from jax_flash2.bench.progress import Progress
from jax_flash2.bench.spec import SHORT_DTYPE, LeftOut

DECODE_IMPLS: tuple[str, ...] = ("flash2", "xla", "cudnn", "tokamax")
GPU_DECODE_DEFAULTS = dict(cache_lens=(8192, 16384, 32768), head_dims=(128,), batch=8, heads=32, kv_heads=4,
                           warmup=3, iters=20)
CPU_DECODE_DEFAULTS = dict(cache_lens=(64, 128), head_dims=(32,), batch=2, heads=4, kv_heads=2, warmup=1, iters=2)
# Bytes of the copy that measures the device's bandwidth (read once, written once).
GPU_COPY_BYTES = 1 << 31
CPU_COPY_BYTES = 1 << 24

DecodeFn = Callable[..., jax.Array]  # (q, k_cache, v_cache, cache_seqlens, block_table or None) -> out


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """One decoding step: q [batch, q_len, heads, head_dim] over cache_len keys per sequence.

  page_size None: a contiguous cache [batch, cache_len, kv_heads, head_dim];
  else a paged one [batch * cache_len // page_size, page_size, kv_heads,
  head_dim] through a block_table [batch, cache_len // page_size] of shuffled pages.
  """

  batch: int
  cache_len: int
  heads: int
  kv_heads: int
  head_dim: int
  q_len: int
  dtype: str
  page_size: int | None = None

  @property
  def pages_per_seq(self) -> int:
    return 0 if self.page_size is None else self.cache_len // self.page_size

  def describe(self) -> str:
    cache = "contiguous" if self.page_size is None else f"paged {self.page_size}"
    return (f"b{self.batch} cache{self.cache_len} q{self.q_len} h{self.heads}/{self.kv_heads}kv d{self.head_dim} "
            f"{cache} {SHORT_DTYPE.get(self.dtype, self.dtype)}")


def bytes_moved(shape: DecodeShape) -> int:
  """Bytes a decoding step must move: K and V of every sequence's cache
  (batch x cache_len x kv_heads x head_dim x 2 tensors x itemsize), the int32
  block table where paged, q read and out written."""
  item = jnp.dtype(shape.dtype).itemsize
  kv = shape.batch * shape.cache_len * shape.kv_heads * shape.head_dim * 2 * item
  table = shape.batch * shape.pages_per_seq * 4
  q_and_out = 2 * shape.batch * shape.q_len * shape.heads * shape.head_dim * item
  return kv + table + q_and_out


def tb_per_s(nbytes: int, ms: float | None) -> float | None:
  return None if ms is None or ms <= 0 else nbytes / (ms * 1e-3) / 1e12


@dataclasses.dataclass(frozen=True)
class DecodeSweepConfig:
  """The grid of a --decode run: dtypes x head_dims x page_sizes x cache_lens x impls."""

  cache_lens: tuple[int, ...]
  page_sizes: tuple[int | None, ...]
  head_dims: tuple[int, ...]
  dtypes: tuple[str, ...]
  batch: int
  heads: int
  kv_heads: int
  q_len: int
  impls: tuple[str, ...]
  left_out: tuple[LeftOut, ...] = ()
  warmup: int = 3
  iters: int = 20
  input_sets: int = 2
  check: bool = True
  interpret: bool = False
  platform: str = "gpu"
  kernel_time: bool = False
  save: bool = True
  out: str | None = None
  seed: int = 0

  @property
  def tiny(self) -> bool:
    return self.platform != "gpu"

  def shapes(self) -> list[DecodeShape]:
    return [DecodeShape(self.batch, n, self.heads, self.kv_heads, d, self.q_len, dt, p)
            for dt in self.dtypes for d in self.head_dims for p in self.page_sizes for n in self.cache_lens]

  def num_cells(self) -> int:
    return len(self.shapes()) * len(self.impls)


@dataclasses.dataclass(frozen=True)
class DecodeCell:
  """One (implementation, decode shape) cell. ms / kernel_ms as in CellResult;
  bytes: `bytes_moved`; tb_s / kernel_tb_s: bytes over ms / kernel_ms;
  copy_fraction / kernel_copy_fraction: those over the run's copy bandwidth timed
  the same way (wall clock / kernel time);
  rel_err_out: ||out - ref|| / ||ref|| against the float32 reference."""

  impl: str
  dtype: str
  batch: int
  cache_len: int
  heads: int
  kv_heads: int
  head_dim: int
  q_len: int
  page_size: int | None
  status: str
  error: str | None = None
  ms: float | None = None
  ms_min: float | None = None
  kernel_ms: float | None = None
  iters: int | None = None
  bytes: int | None = None
  tb_s: float | None = None
  kernel_tb_s: float | None = None
  copy_fraction: float | None = None
  kernel_copy_fraction: float | None = None
  rel_err_out: float | None = None


DECODE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DecodeCell))

# ------------------------------------------------------------ implementations


@dataclasses.dataclass(frozen=True)
class DecodeImpl:
  name: str
  description: str
  factory: Callable[[DecodeShape, DecodeSweepConfig], DecodeFn]
  supports: Callable[[DecodeShape, DecodeSweepConfig], str | None]  # None, or why a shape cannot run
  available: Callable[[str], str | None] = lambda platform: None  # None, or why not on this platform


def _flash2(shape: DecodeShape, cfg: DecodeSweepConfig) -> DecodeFn:
  from jax_flash2 import flash_decode

  # Interpret mode runs the Triton kernel itself on the CPU; "auto" would fall back to XLA.
  backend = "triton" if cfg.interpret else "auto"
  return lambda q, k, v, lens, table: flash_decode(q, k, v, lens, block_table=table, backend=backend,
                                                   interpret=cfg.interpret)


def causal_mask(q: jax.Array, k: jax.Array, lens: jax.Array) -> jax.Array:
  """[batch, 1, q_len, cache_len]: query i of sequence b sees key j iff j <= lens[b] - q_len + i
  (flash_decode's bottom-right causal mask; the lengths themselves go as key_value_seq_lengths)."""
  level = lens[:, None] - q.shape[1] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]  # [batch, q_len]
  return (jnp.arange(k.shape[1], dtype=jnp.int32)[None, None] <= level[:, :, None])[:, None]


def _xla(shape: DecodeShape, cfg: DecodeSweepConfig) -> DecodeFn:
  """jax.nn's XLA attention over the gathered cache: in the input dtype, GQA
  by grouping (no repeated K/V), decoding's bottom-right causal mask."""
  from jax_flash2 import reference

  def attn(q, k, v, lens, table):
    k, v = reference.gather_cache(k, table), reference.gather_cache(v, table)
    return jax.nn.dot_product_attention(q, k, v, mask=causal_mask(q, k, lens), key_value_seq_lengths=lens,
                                        implementation="xla")

  return attn


def _contiguous(shape: DecodeShape) -> str | None:
  return "reads a contiguous cache only (no block table)" if shape.page_size is not None else None


def _one_row_contiguous(shape: DecodeShape) -> str | None:
  if shape.q_len != 1:
    return "one query row only (is_causal aligns top-left; decoding's causal mask is bottom-right)"
  return _contiguous(shape)


def _cudnn_supports(shape: DecodeShape, cfg: DecodeSweepConfig) -> str | None:
  if cfg.platform != "gpu":
    return "needs an NVIDIA GPU"
  if jnp.dtype(shape.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "cuDNN takes fp16/bf16 only"
  return _one_row_contiguous(shape)


def _cudnn(shape: DecodeShape, cfg: DecodeSweepConfig) -> DecodeFn:
  return lambda q, k, v, lens, table: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens,
                                                                   implementation="cudnn")


# tokamax.dot_product_attention (openxla/tokamax, tokamax/_src/ops/attention/
# api.py) takes jax.nn.dot_product_attention's arguments, key_value_seq_lengths
# ([batch]) and a boolean mask among them (so q_len > 1 gets decoding's causal
# mask), and no paged cache; implementation=None is tokamax as users call it.
def _tokamax_available(platform: str) -> str | None:
  try:
    tokamax = importlib.import_module("tokamax")
  except ImportError:
    return "tokamax is not installed (pip install tokamax)"
  if "key_value_seq_lengths" not in inspect.signature(tokamax.dot_product_attention).parameters:
    return "this tokamax has no key_value_seq_lengths"
  return None


def _tokamax(shape: DecodeShape, cfg: DecodeSweepConfig) -> DecodeFn:
  import tokamax

  def attn(q, k, v, lens, table):
    mask = None if q.shape[1] == 1 else causal_mask(q, k, lens)
    return tokamax.dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=lens)

  return attn


DECODE_REGISTRY: dict[str, DecodeImpl] = {
    impl.name: impl
    for impl in (
        DecodeImpl("flash2", "jax_flash2.flash_decode (split-KV Triton kernel; interpret mode on a CPU)", _flash2,
                   lambda shape, cfg: None),
        DecodeImpl("xla", 'jax.nn.dot_product_attention(implementation="xla") over the gathered cache, '
                   "key_value_seq_lengths and a causal mask", _xla, lambda shape, cfg: None),
        DecodeImpl("cudnn", 'jax.nn.dot_product_attention(implementation="cudnn", key_value_seq_lengths=...)',
                   _cudnn, _cudnn_supports, lambda platform: None if platform == "gpu" else "needs an NVIDIA GPU"),
        DecodeImpl("tokamax", "tokamax.dot_product_attention(key_value_seq_lengths=...)", _tokamax,
                   lambda shape, cfg: _tokamax_available(cfg.platform) or _contiguous(shape),
                   _tokamax_available),
    )
}


def select(names: list[str], platform: str, *, requested: bool) -> tuple[tuple[str, ...], tuple[LeftOut, ...]]:
  """(the decode `names` that can run on `platform`, the others with why)."""
  kept, left_out = [], []
  for name in names:
    reason = DECODE_REGISTRY[name].available(platform)
    if reason is None:
      kept.append(name)
    else:
      left_out.append(LeftOut(impl=name, reason=reason, requested=requested))
  return tuple(kept), tuple(left_out)


# -------------------------------------------------------------------- inputs


def make_inputs(shape: DecodeShape, seed: int) -> tuple:
  """(q, k_cache, v_cache, cache_seqlens, block_table or None), random normal;
  a paged cache's pages in a shuffled order."""
  dtype = jnp.dtype(shape.dtype)
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  if shape.page_size is None:
    cache_shape = (shape.batch, shape.cache_len, shape.kv_heads, shape.head_dim)
    table = None
  else:
    pages = shape.batch * shape.pages_per_seq
    cache_shape = (pages, shape.page_size, shape.kv_heads, shape.head_dim)
    order = np.random.default_rng(seed).permutation(pages).astype(np.int32)
    table = jnp.asarray(order.reshape(shape.batch, shape.pages_per_seq))
  draw = lambda key, s: jax.random.normal(key, s, jnp.float32).astype(dtype)
  q = draw(kq, (shape.batch, shape.q_len, shape.heads, shape.head_dim))
  lens = jnp.full((shape.batch,), shape.cache_len, jnp.int32)
  x = (q, draw(kk, cache_shape), draw(kv, cache_shape), lens, table)
  jax.block_until_ready([a for a in x if a is not None])
  return x


def copy_bandwidth(platform: str, kernel_time: bool, warmup: int = 2, iters: int = 5) -> dict[str, Any]:
  """The device's copy bandwidth: a large device-to-device copy (x + 1 on
  random 32-bit words: each byte read once, written once) after warm-up;
  bytes read + written over the median wall-clock time and, with
  `kernel_time` on a GPU, over the kernel time (the figure a cell's kernel
  bandwidth is compared with). Word-wide, since a byte-wide add runs far under
  the memory's rate and would make every fraction look too good."""
  nbytes = GPU_COPY_BYTES if platform == "gpu" else CPU_COPY_BYTES
  x = jax.random.bits(jax.random.PRNGKey(0), (nbytes // 4,), jnp.uint32)
  add_one = lambda a: a + jnp.uint32(1)
  ms = timing.time_fn_ms(add_one, x, warmup=warmup, iters=iters)
  kernel_ms = None
  if kernel_time and platform == "gpu":
    compiled = jax.jit(add_one).lower(x).compile()
    kernel_ms = kernel_trace.device_ms_per_call(lambda i: compiled(x), timing.CALLS_PER_ROUND)
  del x
  timing.free()
  return dict(copy_bytes=2 * nbytes, copy_ms=ms, copy_tb_s=tb_per_s(2 * nbytes, ms), copy_kernel_ms=kernel_ms,
              copy_kernel_tb_s=tb_per_s(2 * nbytes, kernel_ms),
              copy_note="host (CPU) figures, not GPU ones" if platform != "gpu" else
              "device-to-device copy on the GPU: bytes read + written / median time (and / kernel time)")


# ---------------------------------------------------------------------- cells


def _rel_err(got: jax.Array, want: jax.Array) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def reference_out(x: tuple) -> jax.Array:
  """The float32 reference output of inputs `x` (make_inputs)."""
  from jax_flash2 import reference

  q, k, v, lens, table = x
  f32 = lambda a: a.astype(jnp.float32)
  return jax.jit(lambda *a: reference.decode_attention(*a, block_table=table, compute_dtype=jnp.float32)[0])(
      f32(q), f32(k), f32(v), lens)


def run_cell(impl: DecodeImpl, shape: DecodeShape, inputs: list[tuple], cfg: DecodeSweepConfig, copy: dict[str, Any],
             want: jax.Array | None) -> DecodeCell:
  fields = dict(impl=impl.name, **dataclasses.asdict(shape))
  nbytes = bytes_moved(shape)
  reason = impl.supports(shape, cfg)
  if reason is not None:
    return DecodeCell(status="unsupported", error=reason, bytes=nbytes, **fields)
  prepared = None
  try:
    fn = impl.factory(shape, cfg)
    compiled = jax.jit(fn).lower(*inputs[0]).compile()
    prepared = timing.Prepared(compiled=compiled, args=list(inputs))
    err = None
    if want is not None:
      err = _rel_err(prepared(0), want)
    times = timing.time_calls(prepared, cfg.warmup, cfg.iters)
    kernel_ms = None
    if cfg.kernel_time:
      try:
        kernel_ms = kernel_trace.device_ms_per_call(prepared, timing.CALLS_PER_ROUND)
      except Exception:  # noqa: BLE001 - a failed trace costs the kernel time only
        kernel_ms = None
  except Exception as exc:  # noqa: BLE001 - every failure becomes a table entry
    status, short = timing.classify(exc)
    return DecodeCell(status=status, error=short, bytes=nbytes, **fields)
  finally:
    del prepared
    timing.free()
  status, error = "ok", None
  if err is not None and not math.isfinite(err):
    status, error = "error", "non-finite values in out"
  ms = timing.median_ms(times)
  frac = lambda t, ref: None if t is None or not ref else t / ref
  tb, ktb = tb_per_s(nbytes, ms), tb_per_s(nbytes, kernel_ms)
  return DecodeCell(status=status, error=error, ms=ms, ms_min=min(times) * 1e3, kernel_ms=kernel_ms,
                    iters=len(times), bytes=nbytes, tb_s=tb, kernel_tb_s=ktb,
                    copy_fraction=frac(tb, copy.get("copy_tb_s")),
                    kernel_copy_fraction=frac(ktb, copy.get("copy_kernel_tb_s")), rel_err_out=err, **fields)


def run_decode(cfg: DecodeSweepConfig, copy: dict[str, Any], progress: Progress | None = None) -> list[DecodeCell]:
  progress = progress or Progress(0, enabled=False)
  cells = []
  for shape in cfg.shapes():
    try:
      inputs = [make_inputs(shape, cfg.seed + i) for i in range(cfg.input_sets)]
      want = reference_out(inputs[0]) if cfg.check else None
    except Exception as exc:  # noqa: BLE001 - e.g. the inputs alone do not fit
      status, short = timing.classify(exc)
      for name in cfg.impls:
        cells.append(DecodeCell(impl=name, status=status, error=f"inputs: {short}", bytes=bytes_moved(shape),
                                **dataclasses.asdict(shape)))
        progress.update(f"{name} {shape.describe()}")
      timing.free()
      continue
    for name in cfg.impls:
      cells.append(run_cell(DECODE_REGISTRY[name], shape, inputs, cfg, copy, want))
      progress.update(f"{name} {shape.describe()}")
    del inputs, want
    timing.free()
  return cells


# -------------------------------------------------------------------- output

_COLUMNS = (("ms", 9), ("kern ms", 9), ("TB/s", 7), ("kern TB/s", 9), ("%copy", 6), ("rel err", 8))


def _fmt(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def format_table(cells: list[DecodeCell], copy: dict[str, Any], tiny: bool) -> str:
  copy_text = (f"copy bandwidth {_fmt(copy.get('copy_tb_s'), '.3g')} TB/s wall, "
               f"{_fmt(copy.get('copy_kernel_tb_s'), '.3g')} kernel")
  lines = [f"decode: bytes = K/V read + block table + q + out; %copy: kernel TB/s / kernel copy TB/s where "
           f"measured, else wall / wall; {copy_text}" + (" (host figures: no GPU)" if tiny else "")]
  head = f"{'impl':<8} {'cache':>7} {'page':>5} " + " ".join(f"{name:>{w}}" for name, w in _COLUMNS)
  last_group = None
  for c in cells:
    group = (c.dtype, c.head_dim, c.batch, c.heads, c.kv_heads, c.q_len)
    if group != last_group:
      lines += ["", f"{SHORT_DTYPE.get(c.dtype, c.dtype)} d{c.head_dim} b{c.batch} h{c.heads}/{c.kv_heads}kv "
                f"q_len {c.q_len}", head]
      last_group = group
    page = "-" if c.page_size is None else str(c.page_size)
    row = f"{c.impl:<8} {c.cache_len:>7} {page:>5} "
    if c.status != "ok":
      lines.append(row + f"{c.status}: {c.error}")
      continue
    pct = c.kernel_copy_fraction if c.kernel_copy_fraction is not None else c.copy_fraction
    values = (_fmt(c.ms, ".4f"), _fmt(c.kernel_ms, ".4f"), _fmt(c.tb_s, ".3g"), _fmt(c.kernel_tb_s, ".3g"),
              _fmt(None if pct is None else 100 * pct, ".0f"), _fmt(c.rel_err_out, ".1e"))
    lines.append(row + " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, _COLUMNS)))
  return "\n".join(lines) + "\n"


def write_results(out_dir: str, meta: dict[str, Any], cfg: DecodeSweepConfig, cells: list[DecodeCell]) -> list[str]:
  """results.json (report.SCHEMA_VERSION, "kind": "decode") and results.csv in `out_dir`."""
  import csv

  from jax_flash2.bench import report

  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.csv")]
  doc = {
      "schema_version": report.SCHEMA_VERSION,
      "kind": "decode",
      "metadata": meta,
      "config": dataclasses.asdict(cfg),
      "notes": {
          "tiny_cpu_run": cfg.tiny,
          "bytes": "batch*cache_len*kv_heads*head_dim*2*itemsize (K and V) + block table (int32, paged only) + "
          "q + out",
          "tb_s": "bytes / ms; kernel_tb_s: bytes / kernel_ms" + (" (host figures: no GPU)" if cfg.tiny else ""),
          "copy_fraction": "tb_s / metadata.copy_tb_s (kernel_copy_fraction likewise)",
          "rel_err_out": "||out - ref|| / ||ref||, ref the float32 reference.decode_attention on input set 0",
          "page_size": "null: contiguous cache; else pages of that many tokens in shuffled order",
      },
      "cells": [dataclasses.asdict(c) for c in cells],
  }
  with open(paths[0], "w") as f:
    json.dump(report._clean(doc), f, indent=1, allow_nan=False)
  with open(paths[1], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(DECODE_FIELDS))
    writer.writeheader()
    for c in cells:
      writer.writerow({k: ("" if v is None else v) for k, v in report._clean(dataclasses.asdict(c)).items()})
  return paths
