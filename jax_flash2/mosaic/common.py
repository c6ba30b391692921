"""What the Mosaic GPU (Hopper, sm_90a) attention kernels share.

Every kernel here is warp-specialized: `consumers` consumer warpgroups (128
threads each) own the rows of an outer tile, with their accumulators in
registers, and compute on the tensor cores (wgmma); one producer warpgroup,
which gives its registers to them (setmaxnreg), streams the inner blocks
through a ring of `stages` shared-memory slots with TMA copies. A slot has ready barriers (completed by
the TMA engine) and consumed barriers (one arrival per consumer); the ring's
step i uses slot i % stages, and a slot is refilled once the consumers have
released what it held `stages` steps before.

The Q-outer kernels (the forward, dQ) own query rows and stream K/V blocks;
the K/V-outer ones (dK/dV, the fused backward) own key rows and stream Q
blocks. A kernel runs one CTA per tile, or persistent CTAs, one per SM, each
taking tiles in turn (`PersistentSchedule`, `run_tiles`): the ring runs on
from tile to tile and the outer rows are double-buffered, so that a tile's
first loads and last stores overlap its neighbours' work.

The kernels work on whole blocks: the entry points pad ragged lengths with
`pad_seq` and slice the results back with `unpad_seq`; inside, every bound
and mask uses the real lengths (jax_flash2.mask.Mask: causal attention is
bottom-right aligned). `KVOuter` holds what the dK/dV kernel and the fused
kernel share: the tile, the Q-block copies, and the per-block P^T and dS^T.

Bands and score modifiers are static. A tile visits only the inner blocks its
band touches (causal attention, a sliding window: `q_tile_blocks` for a Q
tile, `KVOuter.tile_at` for a K/V tile), each consumer the part of them its
own rows touch (`kv_range`, `KVOuter.q_blocks`), and only blocks that cross
an edge take the element mask. `Scores` turns Q K^T into the softmax's
base-2 scores (the scale; a softcap and ALiBi where the problem has them).
Every option is a Python branch on the static Mask and Scores, and a band
without a left edge keeps its first block the int 0: the kernels of plain
full and causal attention are the programs they were before the options.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2.mask import JNP, NUMPY, Arithmetic, Mask, SegmentRanges, intersect, segment_block_ranges

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Consumer warpgroups per CTA (the forward may take 3); the producer
# warpgroup comes after them.
NUM_CONSUMERS = 2
# wgmma works on M = 64 rows per warpgroup instruction.
WGMMA_M = 64
# Rows of the outer tile of the backward kernels: 64 per consumer (key rows
# in dK/dV, query rows in dQ), and the multiple they pad both lengths to.
OUTER_ROWS = NUM_CONSUMERS * WGMMA_M
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Served by backward_wide.py: dK + dV of 64 key rows at head_dim 256 do not
# fit a warpgroup's registers.
WIDE_HEAD_DIMS = (256,)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory one CTA may use on H100/H200 (227 KiB).
SMEM_LIMIT = 227 * 1024
# What Mosaic adds to the buffers a backward kernel's shared-memory count
# sums (barriers, 1 KiB alignment of swizzled tiles): up to 1,632 bytes over
# the buffers at the default tilings (the head_dim-256 dQ kernel), so that
# check_smem refuses, with its own message, a tiling Mosaic would refuse
# (tests/test_mosaic.py holds every kernel's estimate to Mosaic's count).
BWD_SMEM_RESERVE = 2048
# setmaxnreg budgets per thread, by consumer warpgroups: 2 x 240 + 24 and
# 3 x 160 + 24 (x 128 threads) fit the 64K registers of an SM; the producer
# only computes addresses.
CONSUMER_REGISTERS = types.MappingProxyType({2: 240, 3: 160})
PRODUCER_REGISTERS = 24
# Persistent CTAs in Mosaic's interpreter: few, so that each takes several tiles.
_PERSISTENT_INTERPRET_CTAS = 2
# SMs of an H100 SXM / H200, for lowering where no GPU is attached.
_HOPPER_SMS = 132


def compiler_params() -> plgpu.CompilerParams:
  """The kernels' compiler parameters: approximate exp2 and reciprocal, and
  no shared memory set aside for reductions across warps (Pallas reserves
  2 KiB for them wherever a kernel reduces): every reduction here runs
  along a row of the WGMMA layout, within a warp, and one that needed
  the scratch would fail to lower."""
  return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def specialized_kernel(body, *, out_type, scratch, grid, grid_names, interpret_params, name: str,
                       consumers: int = NUM_CONSUMERS):
  """plgpu.kernel as every kernel here runs: `consumers` consumer
  warpgroups and a producer (thread axis "wg"); the interpreter where
  interpret_params says so."""
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
                      num_threads=consumers + 1, thread_name="wg", compiler_params=compiler_params(),
                      interpret=interpret_params, kernel_name=name)


def interpret_params_of(
    interpret: bool | plgpu.InterpretGPUParams,
) -> tuple[plgpu.InterpretGPUParams | None, bool]:
  """(the interpreter's parameters or None, whether to interpret) from a
  kernel's `interpret` argument: False, True, or InterpretGPUParams."""
  params = plgpu.InterpretGPUParams() if interpret is True else (interpret or None)
  return params, params is not None


def sm_count() -> int:
  """SMs of the GPU the kernels will run on: one persistent CTA each."""
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:  # no GPU here (lowering for CUDA on a CPU host)
    return _HOPPER_SMS


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
  """The scores' scale: head_dim ** -0.5 unless given."""
  return float(head_dim ** -0.5 if softmax_scale is None else softmax_scale)


def per_head(ref, batch, head):
  """This (batch, head)'s float32 scalar of a [batch or 1, heads] input in
  global memory (the ALiBi slopes, the sinks)."""
  return ref[batch if ref.shape[0] > 1 else 0, head]


@dataclasses.dataclass(frozen=True)
class Scores:
  """What turns a tile of Q K^T into the softmax's scores, as
  jax_flash2.reference and the Triton kernels define them: the scale, then
  softcap * tanh(scores / softcap), then ALiBi's -slope * |i + offset - j|
  (offset = seq_k - seq_q, the band's bottom-right alignment).

  softcap: None for none; alibi: the kernel reads one float32 slope per
  (batch, head) from a [batch or 1, heads] array (`slope`)."""

  softmax_scale: float
  softcap: float | None = None
  alibi: bool = False
  offset: int = 0

  @property
  def modified(self) -> bool:
    """Whether anything but the scale changes the scores: the kernels then
    take them to base 2 up front; plain scores fold the scale into the
    exponential's argument (one FFMA a score)."""
    return self.softcap is not None or self.alibi

  def slope(self, slopes_ref, batch, head):
    """This (batch, head)'s ALiBi slope, a float32 scalar read from global
    memory (slopes_ref: [batch or 1, heads]), or None without ALiBi."""
    if not self.alibi:
      return None
    return per_head(slopes_ref, batch, head)

  def log2(self, s, query, key, slope):
    """(the scores of the tile s = Q K^T in base 2, the softcap's derivative
    d(softcap * t) / d(scaled score) = 1 - t^2 that dS takes in the backward,
    or None without a softcap). query, key: int32 positions of s's elements
    (any broadcast, e.g. a transposed tile's), read only by ALiBi.

    On the GPU tanh is tanh.approx.f32 (approx_math), as FlashAttention-3's
    softcap: one MUFU op a score beside the exponential's."""
    if self.softcap is not None:
      t = jnp.tanh(s * (self.softmax_scale / self.softcap))
      s, dcap = t * (self.softcap * LOG2_E), 1.0 - t * t
    else:
      s, dcap = s * (self.softmax_scale * LOG2_E), None
    if self.alibi:
      distance = jnp.abs((query - key + self.offset).astype(jnp.float32))
      s = s - (slope * LOG2_E) * distance
    return s, dcap


# Past every position: the first of an empty span.
_PAST_ALL = 2**30


def in_span(index, first, last):
  """first <= index <= last (bool [rows, cols]) for positions index [rows,
  cols] and per-row bounds first, last [rows] (None: unbounded; one of them
  is not). Where both bound a row: one unsigned compare a position,
  index - first <= last - first, rows with an empty span taking first past
  every position and width 0."""
  broadcast = lambda x: lax.broadcast_in_dim(x, index.shape, [0])
  if last is None:
    return index >= broadcast(first)
  if first is None:
    return index <= broadcast(last)
  empty = last < first
  first = jnp.where(empty, _PAST_ALL, first)
  width = jnp.where(empty, 0, last - first)
  return (index - broadcast(first)).astype(jnp.uint32) <= broadcast(width).astype(jnp.uint32)


@dataclasses.dataclass(frozen=True)
class ScoreTile:
  """Where a [rows, cols] tile of scores (the WGMMA layout) lies in the
  attention matrix: rows from position row_start, columns from col_start;
  rows are queries and columns keys, or the reverse (`transposed`: the S^T
  of the dK/dV kernels)."""

  shape: tuple[int, int]
  row_start: Any
  col_start: Any
  transposed: bool = False

  def positions(self):
    """(query, key): the int32 positions [rows, cols] of the tile's scores."""
    row = self.row_start + plgpu.broadcasted_iota(jnp.int32, self.shape, 0, layout=plgpu.Layout.WGMMA)
    col = self.col_start + plgpu.broadcasted_iota(jnp.int32, self.shape, 1, layout=plgpu.Layout.WGMMA)
    return (col, row) if self.transposed else (row, col)

  def visible(self, mask: Mask, *, check_keys: bool):
    """bool [rows, cols]: mask.visible of the tile's scores without
    check_queries, computed from each row's span of visible columns
    (mask.key_span, mask.query_span): one compare a score, where the
    element-wise form takes one a side."""
    if not mask.has_band:  # the end of the keys alone: one compare already
      return mask.visible(*self.positions(), check_queries=False, check_keys=check_keys)
    rows = self.row_start + plgpu.broadcasted_iota(jnp.int32, self.shape[:1], 0,
                                                   layout=plgpu.Layout.WGMMA.reduce(1))
    if self.transposed:
      first, last = mask.query_span(rows)
      if check_keys:  # a key row past seq_k sees nothing
        past = rows >= mask.seq_k
        first = jnp.where(past, _PAST_ALL, 0 if first is None else first)
    else:
      first, last = mask.key_span(rows, check_keys=check_keys)

    def relative(bound):
      # Per-row bounds relative to the tile's first column, whose local
      # positions are the iota itself; the end of the keys alone is one
      # bound for all rows.
      if bound is None:
        return None
      if jnp.ndim(bound) == 0:
        bound = plgpu.layout_cast(jnp.full(self.shape[:1], bound, jnp.int32), plgpu.Layout.WGMMA.reduce(1))
      return bound - self.col_start
    return in_span(plgpu.broadcasted_iota(jnp.int32, self.shape, 1, layout=plgpu.Layout.WGMMA),
                   relative(first), relative(last))


def _visible(tile: ScoreTile, mask: Mask, same_segment):
  """bool [rows, cols]: the tile's pairs that the mask and the segment ids show."""
  visible = tile.visible(mask, check_keys=mask.segments or not mask.causal)
  return visible if same_segment is None else visible & same_segment()


def score_bias(tile: ScoreTile, mask: Mask, *, same_segment=None) -> jax.Array:
  """float32 [rows, cols] in the WGMMA layout: 0 where the tile's pair is
  visible, -inf where the mask hides it: a starting value for S's
  accumulator that masks the scores as the product adds them.
  same_segment() as in `recomputed_probs`."""
  return jnp.where(_visible(tile, mask, same_segment), jnp.float32(0), jnp.float32(-jnp.inf))


def recomputed_probs(s, lse_log2, *, scores: Scores, mask: Mask, tile: ScoreTile, slope, masked: bool, lse_axis: int,
                     same_segment=None):
  """(P, the softcap's derivative or None) that a backward kernel recomputes
  for a tile s = Q K^T (or its transpose) from the forward's lse, taken to
  base 2 (lse_log2; broadcast along the tile's axis lse_axis): P =
  exp2(scores in base 2 - lse_log2), with the element mask where `masked`,
  after the exponential, so that rows that see no key (lse = -inf) give 0
  and not NaN. tile: where s lies. same_segment(): with segment ids,
  whether each pair's ids are equal (read only where `masked`)."""
  dcap = None
  if scores.modified:
    s, dcap = scores.log2(s, *tile.positions(), slope)
    p = jnp.exp2(s - lax.broadcast_in_dim(lse_log2, s.shape, [lse_axis]))
  else:
    p = jnp.exp2(s * (scores.softmax_scale * LOG2_E) - lax.broadcast_in_dim(lse_log2, s.shape, [lse_axis]))
  if masked:
    p = jnp.where(_visible(tile, mask, same_segment), p, 0.0)
  return p, dcap



def grad_scores(p, dp, delta, dcap, *, delta_axis: int):
  """dS = P * (dP - delta) for a tile (or its transpose), delta broadcast
  along the tile's axis delta_axis, times the softcap's derivative dcap
  (d(softcap * tanh) / d(scaled score), from `recomputed_probs`) where
  there is one."""
  ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [delta_axis]))
  return ds if dcap is None else ds * dcap

