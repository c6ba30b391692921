"""The public entry point: argument checking, canonicalisation, backend choice."""

from __future__ import annotations

import enum
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import reference
from jax_flash2.config import BlockSizes, default_block_sizes, padded_head_dim
from jax_flash2.triton.tiles import Problem
from jax_flash2.vjp import KernelCall, flash

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256
# Compute capability from which the Pallas Triton lowering is supported.
_MIN_COMPUTE_CAPABILITY = (8, 0)


class Backend(enum.Enum):
  AUTO = "auto"
  TRITON = "triton"
  XLA = "xla"


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Exact softmax attention with FlashAttention-2 kernels.

  Args:
    q: [batch, seq_q, heads, head_dim] queries.
    k: [batch, seq_k, kv_heads, head_dim] keys. heads must be a multiple of
      kv_heads (grouped-query attention; kv_heads = 1 is multi-query): query
      head h reads K/V head h // (heads // kv_heads). dK and dV sum over each
      group inside the kernel; K and V are never repeated in memory.
    v: [batch, seq_k, kv_heads, head_dim] values.
    mask: boolean or numeric array broadcastable to [batch, heads, seq_q,
      seq_k]; nonzero means visible (what `flax.linen.make_attention_mask`
      and `make_causal_mask` build). Applied block by block inside the
      kernels; blocks it hides entirely are skipped. Combines with causal.
    causal: mask future keys. With seq_q != seq_k the mask is aligned
      bottom-right: query i sees key j iff j <= i + seq_k - seq_q. For seq_q=2,
      seq_k=5 (1 = visible)::

          1 1 1 1 0
          1 1 1 1 1

      A query row that sees no key (possible when seq_q > seq_k) returns
      zeros, lse = -inf, and zero gradients.
    window_size: (left, right): local attention, key j visible to query i iff
      i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right; None on a
      side leaves it unbounded. Blocks wholly outside the band are skipped,
      so the cost grows with the window, not the sequence. With causal the
      right side is capped at 0.
    softcap: if given, scores (after softmax_scale) become
      softcap * tanh(scores / softcap) before the softmax (Gemma 2, Grok);
      gradients flow through the tanh.
    alibi_slopes: float32 [heads] or [batch, heads]: ALiBi adds
      -slope * |i + seq_k - seq_q - j| to the scaled scores (after softcap).
      The slopes take no gradient.
    q_segment_ids, kv_segment_ids: int32 [batch, seq_q] and [batch, seq_k],
      both or neither: for packed sequences, query i sees key j only if
      their ids are equal. Tiles whose id ranges do not meet are skipped.
    softmax_scale: multiplies q.k before the softmax; defaults to
      1 / sqrt(head_dim).
    return_lse: also return the log-sum-exp of each row's scaled scores.
    backend: "auto" (Pallas kernels on an NVIDIA GPU of compute capability
      8.0 or newer, else the XLA path with a warning), "triton" (the Pallas
      Triton-lowering kernels) or "xla" (plain XLA; quadratic memory).
    interpret: run the Pallas kernels in Pallas interpret mode (any platform,
      slow; for tests).
    block_sizes: tile sizes and launch parameters; defaults per head_dim.

  Returns:
    out: [batch, seq_q, heads, head_dim], q's dtype. With return_lse,
    (out, lse) where lse is float32 [batch, heads, seq_q], natural log.
  """
  _check_arrays(q, k, v)
  head_dim = q.shape[-1]
  softmax_scale = _check_scale(softmax_scale, head_dim)
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
  left, right = _check_window(window_size)
  if softcap is not None:
    softcap = _check_positive("softcap", softcap)
  if causal:
    right = 0 if right is None else min(right, 0)
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a jax_flash2.BlockSizes or None, got {type(block_sizes).__name__}")
  kind = _resolve_backend(backend, interpret)
  if mask is not None:
    mask = _canonical_mask(mask, q, k)
  if alibi_slopes is not None:
    alibi_slopes = _canonical_slopes(alibi_slopes, q)
  q_segment_ids, kv_segment_ids = _check_segments(q_segment_ids, kv_segment_ids, q, k)

  if kind is Backend.XLA:
    out, lse = reference.attention(
        q, k, v, mask=mask, window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale,
        compute_dtype=jnp.float32,
    )
  else:
    seq_q, seq_k = q.shape[1], k.shape[1]
    problem = Problem(
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        head_dim_padded=padded_head_dim(head_dim),
        window_left=left,
        window_right=right,
        softmax_scale=softmax_scale,
        dtype=jnp.dtype(q.dtype).name,
        has_mask=mask is not None,
        group=q.shape[2] // k.shape[2],
        softcap=softcap,
        has_alibi=alibi_slopes is not None,
        has_segments=q_segment_ids is not None,
    )
    blocks = (block_sizes or default_block_sizes(head_dim, causal)).fit(seq_q, seq_k)
    call = KernelCall(problem=problem, block_sizes=blocks, interpret=bool(interpret))
    out, lse = flash(q, k, v, mask, q_segment_ids, kv_segment_ids, alibi_slopes, call)
  return (out, lse) if return_lse else out


def _check_arrays(q, k, v) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
      raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype).name}; supported: float16, bfloat16, float32")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape [batch, seq_k, heads, head_dim], got {shapes}")
  for axis, what in ((0, "batch"), (3, "head_dim")):
    if q.shape[axis] != k.shape[axis]:
      raise ValueError(f"q and k/v differ in {what} (axis {axis}): {shapes}")
  if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
    raise ValueError(f"q's heads (axis 2) must be a multiple of k/v's heads: {shapes}")
  for name, x in (("q", q), ("k", k)):
    if x.shape[1] < 1 or x.shape[0] < 1 or x.shape[2] < 1:
      raise ValueError(f"{name} has an empty batch, seq or heads axis: {shapes}")
  head_dim = q.shape[-1]
  if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim} ({shapes})")


def _canonical_mask(mask, q, k) -> jax.Array:
  """The mask as int8 [batch or 1, heads or 1, seq_q, seq_k], 1 = visible;
  broadcast batch/head axes stay 1. (int8, not bool: the kernels load it.)"""
  if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
    raise TypeError(f"mask must be an array, got {type(mask).__name__}")
  batch, seq_q, heads, _ = q.shape
  full = (batch, heads, seq_q, k.shape[1])
  if mask.ndim > 4:
    raise ValueError(f"mask must be broadcastable to [batch, heads, seq_q, seq_k] = {full}, got {tuple(mask.shape)}")
  shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
  for got, want, what in zip(shape, full, ("batch", "heads", "seq_q", "seq_k")):
    if got not in (1, want):
      raise ValueError(
          f"mask {what} axis is {got}, expected 1 or {want}: mask {tuple(mask.shape)} is not broadcastable "
          f"to [batch, heads, seq_q, seq_k] = {full}"
      )
  if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.number)):
    raise TypeError(f"mask must be boolean or numeric, got dtype {mask.dtype}")
  # Query and key axes are always materialised (the kernels read tiles of
  # them); batch and heads stay broadcast.
  shape = (shape[0], shape[1], seq_q, k.shape[1])
  visible = jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape)) != 0
  return jnp.broadcast_to(visible, shape).astype(jnp.int8)


def _check_segments(q_ids, kv_ids, q, k) -> tuple[jax.Array | None, jax.Array | None]:
  """Segment ids as int32 [batch, seq_q] and [batch, seq_k], or (None, None)."""
  if q_ids is None and kv_ids is None:
    return None, None
  if q_ids is None or kv_ids is None:
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  for name, ids, x in (("q_segment_ids", q_ids, q), ("kv_segment_ids", kv_ids, k)):
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(ids).__name__}")
    if tuple(ids.shape) != tuple(x.shape[:2]):
      raise ValueError(f"{name} must have shape [batch, seq] = {tuple(x.shape[:2])}, got {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")
  return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def _canonical_slopes(slopes, q) -> jax.Array:
  """ALiBi slopes as float32 [batch or 1, heads]."""
  if not hasattr(slopes, "shape") or not hasattr(slopes, "dtype"):
    raise TypeError(f"alibi_slopes must be an array, got {type(slopes).__name__}")
  batch, _, heads, _ = q.shape
  if tuple(slopes.shape) not in ((heads,), (batch, heads)):
    raise ValueError(
        f"alibi_slopes must have shape [heads] = ({heads},) or [batch, heads] = ({batch}, {heads}), "
        f"got {tuple(slopes.shape)}"
    )
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be floating point, got dtype {slopes.dtype}")
  return jax.lax.stop_gradient(jnp.reshape(slopes, (-1, heads)).astype(jnp.float32))


def _check_window(window_size) -> tuple[int | None, int | None]:
  if window_size is None:
    return None, None
  if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
    raise TypeError(f"window_size must be a pair (left, right) of ints >= 0 or None, got {window_size!r}")
  for side in window_size:
    if side is not None and (isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 0):
      raise ValueError(f"window_size sides must be ints >= 0 or None, got {window_size!r}")
  return tuple(None if side is None else int(side) for side in window_size)


def _check_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  return _check_positive("softmax_scale", softmax_scale)


def _check_positive(name: str, value) -> float:
  """A static, finite, positive float (it is baked into the kernels)."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python float, not a traced value")
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}") from None
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f"{name} must be a finite positive number, got {value!r}")
  return number


def _resolve_backend(backend: str, interpret: bool) -> Backend:
  try:
    kind = Backend(backend)
  except ValueError:
    raise ValueError(f"backend must be one of {[b.value for b in Backend]}, got {backend!r}") from None
  if interpret:
    if kind is Backend.XLA:
      raise ValueError("interpret=True runs the Pallas kernels; it cannot be combined with backend='xla'")
    return Backend.TRITON
  if kind is Backend.AUTO:
    if _has_supported_gpu():
      return Backend.TRITON
    _warn_xla_fallback()
    return Backend.XLA
  return kind


def _has_supported_gpu() -> bool:
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return False
  major, minor = (int(x) for x in str(capability).split(".")[:2])
  return (major, minor) >= _MIN_COMPUTE_CAPABILITY


@functools.cache
def _warn_xla_fallback() -> None:
  warnings.warn(
      "jax_flash2: no NVIDIA GPU of compute capability >= 8.0 found; flash_attention is running "
      "the plain XLA attention (quadratic memory), not the flash kernel. Pass backend='xla' to "
      "silence this.",
      RuntimeWarning,
      stacklevel=3,
  )
