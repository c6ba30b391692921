"""Plain-jnp attention: the definition the kernels are tested against.

It materialises the [batch, heads, seq_q, seq_k] score matrix, so its memory
is quadratic in sequence length. It doubles as the XLA backend (differentiated
by JAX's own autodiff) on machines without a supported GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash2 import dropout
from jax_flash2.mask import Mask


def band_visible(seq_q: int, seq_k: int, left: int | None, right: int | None) -> jax.Array:
  """[seq_q, seq_k] bool: query i sees key j iff
  i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right (None: unbounded;
  jax_flash2.mask.Mask.visible).

  The band is aligned bottom-right, as in FlashAttention-2; causal is
  (left, right) = (None, 0). For causal with seq_q=2, seq_k=5 and seq_q=5,
  seq_k=2 (1 = visible)::

      1 1 1 1 0        0 0
      1 1 1 1 1        0 0
                       0 0
                       1 0
                       1 1
  """
  band = Mask(seq_q, seq_k, window_left=left, window_right=right)
  return band.visible(jnp.arange(seq_q)[:, None], jnp.arange(seq_k)[None, :])


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    dropout_broadcast: bool = False,
    bias: jax.Array | None = None,
    sinks: jax.Array | None = None,
    compute_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Exact softmax attention and its log-sum-exp.

  Args:
    q: [batch, seq_q, heads, head_dim].
    k, v: [batch, seq_k, kv_heads, head_dim]; heads is a multiple of kv_heads
      (grouped-query attention: query head h reads K/V head h // (heads // kv_heads)).
    mask: broadcastable to [batch, heads, seq_q, seq_k]; nonzero = visible.
    causal: bottom-right aligned causal mask (see `band_visible`).
    window_size: (left, right) band around the diagonal (see `band_visible`);
      causal caps right at 0.
    softcap: scores become softcap * tanh(scores / softcap) (after scaling).
    alibi_slopes: [heads] or [batch, heads]; adds -slope * |i + seq_k - seq_q - j|.
    q_segment_ids, kv_segment_ids: [batch, seq_q], [batch, seq_k]; query i
      sees key j only if their ids are equal.
    softmax_scale: multiplies the scores; defaults to head_dim ** -0.5.
    dropout_rate, dropout_seed: dropout on the probabilities with the mask
      of jax_flash2.dropout (seed: int32 [2]); the lse is not affected.
    dropout_broadcast: one dropout mask for every batch element and head.
    bias: broadcastable to [batch, heads, seq_q, seq_k]; added to the scores
      after softcap and ALiBi.
    sinks: [heads]: attention sinks (gpt-oss), one logit per head that joins
      each row's softmax denominator and carries no value:
      p_ij = exp(s_ij) / (exp(sink) + sum_j exp(s_ij)).
    compute_dtype: dtype of the arithmetic; defaults to q's dtype promoted to
      at least float32 (so float64 inputs give a float64 reference).

  Returns:
    out: [batch, seq_q, heads, head_dim] in q's dtype. Rows that see no key
      are zero.
    lse: [batch, heads, seq_q] in compute_dtype, the natural log of the sum of
      exp(scaled scores) of each row (and of exp(sink)); -inf for rows that
      see no key (the sink where there are sinks).
  """
  if softmax_scale is None:
    softmax_scale = q.shape[-1] ** -0.5
  if compute_dtype is None:
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)
  group = q.shape[2] // k.shape[2]
  qc = q.astype(compute_dtype)
  kc, vc = (jnp.repeat(x.astype(compute_dtype), group, axis=2) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", qc, kc, precision=jax.lax.Precision.HIGHEST) * softmax_scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  if alibi_slopes is not None:
    slopes = jnp.reshape(alibi_slopes, (-1, q.shape[2])).astype(s.dtype)[:, :, None, None]
    distance = jnp.abs(jnp.arange(q.shape[1])[:, None] + (k.shape[1] - q.shape[1]) - jnp.arange(k.shape[1]))
    s = s - slopes * distance.astype(s.dtype)
  if bias is not None:
    s = s + bias.astype(s.dtype)
  band = Mask(q.shape[1], k.shape[1], causal=causal, window_left=window_size[0], window_right=window_size[1])
  if band.has_band:
    s = jnp.where(band_visible(q.shape[1], k.shape[1], band.left, band.right), s, -jnp.inf)
  if mask is not None:
    s = jnp.where(mask != 0, s, -jnp.inf)
  if q_segment_ids is not None:
    same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    s = jnp.where(same, s, -jnp.inf)
  # A row that sees nothing has max -inf; shifting by 0 instead keeps exp() at
  # 0 rather than NaN, and the guarded divide and log keep its gradient finite.
  # A row with a NaN or a +inf score comes out NaN, lse included.
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    # The sink column: in the max and the denominator, not in the values.
    sink = jnp.broadcast_to(sinks.astype(s.dtype)[None, :, None, None], m.shape)
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(m)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sink - m)
  seen = l != 0
  l_safe = jnp.where(seen, l, 1.0)
  probs = p / l_safe
  if dropout_rate > 0.0:
    batch, heads = q.shape[0], q.shape[2]
    head = jnp.arange(batch * heads, dtype=jnp.int32).reshape(batch, heads, 1, 1)
    if dropout_broadcast:
      head = jnp.zeros_like(head)
    rows = jnp.arange(q.shape[1], dtype=jnp.int32)[:, None]
    cols = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    probs = probs * dropout.multiplier(dropout_seed, head, rows, cols, dropout_rate).astype(probs.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, vc, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]
  return out.astype(q.dtype), lse


