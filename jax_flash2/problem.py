"""The static description of one attention call, and its optional arrays.

`Problem` is what every backend decides on and every kernel is specialised
for: hashable, so that jit caches on it. `Operands` carries the arrays that
only some calls have, by name.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from jax_flash2.mask import Mask


def padded_head_dim(head_dim: int) -> int:
  """The power of two (at least 16) that tile-based kernels pad head_dim to."""
  return max(16, 1 << (head_dim - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static facts of one attention call.

  Attributes:
    mask: which (query, key) pairs are visible (band, dense mask, segment ids).
    head_dim: q's and k's last axis.
    softmax_scale: multiplies q.k before the softmax.
    dtype: q's dtype name ("bfloat16", "float16" or "float32").
    group: query heads per K/V head (1 for multi-head attention).
    softcap: scores become softcap * tanh(scores / softcap), or None.
    has_alibi: ALiBi slopes ([batch or 1, heads] float32) add
      -slope * |i + seq_k - seq_q - j| to the scores.
    dropout_rate: dropout on the probabilities (0.0: none), drawn by
      jax_flash2.dropout's hash from an int32 [2] seed.
    dropout_broadcast: one dropout mask shared by every batch and head.
    dropout_batch: where vmap folded a mapped axis into batch, the batch of
      one mapped element: dropout's hash takes batch indices modulo it, so
      each element draws the mask an unbatched call would (None: as they are).
    has_bias: an additive bias ([batch or 1, heads or 1, seq_q, seq_k]) on
      the scores, after softcap and ALiBi.
    has_sinks: attention sinks, one logit per query head in every row's
      softmax denominator: the forward kernels join them to their output and
      lse (vjp.py).
  """

  mask: Mask
  head_dim: int
  softmax_scale: float
  dtype: str
  group: int = 1
  softcap: float | None = None
  has_alibi: bool = False
  dropout_rate: float = 0.0
  dropout_broadcast: bool = False
  dropout_batch: int | None = None
  has_bias: bool = False
  has_sinks: bool = False

  @property
  def seq_q(self) -> int:
    return self.mask.seq_q

  @property
  def seq_k(self) -> int:
    return self.mask.seq_k

  @property
  def causal(self) -> bool:
    """The band stops each query at its level key (with or without a window)."""
    return self.mask.right == 0

  @property
  def head_dim_padded(self) -> int:
    return padded_head_dim(self.head_dim)

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def modifies_scores(self) -> bool:
    """Whether anything but the scale changes the scores before the softmax."""
    return self.softcap is not None or self.has_alibi or self.has_bias

  @property
  def is_plain(self) -> bool:
    """Full or causal attention and nothing else: no window, dense mask,
    segment ids, softcap, ALiBi, dropout or bias."""
    band = self.mask.is_full or self.mask.is_causal
    return band and not (self.modifies_scores or self.has_dropout)


class Operands(NamedTuple):
  """The optional input arrays of one call, None where the call has none.

  mask: int8 [batch or 1, heads or 1, seq_q, seq_k], nonzero = visible.
  q_segment_ids, kv_segment_ids: int32 [batch, seq_q] and [batch, seq_k].
  alibi_slopes: float32 [batch or 1, heads].
  dropout_seed: int32 [2] (jax_flash2.dropout.seed_words).
  bias: float [batch or 1, heads or 1, seq_q, seq_k], added to the scores.
  sinks: float32 [heads], one logit per query head in every row's softmax
    denominator; the kernels' calls (vjp.py, sharding.py) take it as
    [batch or 1, heads], like the ALiBi slopes, and only the forward kernels
    read it.
  """

  mask: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  dropout_seed: jax.Array | None = None
  bias: jax.Array | None = None
  sinks: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
  """Static facts of one flash_decode call (see jax_flash2.decode).

  Attributes:
    seq_q: new queries per sequence; query i is level with cache position
      cache_seqlens[b] - seq_q + i.
    head_dim, softmax_scale, dtype, group, softcap, has_alibi: as in Problem.
    window_left, window_right: the band around each query's level key, causal
      folded in (right <= 0); None: unbounded.
    page_size, num_pages: the paged cache's pages (None when contiguous).
  """

  seq_q: int
  head_dim: int
  softmax_scale: float
  dtype: str
  group: int = 1
  window_left: int | None = None
  window_right: int | None = None
  softcap: float | None = None
  has_alibi: bool = False
  page_size: int | None = None
  num_pages: int | None = None

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def head_dim_padded(self) -> int:
    return padded_head_dim(self.head_dim)


def cache_capacity(k_cache, block_table) -> int:
  """Keys a sequence's KV cache holds: max_seq, or max_pages * page_size
  when paged (block_table [batch, max_pages]). Lengths past it
  (write_kv_cache counts dropped tokens too) read as it, so that no kernel
  reads past the cache or the table."""
  return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
