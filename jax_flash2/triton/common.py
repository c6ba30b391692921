"""What the Triton-lowering kernels share: tile loads and stores, BlockSpecs,
the optional inputs' specs and refs, score modifiers, and the split of a
block loop into masked and unmasked stretches.

Which pairs are visible and which blocks a program visits come from
jax_flash2.mask; these helpers apply them inside the kernels.
"""

from __future__ import annotations

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

from jax_flash2 import dropout, mask as mask_lib
from jax_flash2.problem import Operands, Problem

# Scores are kept in the log2 domain inside the kernels: exp2 is a single
# instruction (ex2.approx) where exp is a multiply plus ex2.
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def precision(problem: Problem) -> lax.Precision | None:
  """float32 inputs get true float32 dots, not Triton's default tf32."""
  return lax.Precision.HIGHEST if jnp.dtype(problem.dtype) == jnp.float32 else None


def head_mask(problem: Problem) -> jax.Array | None:
  """[head_dim_padded] bool, or None when no padding columns exist."""
  if problem.head_dim == problem.head_dim_padded:
    return None
  return jnp.arange(problem.head_dim_padded, dtype=jnp.int32) < problem.head_dim


def has_tile_flags(problem: Problem) -> bool:
  """Whether per-tile flags (from the dense mask, and the segment ids'
  ranges if there are any) say which tiles can be skipped; then every
  visited tile takes the element mask. A dense mask need not hide a
  contiguous run of tiles, so it cannot be turned into loop bounds."""
  return problem.mask.dense


def has_segment_bounds(problem: Problem) -> bool:
  """Whether segment ids alone narrow the loops, through per-block bounds
  (mask.segment_block_ranges) instead of per-tile flags and conds."""
  return problem.mask.segments and not problem.mask.dense


def dot(a: jax.Array, b: jax.Array, problem: Problem, *, trans_a=False, trans_b=False) -> jax.Array:
  """a @ b with float32 accumulation; trans_* contract over the other axis."""
  contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
  return lax.dot_general(
      a, b, (contract, ((), ())), precision=precision(problem), preferred_element_type=jnp.float32
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
    distance = jnp.abs(q_idx + problem.mask.offset - k_idx).astype(jnp.float32)
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
  """Which scores of a tile take part, for broadcastable query/key indices
  (q_idx[:, None], k_idx[None, :] for a [q, k] tile, or the transposes):
  the band and both sequence ends. Used only on tiles that cross an edge of
  the band or a ragged end; every other tile is known to be visible whole."""
  return problem.mask.visible(q_idx, k_idx)


def _rows(start, block: int, seq: int):
  """The rows of the block at `start` that exist: all `block`, or (traced)
  fewer in a ragged last block, so that its band bounds follow its last real row."""
  return jnp.minimum(seq - start, block) if seq % block else block


def kv_block_range(problem: Problem, q_start, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) for the K/V-block loop of a Q-outer program
  (mask.Mask.kv_blocks): blocks outside [lo, hi) are skipped, those in
  [full_lo, full_hi) need no element mask."""
  rows = _rows(q_start, block_q, problem.seq_q)
  return problem.mask.kv_blocks(q_start, rows, block_k, mask_lib.LAX)


def q_block_range(problem: Problem, k_start, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) for the Q-block loop of a K/V-outer program
  (mask.Mask.q_blocks), with a ragged last K/V block never in the full
  stretch: its keys past seq_k must be masked against every Q block."""
  rows = _rows(k_start, block_k, problem.seq_k)
  lo, full_lo, full_hi, hi = problem.mask.q_blocks(k_start, rows, block_q, mask_lib.LAX)
  if problem.seq_k % block_k:
    # Written as integer arithmetic (missing > 0 only for the last block): a
    # jnp.where on these scalar bounds crashed the Triton lowering ('i1' * 'i64').
    num_blocks = pl.cdiv(problem.seq_q, block_q)
    missing = block_k - jnp.minimum(problem.seq_k - k_start, block_k)
    full_lo = jnp.minimum(full_lo + missing * num_blocks, hi)
    full_hi = jnp.maximum(full_hi, full_lo)
  return lo, full_lo, full_hi, hi


def within_segments(opt: OptionalRefs, outer_block, bounds: tuple) -> tuple:
  """A program's band bounds (lo, full_lo, full_hi, hi), from
  `kv_block_range` or `q_block_range`, narrowed to its outer block's
  segment bounds (mask.segment_block_ranges); unchanged without those.
  Interior blocks of a segment then run without the element mask or a cond."""
  if opt.segment_bounds is None:
    return bounds
  segment = tuple(opt.segment_bounds[outer_block, j] for j in range(4))
  return mask_lib.intersect(bounds, segment, mask_lib.LAX)


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


def segment_ranges(operands: Operands) -> mask_lib.SegmentRanges | None:
  """The per-block segment-id ranges of a call's ids, None without ids; one
  serves every kernel of a pass (they often tile a side alike)."""
  if operands.q_segment_ids is None:
    return None
  return mask_lib.SegmentRanges(operands.q_segment_ids, operands.kv_segment_ids)


def with_optional_inputs(
    in_specs: list,
    args: list,
    operands: Operands,
    block_q: int,
    block_k: int,
    heads_per_program: int = 1,
    kv_outer: bool = False,
    ranges: mask_lib.SegmentRanges | None = None,
) -> tuple[list, list]:
  """Appends the optional inputs a call has, in the order `split_refs`
  takes them apart: the dense mask and its tile flags (for these tiles), or
  else the segment bounds; the query and key segment ids, the ALiBi slopes,
  the dropout seed, the bias. kv_outer: the programs own K/V blocks and loop
  over Q blocks (the dK/dV kernel), which the segment bounds follow. ranges:
  the segment ranges shared by a pass's kernels (derived here if None)."""
  in_specs, args = list(in_specs), list(args)
  mask, alibi_slopes, seed, bias = operands.mask, operands.alibi_slopes, operands.dropout_seed, operands.bias
  segments = None if operands.q_segment_ids is None else (operands.q_segment_ids, operands.kv_segment_ids)
  if ranges is None:
    ranges = segment_ranges(operands)
  if mask is not None:
    seq_q, seq_k = mask.shape[2:]
    in_specs.append(_slab_spec(mask, (round_up(seq_q, block_q), round_up(seq_k, block_k)), heads_per_program))
    args.append(mask)
    flags = mask_lib.block_flags(mask, ranges, block_q, block_k)
    in_specs.append(_slab_spec(flags, flags.shape[2:], heads_per_program))
    args.append(flags)
  elif segments is not None:
    q_ranges, kv_ranges = ranges.queries(block_q), ranges.keys(block_k)
    bounds = mask_lib.segment_block_ranges(*((kv_ranges, q_ranges) if kv_outer else (q_ranges, kv_ranges)))
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
  mask = take(problem.mask.dense)
  flags = take(has_tile_flags(problem))
  segment_bounds = take(has_segment_bounds(problem))
  q_segments, kv_segments = take(problem.mask.segments), take(problem.mask.segments)
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
  those of the kernel's own operands (a shard's, under sharding), batch
  taken modulo problem.dropout_batch where vmap folded a mapped axis in."""
  if problem.dropout_broadcast:
    return jnp.int32(0)
  if problem.dropout_batch is not None:
    batch_index = lax.rem(batch_index, jnp.int32(problem.dropout_batch))
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


def softmax_state(rows: int, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The online softmax's starting (acc, m_i, l_i) for `rows` rows of width d:
  nothing accumulated, running max -inf, running sum 0."""
  return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


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
