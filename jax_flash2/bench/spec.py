"""Frozen records describing what to run and what came out."""

from __future__ import annotations

import dataclasses
from typing import Literal

Mode = Literal["fwd", "bwd", "fwd+bwd"]
MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
Status = Literal["ok", "unsupported", "OOM", "error"]

# Short names accepted on the command line -> jnp dtype names.
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float32": "float32",
}
SHORT_DTYPE: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# (left, right) of a local-attention band, as flash_attention's window_size:
# key j is visible to query i iff i - left <= j <= i + right (seq_q == seq_k);
# None on a side leaves it unbounded.
Window = tuple[int | None, int | None]


def _side(n: int | None) -> str:
  return "none" if n is None else str(n)


def window_text(window: Window | None) -> str:
  """"1024,0" for (1024, 0), "none" for no window: how --window spells it."""
  return "none" if window is None else f"{_side(window[0])},{_side(window[1])}"


def softcap_text(softcap: float | None) -> str:
  """"30" for 30.0, "none" for no softcap: how --softcap spells it."""
  if softcap is None:
    return "none"
  short = f"{softcap:g}"
  return short if float(short) == softcap else repr(softcap)


def varlen_text(varlen: tuple[int, ...]) -> str:
  """"1024,3072,512": how --varlen spells the lengths."""
  return ",".join(str(n) for n in varlen)


def mask_text(
    causal: bool, window: Window | None, segments: int, softcap: float | None = None,
    varlen: tuple[int, ...] | None = None,
) -> str:
  """"causal", "non-causal", plus " window 1024,0", " 8 segments",
  " varlen 1024,3072,512" and " softcap 30" when set."""
  text = "causal" if causal else "non-causal"
  if window is not None:
    text += f" window {window_text(window)}"
  if segments > 1:
    text += f" {segments} segments"
  if varlen is not None:
    text += f" varlen {varlen_text(varlen)}"
  if softcap is not None:
    text += f" softcap {softcap_text(softcap)}"
  return text


@dataclasses.dataclass(frozen=True)
class Shape:
  """One attention problem, layout [batch, seq, heads, head_dim], seq_q == seq_k.

  window_left / window_right: the band of `Window`; both None means no window
  (flat fields so that JSON and CSV cells carry them as plain numbers).
  segments: each row packs this many equal contiguous sequences (segment ids
  position // (seqlen // segments)); 1 means no segment ids.
  softcap: scores become softcap * tanh(scores / softcap); None: no softcap.
  varlen: the lengths of sequences packed end to end into one row (batch 1,
  seqlen their sum), self-attention within each (flash_attention_varlen with
  one cu_seqlens array); None: not packed that way.
  """

  batch: int
  seqlen: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool
  dtype: str  # a jnp dtype name: "bfloat16", "float16" or "float32"
  window_left: int | None = None
  window_right: int | None = None
  segments: int = 1
  softcap: float | None = None
  varlen: tuple[int, ...] | None = None

  @property
  def window(self) -> Window | None:
    """(left, right) for flash_attention's window_size, None when unset."""
    if self.window_left is None and self.window_right is None:
      return None
    return (self.window_left, self.window_right)

  @property
  def mask(self) -> str:
    return mask_text(self.causal, self.window, self.segments, self.softcap, self.varlen)

  @property
  def q_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seqlen, self.heads, self.head_dim)

  @property
  def kv_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seqlen, self.kv_heads, self.head_dim)

  @property
  def is_gqa(self) -> bool:
    return self.kv_heads != self.heads

  def describe(self) -> str:
    heads = f"{self.heads}" if not self.is_gqa else f"{self.heads}/{self.kv_heads}kv"
    mask = "causal" if self.causal else "full"
    if self.window is not None:
      mask += f" win{window_text(self.window)}"
    if self.segments > 1:
      mask += f" seg{self.segments}"
    if self.varlen is not None:
      mask += f" varlen{varlen_text(self.varlen)}"
    if self.softcap is not None:
      mask += f" cap{softcap_text(self.softcap)}"
    return f"b{self.batch} s{self.seqlen} h{heads} d{self.head_dim} {mask} {SHORT_DTYPE.get(self.dtype, self.dtype)}"