def triangular(mask: Mask) -> bool:
  """Whether a Q block's work grows with its index and a K/V block's
  shrinks with its own: a band with a right edge and no left one (causal
  attention; a window's right side alone). The kernels then run the
  heaviest tiles first and persistent CTAs pair heavy tiles with light ones
  (`PersistentSchedule`). Under a window's two sides every tile visits about
  as many blocks as the next ((left + right) / block + 1 or 2; fewer only
  near the sequence's start), and under a left side alone the work shrinks
  the other way: those tiles go round-robin in grid order, so that CTAs
  running together take neighbouring outer blocks, whose inner blocks
  (their windows) overlap in L2."""
  return mask.left is None and mask.right is not None


def kv_range(mask: Mask, q_start, rows: int, block_kv: int):
  """(lo, full_lo, full_hi, hi) over K/V blocks for the queries [q_start,
  q_start + rows) (mask.Mask.kv_blocks): lo and full_lo are the int 0
  without a left edge, and then only the right side's bounds are computed,
  as the kernels did before windows."""
  if mask.left is None:
    full_hi, hi = mask.kv_blocks_right(q_start, rows, block_kv)
    return 0, 0, full_hi, hi
  return mask.kv_blocks(q_start, rows, block_kv)


def segment_range(band: tuple, segment_ranges, batch, group, first, end):
  """A consumer's (lo, full_lo, full_hi, hi) over inner blocks under its
  band (`kv_range`, `KVOuter.q_blocks`) and its segment ids: segment_ranges
  int32 [batch, row groups, 4] in GMEM (`SegmentIds.ranges`), row group
  `group`. Clamped into the tile's blocks [first, end); a consumer whose rows
  share no id with the other side gets the empty range at `first`."""
  ranges = segment_ranges.at[batch, group]
  lo, full_lo, full_hi, hi = intersect(band, tuple(ranges[i] for i in range(4)), JNP)
  lo = jnp.clip(lo, first, end)
  hi = jnp.clip(hi, lo, end)
  full_lo = jnp.clip(full_lo, lo, hi)
  return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def at_least(x, floor):
  """max(x, floor): a Python int where both are (a stretch's static start)."""
  if isinstance(x, int) and isinstance(floor, int):
    return max(x, floor)
  return jnp.maximum(x, floor)


def optional_input(x) -> tuple:
  """A kernel's optional input as trailing arguments: (x,), or () for None."""
  return () if x is None else (x,)


def optional_ref(refs, present: bool):
  """(the first of a kernel's remaining refs, the rest) where an optional
  input is present, else (None, refs)."""
  return (refs[0], refs[1:]) if present else (None, refs)


def swizzled(cols: int, dtype) -> tuple:
  """The transforms of a shared-memory tile of `cols` columns: the widest
  swizzle its rows allow (128 bytes from 64 16-bit columns), so that wgmma
  and the TMA engine read it without bank conflicts."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8, "tile")
  return (
      plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle),
  )


# ---------------------------------------------------------------- inputs


def check_operands(what: str, head_dims: tuple[int, ...], q, k, v, do=None, lse=None, delta=None) -> None:
  """Raises unless q [batch, seq_q, heads, D], k and v [batch, seq_k,
  kv_heads, D] (heads a multiple of kv_heads) and, for a backward, do like q
  and float32 lse, delta [batch, heads, seq_q] are what `what` (a kernel
  module) serves: ValueError for inconsistent operands, NotImplementedError
  for a dtype or head_dim it does not take."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have one shape, got {k.shape} and {v.shape}")
  if do is not None and do.shape != q.shape:
    raise ValueError(f"do must have q's shape {q.shape}, got {do.shape}")
  batch, seq_q, heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k's batch and head_dim must match q's: q {q.shape}, k {k.shape}")
  if heads % k.shape[2]:
    raise ValueError(f"q's heads ({heads}) must be a multiple of k's ({k.shape[2]})")
  for name, x in (("lse", lse), ("delta", delta)):
    if x is not None and (x.shape != (batch, heads, seq_q) or x.dtype != jnp.float32):
      raise ValueError(
          f"{name} must be float32 [batch, heads, seq_q] = {(batch, heads, seq_q)}, got {x.dtype} {x.shape}")
  arrays = [x for x in (q, k, v, do) if x is not None]
  if len({jnp.dtype(x.dtype) for x in arrays}) != 1:
    names = ("q", "k", "v", "do")[:len(arrays)]
    raise ValueError(f"{', '.join(names)} must share a dtype, got {', '.join(str(x.dtype) for x in arrays)}")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"{what} supports bfloat16 and float16 (wgmma operands), got {q.dtype}")
  if head_dim not in head_dims:
    raise NotImplementedError(f"{what} supports head_dim in {head_dims}, got {head_dim}")


