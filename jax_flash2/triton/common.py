"""What the Triton-lowering kernels share: static problem facts, masked tile
loads, the visibility mask, and the split of a block loop into masked and
unmasked stretches."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import ManualAxisType

from jax_flash2 import dropout

# Scores are kept in the log2 domain inside the kernels: exp2 is a single
# instruction (ex2.approx) where exp is a multiply plus ex2.
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static facts of one attention call, closed over by every kernel."""

  seq_q: int
  seq_k: int
  head_dim: int
  head_dim_padded: int
  # The visibility band: query i sees key j iff
  #   i + offset - window_left <= j <= i + offset + window_right,
  # None leaving that side unbounded. Causal is window_right = 0.
  window_left: int | None
  window_right: int | None
  softmax_scale: float
  dtype: Any
  # A dense mask ([batch or 1, heads or 1, seq_q, seq_k] int8, nonzero =
  # visible) comes with a per-tile summary that lets the loops skip tiles it
  # hides entirely; every tile it leaves visible runs with the element mask.
  has_mask: bool = False
  # Grouped-query attention: query heads per K/V head (1 for plain MHA).
  group: int = 1
  # Scores become softcap * tanh(scores / softcap) before the softmax.
  softcap: float | None = None
  # ALiBi: scores get -slope * |i + offset - j|, one slope per (batch,) head,
  # read from a [batch or 1, heads] float32 input.
  has_alibi: bool = False
  # Packed sequences: query i sees key j only if their segment ids (int32
  # [batch, seq_q] and [batch, seq_k]) are equal. Without a dense mask they
  # narrow each program's loop bounds (see segment_block_bounds); with one,
  # they join its tile flags.
  has_segments: bool = False
  # Dropout on the probabilities, drawn by jax_flash2.dropout's hash from an
  # int32 [2] seed input; broadcast: one mask shared by every batch and head.
  dropout_rate: float = 0.0
  dropout_broadcast: bool = False
  # An additive bias on the scores, read tile by tile from a [batch or 1,
  # heads or 1, seq_q, seq_k] input (after softcap and ALiBi, before the
  # masks); its gradient is dS, written by a kernel of its own.
  has_bias: bool = False

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def has_tile_flags(self) -> bool:
    """Whether per-tile flags (from the dense mask, and the segment ids'
    ranges if there are any) say which tiles can be skipped; then every
    visited tile takes the element mask. A dense mask need not hide a
    contiguous run of tiles, so it cannot be turned into loop bounds."""
    return self.has_mask

  @property
  def has_segment_bounds(self) -> bool:
    """Whether segment ids alone narrow the loops, through per-block bounds
    (segment_block_bounds) instead of per-tile flags and conds."""
    return self.has_segments and not self.has_mask

  @property
  def modifies_scores(self) -> bool:
    """Whether scores need their scale applied before the softmax's max."""
    return self.softcap is not None or self.has_alibi or self.has_bias

  @property
  def offset(self) -> int:
    """Bottom-right alignment of the band: query i is level with key i + offset."""
    return self.seq_k - self.seq_q

  @property
  def precision(self) -> lax.Precision | None:
    # float32 inputs get true float32 dots, not Triton's default tf32.
    return lax.Precision.HIGHEST if jnp.dtype(self.dtype) == jnp.float32 else None

  def head_mask(self) -> jax.Array | None:
    """[head_dim_padded] bool, or None when no padding columns exist."""
    if self.head_dim == self.head_dim_padded:
      return None
    return jnp.arange(self.head_dim_padded, dtype=jnp.int32) < self.head_dim


def dot(a: jax.Array, b: jax.Array, problem: Problem, *, trans_a=False, trans_b=False) -> jax.Array:
  """a @ b with float32 accumulation; trans_* contract over the other axis."""
  contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
  return lax.dot_general(
      a, b, (contract, ((), ())), precision=problem.precision, preferred_element_type=jnp.float32
  )


