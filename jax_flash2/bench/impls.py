"""The registry of attention implementations the bench compares.

Each entry has a `factory` building a jitted ``attn(q, k, v) -> out`` for one
shape (layout [batch, seq, heads, head_dim]; k and v may have fewer heads
when kv_heads != heads), an `available` check returning None when it can run
on this machine at all, else a short reason (the run leaves it out), and a
`supports` check returning None when a shape can run, else a short reason
shown as "unsupported" (`supports` includes `available`). Adding an
implementation is one `register(Impl(...))` call.

A shape's window, segments and softcap (spec.Shape) are part of the
problem: every factory applies them (or its `supports` says why it cannot).
Segment ids are built inside the jitted function from an iota
(`segment_ids`), so they cost no input and XLA folds them to constants.
Attention sinks (--sinks) are run-wide (`Options.sinks`): the jax_flash2
implementations take `sink_logits`, built inside the jitted function
likewise, and those without sinks are left out of the run. So is --varlen
(`Options.varlen`; every shape of the run then has `varlen` lengths): the
jax_flash2 implementations call `flash_attention_varlen` on the packed row,
their "-segids" twins `flash_attention` with the same lengths as segment ids
(the yardstick of the varlen call), and the others, which have no packed
sequences, are left out.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2.bench.spec import LeftOut, Shape, SweepConfig

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Options:
  """Run-wide settings a factory may need."""

  platform: str  # jax.default_backend(): "gpu", "cpu", ...
  interpret: bool = False  # run Pallas kernels in interpret mode
  sinks: bool = False  # attention sinks (sink_logits) on every problem
  varlen: bool = False  # every problem is a --varlen packing (Shape.varlen)


def run_options(cfg: SweepConfig) -> Options:
  """The run-wide options of `cfg`."""
  return Options(platform=cfg.platform, interpret=cfg.interpret, sinks=cfg.sinks, varlen=bool(cfg.varlens))


def _runs_anywhere(opts: Options) -> str | None:
  return None


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation: how to build it, where it runs, which shapes it takes."""

  name: str
  description: str
  factory: Callable[[Shape, Options], AttentionFn]
  supports: Callable[[Shape, Options], str | None]
  # XLA options every executable of this implementation is compiled with
  # (`jax.stages.Lowered.compile(compiler_options=...)`), e.g. one that asks
  # cuDNN for its deterministic backward; None: XLA's defaults.
  compiler_options: Mapping[str, Any] | None = None
  available: Callable[[Options], str | None] = _runs_anywhere


REGISTRY: dict[str, Impl] = {}
# What a run compares unless --impls says otherwise; those that cannot run
# on the machine (cuDNN without a GPU, tokamax where it is not installed)
# are left out without a word.
DEFAULT_IMPLS: tuple[str, ...] = ("flash2", "cudnn", "xla", "tokamax")
# Added to the defaults of a --varlen run: flash2's lengths as segment ids, the
# yardstick of its varlen call.
VARLEN_DEFAULT_IMPLS: tuple[str, ...] = ("flash2-segids",)


def default_impls(opts: Options) -> tuple[str, ...]:
  return DEFAULT_IMPLS + (VARLEN_DEFAULT_IMPLS if opts.varlen else ())


def register(impl: Impl) -> Impl:
  REGISTRY[impl.name] = impl
  return impl


def get(name: str) -> Impl:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(REGISTRY)}") from None


def select(names: Iterable[str], opts: Options, *, requested: bool) -> tuple[tuple[str, ...], tuple[LeftOut, ...]]:
  """(the `names` that can run under `opts`, the others with the reason).

  `requested`: the names came from --impls rather than the defaults.
  """
  kept, left_out = [], []
  for name in names:
    reason = get(name).available(opts)
    if reason is None:
      kept.append(name)
    else:
      left_out.append(LeftOut(impl=name, reason=reason, requested=requested))
  return tuple(kept), tuple(left_out)


def segment_ids(batch: int, seqlen: int, segments: int) -> jax.Array | None:
  """int32 [batch, seqlen]: position // (seqlen // segments); None for one segment."""
  if segments <= 1:
    return None
  ids = jnp.arange(seqlen, dtype=jnp.int32) // (seqlen // segments)
  return jnp.broadcast_to(ids, (batch, seqlen))