def check_smem(config, needs: dict[str, int], head_dim: int) -> None:
  """Raises ValueError if a kernel of `needs` ({kernel: bytes of shared
  memory}) does not fit a Hopper CTA under `config`."""
  for kernel, smem in needs.items():
    if smem > SMEM_LIMIT:
      raise ValueError(
          f"{config} needs {smem} bytes of shared memory for {kernel} at head_dim {head_dim}, more than "
          f"the {SMEM_LIMIT} a Hopper CTA has: lower stages or the block sizes"
      )


def check_backward_smem(config, head_dim: int, dtype, smem_bytes: dict, kernels) -> None:
  """check_smem for a module's backward kernels `kernels` ("dkv", "dq"),
  smem_bytes: {"dkv": fn, "dq": fn}, fn(config, head_dim, dtype) a kernel's
  shared memory."""
  labels = {"dkv": "the dK/dV kernel", "dq": "the dQ kernel"}
  check_smem(config, {labels[name]: smem_bytes[name](config, head_dim, dtype) for name in kernels}, head_dim)


def pad_seq(x: jax.Array, multiple: int, *, axis: int = 1, value: float = 0.0) -> jax.Array:
  """x with its sequence `axis` padded with `value` up to a multiple of
  `multiple`; x itself, not a copy, when its length already is one."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def unpad_seq(x: jax.Array, length: int, *, axis: int = 1) -> jax.Array:
  """The first `length` entries of x along `axis` (x itself when that is all)."""
  return x if x.shape[axis] == length else lax.slice_in_dim(x, 0, length, axis=axis)


def pad_backward(q, k, v, do, lse, delta):
  """A backward's operands padded along their sequence axes to multiples of
  OUTER_ROWS, which every block of the backward kernels divides, so that one
  padding serves all of them (an operand already a multiple is returned as
  it is). Padded query rows get lse = +inf, so that P = exp2(S - lse) = 0
  there (finite S: Q is 0), and dO = 0, delta = 0, so that dS = P * (dP -
  delta) = 0 as well: they add nothing to dK and dV, and their dQ rows are
  sliced away."""
  q, do = pad_seq(q, OUTER_ROWS), pad_seq(do, OUTER_ROWS)
  k, v = pad_seq(k, OUTER_ROWS), pad_seq(v, OUTER_ROWS)
  lse = pad_seq(lse, OUTER_ROWS, axis=2, value=jnp.inf)
  delta = pad_seq(delta, OUTER_ROWS, axis=2)
  return q, k, v, do, lse, delta


class SegmentIds(NamedTuple):
  """A kernel's segment-id inputs in GMEM: q int32 [batch, seq_q'], kv int32
  [batch, seq_k'] (padded like the operands), and ranges int32 [batch, outer
  row groups, 4], each consumer's inner block range under the ids
  (jax_flash2.mask.segment_block_ranges; empty past the real rows)."""

  q: Any
  kv: Any
  ranges: Any


def segment_inputs(q_ids, kv_ids, *, padded_q: int, padded_k: int, rows: int, block: int, groups: int,
                   q_outer: bool) -> SegmentIds:
  """The SegmentIds of a Q-outer (q_outer: rows-row query groups over
  block-row K/V blocks) or K/V-outer kernel (rows-row key groups over Q
  blocks), `groups` outer row groups, computed once per call."""
  extents = SegmentRanges(q_ids, kv_ids)
  if q_outer:
    ranges, empty = segment_block_ranges(extents.queries(rows), extents.keys(block)), padded_k // block
  else:
    ranges, empty = segment_block_ranges(extents.keys(rows), extents.queries(block)), padded_q // block
  ranges = jnp.pad(ranges, ((0, 0), (0, groups - ranges.shape[1]), (0, 0)), constant_values=empty)
  return SegmentIds(pad_ids(q_ids, padded_q), pad_ids(kv_ids, padded_k), ranges)


def load_ids(ref, *, layout) -> jax.Array:
  """Segment ids from GMEM straight into `layout` (a row's or a column's of
  the score fragment). Mosaic's optimized register loads read SMEM only;
  these few words per tile take the plain transfer."""
  return plgpu.load(ref, layout=layout, optimized=False)


def segment_hull(ranges, batch, first, consumers: int, lo, hi):
  """(lo, hi), a tile's band of inner blocks, narrowed to the hull of its
  consumers' ranges under the segment ids: row groups first .. first +
  consumers - 1 of `ranges` (SegmentIds.ranges). The caller clamps `first`
  and this the batch: a persistent CTA also asks for the tile after its
  last, which it never runs, and the reads must stay in bounds."""
  b = jnp.minimum(batch, ranges.shape[0] - 1)
  groups = [ranges.at[b, first + c] for c in range(consumers)]
  seg_lo = functools.reduce(jnp.minimum, [g[0] for g in groups])
  seg_hi = functools.reduce(jnp.maximum, [jnp.where(g[0] < g[3], g[3], 0) for g in groups])
  lo = jnp.maximum(lo, seg_lo)
  return lo, jnp.maximum(jnp.minimum(hi, seg_hi), lo)


def same_ids(row_ids, col_ids, shape) -> jax.Array:
  """bool `shape` [rows, cols]: where a row's segment id equals its column's
  (row_ids, col_ids in the rows' and the columns' fragment layouts)."""
  return lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(col_ids, shape, [1])


def segment_refs(refs, segments: bool) -> tuple[SegmentIds | None, tuple]:
  """A kernel's SegmentIds refs (its inputs after the ALiBi slopes) where
  `segments`, and the refs after them."""
  return (SegmentIds(*refs[:3]), refs[3:]) if segments else (None, refs)


def with_segment_ids(mask: Mask, q_ids, kv_ids, batch: int) -> Mask:
  """`mask` with segment ids taking part where given: q_ids int32 [batch,
  seq_q] and kv_ids int32 [batch, seq_k], both or neither, or a ValueError."""
  if (q_ids is None) != (kv_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids go together: pass both or neither")
  if q_ids is None:
    return mask
  for name, ids, seq in (("q_segment_ids", q_ids, mask.seq_q), ("kv_segment_ids", kv_ids, mask.seq_k)):
    if ids.shape != (batch, seq) or ids.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 [batch, seq] = [{batch}, {seq}], got {ids.dtype}{list(ids.shape)}")
  return dataclasses.replace(mask, segments=True)


def pad_ids(ids: jax.Array, length: int) -> jax.Array:
  """Segment ids [batch, seq] padded to `length` columns (the kernels mask
  the padding by position, whatever its ids)."""
  return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])))


def band_of(seq_q: int, seq_k: int, causal: bool, window_size) -> Mask:
  """The Mask of an entry point's causal and window_size ((left, right),
  None on a side leaving it unbounded; causal caps the right side at 0)."""
  if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
      side is None or (isinstance(side, int) and not isinstance(side, bool) and side >= 0) for side in window_size):
    raise ValueError(f"window_size must be a pair (left, right) of ints >= 0 or None, got {window_size!r}")
  left, right = window_size
  return Mask(seq_q, seq_k, causal=bool(causal), window_left=left, window_right=right)


def check_per_head(name: str, x, q) -> None:
  """Raises ValueError unless x is None or float32 [batch or 1, heads] for
  q [batch, seq, heads, D] (the ALiBi slopes, the sinks)."""
  if x is None:
    return
  batch, heads = q.shape[0], q.shape[2]
  if x.dtype != jnp.float32 or x.shape not in ((1, heads), (batch, heads)):
    raise ValueError(f"{name} must be float32 [batch or 1, heads] = [{batch} or 1, {heads}], got "
                     f"{x.dtype} {x.shape}")


def scores_of(q, mask: Mask, softmax_scale: float | None, softcap: float | None, alibi_slopes) -> Scores:
  """The Scores of an entry point's arguments, checked: softcap > 0 or
  None; alibi_slopes float32 [batch or 1, heads] or None."""
  if softcap is not None and not softcap > 0:
    raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
  check_per_head("alibi_slopes", alibi_slopes, q)
  return Scores(softmax_scale_of(softmax_scale, q.shape[-1]), None if softcap is None else float(softcap),
                alibi_slopes is not None, mask.offset)


def backward_kernels(kernels: dict, q, k, v, do, lse, delta, *, causal: bool, window_size, softcap, alibi_slopes,
                     softmax_scale: float | None, config, interpret, q_segment_ids=None,
                     kv_segment_ids=None) -> jax.Array | tuple[jax.Array, ...]:
  """Runs a module's backward kernels on one padding of the operands
  (`pad_backward`; ragged lengths pad once, not once per kernel) and slices
  their gradients back to the real lengths: (dq, dk, dv), (dk, dv) or dq.
  kernels: {"dkv" and/or "dq": call}, call(*padded operands, mask=,
  scores=, slopes=, config=, interpret=) giving (dk, dv) or dq, `config`
  already checked by the module (its check_config); with segment ids the
  calls take segment_ids=(q ids, kv ids) too."""
  mask = band_of(q.shape[1], k.shape[1], causal, window_size)
  mask = with_segment_ids(mask, q_segment_ids, kv_segment_ids, q.shape[0])
  kwargs = dict(segment_ids=(q_segment_ids, kv_segment_ids)) if mask.segments else {}
  scores = scores_of(q, mask, softmax_scale, softcap, alibi_slopes)
  padded = pad_backward(q, k, v, do, lse, delta)
  kwargs.update(mask=mask, scores=scores, slopes=alibi_slopes, config=config, interpret=interpret)
  grads = []
  if "dkv" in kernels:
    grads += [unpad_seq(x, mask.seq_k) for x in kernels["dkv"](*padded, **kwargs)]
  if "dq" in kernels:
    grads.insert(0, unpad_seq(kernels["dq"](*padded, **kwargs), mask.seq_q))
  return grads[0] if len(grads) == 1 else tuple(grads)


# ---------------------------------------------------------------- the K/V ring


def load_kv_blocks(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, *,
                   batch, kv_head, num_steps, first_step, block_kv: int, stages: int, first_block=0) -> None:
  """TMA copies of K/V blocks first_block..first_block + num_steps - 1 of
  (batch, kv_head) into the ring, the tile's i-th block into the ring's step
  `first_step + i` (slot (first_step + i) % stages): a persistent CTA keeps
  one ring across its tiles. A slot is refilled once both consumers released
  what it held `stages` steps before. first_block: the int 0 unless a band's
  left edge skips the leading blocks."""

  @pl.loop(0, num_steps)
  def _load(step):
    ring_step = first_step + step
    slot = lax.rem(ring_step, jnp.int32(stages))
    block = step if isinstance(first_block, int) and first_block == 0 else first_block + step
    kv_rows = (batch, pl.ds(block * block_kv, block_kv), kv_head)

    # The first round of slots is free from the start.
    @pl.when(ring_step >= stages)
    def _():
      plgpu.barrier_wait(k_consumed.at[slot])

    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem.at[slot], k_ready.at[slot])

    @pl.when(ring_step >= stages)
    def _():
      plgpu.barrier_wait(v_consumed.at[slot])

    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem.at[slot], v_ready.at[slot])


def observe_last_releases(k_consumed, v_consumed, *, end_step, stages: int) -> None:
  """Waits for the consumers' release of the ring's last `stages` steps
  before `end_step`, so that the producer has seen every phase of the
  consumed barriers when they are freed. The hardware does not need it (the
  CTA ends with its consumers anyway); Mosaic's interpreter checks it."""

  @pl.loop(jnp.maximum(end_step - stages, 0), end_step)
  def _release(ring_step):
    slot = lax.rem(ring_step, jnp.int32(stages))
    plgpu.barrier_wait(k_consumed.at[slot])
    plgpu.barrier_wait(v_consumed.at[slot])


def kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, *, group: int,
                     block_kv: int, stages: int):
  """(produce, observe) for `run_tiles` in a Q-outer kernel (the forward,
  dQ): the tile's K/V blocks through the ring, for the K/V head of its query
  head."""

  def produce(tile: QTile, ring_base):
    load_kv_blocks(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, batch=tile.batch,
                   kv_head=tile.kv_head(group), num_steps=tile.num_steps, first_step=ring_base,
                   block_kv=block_kv, stages=stages, first_block=tile.kv_lo)

  def observe(end_step):
    observe_last_releases(k_consumed, v_consumed, end_step=end_step, stages=stages)

  return produce, observe


def run_tiles(schedule: PersistentSchedule | None, tile_at, *, wg, axis: str, produce, observe, load, compute,
              store, epilogue=lambda end_step: None, buffers: int = 2, consumers: int = NUM_CONSUMERS,
              produce_aside=(), tiles_ref=None) -> None:
  """A warp-specialized CTA's two roles over its tiles; the kernels supply
  the work, as callables of a tile (QTile or the like: num_steps ring steps):

    produce(tile, ring_base): the producer's TMA copies of the tile's inner
      blocks into the ring's steps ring_base, ring_base + 1, ...;
    observe(end_step): the producer's wait for the release of the ring's
      last slots before end_step;
    load(tile, buffer): a consumer starts the copies of its outer rows;
    compute(tile, buffer, ring_base): waits for them and returns its result;
    store(tile, buffer, result): starts the result's TMA stores;
    epilogue(end_step): a consumer's work after its last tile (end_step:
      the ring steps of all its tiles);
    produce_aside: callables (tile, ring_base), optional (persistent CTAs
      only): more producer work, each run by one more warp of the producer
      warpgroup (the second, third, ...) over the same tiles while its first
      warp runs `produce` and `observe`, so that none waits behind another.

  With schedule None the CTA takes the one tile of its grid position
  (tile_at(index on `axis`, head, batch)); else the schedule's tiles, with
  one ring through all of them and the outer rows double-buffered, the next
  tile's rows loading while the current one's results are stored (with
  `buffers` 1, where shared memory has no room for a second set: after the
  stores have read them). tiles_ref: the schedule's table (int32 in global
  memory; see PersistentSchedule.table), where it has one. wg: the
  warpgroup index; warpgroups [0, consumers) consume, warpgroup `consumers`
  produces."""
  producer, consumer_registers = consumers, CONSUMER_REGISTERS[consumers]

  def scoped_store(tile, buffer, result):
    with jax.named_scope("epilogue"):  # a tile's stores, for the profiler
      store(tile, buffer, result)

  if schedule is None and produce_aside:
    raise NotImplementedError("run_tiles: produce_aside needs a schedule (persistent CTAs)")
  if schedule is None:
    tile = tile_at(lax.axis_index(axis), lax.axis_index("heads"), lax.axis_index("batch"))

    @pl.when(wg == producer)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      produce(tile, jnp.int32(0))
      observe(tile.num_steps)

    @pl.when(wg < consumers)
    def _consumer():
      plgpu.set_max_registers(consumer_registers, action="increase")
      load(tile, 0)
      scoped_store(tile, 0, compute(tile, 0, jnp.int32(0)))
      epilogue(tile.num_steps)
      # Shared memory must outlive the stores' reads of it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return

  cta = lax.axis_index("cta")
  num_tiles = schedule.tile_count(cta, tiles_ref)
  number_of = lambda i: schedule.number(cta, i, tiles_ref)
  tile_of = lambda number: tile_at(*schedule.decode(number))

  @pl.when(wg == producer)
  def _persistent_producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def over_tiles(work):
      def one_tile(i, ring_base):
        tile = tile_of(number_of(i))
        work(tile, ring_base)
        return ring_base + tile.num_steps

      return lax.fori_loop(0, num_tiles, one_tile, jnp.int32(0))

    if not produce_aside:
      observe(over_tiles(produce))
      return

    @plgpu.warp_map
    def _(warp):
      @pl.when(warp == 0)
      def _():
        observe(over_tiles(produce))

      for index, work in enumerate(produce_aside, start=1):
        @pl.when(warp == index)
        def _(work=work):
          over_tiles(work)

  @pl.when(wg < consumers)
  def _persistent_consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    first = number_of(jnp.int32(0))
    load(tile_of(first), 0)

    def consume(i, carry):
      ring_base, number = carry
      # The next tile's number is read a whole tile before its rows load: a
      # table's entries come from global memory.
      next_number = number_of(i + 1)
      tile, next_tile = tile_of(number), tile_of(next_number)
      if buffers == 1:
        scoped_store(tile, 0, compute(tile, 0, ring_base))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the rows' buffer

        @pl.when(i + 1 < num_tiles)
        def _():
          load(next_tile, 0)

        return ring_base + tile.num_steps, next_number
      buffer = lax.rem(i, jnp.int32(2))
      result = compute(tile, buffer, ring_base)
      # The next tile's rows go to the other buffer, which staged the
      # previous tile's results, issued a whole tile ago: their stores must
      # have read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(i + 1 < num_tiles)(lambda: load(next_tile, 1 - buffer))
      scoped_store(tile, buffer, result)
      return ring_base + tile.num_steps, next_number

    end_step, _ = lax.fori_loop(0, num_tiles, consume, (jnp.int32(0), first))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # shared memory must outlive the stores' reads
    epilogue(end_step)