def scores_log2(
    qk: jax.Array, problem: Problem, q_idx, k_idx, slope, bias=None
) -> tuple[jax.Array, jax.Array | None]:
  """Scores in the log2 domain with softcap, ALiBi and bias applied, and the
  softcap's derivative (None without one) that dS picks up in the backward.

  q_idx, k_idx broadcast to the tile's shape ([q, 1] and [1, k], or the
  transposes); slope is this head's ALiBi slope (a scalar) or None; bias is
  the tile of the additive bias (float32) or None.
  """
  if problem.softcap is not None:
    s, dcap = softcapped_log2(qk, problem)
  else:
    s, dcap = qk * (problem.softmax_scale * LOG2_E), None
  if slope is not None:
    distance = jnp.abs(q_idx + problem.offset - k_idx).astype(jnp.float32)
    s = s - (slope * LOG2_E) * distance
  if bias is not None:
    s = s + bias * LOG2_E
  return s, dcap


def softcapped_log2(qk: jax.Array, problem: Problem) -> tuple[jax.Array, jax.Array]:
  """Softcapped scores in the log2 domain, and d(softcap)/d(scaled score).

  t = tanh(scale * qk / cap); the score is cap * t, its derivative 1 - t^2,
  which the backward multiplies into dS.
  """
  t = jnp.tanh(qk * (problem.softmax_scale / problem.softcap))
  return t * (problem.softcap * LOG2_E), 1.0 - t * t


def _tile_mask(rows: jax.Array | None, cols: jax.Array | None) -> jax.Array | None:
  """[rows, cols] validity from per-row and per-column vectors (None: all valid)."""
  if rows is None and cols is None:
    return None
  if cols is None:
    return rows[:, None]
  if rows is None:
    return cols[None, :]
  return rows[:, None] & cols[None, :]


def load(ref, mask: jax.Array | None, other=0.0) -> jax.Array:
  """Loads a tile or vector; positions where `mask` is False read `other`.

  With mask None this is a plain, unmasked (fastest) load.
  """
  return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=other)


def store(ref, value: jax.Array, mask: jax.Array | None) -> None:
  """Stores a tile or vector, leaving positions where `mask` is False alone."""
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def load_tile(ref, rows: jax.Array | None, cols: jax.Array | None, other=0.0) -> jax.Array:
  """Loads a [rows, cols] tile; rows or columns outside the array (False in the
  `rows`/`cols` validity vectors, None where all are valid) read `other`."""
  return load(ref, _tile_mask(rows, cols), other)


def store_tile(ref, value: jax.Array, rows: jax.Array | None, cols: jax.Array | None) -> None:
  store(ref, value, _tile_mask(rows, cols))


# Per-row vectors (lse, delta) use `load` and `store` with the row vector as mask.


def visible(problem: Problem, q_idx: jax.Array, k_idx: jax.Array) -> jax.Array:
  """Which scores of a tile take part, for broadcastable query/key indices.

  Pass q_idx[:, None], k_idx[None, :] for a [q, k] tile, or the transposes for
  a [k, q] tile. Used only on tiles that cross an edge of the band or a ragged
  sequence end; every other tile is known to be fully visible and skips this.
  """
  mask = (q_idx < problem.seq_q) & (k_idx < problem.seq_k)
  if problem.window_right is not None:
    mask &= k_idx <= q_idx + (problem.offset + problem.window_right)
  if problem.window_left is not None:
    mask &= k_idx >= q_idx + (problem.offset - problem.window_left)
  return mask