def cu_seqlens(varlen: tuple[int, ...]) -> jax.Array:
  """int32 [len(varlen) + 1]: 0 then the running sums of the lengths."""
  return jnp.asarray(np.cumsum((0, *varlen)), jnp.int32)


def varlen_segment_ids(varlen: tuple[int, ...]) -> jax.Array:
  """int32 [1, sum(varlen)]: sequence s's rows hold s (the packing as segment ids)."""
  return jnp.asarray(np.repeat(np.arange(len(varlen)), varlen), jnp.int32)[None]


def shape_segment_ids(shape: Shape) -> jax.Array | None:
  """`shape`'s segment ids: its equal segments, or its varlen lengths; None for neither."""
  if shape.varlen is not None:
    return varlen_segment_ids(shape.varlen)
  return segment_ids(shape.batch, shape.seqlen, shape.segments)


def sink_logits(heads: int) -> jax.Array:
  """float32 [heads]: the sinks of a --sinks run, drawn from a fixed key
  (the accuracy check's reference takes the same), constants of the timed
  function: the backward times dq, dk, dv, not dsinks (a row sum)."""
  return jax.random.normal(jax.random.key(0), (heads,), jnp.float32)


def _no_sinks(opts: Options) -> str | None:
  """Why an implementation without attention sinks is left out of a --sinks run."""
  return "has no attention sinks (--sinks)" if opts.sinks else None


def _no_varlen(opts: Options) -> str | None:
  """Why an implementation without packed sequences is left out of a --varlen run."""
  if opts.varlen:
    return "has no packed sequences (--varlen): its sequence lengths pad, they do not pack"
  return None


def _no_softcap(shape: Shape, api: str) -> str | None:
  """Why `api`, which has no softcap, cannot serve `shape`."""
  return f"{api} has no softcap" if shape.softcap is not None else None


def _gqa_ok(shape: Shape) -> str | None:
  if shape.heads % shape.kv_heads:
    return f"heads {shape.heads} not a multiple of kv_heads {shape.kv_heads}"
  return None


def _segment_mask(shape: Shape) -> jax.Array | None:
  """bool [batch, 1, seq, seq]: ids_q == ids_k, for APIs without segment ids; None for one segment."""
  ids = segment_ids(shape.batch, shape.seqlen, shape.segments)
  return None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]


def _bounded_window(shape: Shape) -> tuple[int, int] | None:
  """`shape`'s window with unbounded sides as seqlen, for APIs whose two sides
  are ints (key j visible to query i iff i - left <= j <= i + right, seq_q == seq_k)."""
  if shape.window is None:
    return None
  left, right = shape.window
  return (shape.seqlen if left is None else left, shape.seqlen if right is None else right)


# ---------------------------------------------------------------- jax_flash2


def _flash2_backends() -> tuple[str, ...]:
  from jax_flash2 import Backend

  return tuple(b.value for b in Backend)


def _flash2_factory(backend: str, varlen_as_segment_ids: bool = False) -> Callable[[Shape, Options], AttentionFn]:
  """jax_flash2 under `backend`. A varlen shape goes through
  flash_attention_varlen (one cu_seqlens array for queries and keys, on the
  batch-1 row as [total, heads, head_dim]), or, `varlen_as_segment_ids`,
  through flash_attention with the lengths as segment ids."""

  def factory(shape: Shape, opts: Options) -> AttentionFn:
    from jax_flash2 import flash_attention, flash_attention_varlen

    def attn(q, k, v):
      options = dict(causal=shape.causal, window_size=shape.window, softcap=shape.softcap,
                     sinks=sink_logits(shape.heads) if opts.sinks else None, backend=backend,
                     interpret=opts.interpret)
      if shape.varlen is not None and not varlen_as_segment_ids:
        cu = cu_seqlens(shape.varlen)
        return flash_attention_varlen(q[0], k[0], v[0], cu, cu, **options)[None]
      ids = shape_segment_ids(shape)
      return flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, **options)

    return jax.jit(attn)

  return factory


def _flash2_available(backend: str) -> Callable[[Options], str | None]:
  def available(opts: Options) -> str | None:
    if backend not in _flash2_backends():
      return f"backend {backend!r} not in this jax_flash2"
    if opts.platform != "gpu" and not opts.interpret:
      return "needs a GPU (or --interpret)"
    return None

  return available


