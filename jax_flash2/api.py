"""The public entry points: flash_attention() and plan().

Both check and canonicalise a call once, into a static `Problem` (its
shapes, mask and options) and, for flash_attention, an `Operands` of its
optional arrays; backends.choose then decides which backend runs each pass.
"""

from __future__ import annotations

import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import backends, dropout, vjp
from jax_flash2.backends import Backend, Device, Plan
from jax_flash2.config import BlockSizes, MosaicConfig
from jax_flash2.mask import Mask
from jax_flash2.problem import Operands, Problem

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
    softmax_scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_broadcast: bool = False,
    return_lse: bool = False,
    backend: Backend | str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
    mosaic_config: MosaicConfig | None = None,
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
    bias: float array broadcastable to [batch, heads, seq_q, seq_k], added
      to the scores (after softmax_scale, softcap and ALiBi), read block by
      block (relative-position biases, T5, Swin). Differentiable: dbias is
      computed by a kernel of its own, only when asked for, and summed over
      the axes the bias broadcasts over. Its gradient kernel writes a float32
      [batch, heads, seq_q, seq_k] array, so dbias costs quadratic memory.
    causal: mask future keys. With seq_q != seq_k the mask is aligned
      bottom-right: query i sees key j iff j <= i + seq_k - seq_q. For seq_q=2,
      seq_k=5 (1 = visible)::

          1 1 1 1 0
          1 1 1 1 1

      A query row that sees no key (possible when seq_q > seq_k) returns
      zeros, lse = -inf (the sink with sinks), and zero gradients.
    window_size: (left, right): local attention, key j visible to query i iff
      i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right; None on a
      side leaves it unbounded. Blocks wholly outside the band are skipped,
      so the cost grows with the window, not the sequence. With causal the
      right side is capped at 0. Plain ints: a traced side raises ValueError.
    softcap: if given, scores (after softmax_scale) become
      softcap * tanh(scores / softcap) before the softmax (Gemma 2, Grok);
      gradients flow through the tanh. A static Python float: a traced
      value raises TypeError.
    alibi_slopes: float32 [heads] or [batch, heads]: ALiBi adds
      -slope * |i + seq_k - seq_q - j| to the scaled scores (after softcap).
      The slopes take no gradient.
    q_segment_ids, kv_segment_ids: int32 [batch, seq_q] and [batch, seq_k],
      both or neither: for packed sequences, query i sees key j only if
      their ids are equal. Tiles whose query and key blocks' id ranges (min
      to max) do not meet are skipped: ids that never decrease along the
      sequence (packed sequences) skip the tiles between sequences; unsorted
      ids give the same result but skip fewer tiles.
    sinks: float [heads] (any float dtype: used as float32, dsinks in its
      own dtype): attention sinks (gpt-oss), one learned logit per query
      head that joins each row's softmax denominator and carries no value:
      p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)). lse then
      includes it, and a row that sees no key returns zeros and lse = sink_h.
      Differentiable (dsinks sums over batch and rows). The forward kernels
      join it to each row's running max and sum in their last step (a ring
      over a split sequence, to its merged output), so every backend and
      option serves it.
    softmax_scale: multiplies q.k before the softmax; defaults to
      1 / sqrt(head_dim). A static Python float: a traced value raises
      TypeError.
    dropout_rate: probability of dropping each attention probability (the
      kept ones are scaled by 1 / (1 - rate)), in [0, 1); a static Python
      float (a traced value raises TypeError). Needs dropout_rng.
      The mask is a hash of (key, batch, head, row, column) drawn inside the
      kernels and regenerated by the backward, never stored; the same key
      gives the same output, and backend="xla" draws the same mask. lse is
      that of the probabilities before dropout. Under sharding, batch and
      head are the shard's own indices: a differently sharded run draws a
      different (equally distributed) mask.
    dropout_rng: a JAX PRNG key (typed, or a raw uint32 [2] key).
    dropout_broadcast: one dropout mask for every batch element and head
      (Flax's broadcast_dropout=True).
    return_lse: also return the log-sum-exp of each row's scaled scores
      (and of its head's sink, with sinks).
    backend: a `Backend` or its name. "auto": each pass on the first backend
      that serves it, in measured order: the Mosaic GPU kernels on Hopper
      (bf16/fp16, head_dim 64/128/256, full or causal attention, windows,
      softcap, ALiBi, segment ids, sinks, GQA; not a dense mask, dropout or
      a bias; ragged lengths under defaults.HOPPER_RAGGED_MIN_SEQ stay on
      Triton), the Triton-lowering kernels on NVIDIA GPUs of compute
      capability >= 8.0, else plain XLA with a warning. "mosaic": the Mosaic
      kernels where they serve a pass, the Triton ones for the rest
      (ValueError off Hopper, unless interpret). "triton": the Triton
      kernels. "xla": plain XLA (quadratic memory, any derivative order).
      `plan()` says what runs and why.
    interpret: run the Pallas kernels in Pallas interpret mode (any platform,
      slow; for tests): the Triton kernels, or Mosaic's interpreter with
      backend="mosaic".
    block_sizes: the Triton kernels' tiles (BlockSizes); defaults per head_dim.
    mosaic_config: the Mosaic kernels' tilings (MosaicConfig); defaults per
      head_dim. A config given for a kernel family that runs neither pass is
      an error: configs never switch the family.

  Returns:
    out: [batch, seq_q, heads, head_dim], q's dtype. With return_lse,
    (out, lse) where lse is float32 [batch, heads, seq_q], natural log.
  """
  problem = check_problem(q, k, v, mask=mask, bias=bias, causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     sinks=sinks, softmax_scale=softmax_scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                     dropout_broadcast=dropout_broadcast)
  return_lse = check_flag("return_lse", return_lse)  # before any work, not after it
  requested = check_backend(backend)
  plan = _plan(problem, requested, Device(backends.default_compute_capability(), check_flag("interpret", interpret)),
               block_sizes, mosaic_config)
  operands = _operands(q, k, mask=mask, bias=bias, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids, sinks=sinks,
                       dropout_rng=dropout_rng if problem.has_dropout else None)
  if plan.kernels:
    out, lse = vjp.flash_checked(q, k, v, operands, backends.Call(problem, plan))
  else:
    if requested is Backend.AUTO:
      warnings.warn(
          "jax_flash2: no NVIDIA GPU of compute capability 8.0 or newer here, so flash_attention runs the plain "
          "XLA attention (quadratic memory), not the flash kernels (jax_flash2.plan() says why). Pass "
          "backend='xla' to silence this.",
          RuntimeWarning,
          stacklevel=2,
      )
    out, lse = backends.XLA.attention(q, k, v, operands, problem)
  return (out, lse) if return_lse else out


def plan(
    q,
    k,
    v,
    *,
    compute_capability: tuple[int, int] | None = None,
    backend: Backend | str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
    mosaic_config: MosaicConfig | None = None,
    return_lse: bool = False,
    **options,
) -> Plan:
  """Which backend would run the forward and the backward of
  flash_attention(q, k, v, **options), with which configs, and why a faster
  backend does not serve a pass.

  Args:
    q, k, v, **options: flash_attention's arguments; arrays may be
      jax.ShapeDtypeStructs (only shapes and dtypes are read).
    compute_capability: answer for an NVIDIA GPU of this (major, minor),
      e.g. (9, 0) for an H100/H200, from any machine; None: the default
      device.

  Returns:
    A Plan: `plan.forward.backend` and `plan.backward.backend` in {"mosaic",
    "triton", "xla"}, `.config` the kernels' tiling, `.reason` why a backend
    ahead in the order does not serve the pass (None when the first does).
    flash_attention decides through the same function, so this is what runs.
  """
  del return_lse  # it does not change what runs
  if compute_capability is None:
    compute_capability = backends.default_compute_capability()
  elif not (isinstance(compute_capability, tuple) and len(compute_capability) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in compute_capability)):
    raise TypeError(f"compute_capability must be a (major, minor) pair of ints or None, got {compute_capability!r}")
  unknown = sorted(set(options) - _PROBLEM_OPTIONS)
  if unknown:
    raise TypeError(f"plan() got unexpected keyword arguments {unknown}; beside its own it takes flash_attention's "
                    f"options: {', '.join(sorted(_PROBLEM_OPTIONS))}")
  problem = check_problem(q, k, v, **options)
  device = Device(compute_capability, check_flag("interpret", interpret))
  return _plan(problem, check_backend(backend), device, block_sizes, mosaic_config)


def _plan(problem: Problem, backend: Backend, device: Device, block_sizes, mosaic_config) -> Plan:
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a jax_flash2.BlockSizes or None, got {type(block_sizes).__name__}")
  if mosaic_config is not None and not isinstance(mosaic_config, MosaicConfig):
    raise TypeError(f"mosaic_config must be a jax_flash2.MosaicConfig or None, got {type(mosaic_config).__name__}")
  return backends.choose(problem, device, backend, block_sizes=block_sizes, mosaic_config=mosaic_config)


def check_problem(q, k, v, *, mask=None, bias=None, causal=False, window_size=None, softcap=None, alibi_slopes=None,
             q_segment_ids=None, kv_segment_ids=None, sinks=None, softmax_scale=None, dropout_rate=0.0,
             dropout_rng=None, dropout_broadcast=False) -> Problem:
  """The static description of a call, every argument checked."""
  _check_arrays(q, k, v)
  head_dim = q.shape[-1]
  softmax_scale = check_scale(softmax_scale, head_dim)
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
  left, right = check_window(window_size)
  if softcap is not None:
    softcap = check_positive("softcap", softcap)
  if mask is not None:
    _check_mask(mask, q, k)
  if bias is not None:
    _check_bias(bias, q, k)
  if alibi_slopes is not None:
    check_slopes(alibi_slopes, q)
  if sinks is not None:
    check_sinks(sinks, q)
  segments = _check_segments(q_segment_ids, kv_segment_ids, q, k)
  dropout_rate = _check_dropout(dropout_rate, dropout_rng)
  visibility = Mask(q.shape[1], k.shape[1], causal=bool(causal), window_left=left, window_right=right,
                    dense=mask is not None, segments=segments)
  return Problem(
      mask=visibility,
      head_dim=head_dim,
      softmax_scale=softmax_scale,
      dtype=jnp.dtype(q.dtype).name,
      group=q.shape[2] // k.shape[2],
      softcap=softcap,
      has_alibi=alibi_slopes is not None,
      dropout_rate=dropout_rate,
      dropout_broadcast=check_flag("dropout_broadcast", dropout_broadcast) and dropout_rate > 0.0,
      has_bias=bias is not None,
      has_sinks=sinks is not None,
  )


# The options of flash_attention that describe the problem (plan() takes them by name).
_PROBLEM_OPTIONS = frozenset(inspect.signature(check_problem).parameters) - {"q", "k", "v"}


def _operands(q, k, *, mask, bias, alibi_slopes, q_segment_ids, kv_segment_ids, sinks, dropout_rng) -> Operands:
  """The optional arrays of a checked call, in the forms the kernels read."""
  return Operands(
      # int8, not bool: the kernels load it.
      mask=None if mask is None else (_per_score(mask, _per_score_shape("mask", mask, q, k), q, k) != 0).astype(jnp.int8),
      q_segment_ids=None if q_segment_ids is None else q_segment_ids.astype(jnp.int32),
      kv_segment_ids=None if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32),
      alibi_slopes=None if alibi_slopes is None else jax.lax.stop_gradient(
          jnp.reshape(alibi_slopes, (-1, q.shape[2])).astype(jnp.float32)),
      dropout_seed=None if dropout_rng is None else jax.lax.stop_gradient(dropout.seed_words(dropout_rng)),
      bias=None if bias is None else _per_score(bias, _per_score_shape("bias", bias, q, k), q, k),
      # float32, by a differentiable cast: dsinks returns in the caller's dtype.
      sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
  )


def check_backend(backend) -> Backend:
  try:
    return Backend(backend)
  except ValueError:
    raise ValueError(f"backend must be one of {[b.value for b in Backend]}, got {backend!r}") from None


def check_flag(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
  return bool(value)


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


def _per_score_shape(name: str, x, q, k) -> tuple[int, ...]:
  """x's shape, broadcastable to [batch, heads, seq_q, seq_k], with leading
  1s to rank 4."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  batch, seq_q, heads, _ = q.shape
  full = (batch, heads, seq_q, k.shape[1])
  if x.ndim > 4:
    raise ValueError(f"{name} must be broadcastable to [batch, heads, seq_q, seq_k] = {full}, got {tuple(x.shape)}")
  shape = (1,) * (4 - x.ndim) + tuple(x.shape)
  for got, want, what in zip(shape, full, ("batch", "heads", "seq_q", "seq_k")):
    if got not in (1, want):
      raise ValueError(
          f"{name} {what} axis is {got}, expected 1 or {want}: {name} {tuple(x.shape)} is not broadcastable "
          f"to [batch, heads, seq_q, seq_k] = {full}"
      )
  return shape


def _per_score(x, shape, q, k) -> jax.Array:
  """x as [batch or 1, heads or 1, seq_q, seq_k]: the query and key axes
  materialised (the kernels read tiles of them), batch and heads left
  broadcast. Broadcasting is differentiable: a bias's gradient sums back
  over the seq axes it had as 1."""
  return jnp.broadcast_to(jnp.reshape(x, shape), (shape[0], shape[1], q.shape[1], k.shape[1]))


def _check_mask(mask, q, k) -> tuple[int, ...]:
  if hasattr(mask, "dtype") and not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.number)):
    raise TypeError(f"mask must be boolean or numeric, got dtype {mask.dtype}")
  return _per_score_shape("mask", mask, q, k)