@dataclasses.dataclass(frozen=True)
class LeftOut:
  """An implementation a run leaves out because it cannot run on this machine."""

  impl: str
  reason: str  # e.g. "needs an NVIDIA GPU", "tokamax is not installed"
  requested: bool  # named in --impls (the run says why), not only a default

  def __post_init__(self):
    if not self.reason:
      raise ValueError(f"LeftOut({self.impl!r}) needs a reason")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimedRun:
  """What every mode of a run shares: how to time and check it, where it
  runs and where its files go. Keyword-only, so that a mode's own grid
  fields (no defaults) come first in its constructor.

  `left_out`: implementations asked for (or defaults) that cannot run here;
  `kernel_time`: also read each cell's GPU kernel time from a profiler
  trace; `save`: write results into `out` (None: a dated folder the CLI picks).
  """

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

  def __post_init__(self):
    if self.warmup < 0 or self.iters < 1 or self.input_sets < 1:
      raise ValueError(f"warmup must be >= 0, iters and input_sets >= 1; got {self.warmup}, {self.iters}, "
                       f"{self.input_sets}")

  @property
  def tiny(self) -> bool:
    """True when running without a GPU: figures are CPU / interpret figures."""
    return self.platform != "gpu"


@dataclasses.dataclass(frozen=True)
class SweepConfig(TimedRun):
  """The grid of a run (timing, checks and output: `TimedRun`). Built by
  `cli.config_from_args`.

  `batch` None means tokens // seqlen; `heads` None means hidden // head_dim;
  `kv_heads` None means heads. `windows` holds None for no window; `segments`
  1 for no segment ids; `softcaps` None for no softcap. `varlens`: packings
  of --varlen, each a tuple of sequence lengths run as one row of their sum
  in place of `seqlens` (which then holds those sums); () for none.
  `sinks`: every problem has attention sinks (impls.sink_logits; FLOPs
  unchanged). `impls` are those that run here. `plot`: with saved results,
  the PNG plots.
  """

  seqlens: tuple[int, ...]
  head_dims: tuple[int, ...]
  causal: tuple[bool, ...]
  dtypes: tuple[str, ...]
  modes: tuple[str, ...]
  impls: tuple[str, ...]
  tokens: int = 16384
  hidden: int = 2048
  batch: int | None = None
  heads: int | None = None
  kv_heads: int | None = None
  windows: tuple[Window | None, ...] = (None,)
  segments: tuple[int, ...] = (1,)
  softcaps: tuple[float | None, ...] = (None,)
  varlens: tuple[tuple[int, ...], ...] = ()
  sinks: bool = False
  plot: bool = True
  memory: bool = False
  memory_only: bool = False
  memory_max_seqlen: int | None = None

  def batch_for(self, seqlen: int) -> int:
    return self.batch if self.batch is not None else max(1, self.tokens // seqlen)

  def heads_for(self, head_dim: int) -> int:
    return self.heads if self.heads is not None else max(1, self.hidden // head_dim)

  def kv_heads_for(self, head_dim: int) -> int:
    return self.kv_heads if self.kv_heads is not None else self.heads_for(head_dim)

  def rows(self) -> list[tuple[int, tuple[int, ...] | None]]:
    """(seqlen, varlen) of each row of a group: the seqlens, or the --varlen packings and their sums."""
    if self.varlens:
      return [(sum(lens), lens) for lens in self.varlens]
    return [(seqlen, None) for seqlen in self.seqlens]

  def shape(
      self, dtype: str, head_dim: int, causal: bool, seqlen: int, window: Window | None = None, segments: int = 1,
      softcap: float | None = None, varlen: tuple[int, ...] | None = None,
  ) -> Shape:
    """One problem; a `varlen` packing is one row (batch 1) of seqlen sum(varlen)."""
    left, right = window if window is not None else (None, None)
    if varlen is not None and seqlen != sum(varlen):
      raise ValueError(f"seqlen {seqlen} is not the sum of the varlen lengths {varlen}")
    return Shape(
        batch=1 if varlen is not None else self.batch_for(seqlen),
        seqlen=seqlen,
        heads=self.heads_for(head_dim),
        kv_heads=self.kv_heads_for(head_dim),
        head_dim=head_dim,
        causal=causal,
        dtype=dtype,
        window_left=left,
        window_right=right,
        segments=segments,
        softcap=softcap,
        varlen=varlen,
    )

  def groups(self) -> list[tuple[str, int, bool, Window | None, int, float | None]]:
    """(dtype, head_dim, causal, window, segments, softcap) in sweep order; each group runs all `rows`."""
    return [
        (d, h, c, w, n, cap)
        for d in self.dtypes
        for h in self.head_dims
        for c in self.causal
        for w in self.windows
        for n in self.segments
        for cap in self.softcaps
    ]

  def num_cells(self) -> int:
    return len(self.groups()) * len(self.rows()) * len(self.modes) * len(self.impls)


@dataclasses.dataclass(frozen=True)
class CellResult:
  """One (implementation, shape, mode) cell of the sweep.

  ms: wall clock per call, the median over rounds (timing.py); ms_min the
  fastest round. kernel_ms: the GPU's own time per call, the summed durations
  of the device activities (kernels, memsets, copies) a profiler trace of a
  few calls records (kernel_trace.py); None without a GPU or a trace.
  tflops / kernel_tflops: flops over ms / kernel_ms.

  Memory fields are filled for mode fwd+bwd only (None elsewhere):
    compiled_bytes: argument + output + temp - alias bytes of the compiled
      executable, from XLA's `memory_analysis()`; per function, reliable.
    compiled_temp_bytes: the temp part of that (workspace, intermediates).
    device_peak_bytes: the device's `peak_bytes_in_use` after the cell. It is
      a process-wide high-water mark that never resets, so it is this cell's
      own peak only when `device_peak_new` is True (the mark rose during it);
      otherwise the cell's peak was at most this. None where the device
      reports no memory stats (CPU).
    min_bytes: the theoretical minimum: q, k, v, dout in and out, dq, dk, dv
      out (q's dtype) plus a float32 lse.
  flops / flops_convention: see flops.py; "dense" (4*B*H*S*S*D forward),
    "causal-half" (half that: plain causal, the FlashAttention convention)
    or "visible" (4*D*B*H per visible (query, key) pair: windows, segments,
    varlen). A softcap changes no FLOPs (its tanh is element-wise work).
  visible_fraction: visible (query, key) pairs / S*S, exact, whatever the
    convention.
  rel_err_out / rel_err_grad: ||x - ref|| / ||ref|| against the float32
    reference on this (impl, dtype, head_dim, mask) group's check shape
    (rel_err_grad: the largest of dq, dk, dv). None when not checked.
  """

  impl: str
  dtype: str
  batch: int
  heads: int
  kv_heads: int
  seqlen: int
  head_dim: int
  causal: bool
  mode: str
  status: str
  window_left: int | None = None
  window_right: int | None = None
  segments: int = 1
  softcap: float | None = None
  varlen: tuple[int, ...] | None = None
  error: str | None = None
  ms: float | None = None
  ms_min: float | None = None
  kernel_ms: float | None = None
  iters: int | None = None
  flops: int | None = None
  flops_convention: str | None = None
  visible_fraction: float | None = None
  tflops: float | None = None
  kernel_tflops: float | None = None
  speed_vs_cudnn: float | None = None
  compiled_bytes: int | None = None
  compiled_temp_bytes: int | None = None
  device_peak_bytes: int | None = None
  device_peak_new: bool | None = None
  min_bytes: int | None = None
  rel_err_out: float | None = None
  rel_err_grad: float | None = None

  @property
  def shape(self) -> Shape:
    return Shape(
        self.batch, self.seqlen, self.heads, self.kv_heads, self.head_dim, self.causal, self.dtype,
        self.window_left, self.window_right, self.segments, self.softcap, self.varlen,
    )

  def to_record(self) -> dict:
    return dataclasses.asdict(self)


CELL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CellResult))


