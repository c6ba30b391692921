"""Which (query, key) pairs attention sees, and which blocks of them a kernel visits.

`Mask` is the static half: the band of causal attention and sliding windows,
aligned bottom-right (query i is level with key i + seq_k - seq_q, as in
FlashAttention-2), and whether a dense mask and segment ids take part. Its
methods are the one definition of element visibility (`visible`) and of the
per-block ranges that follow from the band (`kv_blocks`, `q_blocks`); the
reference, the Triton kernels and the Mosaic kernels all use them. The
functions below it derive per-block ranges from the arrays (segment ids,
a dense mask), outside the kernels.

A band edge is None when that side is unbounded: query i sees key j iff

    i + offset - left <= j <= i + offset + right,   offset = seq_k - seq_q.

Causal attention is right = 0; with a window, causal caps its right side at 0.
For causal with seq_q = 2, seq_k = 5 (1 = visible)::

    1 1 1 1 0
    1 1 1 1 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """The integer operations a block range is computed with: those of the
  code it runs in (a kernel's traced scalars, the host's numpy), so that
  each caller gets the instructions it would write itself.

  div: floor division of a non-negative value by a static int; at_least_0:
  max(x, 0); clip(x, lo, hi); as_int32: the result's type."""

  div: Callable[[Any, int], Any]
  at_least_0: Callable[[Any], Any]
  minimum: Callable[[Any, Any], Any]
  clip: Callable[[Any, Any, Any], Any]
  as_int32: Callable[[Any], Any]


def _int32(x):
  return x.astype(jnp.int32) if hasattr(x, "astype") else jnp.int32(x)


# jnp on traced int32 scalars (the Mosaic GPU kernels).
JNP = Arithmetic(
    div=lambda a, b: a // b, at_least_0=lambda x: jnp.clip(x, 0, None), minimum=jnp.minimum, clip=jnp.clip,
    as_int32=_int32,
)
# numpy on the host (schedules built before a kernel is traced).
NUMPY = Arithmetic(
    div=lambda a, b: a // b, at_least_0=lambda x: np.clip(x, 0, None), minimum=np.minimum, clip=np.clip,
    as_int32=lambda x: np.asarray(x).astype(np.int32),
)
# lax on traced int32 scalars (the Triton kernels: int32 even under x64, and no
# select on scalar bounds, which their lowering does not take).
LAX = Arithmetic(
    div=lambda a, b: lax.div(a, jnp.int32(b)), at_least_0=lambda x: jnp.maximum(x, 0), minimum=jnp.minimum,
    clip=jnp.clip, as_int32=lambda x: x,
)


