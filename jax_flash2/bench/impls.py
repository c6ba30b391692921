"""The registry of attention implementations the bench compares.

Each entry has a `factory` building a jitted ``attn(q, k, v) -> out`` for one
shape (layout [batch, seq, heads, head_dim]; k and v may have fewer heads
when kv_heads != heads) and a `supports` check returning None when the shape
can run, else a short reason shown as "unsupported". Adding an
implementation is one `register(Impl(...))` call.

A shape's window and segments (spec.Shape) are part of the problem: every
factory applies them (or its `supports` says why it cannot). Segment ids are
built inside the jitted function from an iota (`segment_ids`), so they cost
no input and XLA folds them to constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_flash2.bench.spec import Shape

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Options:
  """Run-wide settings a factory may need."""

  platform: str  # jax.default_backend(): "gpu", "cpu", ...
  interpret: bool = False  # run Pallas kernels in interpret mode


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation: how to build it and which shapes it takes."""

  name: str
  description: str
  factory: Callable[[Shape, Options], AttentionFn]
  supports: Callable[[Shape, Options], str | None]
  # XLA options every executable of this implementation is compiled with
  # (`jax.stages.Lowered.compile(compiler_options=...)`), e.g. one that asks
  # cuDNN for its deterministic backward; None: XLA's defaults.
  compiler_options: Mapping[str, Any] | None = None


REGISTRY: dict[str, Impl] = {}
DEFAULT_IMPLS: tuple[str, ...] = ("flash2", "cudnn", "xla")


def register(impl: Impl) -> Impl:
  REGISTRY[impl.name] = impl
  return impl


def get(name: str) -> Impl:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(REGISTRY)}") from None


def segment_ids(batch: int, seqlen: int, segments: int) -> jax.Array | None:
  """int32 [batch, seqlen]: position // (seqlen // segments); None for one segment."""
  if segments <= 1:
    return None
  ids = jnp.arange(seqlen, dtype=jnp.int32) // (seqlen // segments)
  return jnp.broadcast_to(ids, (batch, seqlen))


# ---------------------------------------------------------------- jax_flash2


def _flash2_backends() -> tuple[str, ...]:
  from jax_flash2 import Backend

  return tuple(b.value for b in Backend)


def _flash2_factory(backend: str) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    from jax_flash2 import flash_attention

    def attn(q, k, v):
      ids = segment_ids(shape.batch, shape.seqlen, shape.segments)
      return flash_attention(
          q, k, v, causal=shape.causal, window_size=shape.window, q_segment_ids=ids, kv_segment_ids=ids,
          backend=backend, interpret=opts.interpret,
      )

    return jax.jit(attn)

  return factory


def _flash2_supports(backend: str) -> Callable[[Shape, Options], str | None]:
  def supports(shape: Shape, opts: Options) -> str | None:
    if backend not in _flash2_backends():
      return f"backend {backend!r} not in this jax_flash2"
    if (gqa := _gqa_ok(shape)) is not None:
      return gqa
    if shape.head_dim % 8 or not 8 <= shape.head_dim <= 256:
      return "head_dim must be a multiple of 8 in [8, 256]"
    if opts.platform != "gpu" and not opts.interpret:
      return "needs a GPU (or --interpret)"
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
  if shape.segments > 1:
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seqlen), jnp.int32)
  forward = plan(q, kv, kv, causal=shape.causal, window_size=shape.window, q_segment_ids=ids, kv_segment_ids=ids,
                 backend="mosaic", interpret=opts.interpret, compute_capability=(9, 0)).forward
  return None if forward.backend == "mosaic" else forward.reason


register(
    Impl(
        name="flash2",
        description="jax_flash2.flash_attention as users call it (backend 'auto': on Hopper, the Mosaic "
        "kernels where they measured faster)",
        factory=_flash2_factory("auto"),
        supports=_flash2_supports("auto"),
    )
)
register(
    Impl(
        name="flash2-triton",
        description="jax_flash2.flash_attention, Pallas kernels lowered through Triton",
        factory=_flash2_factory("triton"),
        supports=_flash2_supports("triton"),
    )
)
register(
    Impl(
        name="flash2-mosaic",
        description="jax_flash2.flash_attention(backend='mosaic'): the Mosaic GPU kernels (Hopper)",
        factory=_flash2_factory("mosaic"),
        supports=_flash2_supports("mosaic"),
    )
)

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


def _dpa_window(shape: Shape, implementation: str) -> tuple[bool, tuple[int, int] | None]:
  """(is_causal, local_window_size) passing `shape`'s mask to jax.nn.dot_product_attention."""
  if shape.window is None:
    return shape.causal, None
  left, right = shape.window
  if implementation == "cudnn":
    # Only reached for right == 0 or causal (see _cudnn_supports): causal plus a left bound.
    return True, (left, 0) if left is not None else None
  unbounded = shape.seqlen
  return shape.causal, (unbounded if left is None else left, unbounded if right is None else right)


def _dpa_factory(implementation: str) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    is_causal, window = _dpa_window(shape, implementation)

    def attn(q, k, v):
      ids = segment_ids(shape.batch, shape.seqlen, shape.segments)
      mask = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
      return jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=is_causal, local_window_size=window, implementation=implementation
      )

    return jax.jit(attn)

  return factory


def _gqa_ok(shape: Shape) -> str | None:
  if shape.heads % shape.kv_heads:
    return f"heads {shape.heads} not a multiple of kv_heads {shape.kv_heads}"
  return None


def _cudnn_supports(shape: Shape, opts: Options) -> str | None:
  if opts.platform != "gpu":
    return "needs an NVIDIA GPU"
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
    )
)
register(
    Impl(
        name="xla",
        description='jax.nn.dot_product_attention(implementation="xla")',
        factory=_dpa_factory("xla"),
        supports=lambda shape, opts: _gqa_ok(shape),
    )
)