def gather_cache(cache: jax.Array, block_table: jax.Array | None) -> jax.Array:
  """A KV cache as [batch, max_seq, kv_heads, head_dim]: as it is when
  contiguous; a paged one ([num_pages, page_size, ...]) gathered through
  block_table [batch, max_pages] into max_seq = max_pages * page_size."""
  if block_table is None:
    return cache
  pages = jnp.take(cache, jnp.clip(block_table, 0, cache.shape[0] - 1), axis=0)  # [batch, max_pages, page, ...]
  return pages.reshape(pages.shape[0], pages.shape[1] * pages.shape[2], *pages.shape[3:])


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    compute_dtype: jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of seq_q new queries over a KV cache (jax_flash2.flash_decode),
  over the gathered cache with a dense mask.

  Sequence b has cache_seqlens[b] keys; query i is level with key
  cache_seqlens[b] - seq_q + i, and the causal mask, the window and ALiBi's
  distances are taken from that diagonal. Returns (out like q, lse
  [batch, heads, seq_q] in compute_dtype) as `attention` does."""
  k, v = gather_cache(k_cache, block_table), gather_cache(v_cache, block_table)
  seq_q, max_seq = q.shape[1], k.shape[1]
  lens = cache_seqlens.astype(jnp.int32)[:, None, None]
  level = lens - seq_q + jnp.arange(seq_q, dtype=jnp.int32)[None, :, None]  # [batch, seq_q, 1]
  keys = jnp.arange(max_seq, dtype=jnp.int32)[None, None, :]
  left, right = window_size
  if causal:
    right = 0 if right is None else min(right, 0)
  visible = keys < lens
  if right is not None:
    visible &= keys <= level + right
  if left is not None:
    visible &= keys >= level - left
  # Values past a sequence's length may be anything (NaN in a fresh
  # buffer): zeroed, as 0 * NaN would reach the output.
  v = jnp.where((keys < lens)[:, 0, :, None, None], v, jnp.zeros((), v.dtype))
  bias = None
  if alibi_slopes is not None:
    slopes = jnp.reshape(alibi_slopes, (-1, q.shape[2]))[:, :, None, None]
    bias = -slopes * jnp.abs(level - keys)[:, None].astype(slopes.dtype)
  return attention(q, k, v, mask=visible[:, None], softcap=softcap, bias=bias, sinks=sinks,
                   softmax_scale=softmax_scale, compute_dtype=compute_dtype)
