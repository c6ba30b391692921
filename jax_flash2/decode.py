"""Decoding over a KV cache: flash_decode() and write_kv_cache().

flash_decode attends a few new queries per sequence (one token, or a few
for speculative decoding) to a contiguous or paged KV cache whose sequences
have their own lengths. On NVIDIA GPUs it runs the split-KV kernel of
jax_flash2.triton.decode (flash-decoding: each sequence's cache is cut
into splits that run in parallel, merged exactly by their lse); elsewhere a
plain XLA attention over the gathered cache. It is forward only. Under jit
with operands sharded over batch and heads the kernel runs on each shard
without gathering, and a vmapped axis folds into batch (jax_flash2.sharding).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import backends, sharding
from jax_flash2.api import (MAX_HEAD_DIM, SUPPORTED_DTYPES, check_backend, check_flag, check_positive, check_scale,
                            check_sinks, check_slopes, check_window)
from jax_flash2.backends import Backend, DecodeCall, Device, PassPlan
from jax_flash2.problem import DecodeProblem

# Pages hold a multiple of this many tokens: the kernel's K/V blocks divide a page.
PAGE_MULTIPLE = 16


def flash_decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    backend: Backend | str = "auto",
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of new queries over a KV cache (forward only).

  Args:
    q: [batch, seq_q, heads, head_dim], the new tokens' queries (seq_q small:
      1, or a few for speculative decoding).
    k_cache, v_cache: [batch, max_seq, kv_heads, head_dim], or with
      block_table a paged cache [num_pages, page_size, kv_heads, head_dim]
      (page_size a multiple of 16). heads is a multiple of kv_heads (GQA;
      1 is MQA): the kernel reads each K/V head once for its whole group.
    cache_seqlens: int32 [batch], the valid keys of each sequence, the new
      tokens' included (write_kv_cache returns it). Key j is visible to
      query i iff j < cache_seqlens[b] and, with causal, j <= cache_seqlens[b]
      - seq_q + i. For seq_q = 2, cache_seqlens[b] = 5 (1 = visible)::

          1 1 1 1 0
          1 1 1 1 1

      Blocks past a sequence's length are never read. A sequence of length 0
      gives zeros (lse -inf, or its head's sink); lengths are clipped to
      [0, the cache's capacity].
    block_table: int32 [batch, max_pages_per_seq]: key j of sequence b lies
      in page block_table[b, j // page_size], row j % page_size.
    softmax_scale, softcap, sinks: as in flash_attention.
    causal, window_size: as in flash_attention, relative to the diagonal
      above: query i sees key j iff level - left <= j <= level + right,
      level = cache_seqlens[b] - seq_q + i.
    alibi_slopes: float32 [heads] or [batch, heads]: adds
      -slope * |cache_seqlens[b] - seq_q + i - j| to the scaled scores.
    return_lse: also return lse, float32 [batch, heads, seq_q], natural log.
    num_splits: splits of each sequence's cache (positive int); None chooses
      enough for batch * kv_heads * splits programs to fill the GPU
      (defaults.decode_splits). Any number gives the same result to rounding.
    backend: "auto" (the Triton kernel on NVIDIA GPUs of compute capability
      >= 8.0, else XLA with a warning), "triton" or "xla".
    interpret: run the Triton kernel in Pallas interpret mode (tests).

  Returns:
    out like q; with return_lse, (out, lse). jax.grad through it raises:
    decoding has no gradient (train with flash_attention).
  """
  p, plan = _decide(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                    causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                    num_splits=num_splits, backend=backend, interpret=interpret)
  return_lse = check_flag("return_lse", return_lse)  # before any work, not after it
  if plan.backend == Backend.XLA.value and check_backend(backend) is Backend.AUTO:
    warnings.warn(
        "jax_flash2: no NVIDIA GPU of compute capability 8.0 or newer here, so flash_decode runs the plain XLA "
        "attention over the gathered cache, not the split-KV kernel (jax_flash2.decode_plan() says why). Pass "
        "backend='xla' to silence this.",
        RuntimeWarning,
        stacklevel=2,
    )
  slopes = None if alibi_slopes is None else jnp.reshape(alibi_slopes, (-1, q.shape[2])).astype(jnp.float32)
  sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
  lens = cache_seqlens.astype(jnp.int32)
  table = None if block_table is None else block_table.astype(jnp.int32)
  arrays = (q, k_cache, v_cache, lens, table, slopes, sinks)
  if plan.backend != Backend.XLA.value:
    # The kernel is partitioned over Auto mesh axes only; plain XLA takes any.
    sharding.check_auto_axes(zip(sharding.DECODE_ARGS, arrays))
  out, lse = _no_gradient_call(arrays, DecodeCall(p, plan, interpret, has_sinks=sinks is not None))
  return (out, lse) if return_lse else out