def _check_bias(bias, q, k) -> tuple[int, ...]:
  if hasattr(bias, "dtype") and jnp.dtype(bias.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise TypeError(f"bias has dtype {jnp.dtype(bias.dtype).name}; supported: float16, bfloat16, float32")
  return _per_score_shape("bias", bias, q, k)


def _check_segments(q_ids, kv_ids, q, k) -> bool:
  """Whether segment ids are given ([batch, seq_q] and [batch, seq_k] integers)."""
  if q_ids is None and kv_ids is None:
    return False
  if q_ids is None or kv_ids is None:
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  for name, ids, x in (("q_segment_ids", q_ids, q), ("kv_segment_ids", kv_ids, k)):
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(ids).__name__}")
    if tuple(ids.shape) != tuple(x.shape[:2]):
      raise ValueError(f"{name} must have shape [batch, seq] = {tuple(x.shape[:2])}, got {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")
  return True


def _check_dropout(rate, rng) -> float:
  """A static rate in [0, 1) and, when it is positive, a PRNG key to draw
  the mask from."""
  if isinstance(rate, jax.core.Tracer):
    raise TypeError("dropout_rate must be a static Python float, not a traced value")
  if isinstance(rate, (bool, np.bool_)):
    raise TypeError(f"dropout_rate must be a float, got {type(rate).__name__}")
  try:
    rate = float(rate)
  except (TypeError, ValueError):
    raise TypeError(f"dropout_rate must be a float, got {type(rate).__name__}") from None
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
  if rate == 0.0:
    return 0.0
  if rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng, a JAX PRNG key")
  typed = hasattr(rng, "dtype") and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  raw = hasattr(rng, "dtype") and rng.dtype == jnp.uint32
  if not (typed or raw):
    raise TypeError(
        f"dropout_rng must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey), got "
        f"{getattr(rng, 'dtype', type(rng).__name__)} {tuple(getattr(rng, 'shape', ()))}"
    )
  if tuple(rng.shape) != (() if typed else (2,)):
    raise ValueError(
        f"dropout_rng must be a single PRNG key (shape {'()' if typed else '(2,)'} for a "
        f"{'typed' if typed else 'raw uint32'} key), got shape {tuple(rng.shape)}: one key draws the masks of "
        "every batch element and head"
    )
  return rate


def check_slopes(slopes, q) -> None:
  """ALiBi slopes: float [heads] or [batch, heads]."""
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


def check_sinks(sinks, q) -> None:
  """Attention sinks: float [heads], q's heads."""
  if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
    raise TypeError(f"sinks must be an array, got {type(sinks).__name__}")
  heads = q.shape[2]
  if tuple(sinks.shape) != (heads,):
    raise ValueError(f"sinks must have shape [heads] = ({heads},) (q's heads), got {tuple(sinks.shape)}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be floating point, got dtype {sinks.dtype}")


def check_window(window_size) -> tuple[int | None, int | None]:
  if window_size is None:
    return None, None
  if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
    raise TypeError(f"window_size must be a pair (left, right) of ints >= 0 or None, got {window_size!r}")
  for side in window_size:
    if side is not None and (isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 0):
      raise ValueError(f"window_size sides must be ints >= 0 or None, got {window_size!r}")
  return tuple(None if side is None else int(side) for side in window_size)


def check_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  return check_positive("softmax_scale", softmax_scale)


def check_positive(name: str, value) -> float:
  """A static, finite, positive float (it is baked into the kernels)."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python float, not a traced value")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}") from None
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f"{name} must be a finite positive number, got {value!r}")
  return number
