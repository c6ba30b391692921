"""The registry of attention implementations the bench compares.

Each entry has a `factory` building a jitted ``attn(q, k, v) -> out`` for one
shape (layout [batch, seq, heads, head_dim]; k and v may have fewer heads
when kv_heads != heads) and a `supports` check returning None when the shape
can run, else a short reason shown as "unsupported". Adding an
implementation is one `register(Impl(...))` call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

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


REGISTRY: dict[str, Impl] = {}
DEFAULT_IMPLS: tuple[str, ...] = ("flash2-triton", "cudnn", "xla")


def register(impl: Impl) -> Impl:
  REGISTRY[impl.name] = impl
  return impl


def get(name: str) -> Impl:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(REGISTRY)}") from None


# ---------------------------------------------------------------- jax_flash2


def _flash2_backends() -> tuple[str, ...]:
  from jax_flash2 import api

  return tuple(b.value for b in api.Backend)


def _flash2_factory(backend: str) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    from jax_flash2 import flash_attention

    return jax.jit(
        functools.partial(
            flash_attention, causal=shape.causal, backend=backend, interpret=opts.interpret
        )
    )

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
    return None

  return supports


register(
    Impl(
        name="flash2-triton",
        description="jax_flash2.flash_attention, Pallas kernels lowered through Triton",
        factory=_flash2_factory("triton"),
        supports=_flash2_supports("triton"),
    )
)
# Reserved: becomes runnable as soon as jax_flash2.api.Backend gains "mosaic".
register(
    Impl(
        name="flash2-mosaic",
        description="jax_flash2.flash_attention, Pallas kernels lowered through Mosaic GPU",
        factory=_flash2_factory("mosaic"),
        supports=_flash2_supports("mosaic"),
    )
)

# ------------------------------------------------- jax.nn.dot_product_attention


def _dpa_factory(implementation: str) -> Callable[[Shape, Options], AttentionFn]:
  def factory(shape: Shape, opts: Options) -> AttentionFn:
    return jax.jit(
        functools.partial(jax.nn.dot_product_attention, is_causal=shape.causal, implementation=implementation)
    )

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
register(
    Impl(
        name="xla",
        description='jax.nn.dot_product_attention(implementation="xla")',
        factory=_dpa_factory("xla"),
        supports=lambda shape, opts: _gqa_ok(shape),
    )
)