def decode_plan(q, k_cache, v_cache, cache_seqlens, *, compute_capability: tuple[int, int] | None = None,
                sm_count: int | None = None, return_lse: bool = False, **options) -> PassPlan:
  """Which backend would run flash_decode(q, k_cache, v_cache, cache_seqlens,
  **options), with which DecodeConfig (block_k, num_splits), and why the
  kernel does not serve (None when it does). Arrays may be
  jax.ShapeDtypeStructs. compute_capability, sm_count: answer for such a GPU
  (e.g. (9, 0) and 132 for an H200) from any machine; None: the default
  device's (without an SM count the splits take defaults.decode_splits'
  fixed number)."""
  del return_lse  # it does not change what runs
  if compute_capability is None:
    compute_capability = backends.default_compute_capability()
    sm_count = backends.default_sm_count() if sm_count is None else sm_count
  return _decide(q, k_cache, v_cache, cache_seqlens, compute_capability=compute_capability, sm_count=sm_count,
                 **options)[1]


def write_kv_cache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes new tokens' keys and values into a KV cache.

  Token t of sequence b goes to position cache_seqlens[b] + t (through the
  page table when paged); positions past the cache's capacity (max_seq, or
  max_pages_per_seq * page_size) are dropped. A pure scatter: no host sync,
  and under jit with the caches donated XLA updates them in place.

  Args:
    k_cache, v_cache: as in flash_decode (contiguous or paged).
    k_new, v_new: [batch, seq_new, kv_heads, head_dim], the caches' dtype.
    cache_seqlens: int32 [batch], the keys already written.
    block_table: int32 [batch, max_pages_per_seq] for a paged cache.

  Returns:
    (k_cache, v_cache, cache_seqlens + seq_new).
  """
  _check_cache(k_cache, v_cache, k_new.shape[0] if hasattr(k_new, "shape") else None, block_table)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if not hasattr(x, "shape") or x.ndim != 4:
      raise ValueError(f"{name} must be an array [batch, seq_new, kv_heads, head_dim], got "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    if x.shape[2:] != k_cache.shape[2:] or x.dtype != k_cache.dtype:
      raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} must match the cache's kv_heads, head_dim and dtype: "
                       f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
  batch, seq_new = k_new.shape[:2]
  _check_seqlens(cache_seqlens, batch)
  if block_table is None and k_cache.shape[0] != batch:
    raise ValueError(f"k_new's batch ({batch}) must match the contiguous cache's (k_cache {tuple(k_cache.shape)})")
  lens = cache_seqlens.astype(jnp.int32)
  pos = lens[:, None] + jnp.arange(seq_new, dtype=jnp.int32)[None, :]  # [batch, seq_new]
  if block_table is None:
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], pos.shape)
    index = (rows, pos)  # positions past max_seq are out of range: dropped
  else:
    page_size, max_pages = k_cache.shape[1], block_table.shape[1]
    slot = jnp.clip(pos // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(block_table.astype(jnp.int32), slot, axis=1)
    # Past the table's capacity: an out-of-range page, dropped.
    page = jnp.where(pos < max_pages * page_size, page, k_cache.shape[0])
    index = (page, pos % page_size)
  k_cache = k_cache.at[index].set(k_new, mode="drop")
  v_cache = v_cache.at[index].set(v_new, mode="drop")
  return k_cache, v_cache, lens + seq_new


# ---------------------------------------------------------------- no gradient


@jax.custom_vjp
def _no_gradient_call(arrays, call: DecodeCall):
  return sharding.decode(*arrays, call)


def _no_gradient_fwd(arrays, call):
  return _no_gradient_call(arrays, call), None


def _no_gradient_bwd(residuals, cotangents):
  raise TypeError("jax_flash2.flash_decode has no gradient: decoding over a KV cache is inference only. Train "
                  "with jax_flash2.flash_attention (or flash_attention_varlen), which is differentiable.")


_no_gradient_call.defvjp(_no_gradient_fwd, _no_gradient_bwd)


# ---------------------------------------------------------------- checks


def _decide(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, causal=True,
            window_size=None, softcap=None, alibi_slopes=None, sinks=None, num_splits=None, backend="auto",
            interpret=False, compute_capability=None, sm_count=None) -> tuple[DecodeProblem, PassPlan]:
  """The checked static problem of a call and its plan."""
  _check_q(q)
  batch, seq_q, heads, head_dim = q.shape
  _check_cache(k_cache, v_cache, batch, block_table)
  shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
  if q.dtype != k_cache.dtype:
    raise TypeError(f"q and k_cache/v_cache must share one dtype, got q {q.dtype}, k_cache {k_cache.dtype}")
  if k_cache.shape[3] != head_dim:
    raise ValueError(f"q and k_cache/v_cache differ in head_dim (axis 3): {shapes}")
  kv_heads = k_cache.shape[2]
  if kv_heads < 1 or heads % kv_heads:
    raise ValueError(f"q's heads (axis 2) must be a multiple of the cache's kv_heads (axis 2): {shapes}")
  _check_seqlens(cache_seqlens, batch)
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
  left, right = check_window(window_size)
  if causal:
    right = 0 if right is None else min(right, 0)
  if alibi_slopes is not None:
    check_slopes(alibi_slopes, q)
  if sinks is not None:
    check_sinks(sinks, q)
  if num_splits is not None and (isinstance(num_splits, (bool, np.bool_))
                                 or not isinstance(num_splits, (int, np.integer)) or num_splits < 1):
    raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
  paged = block_table is not None
  p = DecodeProblem(
      seq_q=seq_q, head_dim=head_dim, softmax_scale=check_scale(softmax_scale, head_dim),
      dtype=jnp.dtype(q.dtype).name, group=heads // kv_heads, window_left=left, window_right=right,
      softcap=None if softcap is None else check_positive("softcap", softcap), has_alibi=alibi_slopes is not None,
      page_size=k_cache.shape[1] if paged else None, num_pages=k_cache.shape[0] if paged else None)
  if compute_capability is None and sm_count is None:
    compute_capability, sm_count = backends.default_compute_capability(), backends.default_sm_count()
  device = Device(compute_capability, check_flag("interpret", interpret))
  max_seq = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
  plan = backends.choose_decode(p, device, check_backend(backend), batch=batch, kv_heads=kv_heads, max_seq=max_seq,
                                num_splits=None if num_splits is None else int(num_splits), sm_count=sm_count)
  return p, plan


def _check_q(q) -> None:
  if not hasattr(q, "shape") or not hasattr(q, "dtype"):
    raise TypeError(f"q must be an array, got {type(q).__name__}")
  if q.ndim != 4 or min(q.shape) < 1:
    raise ValueError(f"q must have shape [batch, seq_q, heads, head_dim] with no empty axis, got {tuple(q.shape)}")
  if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise TypeError(f"q has dtype {jnp.dtype(q.dtype).name}; supported: float16, bfloat16, float32")
  head_dim = q.shape[3]
  if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim} (q {tuple(q.shape)})")


def _check_cache(k_cache, v_cache, batch, block_table) -> None:
  """The caches' ranks and shapes, contiguous ([batch, max_seq, ...]) or
  paged ([num_pages, page_size, ...] with block_table [batch, max_pages])."""
  for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4 or min(x.shape) < 1:
      layout = "[num_pages, page_size, kv_heads, head_dim]" if block_table is not None else \
          "[batch, max_seq, kv_heads, head_dim]"
      raise ValueError(f"{name} must have shape {layout} with no empty axis, got {tuple(x.shape)}")
  if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
    raise ValueError(f"k_cache and v_cache must have one shape and dtype, got k_cache {tuple(k_cache.shape)} "
                     f"{k_cache.dtype}, v_cache {tuple(v_cache.shape)} {v_cache.dtype}")
  if block_table is None:
    if batch is not None and k_cache.shape[0] != batch:
      raise ValueError(f"k_cache's batch (axis 0) is {k_cache.shape[0]}, expected {batch} (q's); a paged cache "
                       "needs block_table")
    return
  if not hasattr(block_table, "shape") or not hasattr(block_table, "dtype"):
    raise TypeError(f"block_table must be an array, got {type(block_table).__name__}")
  if not jnp.issubdtype(block_table.dtype, jnp.integer):
    raise TypeError(f"block_table must hold integers (int32), got dtype {block_table.dtype}")
  if block_table.ndim != 2 or (batch is not None and block_table.shape[0] != batch) or block_table.shape[1] < 1:
    raise ValueError(f"block_table must have shape [batch, max_pages_per_seq] with batch {batch}, got "
                     f"{tuple(block_table.shape)}")
  if k_cache.shape[1] % PAGE_MULTIPLE:
    raise ValueError(f"page_size (k_cache axis 1) must be a multiple of {PAGE_MULTIPLE}, got {k_cache.shape[1]} "
                     f"(k_cache {tuple(k_cache.shape)})")


def _check_seqlens(cache_seqlens, batch: int) -> None:
  if not hasattr(cache_seqlens, "shape") or not hasattr(cache_seqlens, "dtype"):
    raise TypeError(f"cache_seqlens must be an int32 array, got {type(cache_seqlens).__name__}")
  if not jnp.issubdtype(cache_seqlens.dtype, jnp.integer):
    raise TypeError(f"cache_seqlens must hold integers (int32), got dtype {cache_seqlens.dtype}")
  if tuple(cache_seqlens.shape) != (batch,):
    raise ValueError(f"cache_seqlens must have shape [batch] = ({batch},), got {tuple(cache_seqlens.shape)}")