def _ordered(lo, full_lo, full_hi, hi):
  """Clamps block bounds into lo <= full_lo <= full_hi <= hi, static where they are."""
  if all(isinstance(x, int) for x in (lo, full_lo, full_hi, hi)):
    return lo, full_lo, full_hi, hi
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def kv_block_range(problem: Problem, q_start, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) for the K/V-block loop of a Q-outer program.

  K/V blocks outside [lo, hi) hold no key this Q block sees and are skipped;
  those in [full_lo, full_hi) are seen whole by every row and need no mask.
  """
  num_blocks, full_blocks = pl.cdiv(problem.seq_k, block_k), problem.seq_k // block_k
  off, left, right = problem.offset, problem.window_left, problem.window_right
  lo = full_lo = 0
  full_hi, hi = full_blocks, num_blocks
  # The block's last row that exists (rows past seq_q are never stored).
  q_last = jnp.minimum(q_start + block_q, problem.seq_q) - 1
  if right is not None:
    # The band's right edge: the last row sees keys up to q_last + off +
    # right, the first row up to q_start + off + right.
    hi = jnp.minimum(cdiv(jnp.maximum(q_last + 1 + off + right, 0), block_k), num_blocks)
    full_hi = jnp.minimum(floordiv(jnp.maximum(q_start + 1 + off + right, 0), block_k), full_blocks)
  if left is not None:
    # The left edge: the first row sees keys from q_start + off - left, the
    # last row from q_last + off - left.
    lo = jnp.minimum(floordiv(jnp.maximum(q_start + off - left, 0), block_k), num_blocks)
    full_lo = cdiv(jnp.maximum(q_last + off - left, 0), block_k)
  return _ordered(lo, full_lo, full_hi, hi)


def q_block_range(problem: Problem, k_start, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) for the Q-block loop of a KV-outer program.

  Q blocks outside [lo, hi) see none of this K/V block and are skipped; those
  in [full_lo, full_hi) see all of it from every row and need no mask.
  """
  num_blocks, full_blocks = pl.cdiv(problem.seq_q, block_q), problem.seq_q // block_q
  off, left, right = problem.offset, problem.window_left, problem.window_right
  lo = full_lo = 0
  full_hi, hi = full_blocks, num_blocks
  if right is not None:
    # Row i sees key j only if i >= j - off - right: the block's first key
    # bounds the first row that sees anything, its last key the first row
    # that sees everything.
    lo = jnp.minimum(floordiv(jnp.maximum(k_start - off - right, 0), block_q), num_blocks)
    full_lo = cdiv(jnp.maximum(k_start + block_k - 1 - off - right, 0), block_q)
  if left is not None:
    # Row i sees key j only if i <= j - off + left; j up to the block's last
    # key that exists.
    k_last = jnp.minimum(k_start + block_k, problem.seq_k) - 1
    hi = jnp.minimum(cdiv(jnp.maximum(k_last + 1 - off + left, 0), block_q), num_blocks)
    full_hi = jnp.minimum(floordiv(jnp.maximum(k_start - off + left + 1, 0), block_q), full_blocks)
  if problem.seq_k % block_k:
    # The ragged last K/V block is masked against every Q block. Written as
    # integer arithmetic (missing > 0 only for that block): a jnp.where on
    # these scalar bounds crashed the Triton lowering ('i1' * 'i64').
    missing = block_k - jnp.minimum(problem.seq_k - k_start, block_k)
    full_lo = jnp.minimum(full_lo + missing * num_blocks, num_blocks)
  return _ordered(lo, full_lo, full_hi, hi)


def within_segments(opt: OptionalRefs, outer_block, bounds: tuple) -> tuple:
  """A program's band bounds (lo, full_lo, full_hi, hi), from
  `kv_block_range` or `q_block_range`, narrowed to its outer block's
  segment bounds (`segment_block_bounds`); unchanged without those.

  A block outside either [lo, hi) holds no visible pair, and one inside both
  full stretches is wholly visible under the band and the segments alike,
  so interior blocks of a segment run without the element mask or a cond.
  """
  if opt.segment_bounds is None:
    return bounds
  lo, full_lo, full_hi, hi = bounds
  seg_lo, seg_full_lo, seg_full_hi, seg_hi = (opt.segment_bounds[outer_block, j] for j in range(4))
  # Integer max/min of scalars only (see the jnp.where note in q_block_range).
  return _ordered(
      jnp.maximum(lo, seg_lo), jnp.maximum(full_lo, seg_full_lo), jnp.minimum(full_hi, seg_full_hi),
      jnp.minimum(hi, seg_hi),
  )


def split_loop(
    step: Callable[[Any, Any, bool], Any],
    carry: Any,
    lo: Any,
    full_lo: Any,
    full_hi: Any,
    hi: Any,
) -> Any:
  """Runs `step(i, carry, masked)` for i in [lo, hi).

  Blocks in [full_lo, full_hi) are known to be wholly visible and run without
  the element mask; those in [lo, full_lo) and [full_hi, hi) cross an edge
  of the band (the causal diagonal, a window), a segment boundary, a ragged
  end or a dense mask, and run with it. Requires lo <= full_lo <= full_hi
  <= hi. A stretch whose two bounds are the same value is left out at trace
  time.
  """

  def empty(start, stop) -> bool:
    return start is stop or (isinstance(start, int) and isinstance(stop, int) and start == stop)

  def run(start, stop, masked, carry):
    if empty(start, stop):
      return carry
    if isinstance(start, int) and isinstance(stop, int) and stop - start == 1:
      # One static block (the ragged tail of an unmasked sequence): no loop.
      return step(jnp.int32(start), carry, masked)
    return lax.fori_loop(start, stop, lambda i, c: step(i, c, masked), carry)

  carry = run(lo, full_lo, True, carry)
  carry = run(full_lo, full_hi, False, carry)
  return run(full_hi, hi, True, carry)