# ---------------------------------------------------------------- tiles and schedules


@dataclasses.dataclass(frozen=True)
class QTile:
  """block_q query rows of one (batch, head): the unit of work of a Q-outer
  kernel's CTA (the forward, dQ). It visits K/V blocks [kv_lo, kv_lo +
  num_steps). Fields are int32 scalars, but kv_lo is the int 0 without a
  left edge (`q_tile_blocks`)."""

  batch: jax.Array
  head: jax.Array
  q_start: jax.Array  # first query row
  num_steps: jax.Array  # K/V blocks the producer loads for it
  kv_lo: Any = dataclasses.field(default=0, kw_only=True)  # the first of them

  @classmethod
  def at(cls, q_index, head, batch, *, num_q_blocks: int, block_q: int, block_kv: int, mask: Mask,
         consumers: int = NUM_CONSUMERS, segment_ranges=None) -> QTile:
    """The tile of grid position q_index (where the work grows with the Q
    block, `triangular`, a kernel runs Q blocks heaviest first: those near
    the end of the sequence visit the most K/V blocks, and taking them first
    keeps them off the critical path at the tail). segment_ranges: with
    segment ids, the consumers' block ranges under them (`segment_kv_range`)."""
    if triangular(mask):
      q_index = jnp.int32(num_q_blocks - 1) - q_index
    q_start = q_index * block_q
    lo, hi = q_tile_blocks(q_start, block_q=block_q, block_kv=block_kv, mask=mask, consumers=consumers)
    if segment_ranges is not None:
      first = jnp.clip(q_index, 0, num_q_blocks - 1) * consumers
      lo, hi = segment_hull(segment_ranges, batch, first, consumers, lo, hi)
    if isinstance(lo, int):
      return cls(batch, head, q_start, hi)
    return cls(batch, head, q_start, hi - lo, kv_lo=lo)

  def kv_head(self, group: int) -> jax.Array:
    """The K/V head of this tile's query head (grouped-query attention)."""
    return lax.div(self.head, jnp.int32(group))

  def step_of(self, kb):
    """The tile's ring step (from its first) of K/V block kb."""
    return kb if isinstance(self.kv_lo, int) else kb - self.kv_lo

  @property
  def kv_end(self):
    """The K/V block after the tile's last."""
    return self.num_steps if isinstance(self.kv_lo, int) else self.kv_lo + self.num_steps


def q_tile_blocks(q_start, *, block_q: int, block_kv: int, mask: Mask, consumers: int, ints: Arithmetic = JNP):
  """(lo, hi): the K/V blocks [lo, hi) the producer loads for the Q tile
  from row q_start, every block any consumer needs: the first consumer's
  rows are the earliest, so its left bound is the tile's, and the last
  consumer's the latest, so its right bound covers them all. lo is the int
  0 without a left edge. ints: jnp in a kernel, numpy on the host."""
  rows = block_q // consumers
  _, hi = mask.kv_blocks_right(q_start + (consumers - 1) * rows, rows, block_kv, ints)
  if mask.left is None:
    return 0, hi
  # hi >= lo: the last consumer's right bound is at or past its own left
  # one (mask.Mask.kv_blocks), which is at or past the first consumer's.
  lo, _ = mask.kv_blocks_left(q_start, rows, block_kv, ints)
  return lo, hi


def q_tile_steps(q_start, *, block_q: int, block_kv: int, mask: Mask, consumers: int, ints: Arithmetic = JNP):
  """K/V blocks the producer loads for the Q tile from row q_start (`q_tile_blocks`)."""
  lo, hi = q_tile_blocks(q_start, block_q=block_q, block_kv=block_kv, mask=mask, consumers=consumers, ints=ints)
  return hi - lo


def q_tile_work(num_q_blocks: int, *, block_q: int, block_kv: int, mask: Mask,
                consumers: int = NUM_CONSUMERS) -> tuple[int, ...]:
  """The ring steps of each Q tile of a `triangular` mask, numbered as
  QTile.at numbers them (block 0 the heaviest): the work a balanced
  PersistentSchedule evens out."""
  return tuple(
      int(q_tile_steps((num_q_blocks - 1 - b) * block_q, block_q=block_q, block_kv=block_kv, mask=mask,
                       consumers=consumers, ints=NUMPY))
      for b in range(num_q_blocks)
  )