def _flash2_supports(backend: str) -> Callable[[Shape, Options], str | None]:
  def supports(shape: Shape, opts: Options) -> str | None:
    if (reason := _flash2_available(backend)(opts)) is not None:
      return reason
    if (gqa := _gqa_ok(shape)) is not None:
      return gqa
    if shape.head_dim % 8 or not 8 <= shape.head_dim <= 256:
      return "head_dim must be a multiple of 8 in [8, 256]"
    if backend == "mosaic":
      return _mosaic_serves(shape, opts)
    return None

  return supports


def _mosaic_serves(shape: Shape, opts: Options) -> str | None:
  """Why backend="mosaic" would run the Triton forward for this shape (so the
  cell would not measure the Mosaic kernel), or None: jax_flash2.plan's
  reason, for a Hopper GPU."""
  from jax_flash2 import plan

  q = jax.ShapeDtypeStruct((shape.batch, shape.seqlen, shape.heads, shape.head_dim), shape.dtype)
  kv = jax.ShapeDtypeStruct((shape.batch, shape.seqlen, shape.kv_heads, shape.head_dim), shape.dtype)
  ids = None
  if shape.segments > 1 or shape.varlen is not None:  # a varlen call is flash_attention with segment ids
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seqlen), jnp.int32)
  forward = plan(q, kv, kv, causal=shape.causal, window_size=shape.window, softcap=shape.softcap, q_segment_ids=ids,
                 kv_segment_ids=ids, backend="mosaic", interpret=opts.interpret, compute_capability=(9, 0)).forward
  return None if forward.backend == "mosaic" else forward.reason


register(
    Impl(
        name="flash2",
        description="jax_flash2.flash_attention as users call it (backend 'auto': on Hopper, the Mosaic "
        "kernels where they measured faster)",
        factory=_flash2_factory("auto"),
        supports=_flash2_supports("auto"),
        available=_flash2_available("auto"),
    )
)
register(
    Impl(
        name="flash2-triton",
        description="jax_flash2.flash_attention, Pallas kernels lowered through Triton",
        factory=_flash2_factory("triton"),
        supports=_flash2_supports("triton"),
        available=_flash2_available("triton"),
    )
)
register(
    Impl(
        name="flash2-mosaic",
        description="jax_flash2.flash_attention(backend='mosaic'): the Mosaic GPU kernels (Hopper)",
        factory=_flash2_factory("mosaic"),
        supports=_flash2_supports("mosaic"),
        available=_flash2_available("mosaic"),
    )
)


# The yardstick of each varlen call: the same --varlen lengths as segment ids
# of one flash_attention row. With one cu_seqlens array varlen makes that
# same call after deriving the ids on the device, so the two should time
# level; a gap is varlen's own overhead.
_ONLY_VARLEN = "only with --varlen (its lengths as segment ids)"


def _segids_available(backend: str) -> Callable[[Options], str | None]:
  def available(opts: Options) -> str | None:
    return _flash2_available(backend)(opts) or (None if opts.varlen else _ONLY_VARLEN)

  return available


def _segids_supports(backend: str) -> Callable[[Shape, Options], str | None]:
  def supports(shape: Shape, opts: Options) -> str | None:
    if shape.varlen is None:
      return _ONLY_VARLEN
    return _flash2_supports(backend)(shape, opts)

  return supports


for _name, _backend in (("flash2", "auto"), ("flash2-triton", "triton"), ("flash2-mosaic", "mosaic")):
  register(
      Impl(
          name=f"{_name}-segids",
          description=f"{_name} with the --varlen lengths as segment ids (flash_attention, not "
          "flash_attention_varlen): the yardstick of its varlen call",
          factory=_flash2_factory(_backend, varlen_as_segment_ids=True),
          supports=_segids_supports(_backend),
          available=_segids_available(_backend),
      )
  )
del _name, _backend

# ------------------------------------------------- jax.nn.dot_product_attention