@dataclasses.dataclass(frozen=True)
class Mask:
  """The static description of what each query sees.

  Attributes:
    seq_q, seq_k: the real sequence lengths.
    causal: query i sees no key past i + seq_k - seq_q.
    window_left, window_right: the sliding window's sides (None: unbounded).
    dense: a dense mask array ([batch or 1, heads or 1, seq_q, seq_k],
      nonzero = visible) takes part as well.
    segments: segment ids ([batch, seq_q] and [batch, seq_k]) take part:
      query i sees key j only if their ids are equal.
  """

  seq_q: int
  seq_k: int
  causal: bool = False
  window_left: int | None = None
  window_right: int | None = None
  dense: bool = False
  segments: bool = False

  @property
  def offset(self) -> int:
    """Bottom-right alignment: query i is level with key i + offset."""
    return self.seq_k - self.seq_q

  @property
  def left(self) -> int | None:
    """The band's left side (keys before the level one), None if unbounded."""
    return self.window_left

  @property
  def right(self) -> int | None:
    """The band's right side (keys after the level one), None if unbounded."""
    if self.causal:
      return 0 if self.window_right is None else min(self.window_right, 0)
    return self.window_right

  @property
  def is_full(self) -> bool:
    """Every query sees every key (no band, no dense mask, no segments)."""
    return self.left is None and self.right is None and not (self.dense or self.segments)

  @property
  def is_causal(self) -> bool:
    """The band is exactly causal (and nothing else hides a key)."""
    return self.left is None and self.right == 0 and not (self.dense or self.segments)

  @property
  def has_band(self) -> bool:
    return self.left is not None or self.right is not None

  def visible(self, q_idx, k_idx, *, check_queries: bool = True, check_keys: bool = True):
    """Whether query q_idx sees key k_idx under the band and the sequence
    ends (broadcast of the two int32 index arrays), or None when nothing
    is checked. check_queries, check_keys: also hide positions at or past
    seq_q, seq_k (a kernel that never lets such a position reach its
    result, or whose band already stops short of it, leaves them out)."""
    parts = []
    if check_queries:
      parts.append(q_idx < self.seq_q)
    if check_keys:
      parts.append(k_idx < self.seq_k)
    if self.right is not None:
      parts.append(k_idx <= q_idx + (self.offset + self.right))
    if self.left is not None:
      parts.append(k_idx >= q_idx + (self.offset - self.left))
    if not parts:
      return None
    visible = parts[0]
    for part in parts[1:]:
      visible &= part
    return visible

  def key_span(self, q_idx, *, check_keys: bool = True):
    """(first, last): query q_idx sees the keys first <= j <= last under
    the band (and, with check_keys, the end of the keys); None for a side
    nothing bounds. The same pairs as `visible` without check_queries."""
    first = None if self.left is None else q_idx + (self.offset - self.left)
    last = None if self.right is None else q_idx + (self.offset + self.right)
    if check_keys:
      last = self.seq_k - 1 if last is None else jnp.minimum(last, self.seq_k - 1)
    return first, last

  def query_span(self, k_idx):
    """(first, last): key k_idx is seen by the queries first <= i <= last
    under the band; None for an unbounded side. The same pairs as
    `visible` without check_queries and check_keys."""
    first = None if self.right is None else k_idx - (self.offset + self.right)
    last = None if self.left is None else k_idx - (self.offset - self.left)
    return first, last

  # ------------------------------------------------------------ per-block ranges
  #
  # A block range is (lo, full_lo, full_hi, hi): blocks outside [lo, hi) hold
  # no visible pair, those in [full_lo, full_hi) are visible whole under the
  # band, and lo <= full_lo <= full_hi <= hi. Sides without an edge are
  # Python ints, so a caller may leave their stretches out at trace time.

  def kv_blocks_right(self, q_start, rows: int, block_k: int, ints: Arithmetic = JNP):
    """(full_hi, hi) over K/V blocks of block_k keys for queries [q_start,
    q_start + rows): the band's right edge and the end of the keys (every
    key of blocks [0, full_hi) is seen by every one of those queries; none
    from hi on). Only the real keys count: the last block, partly past
    seq_k, is never in the full stretch."""
    num_blocks, num_full = -(-self.seq_k // block_k), self.seq_k // block_k
    if self.right is None:
      return ints.as_int32(num_full), ints.as_int32(num_blocks)
    # The last query sees keys up to q_start + rows - 1 + offset + right.
    hi = ints.div(ints.at_least_0(q_start + (rows + (self.offset + self.right + block_k - 1))), block_k)
    hi = ints.minimum(hi, num_blocks)
    # Block kb is seen whole by the first query iff kb * block_k + block_k - 1 <= q_start + offset + right.
    full_hi = ints.div(ints.at_least_0(q_start + (self.offset + self.right + 1)), block_k)
    full_hi = ints.minimum(full_hi, ints.minimum(hi, num_full))
    return ints.as_int32(full_hi), ints.as_int32(hi)

  def kv_blocks_left(self, q_start, rows: int, block_k: int, ints: Arithmetic = JNP):
    """(lo, full_lo) over K/V blocks for queries [q_start, q_start + rows):
    the band's left edge (no key of blocks [0, lo) is seen; from full_lo on
    every key is, by the left edge). (0, 0) without one."""
    if self.left is None:
      return 0, 0
    num_blocks = -(-self.seq_k // block_k)
    # The first query sees keys from q_start + offset - left, the last from
    # q_start + rows - 1 + offset - left.
    lo = ints.minimum(ints.div(ints.at_least_0(q_start + (self.offset - self.left)), block_k), num_blocks)
    full_lo = ints.div(ints.at_least_0(q_start + (rows + (self.offset - self.left + block_k - 2))), block_k)
    return ints.as_int32(lo), ints.as_int32(full_lo)

  def kv_blocks(self, q_start, rows: int, block_k: int, ints: Arithmetic = JNP):
    """The block range (lo, full_lo, full_hi, hi) over K/V blocks for the
    queries [q_start, q_start + rows)."""
    full_hi, hi = self.kv_blocks_right(q_start, rows, block_k, ints)
    lo, full_lo = self.kv_blocks_left(q_start, rows, block_k, ints)
    return _ordered(lo, full_lo, full_hi, hi, ints)

  def q_blocks_right(self, k_start, rows: int, block_q: int, ints: Arithmetic = JNP):
    """(lo, full_lo) over Q blocks of block_q queries for keys [k_start,
    k_start + rows): the band's right edge (no query of blocks [0, lo) sees
    any of these keys; every query from block full_lo on sees all of them,
    by the right edge). (0, 0) without one."""
    num_blocks = -(-self.seq_q // block_q)
    if self.right is None:
      return ints.as_int32(0), ints.as_int32(0)
    # Block b holds a query that sees key k_start iff (b + 1) * block_q - 1 + offset + right >= k_start.
    lo = ints.minimum(ints.div(ints.at_least_0(k_start - (self.offset + self.right)), block_q), num_blocks)
    # Block b sees the last key whole iff b * block_q + offset + right >= k_start + rows - 1.
    full_lo = ints.div(ints.at_least_0(k_start + (rows + (block_q - 2 - self.offset - self.right))), block_q)
    full_lo = ints.clip(full_lo, lo, num_blocks)
    return ints.as_int32(lo), ints.as_int32(full_lo)

  def q_blocks_left(self, k_start, rows: int, block_q: int, ints: Arithmetic = JNP):
    """(full_hi, hi) over Q blocks for keys [k_start, k_start + rows): the
    band's left edge and the end of the queries (queries of blocks
    [full_hi, hi) see only some of these keys, none from hi on). Only the
    real queries count: the last block, partly past seq_q, is never full."""
    num_blocks, num_full = -(-self.seq_q // block_q), self.seq_q // block_q
    if self.left is None:
      return num_full, num_blocks
    # Query i sees key j only if i <= j - offset + left: the last key bounds
    # the last query that sees any, the first key the last that sees all.
    hi = ints.div(ints.at_least_0(k_start + (rows + (self.left - self.offset + block_q - 1))), block_q)
    hi = ints.minimum(hi, num_blocks)
    full_hi = ints.div(ints.at_least_0(k_start + (self.left - self.offset + 1)), block_q)
    full_hi = ints.minimum(full_hi, ints.minimum(hi, num_full))
    return ints.as_int32(full_hi), ints.as_int32(hi)

  def q_blocks(self, k_start, rows: int, block_q: int, ints: Arithmetic = JNP):
    """The block range (lo, full_lo, full_hi, hi) over Q blocks for the keys
    [k_start, k_start + rows)."""
    lo, full_lo = self.q_blocks_right(k_start, rows, block_q, ints)
    full_hi, hi = self.q_blocks_left(k_start, rows, block_q, ints)
    return _ordered(lo, full_lo, full_hi, hi, ints)


def _ordered(lo, full_lo, full_hi, hi, ints: Arithmetic):
  """lo <= full_lo <= full_hi <= hi, by clamping; static where all four are."""
  if all(isinstance(x, int) for x in (lo, full_lo, full_hi, hi)):
    return lo, full_lo, full_hi, hi
  hi = jnp.maximum(hi, lo)
  full_lo = ints.clip(full_lo, lo, hi)
  return lo, full_lo, ints.clip(full_hi, full_lo, hi), hi


def intersect(a: tuple, b: tuple, ints: Arithmetic = LAX) -> tuple:
  """The block range of pairs visible under both block ranges a and b."""
  lo, full_lo, full_hi, hi = (
      jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1]), jnp.minimum(a[2], b[2]), jnp.minimum(a[3], b[3])
  )
  return _ordered(lo, full_lo, full_hi, hi, ints)


# ---------------------------------------------------------------- segment ids


class SegmentRanges:
  """The per-block (min, max) segment ids of one call's query and key ids,
  derived once per block size and shared by the kernels of a pass.

  Disjoint id ranges share no id, so a Q block and a K/V block whose ranges
  do not overlap hold no visible pair (exactly so for sorted ids, as in
  packed sequences)."""

  def __init__(self, q_ids: jax.Array, kv_ids: jax.Array):
    self._ids = {"q": q_ids, "kv": kv_ids}
    self._ranges: dict[tuple[str, int], tuple[jax.Array, jax.Array]] = {}

  def queries(self, block: int) -> tuple[jax.Array, jax.Array]:
    """(min, max) query segment id of each block of `block` rows: [batch, Q blocks]."""
    return self._of("q", block)

  def keys(self, block: int) -> tuple[jax.Array, jax.Array]:
    """(min, max) key segment id of each block of `block` rows: [batch, K blocks]."""
    return self._of("kv", block)

  def _of(self, side: str, block: int) -> tuple[jax.Array, jax.Array]:
    if (side, block) not in self._ranges:
      self._ranges[side, block] = _segment_ranges(self._ids[side], block)
    return self._ranges[side, block]


def _segment_ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(min, max) segment id of each block of a [batch, seq] array: [batch, blocks].
  Padding past a ragged end counts for neither."""
  batch, seq = ids.shape
  n = -(-seq // block)
  info = jnp.iinfo(jnp.int32)
  low = jnp.pad(ids, ((0, 0), (0, n * block - seq)), constant_values=info.max).reshape(batch, n, block)
  high = jnp.pad(ids, ((0, 0), (0, n * block - seq)), constant_values=info.min).reshape(batch, n, block)
  return low.min(axis=2), high.max(axis=2)


def segment_block_ranges(outer: tuple[jax.Array, jax.Array], inner: tuple[jax.Array, jax.Array]) -> jax.Array:
  """int32 [batch, outer blocks, 4]: the block range (lo, full_lo, full_hi,
  hi) over the inner blocks for each outer block, from both sides' per-block
  (min, max) segment ids ([batch, blocks] each, `SegmentRanges`). Outer and
  inner are Q and K/V blocks for a Q-outer kernel, K/V and Q blocks for a
  K/V-outer one.

  [lo, hi) is the hull of the inner blocks whose id range overlaps the outer
  block's: beyond it no id is shared. In [full_lo, full_hi) the outer and
  the inner block each hold a single id, the same one, so every pair is
  visible under the segments. For sorted ids (packed sequences) the
  overlapping blocks are contiguous and the full ones a run inside them, so
  nothing is wasted. Unsorted ids stay correct: hull blocks outside the full
  stretch take the element mask, and one sharing no id adds nothing. An outer
  block that shares no id at all gets the empty range [n, n).
  """
  (outer_min, outer_max), (inner_min, inner_max) = outer, inner
  n = inner_min.shape[1]
  blocks = jnp.arange(n, dtype=jnp.int32)
  # [batch, outer blocks, inner blocks]: 128 x 128 per row at 16k with
  # 128-row blocks, reduced over the last axis in one fusion.
  overlap = (outer_min[:, :, None] <= inner_max[:, None, :]) & (inner_min[:, None, :] <= outer_max[:, :, None])
  full = (
      (outer_min == outer_max)[:, :, None] & (inner_min == inner_max)[:, None, :]
      & (outer_min[:, :, None] == inner_min[:, None, :])
  )
  first = lambda where: jnp.min(jnp.where(where, blocks, n), axis=2)
  lo, hi = first(overlap), jnp.max(jnp.where(overlap, blocks + 1, 0), axis=2)
  full_lo = first(full)
  # Under unsorted ids full blocks may lie apart: the stretch ends at the
  # first block after full_lo that is not full.
  full_hi = first(~full & (blocks >= full_lo[:, :, None]))
  return jnp.stack(_ordered(lo, full_lo, full_hi, hi, JNP), axis=-1).astype(jnp.int32)


def block_flags(mask: jax.Array, segment_ranges: SegmentRanges | None, block_q: int, block_k: int) -> jax.Array:
  """int32 [batch or 1, heads or 1, Q blocks, K blocks]: 0 where a tile is
  surely hidden (by the dense mask, or because its query and key segment-id
  ranges do not overlap), 1 where it may hold a visible score."""
  bm, hm, seq_q, seq_k = mask.shape
  nq, nk = -(-seq_q // block_q), -(-seq_k // block_k)
  padded = jnp.pad(mask != 0, ((0, 0), (0, 0), (0, nq * block_q - seq_q), (0, nk * block_k - seq_k)))
  flags = jnp.any(padded.reshape(bm, hm, nq, block_q, nk, block_k), axis=(3, 5))
  if segment_ranges is not None:
    (q_lo, q_hi), (k_lo, k_hi) = segment_ranges.queries(block_q), segment_ranges.keys(block_k)
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    flags &= overlap[:, None]
  return flags.astype(jnp.int32)