@dataclasses.dataclass(frozen=True)
class PersistentSchedule:
  """Which tiles the persistent CTAs of a kernel take. A tile is one outer
  block (a Q block of the forward and dQ, a K/V block of dK/dV) of one
  (batch, head), numbered with outer blocks fastest, so CTAs running together
  share one (batch, head) and read the same inner blocks from L2; CTA c
  takes tiles c, c + num_ctas, ...

  Causal tiles differ in work (a Q block sees the K/V blocks up to its
  diagonal, a K/V block the Q blocks from it), and a static schedule cannot
  even that out the way the hardware's CTA launcher does. So with `paired`
  the tiles go in pairs of equal total work, the heaviest block of a (batch,
  head) with its lightest, the second heaviest with the second lightest, ...,
  and CTA c takes pairs c, c + num_ctas, ...: every CTA gets the same work,
  but for the last round, which only some CTAs take.

  With `work` (the ring steps of each block, block 0 the heaviest) the tiles
  come instead from `table()`, built on the host, which evens out that last
  round too (`balanced_table`); the kernel reads its tiles from that table
  (an int32 input, `tiles_ref`).

  A tile's number is (batch * heads + head) * num_blocks + block: `decode`.
  """

  num_blocks: int
  heads: int
  batch: int
  num_ctas: int
  paired: bool
  work: tuple[int, ...] | None = None

  @classmethod
  def create(cls, num_blocks: int, heads: int, batch: int, *, causal: bool, interpret: bool,
             work: tuple[int, ...] | None = None):
    """One CTA per SM (fewer in the interpreter, so that each takes several
    tiles), and none without a tile. `work` (causal only): tiles from a
    balanced table."""
    num_tiles = num_blocks * heads * batch
    num_ctas = min(-(-num_tiles // 2) if causal else num_tiles,
                   _PERSISTENT_INTERPRET_CTAS if interpret else sm_count())
    return cls(num_blocks, heads, batch, num_ctas, paired=causal, work=work if causal else None)

  @property
  def num_tiles(self) -> int:
    return self.num_blocks * self.heads * self.batch

  @property
  def tabled(self) -> bool:
    return self.work is not None

  def table(self) -> np.ndarray:
    """int32 [num_ctas, 2 + most tiles of a CTA]: column 0 each CTA's tile
    count, then its tiles' numbers in the order it runs them, then zeros (at
    least one, so that reading one tile past the last stays in bounds). A
    placeholder for a schedule that computes its tiles."""
    if not self.tabled:
      return _NO_TABLE
    return balanced_table(self.num_blocks, self.heads * self.batch, self.num_ctas, self.work)

  def tile_count(self, cta, tiles_ref=None):
    """Tiles of CTA `cta` (int32 scalar)."""
    if self.tabled:
      return tiles_ref[cta, 0]
    if not self.paired:
      return lax.div(jnp.int32(self.num_tiles - 1) - cta, jnp.int32(self.num_ctas)) + 1
    stride = jnp.int32(2 * self.num_ctas)
    firsts = lax.div(jnp.int32(self.num_tiles - 1) - 2 * cta, stride) + 1  # tiles 2p
    seconds = lax.div(jnp.maximum(jnp.int32(self.num_tiles - 2) - 2 * cta, -1) + stride, stride)  # 2p + 1
    return firsts + seconds

  def number(self, cta, i, tiles_ref=None):
    """The number of CTA cta's i-th tile (int32 scalar; i may run one past
    the last tile, whose number is then meaningless but harmless). Block
    counts as the grid's outer axis does: a pair's first tile is block
    `half`, the heavy one where block 0 is the heaviest (K/V blocks; the
    Q-outer kernels reverse their index to run the heaviest Q blocks
    first)."""
    if self.tabled:
      return tiles_ref[cta, 1 + i]
    if not self.paired:
      return cta + i * self.num_ctas
    nb = jnp.int32(self.num_blocks)
    t = 2 * (cta + lax.div(i, jnp.int32(2)) * self.num_ctas) + lax.rem(i, jnp.int32(2))
    position = lax.rem(t, nb)
    half = lax.div(position, jnp.int32(2))
    block = jnp.where(lax.rem(position, jnp.int32(2)) == 0, half, nb - 1 - half)
    return t - position + block

  def decode(self, number):
    """(block, head, batch) of a tile's number, int32 scalars."""
    nb = jnp.int32(self.num_blocks)
    rest = lax.div(number, nb)
    return lax.rem(number, nb), lax.rem(rest, jnp.int32(self.heads)), lax.div(rest, jnp.int32(self.heads))

  def tile(self, cta, i, tiles_ref=None):
    """(block, head, batch) of CTA cta's i-th tile, int32 scalars."""
    return self.decode(self.number(cta, i, tiles_ref))


# `tiles_ref` of a kernel without a table (one CTA per tile, or a schedule
# that computes its tiles): never read.
_NO_TABLE = np.zeros((1, 2), np.int32)
_NO_TABLE.flags.writeable = False

# A tile's cost in `balanced_table` beyond its ring steps: its first loads,
# its last P V and its stores, about a step's time.
TILE_OVERHEAD_STEPS = 1


@functools.lru_cache(maxsize=64)
def balanced_table(num_blocks: int, units: int, num_ctas: int, work: tuple[int, ...]) -> np.ndarray:
  """PersistentSchedule.table() of `units` (batch, head) pairs of num_blocks
  tiles each, tile b of a unit costing work[b] ring steps (plus
  TILE_OVERHEAD_STEPS).

  Pairs dealt round-robin (the paired schedule) leave a last round of pairs
  that only some CTAs take, and where a (batch, head) has an odd number of
  blocks the pairs are unequal too. Here every tile goes, in turn, to the
  CTA with the least work so far (greedy list scheduling): first the
  heavy-light pairs of each (batch, head) in order, as whole pairs, which
  keeps the CTAs that run together on few heads (their K/V shared in L2);
  then the last few rounds' worth of pairs as single tiles, heaviest first,
  which fill the CTAs up evenly (longest processing time first). Of tails of
  1 to 4 rounds, the one whose busiest CTA works least (the shortest of
  equals: the fewest heads at once)."""
  cost = np.asarray(work, np.int64) + TILE_OVERHEAD_STEPS
  pairs = []
  for unit in range(units):
    base = unit * num_blocks
    for b in range((num_blocks + 1) // 2):
      light = num_blocks - 1 - b
      pairs.append((base + b,) if light == b else (base + b, base + light))

  def deal(tail_rounds: int):
    whole = max(len(pairs) // num_ctas - tail_rounds, 0) * num_ctas
    singles = sorted((t for pair in pairs[whole:] for t in pair), key=lambda t: -cost[t % num_blocks])
    loads = [(0, cta) for cta in range(num_ctas)]  # a heap of (work so far, CTA)
    tiles = [[] for _ in range(num_ctas)]
    for group in pairs[:whole] + [(t,) for t in singles]:
      load, cta = heapq.heappop(loads)
      tiles[cta].extend(group)
      heapq.heappush(loads, (load + int(sum(cost[t % num_blocks] for t in group)), cta))
    return max(loads)[0], tiles

  _, tiles = min((deal(tail_rounds) for tail_rounds in range(1, 5)), key=lambda dealt: dealt[0])
  table = np.zeros((num_ctas, 2 + max(len(t) for t in tiles)), np.int32)
  for cta, numbers in enumerate(tiles):
    table[cta, 0] = len(numbers)
    table[cta, 1:1 + len(numbers)] = numbers
  table.flags.writeable = False  # cached: shared by every caller
  return table


def outer_grid(num_blocks: int, heads: int, batch: int, *, axis: str, persistent: bool, causal: bool,
               interpret: bool, work: tuple[int, ...] | None = None):
  """(schedule, grid, grid_names) of a kernel over outer blocks (Q blocks of
  the forward and dQ, axis "q"; K/V blocks of dK/dV, axis "kv"): persistent
  CTAs (schedule; from a balanced table with `work`, causal only), or one
  CTA per tile (schedule None) with the outer blocks the fastest-varying
  grid axis, so that CTAs running together share one (batch, head) and read
  the same inner blocks from L2."""
  if persistent:
    schedule = PersistentSchedule.create(num_blocks, heads, batch, causal=causal, interpret=interpret, work=work)
    return schedule, (schedule.num_ctas,), ("cta",)
  return None, (num_blocks, heads, batch), (axis, "heads", "batch")


def tile_table(schedule: PersistentSchedule | None) -> jax.Array:
  """The kernel input `tiles_ref`: the schedule's table (a placeholder
  without one)."""
  return jnp.asarray(_NO_TABLE if schedule is None else schedule.table())


# ---------------------------------------------------------------- K/V-outer kernels


def zero_padded_keys(mask: Mask, padded_seq_k: int, k_start, dk, dv):
  """dK and dV [rows from key k_start, D] with the rows of keys past seq_k
  zeroed. A K/V-outer kernel does not mask those keys (under causal
  attention, a band whose right edge is 0, the band hides them; else their
  P^T is exp2(-lse), not 0, in the blocks it runs unmasked), but a key's P^T
  and dS^T reach only its own rows of dV and dK, so zeroing them once serves
  as well as a mask on every Q block would. dK and dV as they are under
  causal attention or without padding."""
  if not mask.causal and padded_seq_k > mask.seq_k:
    key = k_start + plgpu.broadcasted_iota(jnp.int32, dk.shape, 0, layout=plgpu.Layout.WGMMA)
    dk, dv = (jnp.where(key < mask.seq_k, x, 0.0) for x in (dk, dv))
  return dk, dv


def copy_q_block(gmem, smem, ready, released, *, ring_step, stages: int, rows, vec) -> None:
  """A K/V-outer producer's TMA copies of one Q block into ring step
  `ring_step`'s slot: Q and lse once the consumers released the slot's last
  Q and lse (released[0]), dO and delta once they released its dO and delta
  (released[1]); the first round of slots is free from the start. gmem,
  smem, ready: (Q, lse, dO, delta)'s arrays, slot buffers and ready
  barriers (one barrier array may serve two of them); rows, vec: the
  block's index into Q/dO and into lse/delta."""
  slot = lax.rem(ring_step, jnp.int32(stages))
  for tile, row_vec, consumed in ((0, 1, released[0]), (2, 3, released[1])):
    @pl.when(ring_step >= stages)
    def _():
      plgpu.barrier_wait(consumed.at[slot])

    plgpu.copy_gmem_to_smem(gmem[tile].at[rows], smem[tile].at[slot], ready[tile].at[slot])
    plgpu.copy_gmem_to_smem(gmem[row_vec].at[vec], smem[row_vec].at[slot], ready[row_vec].at[slot])


@dataclasses.dataclass(frozen=True)
class KVTile:
  """OUTER_ROWS key rows of one (batch, kv head): a K/V-outer CTA's unit of
  work. It visits Q blocks [lo, q_end) of every query head of the group
  (the first consumer's keys come first, so its range starts the tile's;
  the second one's last key ends it), in the order `q_block` gives. q_end
  None: every Q block from lo on (num_q; no left edge). Fields are int32
  scalars but num_q, an int."""

  batch: jax.Array
  kv_head: jax.Array
  kv_index: jax.Array  # K/V block
  k_start: jax.Array  # first key row
  lo: jax.Array
  num_steps: jax.Array  # ring steps: Q blocks the producer loads for it
  num_q: int  # Q blocks of a query head
  q_end: Any = dataclasses.field(default=None, kw_only=True)

  @property
  def visits(self):
    """Q blocks visited per query head."""
    return jnp.int32(self.num_q) - self.lo if self.q_end is None else self.q_end - self.lo

  @property
  def end(self):
    """The Q block after the tile's last."""
    return self.num_q if self.q_end is None else self.q_end

  def q_block(self, position):
    """The Q block at `position` of the visits for one query head."""
    return self.lo + position

  def step_of(self, g, qb):
    """The tile's ring step of Q block qb of query head g of the group."""
    return g * self.visits + (qb - self.lo)


class KVOuterScratch(NamedTuple):
  """A K/V-outer kernel's shared memory (`kv_outer_scratch`). k, v: [buffers,
  2, 64, D], one tile per consumer, reused for dK, dV (two buffers in a
  persistent CTA, which loads the next tile's K and V while the current
  one's gradients are stored); q, do: [stages, block_q, D]; lse, delta:
  [stages, block_q]. kv_ready: [buffers * 2] barriers of 2 arrivals (K and
  V copies); *_ready: [stages] (TMA); q_consumed (Q, lse), do_consumed (dO,
  delta): [stages], 2 arrivals."""

  @classmethod
  def take(cls, scratch, *, interpret: bool):
    """(KVOuterScratch, the interpreter's staging tile or None, the scratch
    refs after them) from a kernel's scratch, laid out by kv_outer_scratch."""
    n = len(cls._fields)
    return cls(*scratch[:n]), scratch[n] if interpret else None, scratch[n + interpret:]

  k: Any
  v: Any
  q: Any
  do: Any
  lse: Any
  delta: Any
  kv_ready: Any
  q_ready: Any
  do_ready: Any
  lse_ready: Any
  delta_ready: Any
  q_consumed: Any
  do_consumed: Any


def kv_outer_scratch(head_dim: int, dtype, *, block_q: int, stages: int, buffers: int, interpret: bool) -> list:
  """The scratch shapes of KVOuterScratch, in its order, and in the
  interpreter the P^T / dS^T staging tile (`KVOuter.staging`) after them."""
  transforms = swizzled(head_dim, dtype)
  scratch = [
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M, head_dim), dtype, transforms=transforms),  # K
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M, head_dim), dtype, transforms=transforms),  # V
      plgpu.SMEM((stages, block_q, head_dim), dtype, transforms=transforms),  # Q
      plgpu.SMEM((stages, block_q, head_dim), dtype, transforms=transforms),  # dO
      plgpu.SMEM((stages, block_q), jnp.float32),  # lse
      plgpu.SMEM((stages, block_q), jnp.float32),  # delta
      plgpu.Barrier(num_arrivals=2, num_barriers=buffers * NUM_CONSUMERS),  # K and V tiles
      *[plgpu.Barrier(num_barriers=stages) for _ in range(4)],  # Q, dO, lse, delta ready
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # Q, lse consumed
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # dO, delta consumed
  ]
  if interpret:
    scratch.append(plgpu.SMEM((NUM_CONSUMERS, WGMMA_M, block_q), dtype, transforms=swizzled(block_q, dtype)))
  return scratch