# Windows: jax.nn.dot_product_attention(local_window_size=(left, right)) (jax
# 0.11.2) masks key j for query i unless i - left <= j <= i + right, aligned
# top-left; with seq_q == seq_k that is our band. Both sides must be ints, so
# an unbounded side becomes seqlen. The XLA path ANDs it with is_causal, as
# flash_attention does. The cuDNN path passes only a left window
# (sliding_window_length = left + 1 with the causal mask) and raises on a
# right side unless causal; so cuDNN runs windows whose right side is 0 or
# capped by causal, as causal + (left, 0), and reports the rest unsupported.
#
# Segments: jax.nn.dot_product_attention has no segment ids (cuDNN's packed
# layout is not reachable through it), so both paths get the dense boolean
# mask ids_q == ids_k, [batch, 1, seq, seq], built in the jitted function.
# XLA applies it to its dense scores; cuDNN turns it into an additive bias
# (no bias gradient for a boolean mask). That materialises seq^2 per batch
# row and skips no tile: it is what these implementations offer for packed
# sequences, not a like-for-like kernel comparison.


_DPA = "jax.nn.dot_product_attention"


def _dpa_window(shape: Shape, implementation: str) -> tuple[bool, tuple[int, int] | None]:
  """(is_causal, local_window_size) passing `shape`'s mask to jax.nn.dot_product_attention."""
  if shape.window is None:
    return shape.causal, None
  left, _ = shape.window
  if implementation == "cudnn":
    # Only reached for right == 0 or causal (see _cudnn_supports): causal plus a left bound.
    return True, (left, 0) if left is not None else None
  return shape.causal, _bounded_window(shape)


def _dpa_factory(implementation: str) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    is_causal, window = _dpa_window(shape, implementation)

    def attn(q, k, v):
      return jax.nn.dot_product_attention(
          q, k, v, mask=_segment_mask(shape), is_causal=is_causal, local_window_size=window,
          implementation=implementation,
      )

    return jax.jit(attn)

  return factory


def _cudnn_available(opts: Options) -> str | None:
  return _no_sinks(opts) or _no_varlen(opts) or (None if opts.platform == "gpu" else "needs an NVIDIA GPU")