@dataclasses.dataclass(frozen=True)
class CheckResult:
  """Accuracy of one implementation against the float32 reference."""

  impl: str
  dtype: str
  batch: int
  heads: int
  kv_heads: int
  seqlen: int
  head_dim: int
  causal: bool
  status: str
  window_left: int | None = None
  window_right: int | None = None
  segments: int = 1
  softcap: float | None = None
  varlen: tuple[int, ...] | None = None
  error: str | None = None
  rel_err_out: float | None = None
  rel_err_dq: float | None = None
  rel_err_dk: float | None = None
  rel_err_dv: float | None = None

  @property
  def rel_err_grad(self) -> float | None:
    errs = [e for e in (self.rel_err_dq, self.rel_err_dk, self.rel_err_dv) if e is not None]
    return max(errs) if errs else None

  def to_record(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryStep:
  """One step of the `--memory` probe: fwd+bwd at one sequence length."""

  impl: str
  dtype: str
  batch: int
  heads: int
  kv_heads: int
  seqlen: int
  head_dim: int
  causal: bool
  status: str
  window_left: int | None = None
  window_right: int | None = None
  segments: int = 1
  softcap: float | None = None
  varlen: tuple[int, ...] | None = None
  error: str | None = None
  ms: float | None = None
  compiled_bytes: int | None = None
  compiled_temp_bytes: int | None = None
  device_peak_bytes: int | None = None
  device_peak_new: bool | None = None
  min_bytes: int | None = None

  def to_record(self) -> dict:
    return dataclasses.asdict(self)