def kv_outer_smem_bytes(head_dim: int, dtype, *, block_q: int, stages: int, buffers: int) -> int:
  """Shared memory of `kv_outer_scratch` (compiled), with BWD_SMEM_RESERVE."""
  item = jnp.dtype(dtype).itemsize
  kv = buffers * 2 * OUTER_ROWS * head_dim * item
  ring = stages * (2 * block_q * head_dim * item + 2 * block_q * 4)
  return kv + ring + BWD_SMEM_RESERVE


class Operands(NamedTuple):
  """A backward kernel's inputs in global memory: q, do [batch, seq_q',
  heads, D]; k, v [batch, seq_k', kv_heads, D]; lse, delta float32 [batch,
  heads, seq_q'] (seq' padded to multiples of OUTER_ROWS); slopes: float32
  [batch or 1, heads], the ALiBi slopes, where the problem has them."""

  q: Any
  k: Any
  v: Any
  do: Any
  lse: Any
  delta: Any
  slopes: Any = None


@dataclasses.dataclass(frozen=True)
class KVOuter:
  """The pieces of a K/V-outer kernel (the dK/dV kernel, the fused one)
  over one kernel's refs. Each consumer owns 64 key rows of the tile (its K
  and V in shared memory, dK and dV in registers); per Q block it computes,
  transposed so that its own key rows are the wgmma M side:

    S^T = K Q^T, dP^T = V dO^T                 (one wgmma group)
    P^T = exp2(S^T * scale * log2(e) - lse * log2(e))
    dS^T = P^T * (dP^T - delta)
    dV += P^T dO, dK += dS^T Q                 (one wgmma group, P^T and
                                                dS^T from registers)

  and dK is scaled by softmax_scale once, at the end. With a softcap or
  ALiBi (`scores`) P^T takes the modified scores, and a softcap's derivative
  multiplies dS^T. P is set to 0 after the exponential where masked, so
  that rows that see no key (lse = -inf) give 0 and not NaN; keys past
  seq_k are not masked (`zero_padded_keys`).

  In Mosaic's interpreter (jax 0.11.2 runs wgmma only from shared-memory
  operands into fresh accumulators) P^T and dS^T go through `staging`
  ([2, 64, block_q]) and the products are added afterwards; the compiled
  kernel never takes that branch."""

  operands: Operands
  dk_ref: Any
  dv_ref: Any
  smem: KVOuterScratch
  staging: Any  # interpreter only, else None
  wg: jax.Array
  mask: Mask
  group: int
  block_q: int
  stages: int
  scores: Scores
  early_vectors: bool
  interpret: bool
  tile_type: Callable[..., KVTile] = KVTile
  segments: SegmentIds | None = None  # the ids' refs, with segment ids (K/V-outer ranges)

  @property
  def num_q(self) -> int:
    return pl.cdiv(self.mask.seq_q, self.block_q)

  @property
  def dtype(self):
    return self.operands.q.dtype

  def tile_at(self, kv_index, kv_head, batch) -> KVTile:
    """The tile of grid position kv_index (K/V block 0 sees the most Q
    blocks when causal: in grid order it runs first, the heaviest-first
    order of the Q-outer kernels)."""
    k_start = kv_index * OUTER_ROWS
    lo, _ = self.mask.q_blocks_right(k_start, WGMMA_M, self.block_q)
    if self.segments is not None:
      hi = self.num_q if self.mask.left is None else self.mask.q_blocks_left(k_start, OUTER_ROWS, self.block_q)[1]
      ranges = self.segments.ranges
      first = jnp.clip(kv_index * NUM_CONSUMERS, 0, ranges.shape[1] - NUM_CONSUMERS)
      lo, hi = segment_hull(ranges, batch, first, NUM_CONSUMERS, lo, hi)
      return self.tile_type(batch, kv_head, kv_index, k_start, lo, self.group * (hi - lo), self.num_q, q_end=hi)
    if self.mask.left is None:
      return self.tile_type(batch, kv_head, kv_index, k_start, lo, self.group * (jnp.int32(self.num_q) - lo),
                            self.num_q)
    # The tile's last key bounds its last query; hi >= lo (mask.Mask.q_blocks).
    _, hi = self.mask.q_blocks_left(k_start, OUTER_ROWS, self.block_q)
    return self.tile_type(batch, kv_head, kv_index, k_start, lo, self.group * (hi - lo), self.num_q, q_end=hi)

  @jax.named_scope("load")
  def load_q_block(self, tile: KVTile, ring_base, step) -> None:
    """The producer's TMA copies of the tile's `step` into ring step
    ring_base + step: Q, dO, lse and delta of Q block q_block(step %
    visits) of query head step // visits of the group."""
    head = tile.kv_head * self.group + lax.div(step, tile.visits)
    q0 = tile.q_block(lax.rem(step, tile.visits)) * self.block_q
    x, s = self.operands, self.smem
    copy_q_block((x.q, x.lse, x.do, x.delta), (s.q, s.lse, s.do, s.delta),
                 (s.q_ready, s.lse_ready, s.do_ready, s.delta_ready), (s.q_consumed, s.do_consumed),
                 ring_step=ring_base + step, stages=self.stages, rows=(tile.batch, pl.ds(q0, self.block_q), head),
                 vec=(tile.batch, head, pl.ds(q0, self.block_q)))

  def observe(self, end_step) -> None:
    # Q and lse are released on q_consumed, dO and delta on do_consumed.
    observe_last_releases(self.smem.q_consumed, self.smem.do_consumed, end_step=end_step, stages=self.stages)

  def _kv_rows(self, tile: KVTile):
    return tile.batch, pl.ds(tile.k_start + self.wg * WGMMA_M, WGMMA_M), tile.kv_head

  def load_kv(self, tile: KVTile, buffer) -> None:
    """Starts the copies of this consumer's K and V rows of `tile`."""
    kv_rows = self._kv_rows(tile)
    ready = self.smem.kv_ready.at[buffer * NUM_CONSUMERS + self.wg]
    plgpu.copy_gmem_to_smem(self.operands.k.at[kv_rows], self.smem.k.at[buffer, self.wg], ready)
    plgpu.copy_gmem_to_smem(self.operands.v.at[kv_rows], self.smem.v.at[buffer, self.wg], ready)

  def wait_kv(self, tile: KVTile, buffer):
    """(first key row, K tile, V tile) of this consumer's rows of `tile`,
    once loaded into `buffer`."""
    k_start = tile.k_start + self.wg * WGMMA_M
    k_tile, v_tile = self.smem.k.at[buffer, self.wg], self.smem.v.at[buffer, self.wg]
    with jax.named_scope("wait_rows"):
      plgpu.barrier_wait(self.smem.kv_ready.at[buffer * NUM_CONSUMERS + self.wg])
    return k_start, k_tile, v_tile

  def q_blocks(self, k_start):
    """(lo, full_lo, full_hi, hi): no query of Q blocks outside [lo, hi)
    sees a key of this consumer's rows from k_start, some of blocks [lo,
    full_lo) (the band's right edge: the causal diagonal) and [full_hi, hi)
    (its left edge) do, and every query of the blocks in [full_lo, full_hi)
    sees all. full_hi and hi are num_q, an int, without a left edge."""
    lo, full_lo = self.mask.q_blocks_right(k_start, WGMMA_M, self.block_q)
    if self.mask.left is None:
      return lo, full_lo, self.num_q, self.num_q
    return self.mask.q_blocks(k_start, WGMMA_M, self.block_q)

  def q_range(self, tile: KVTile, k_start):
    """`q_blocks` of this consumer's rows, under the segment ids too where
    there are some (clamped into the tile's Q blocks)."""
    band = self.q_blocks(k_start)
    if self.segments is None:
      return band
    group = lax.div(k_start, jnp.int32(WGMMA_M))
    return segment_range(band, self.segments.ranges, tile.batch, group, tile.lo, tile.end)

  def _load_vector(self, smem, ready, slot):
    plgpu.barrier_wait(ready.at[slot])
    return plgpu.load(smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))  # one value per query column

  def load_lse(self, slot):
    return self._load_vector(self.smem.lse, self.smem.lse_ready, slot)

  def load_delta(self, slot):
    return self._load_vector(self.smem.delta, self.smem.delta_ready, slot)

  def probs_t(self, s_t, k_start, qb, slot, *, masked: bool, lse=None, slope=None, batch=None):
    """(P^T [keys, queries], the softcap's derivative or None) from S^T and
    the lse of Q block qb in `slot` (loaded here unless given); slope: the
    query head's ALiBi slope (`Scores.slope`); batch: the tile's, read with
    segment ids."""
    lse = (self.load_lse(slot) if lse is None else lse) * LOG2_E
    same_segment = None
    if self.segments is not None:

      def same_segment():
        ids = self.segments
        kv_ids = load_ids(ids.kv.at[batch, pl.ds(k_start, WGMMA_M)], layout=plgpu.Layout.WGMMA.reduce(1))
        q_ids = load_ids(ids.q.at[batch, pl.ds(qb * self.block_q, self.block_q)], layout=plgpu.Layout.WGMMA.reduce(0))
        return same_ids(kv_ids, q_ids, s_t.shape)

    tile = ScoreTile(s_t.shape, k_start, qb * self.block_q, transposed=True)
    return recomputed_probs(s_t, lse, scores=self.scores, mask=self.mask, tile=tile, slope=slope,
                            masked=masked, lse_axis=1, same_segment=same_segment)

  def grad_scores_t(self, p_t, dp_t, slot, *, delta=None, dcap_t=None):
    """dS^T = P^T * (dP^T - delta), delta of the Q block in `slot` (loaded
    here unless given), times the softcap's derivative where there is one."""
    delta = self.load_delta(slot) if delta is None else delta
    return grad_scores(p_t, dp_t, delta, dcap_t, delta_axis=1)

  def p_and_ds_t(self, k_a, v_a, k_start, qb, slot, *, masked: bool, slope=None, batch=None):
    """(P^T, dS^T in the inputs' dtype, Q tile, dO tile) of Q block qb in
    `slot`, once loaded: S^T = K Q^T and dP^T = V dO^T in one wgmma group
    (k_a, v_a: this consumer's K and V, in shared memory or registers), then
    the element-wise work. With early_vectors lse and delta load from shared
    memory while the tensor cores work, so that their latency is off the
    softmax's path."""
    s = self.smem
    # (Named scopes: the regions of Mosaic GPU's profiler, where it is on.)
    with jax.named_scope("wait_q"):
      plgpu.barrier_wait(s.q_ready.at[slot])
      plgpu.barrier_wait(s.do_ready.at[slot])
    q_tile, do_tile = s.q.at[slot], s.do.at[slot]

    def scores(s_ref, dp_ref):
      plgpu.wgmma(s_ref, k_a, q_tile.transpose((1, 0)))
      plgpu.wgmma(dp_ref, v_a, do_tile.transpose((1, 0)))
      vectors = (self.load_lse(slot), self.load_delta(slot)) if self.early_vectors else (None, None)
      return s_ref[...], dp_ref[...], vectors  # waits for both products

    score_acc = plgpu.ACC((WGMMA_M, self.block_q), jnp.float32)
    with jax.named_scope("scores"):
      s_t, dp_t, (lse, delta) = pl.run_scoped(scores, score_acc, score_acc)  # [keys, queries]
    with jax.named_scope("softmax"):
      p_t, dcap_t = self.probs_t(s_t, k_start, qb, slot, masked=masked, lse=lse, slope=slope, batch=batch)
      ds_t = self.grad_scores_t(p_t, dp_t, slot, delta=delta, dcap_t=dcap_t).astype(self.dtype)
    return p_t, ds_t, q_tile, do_tile

  @jax.named_scope("grads")
  def add_grads(self, dk, dv, p_t, ds_t, q_tile, do_tile, *, also=None):
    """(dK + dS^T Q, dV + P^T dO): one wgmma group, waited for. also:
    (acc, issue), compiled only: issue(acc_ref) adds one more product onto
    acc in the same group, and its result comes third."""
    if self.interpret:
      stage = self.staging.at[self.wg]
      stage[...] = p_t.astype(self.dtype)
      plgpu.commit_smem()

      def dv_fresh(acc_ref):
        plgpu.wgmma(acc_ref, stage, do_tile)
        return acc_ref[...]

      dv = dv + pl.run_scoped(dv_fresh, plgpu.ACC(dv.shape, jnp.float32))
      stage[...] = ds_t  # the dV product above is complete
      plgpu.commit_smem()

      def dk_fresh(acc_ref):
        plgpu.wgmma(acc_ref, stage, q_tile)
        return acc_ref[...]

      return dk + pl.run_scoped(dk_fresh, plgpu.ACC(dk.shape, jnp.float32)), dv

    def grads(refs):
      dv_ref, dk_ref, *more = refs
      plgpu.wgmma(dv_ref, p_t.astype(self.dtype), do_tile)
      plgpu.wgmma(dk_ref, ds_t, q_tile)
      if also is not None:
        also[1](*more)

    accs = (dv, dk) if also is None else (dv, dk, also[0])
    dv, dk, *more = pl.run_state(grads)(tuple(plgpu.ACC.init(acc) for acc in accs))  # one wait
    return dk, dv, *more

  def release_q_block(self, slot) -> None:
    # Neither Q, dO, lse nor delta of this slot is read any more.
    plgpu.barrier_arrive(self.smem.do_consumed.at[slot])
    plgpu.barrier_arrive(self.smem.q_consumed.at[slot])

  def zero_padded_keys(self, k_start, dk, dv):
    return zero_padded_keys(self.mask, self.operands.k.shape[1], k_start, dk, dv)

  def store_gradients(self, tile: KVTile, buffer, result) -> None:
    """Scales dK and starts the TMA stores of dK and dV, staged in the K and
    V tiles (every wgmma reading them has completed)."""
    dk, dv = result
    k_tile, v_tile = self.smem.k.at[buffer, self.wg], self.smem.v.at[buffer, self.wg]
    kv_rows = self._kv_rows(tile)
    k_tile[...] = (dk * self.scores.softmax_scale).astype(self.dtype)
    v_tile[...] = dv.astype(self.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_tile, self.dk_ref.at[kv_rows])
    plgpu.copy_smem_to_gmem(v_tile, self.dv_ref.at[kv_rows])