def _cudnn_supports(shape: Shape, opts: Options) -> str | None:
  if (reason := _cudnn_available(opts) or _no_softcap(shape, _DPA)) is not None:
    return reason
  if jnp.dtype(shape.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "cuDNN takes fp16/bf16 only"
  if shape.head_dim % 8 or shape.head_dim > 256:
    return "head_dim must be a multiple of 8, <= 256"
  if shape.window is not None and not shape.causal and shape.window[1] != 0:
    return "cuDNN windows are left-only: right side 0, or --causal"
  # Finer limits (head_dim 256 before Hopper, ...) surface as NotImplementedError
  # from JAX at trace time and are reported as "unsupported" too.
  return _gqa_ok(shape)


register(
    Impl(
        name="cudnn",
        description='jax.nn.dot_product_attention(implementation="cudnn")',
        factory=_dpa_factory("cudnn"),
        supports=_cudnn_supports,
        available=_cudnn_available,
    )
)
# cuDNN's default backward sums dQ across K/V tiles with reduce-adds in
# whatever order they land, so dQ differs in its last bits from run to run
# (on the H200, 9 of 9 reruns at head_dim 128, 4k). XLA's
# xla_gpu_deterministic_ops asks cuDNN for its deterministic backward instead
# (dQ from a matmul kernel of its own): the yardstick at the guarantee
# jax_flash2's gradients give, bit-identical runs.
register(
    Impl(
        name="cudnn-deterministic",
        description='jax.nn.dot_product_attention(implementation="cudnn") compiled with '
        "xla_gpu_deterministic_ops: cuDNN's deterministic backward",
        factory=_dpa_factory("cudnn"),
        supports=_cudnn_supports,
        compiler_options={"xla_gpu_deterministic_ops": True},
        available=_cudnn_available,
    )
)
register(
    Impl(
        name="xla",
        description='jax.nn.dot_product_attention(implementation="xla")',
        factory=_dpa_factory("xla"),
        supports=lambda shape, opts: _no_sinks(opts) or _no_varlen(opts) or _no_softcap(shape, _DPA) or _gqa_ok(shape),
        available=lambda opts: _no_sinks(opts) or _no_varlen(opts),
    )
)

# ------------------------------------------------------------------- tokamax


# tokamax.dot_product_attention (openxla/tokamax, tokamax/_src/ops/attention/
# api.py, 0.0.17) takes jax.nn.dot_product_attention's arguments and layout
# ([batch, seq, heads, head_dim]; k and v may have fewer heads) and returns
# the output like q. `implementation=` picks "mosaic" (its Mosaic GPU
# kernels, Ampere to Blackwell; the backward Hopper and Blackwell only),
# "triton" (its Pallas Triton kernels), "xla", "xla_chunked" or "cudnn"
# (jax.nn's again); None tries "mosaic", "triton", "xla" in turn and runs the
# first that does not raise NotImplementedError, so it is tokamax as users
# call it (XLA on a CPU). A named implementation raises NotImplementedError
# where it cannot serve a shape, which the bench reports as "unsupported".
# local_window_size=(left, right) is the band of spec.Shape with ints on both
# sides, combined with is_causal. It has no segment ids: a dense boolean mask
# [batch, 1, seq, seq], as for jax.nn.dot_product_attention.
# logits_soft_cap=c makes the scaled scores c * tanh(scores / c), our softcap;
# it is passed where a shape has one and the installed API names it. Its
# query_seq_lengths / key_value_seq_lengths pad each batch row; they do not
# pack sequences, so --varlen leaves tokamax out.


def _tokamax_available(implementation: str | None) -> Callable[[Options], str | None]:
  def available(opts: Options) -> str | None:
    try:
      tokamax = importlib.import_module("tokamax")
    except ImportError:
      return "tokamax is not installed (pip install tokamax)"
    if opts.sinks or opts.varlen:
      return _no_sinks(opts) or _no_varlen(opts)
    if implementation is None:
      return None
    # The names its API declares (a `type` alias of a Literal), where it declares them.
    alias = getattr(tokamax, "DotProductAttentionImplementation", None)
    known = typing.get_args(getattr(alias, "__value__", alias))
    if known and implementation not in known:
      return f"this tokamax has no implementation {implementation!r} (it has {', '.join(known)})"
    if implementation in ("mosaic", "triton") and opts.platform != "gpu":
      return f"tokamax's {implementation.capitalize()} kernels need an NVIDIA GPU"
    return None

  return available


def _tokamax_softcap(shape: Shape) -> str | None:
  """Why the installed tokamax cannot take `shape`'s softcap, or None."""
  import tokamax

  if shape.softcap is None or "logits_soft_cap" in inspect.signature(tokamax.dot_product_attention).parameters:
    return None
  return "this tokamax has no logits_soft_cap"


def _tokamax_supports(implementation: str | None) -> Callable[[Shape, Options], str | None]:
  def supports(shape: Shape, opts: Options) -> str | None:
    return _tokamax_available(implementation)(opts) or _tokamax_softcap(shape) or _gqa_ok(shape)

  return supports


def _tokamax_factory(implementation: str | None) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    import tokamax

    window = _bounded_window(shape)
    softcap = {} if shape.softcap is None else dict(logits_soft_cap=shape.softcap)

    def attn(q, k, v):
      return tokamax.dot_product_attention(
          q, k, v, mask=_segment_mask(shape), is_causal=shape.causal, local_window_size=window,
          implementation=implementation, **softcap,
      )

    return jax.jit(attn)

  return factory


def _tokamax_impl(name: str, implementation: str | None, description: str) -> Impl:
  return Impl(
      name=name,
      description=description,
      factory=_tokamax_factory(implementation),
      supports=_tokamax_supports(implementation),
      available=_tokamax_available(implementation),
  )


register(
    _tokamax_impl(
        "tokamax", None, "tokamax.dot_product_attention as users call it (implementation=None: its Mosaic GPU "
        "kernels, else Triton, else XLA, the first that serves the shape)",
    )
)
register(
    _tokamax_impl(
        "tokamax-mosaic", "mosaic", 'tokamax.dot_product_attention(implementation="mosaic"): its Mosaic GPU kernels'
    )
)
register(
    _tokamax_impl(
        "tokamax-triton", "triton", 'tokamax.dot_product_attention(implementation="triton"): its Pallas Triton kernels'
    )
)
register(_tokamax_impl("tokamax-xla", "xla", 'tokamax.dot_product_attention(implementation="xla")'))