def skip_hidden_blocks(step: Callable[[Any, Any, bool], Any], block_visible: Callable[[Any], jax.Array]):
  """Wraps a loop step so that a block the dense mask hides entirely costs one
  scalar load (its per-tile flag) instead of two matmuls."""

  def gated(i, carry, masked: bool):
    del masked  # with a dense mask every tile takes the element mask
    return lax.cond(block_visible(i), lambda c: step(i, c, True), lambda c: c, carry)

  return gated


def block_flags(
    mask: jax.Array, segment_ranges: SegmentRanges | None, block_q: int, block_k: int
) -> jax.Array:
  """int32 [batch or 1, heads or 1, Q blocks, K blocks]: 0 where a tile is
  surely hidden (by the dense mask, or because its query and key segment-id
  ranges do not overlap), 1 where it may hold a visible score."""
  bm, hm, seq_q, seq_k = mask.shape
  nq, nk = -(-seq_q // block_q), -(-seq_k // block_k)
  padded = jnp.pad(mask != 0, ((0, 0), (0, 0), (0, nq * block_q - seq_q), (0, nk * block_k - seq_k)))
  flags = jnp.any(padded.reshape(bm, hm, nq, block_q, nk, block_k), axis=(3, 5))
  if segment_ranges is not None:
    (q_lo, q_hi), (k_lo, k_hi) = segment_ranges.queries(block_q), segment_ranges.keys(block_k)
    # Disjoint id ranges share no id; overlapping ones may (exactly so for
    # sorted ids, as in packed sequences).
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    flags &= overlap[:, None]
  return flags.astype(jnp.int32)


def segment_block_bounds(
    outer: tuple[jax.Array, jax.Array], inner: tuple[jax.Array, jax.Array]
) -> jax.Array:
  """int32 [batch, outer blocks, 4]: (lo, full_lo, full_hi, hi) over the
  inner loop's blocks for each outer block, from both sides' per-block (min,
  max) segment ids ([batch, blocks] each, `SegmentRanges`). Outer and inner
  are Q and K/V blocks for the forward and dQ kernels, K/V and Q blocks for
  the dK/dV kernel.

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
  # [batch, outer blocks, inner blocks], as block_flags: 128 x 128 per row
  # at 16k with 128-row blocks, reduced over the last axis in one fusion.
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
  return jnp.stack(_ordered(lo, full_lo, full_hi, hi), axis=-1).astype(jnp.int32)


class SegmentRanges:
  """The per-block (min, max) segment ids of one pass's query and key ids,
  derived once per block size and shared by the pass's kernels.

  Every kernel's loop bounds (`segment_block_bounds`) and tile flags
  (`block_flags`) come from these. `backward` builds one for its dK/dV and dQ
  kernels, which often tile a side alike (e.g. 64-row Q blocks in both);
  the forward and the backward are separate calls (their own
  custom_partitioning bodies, jax_flash2.sharding), so each derives its own:
  one pass over int32 ids, negligible next to the attention and cheaper
  than carrying the bounds as residuals.
  """

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


def _slab_spec(array: jax.Array, block_shape: tuple, heads_per_program: int) -> pl.BlockSpec:
  """A [batch or 1, heads or 1, ...] array's slab for a program of a grid
  (blocks, batch, heads): broadcast batch/head axes read index 0, and with
  heads_per_program > 1 (the dK/dV kernel under GQA, whose programs own one
  K/V head) a per-head array gives the slabs of all the group's query heads,
  as a leading axis (see `has_group_axis`)."""
  bm, hm = array.shape[:2]
  heads = heads_per_program if has_group_axis(array, heads_per_program) else None

  def index(i, b, h):
    return (b if bm > 1 else 0, h if hm > 1 else 0, *(0 for _ in block_shape))

  return pl.BlockSpec((None, heads, *block_shape), index)


def has_group_axis(array: jax.Array, heads_per_program: int) -> bool:
  """Whether a [batch or 1, heads or 1, ...] input reaches a GQA dK/dV program
  with a leading axis over its group's query heads."""
  return heads_per_program > 1 and array.shape[1] > 1


def segment_spec(seq: int, block: int) -> pl.BlockSpec:
  """The whole [seq] segment ids of one batch row, rounded up to whole blocks."""
  return pl.BlockSpec((None, round_up(seq, block)), lambda i, b, h: (b, 0))


class OptionalInputs(NamedTuple):
  """The optional input arrays of one call, None where the problem has none.

  mask: int8 [batch or 1, heads or 1, seq_q, seq_k], nonzero = visible.
  segments: int32 (q segment ids [batch, seq_q], kv segment ids [batch, seq_k]).
  slopes: float32 ALiBi slopes [batch or 1, heads].
  seed: int32 [2], the dropout seed (jax_flash2.dropout.seed_words).
  bias: float [batch or 1, heads or 1, seq_q, seq_k], added to the scores.
  """

  mask: jax.Array | None = None
  segments: tuple[jax.Array, jax.Array] | None = None
  slopes: jax.Array | None = None
  seed: jax.Array | None = None
  bias: jax.Array | None = None
  # The segments' per-block ranges, set by `share_segment_ranges` where one
  # pass runs several kernels; None: each kernel derives its own.
  segment_ranges: SegmentRanges | None = None


def share_segment_ranges(optional: OptionalInputs) -> OptionalInputs:
  """`optional` with one SegmentRanges for all the kernels it is passed to."""
  if optional.segments is None or optional.segment_ranges is not None:
    return optional
  return optional._replace(segment_ranges=SegmentRanges(*optional.segments))


def with_optional_inputs(
    in_specs: list,
    args: list,
    optional: OptionalInputs,
    block_q: int,
    block_k: int,
    heads_per_program: int = 1,
    kv_outer: bool = False,
) -> tuple[list, list]:
  """Appends the optional inputs a problem has, in the order `split_refs`
  takes them apart: the dense mask and its tile flags (for these tiles), or
  else the segment bounds; the query and key segment ids, the ALiBi slopes,
  the dropout seed, the bias. kv_outer: the programs own K/V blocks and loop
  over Q blocks (the dK/dV kernel), which the segment bounds follow."""
  in_specs, args = list(in_specs), list(args)
  mask, segments, alibi_slopes, seed, bias, ranges = share_segment_ranges(optional)
  if mask is not None:
    seq_q, seq_k = mask.shape[2:]
    in_specs.append(_slab_spec(mask, (round_up(seq_q, block_q), round_up(seq_k, block_k)), heads_per_program))
    args.append(mask)
    flags = block_flags(mask, ranges, block_q, block_k)
    in_specs.append(_slab_spec(flags, flags.shape[2:], heads_per_program))
    args.append(flags)
  elif segments is not None:
    q_ranges, kv_ranges = ranges.queries(block_q), ranges.keys(block_k)
    bounds = segment_block_bounds(*((kv_ranges, q_ranges) if kv_outer else (q_ranges, kv_ranges)))
    in_specs.append(pl.BlockSpec((None, *bounds.shape[1:]), lambda i, b, h: (b, 0, 0)))
    args.append(bounds)
  if segments is not None:
    in_specs += [segment_spec(segments[0].shape[1], block_q), segment_spec(segments[1].shape[1], block_k)]
    args += list(segments)
  if alibi_slopes is not None:
    in_specs.append(alibi_spec(alibi_slopes, heads_per_program))
    args.append(alibi_slopes)
  if seed is not None:
    in_specs.append(pl.BlockSpec((2,), lambda i, b, h: (0,)))
    args.append(seed)
  if bias is not None:
    seq_q, seq_k = bias.shape[2:]
    in_specs.append(_slab_spec(bias, (round_up(seq_q, block_q), round_up(seq_k, block_k)), heads_per_program))
    args.append(bias)
  return in_specs, args


def alibi_spec(slopes: jax.Array, heads_per_program: int = 1) -> pl.BlockSpec:
  """BlockSpec of the [batch or 1, heads] ALiBi slopes over a grid (blocks,
  batch, heads): one slope per program, or its group's when heads_per_program > 1."""
  batched = slopes.shape[0] > 1
  heads = None if heads_per_program == 1 else heads_per_program
  return pl.BlockSpec((None, heads), lambda i, b, h: (b if batched else 0, h))


class OptionalRefs(NamedTuple):
  """A kernel's optional input refs, None where the problem has no such input."""

  mask: Any
  flags: Any
  segment_bounds: Any
  q_segments: Any
  kv_segments: Any
  slopes: Any
  seed: Any
  bias: Any


def split_refs(refs, problem: Problem) -> tuple:
  """(OptionalRefs, *outputs) from a kernel's trailing refs, in the order
  `with_optional_inputs` appends them."""
  refs = list(refs)
  take = lambda present: refs.pop(0) if present else None
  mask = take(problem.has_mask)
  flags = take(problem.has_tile_flags)
  segment_bounds = take(problem.has_segment_bounds)
  q_segments, kv_segments = take(problem.has_segments), take(problem.has_segments)
  slopes = take(problem.has_alibi)
  seed = take(problem.has_dropout)
  bias = take(problem.has_bias)
  return (OptionalRefs(mask, flags, segment_bounds, q_segments, kv_segments, slopes, seed, bias), *refs)


def extra_visible(
    opt: OptionalRefs, problem: Problem, q_start, k_start, block_q: int, block_k: int, mask_head=None
) -> jax.Array | None:
  """[block_q, block_k] bool visibility from the dense mask and the segment
  ids, or None when the problem has neither."""
  # Rows and columns past a ragged end read as hidden (visible() masks them too).
  rows, cols = _in_bounds(problem, q_start, k_start, block_q, block_k)
  visible = None
  if opt.mask is not None:
    visible = _load_score_tile(opt.mask, problem, q_start, k_start, block_q, block_k, mask_head, other=0) != 0
  if opt.q_segments is not None:
    # Past either end the ids read -1 and -2: never equal.
    q_ids = load(opt.q_segments.at[pl.ds(q_start, block_q)], rows, other=-1)
    k_ids = load(opt.kv_segments.at[pl.ds(k_start, block_k)], cols, other=-2)
    same = q_ids[:, None] == k_ids[None, :]
    visible = same if visible is None else visible & same
  return visible


def dropout_head(problem: Problem, batch_index, head_index, heads) -> Any:
  """The flat (batch, query head) index that dropout's hash takes: every
  problem draws its own mask, or all share one when broadcast. Indices are
  those of the kernel's own operands (a shard's, under sharding)."""
  if problem.dropout_broadcast:
    return jnp.int32(0)
  return batch_index * heads + head_index


def dropout_multiplier(opt: OptionalRefs, problem: Problem, head, q_idx, k_idx) -> jax.Array | None:
  """float32 tile, 1 / (1 - rate) where the probability is kept and 0 where
  it is dropped, or None without dropout. q_idx, k_idx broadcast to the
  tile ([q, 1] and [1, k], or the transposes)."""
  if not problem.has_dropout:
    return None
  seed = (opt.seed[0], opt.seed[1])
  return dropout.multiplier(seed, head, q_idx, k_idx, problem.dropout_rate)


def _in_bounds(problem: Problem, q_start, k_start, block_q: int, block_k: int):
  """Row and column validity vectors of a tile, None where no ragged end cuts it."""
  rows = indices(q_start, block_q) < problem.seq_q if problem.seq_q % block_q else None
  cols = indices(k_start, block_k) < problem.seq_k if problem.seq_k % block_k else None
  return rows, cols


def _load_score_tile(ref, problem: Problem, q_start, k_start, block_q: int, block_k: int, head=None, other=0.0):
  """The [block_q, block_k] tile at (q_start, k_start) of a per-score input
  (the dense mask, the bias); `head` indexes its leading group axis in the
  dK/dV kernel. Past a ragged end it reads `other`."""
  rows, cols = _in_bounds(problem, q_start, k_start, block_q, block_k)
  tile = (pl.ds(q_start, block_q), pl.ds(k_start, block_k))
  return load_tile(ref.at[tile] if head is None else ref.at[(head, *tile)], rows, cols, other=other)


def bias_tile(opt: OptionalRefs, problem: Problem, q_start, k_start, block_q: int, block_k: int, head=None):
  """float32 [block_q, block_k] tile of the bias, or None without one."""
  if opt.bias is None:
    return None
  return _load_score_tile(opt.bias, problem, q_start, k_start, block_q, block_k, head).astype(jnp.float32)


def floordiv(a: jax.Array, b: int) -> jax.Array:
  """Division of a non-negative traced int32 by a static int (int32 even under x64)."""
  return lax.div(a, jnp.int32(b))


def cdiv(a: jax.Array, b: int) -> jax.Array:
  """Ceiling division of a non-negative traced int32 by a static int."""
  return floordiv(a + (b - 1), b)


def round_up(n: int, block: int) -> int:
  return -(-n // block) * block


def indices(start: jax.Array, size: int) -> jax.Array:
  """[size] int32 positions start, start + 1, ... of a tile's rows."""
  return start + jnp.arange(size, dtype=jnp.int32)


# jax 0.11 deprecates the Pallas Triton lowering in favour of Mosaic GPU (our
# Hopper path). It still works and is the only Pallas lowering for Ampere, so
# we keep it and hide just that one message. The warning fires when a
# pallas_call is lowered, which under a user's jax.jit happens after our code
# has returned, so a catch_warnings() around the call cannot reach it.
warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
)


# BlockSpecs over grids (blocks of axis 0, batch, heads) on [batch, seq, heads, D]
# arrays and [batch, heads, seq] row vectors (lse, delta).


def q_block_of_program(i, seq_q: int, block_q: int):
  """The Q block that Q-outer program i works on: the last block first.

  Under a causal mask the last Q blocks see the most keys. Launching them
  first lets the short programs fill the gaps at the end of the grid instead
  of leaving the GPU waiting on a few long ones (the tail effect).
  """
  return pl.cdiv(seq_q, block_q) - 1 - i


def rows_spec(block: int, d: int, reverse_seq: int | None = None) -> pl.BlockSpec:
  """[block, D] rows of one (batch, head); grid axis 0 walks the blocks, last
  first when reverse_seq (the sequence length) is given."""
  if reverse_seq is None:
    return pl.BlockSpec((None, block, None, d), lambda i, b, h: (b, i, h, 0))
  return pl.BlockSpec(
      (None, block, None, d), lambda i, b, h: (b, q_block_of_program(i, reverse_seq, block), h, 0)
  )


def whole_seq_spec(seq: int, block: int, d: int, head_divisor: int = 1) -> pl.BlockSpec:
  """The whole sequence of one (batch, head), rounded up to whole blocks: the
  kernel slices it block by block and masks the ragged end. Program head h
  reads head h // head_divisor (K/V under GQA)."""
  return pl.BlockSpec((None, round_up(seq, block), None, d), lambda i, b, h: (b, 0, h // head_divisor, 0))


def group_seq_spec(seq: int, block: int, d: int, group: int) -> pl.BlockSpec:
  """The whole sequence of the `group` query heads that share K/V head h,
  [seq, group, D] (or [seq, D] when group is 1)."""
  heads = None if group == 1 else group
  return pl.BlockSpec((None, round_up(seq, block), heads, d), lambda i, b, h: (b, 0, h, 0))


def group_row_vector_spec(seq: int, block: int, group: int) -> pl.BlockSpec:
  """[group, seq] (or [seq]) of a [batch, heads, seq] vector for K/V head h."""
  heads = None if group == 1 else group
  return pl.BlockSpec((None, heads, round_up(seq, block)), lambda i, b, h: (b, h, 0))


def row_vector_spec(block: int, reverse_seq: int | None = None) -> pl.BlockSpec:
  """[block] of a [batch, heads, seq] vector; grid axis 0 walks the blocks,
  last first when reverse_seq is given."""
  if reverse_seq is None:
    return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))
  return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, q_block_of_program(i, reverse_seq, block)))


def out_struct(shape: tuple[int, ...], dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A pallas_call output that varies over every manual mesh axis its inputs
  vary over. Inside shard_map, check_vma compares each value's varying axes;
  a plain out_shape would claim the kernels' outputs vary over none."""
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs if x is not None))
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=varying))


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
