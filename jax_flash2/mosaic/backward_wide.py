"""FlashAttention-2 backward at head_dim 256 for Hopper (sm_90a) in Pallas's Mosaic GPU backend.

The kernels of backward.py give each consumer warpgroup 64 outer rows and keep
that warpgroup's gradients in registers: dK and dV (dkv) or dQ (dq) of
64 x head_dim in float32. At head_dim 256 that is 256 registers per thread
for dK + dV, more than a thread has, and two 64-row outer tiles with a ring
of 64 x 256 Q/dO (or K/V) slots do not fit in 227 KiB of shared memory.

So here one CTA owns 64 outer rows, and its two consumer warpgroups split
the work the other way (as FlashAttention-3 does at large head dims): by
columns of the score tile for the element-wise part, by halves of head_dim
for the gradients. `dkv` (K/V-outer, 64 key rows; Q blocks of 64 rows
streamed), per Q block, consumer c in {0, 1}:

  S^T_c  = K Q_c^T,  dP^T_c = V dO_c^T     Q_c, dO_c: query rows c*32..c*32+31;
                                           [64 keys x 32 queries], N = 32,
                                           contraction over all of head_dim
  P^T_c  = exp2(S^T_c * scale*log2e - lse_c*log2e)
  dS^T_c = P^T_c * (dP^T_c - delta_c)
  -> columns c of a shared [64 keys x 64 queries] P^T and dS^T; both
     consumers sync
  dV[:, half c] += P^T dO[:, half c],  dK[:, half c] += dS^T Q[:, half c]
                                           (A from shared memory, N = 128)

so each thread holds 64 + 64 accumulator registers, as at head_dim 128, and
the two 32-column score tiles 16 + 16. `dq` (Q-outer, 64 query rows; K/V
blocks of 64 rows streamed) is the same with the roles swapped: S_c = Q K_c^T,
dP_c = dO V_c^T for key columns c, dS_c into a shared [64 x 64] dS, then
dQ[:, half c] += dS K[:, half c]. dK is scaled by softmax_scale at the end
(dQ likewise), and each consumer stores its half of the columns.

The shared P^T / dS^T (dS) tile is single-buffered: double-buffered it does
not fit beside dkv's ring of two slots. Two barriers protect it: `staged`
(both consumers wrote their columns: the products may read it) and `free`
(both consumers' products of the previous step completed: it may be written
again). Both consumers take exactly the same steps (they share the outer
rows, so the same blocks are visible to both), so no slot needs draining.

Every tile in shared memory has a 32-byte swizzle (`_tiles`): the score
products' B operand, N = 32, allows no wider one, and a wgmma's A takes its
B's.

The outer tiles (K, V in dkv; Q, dO in dq) are kept as two column halves,
[2, 64, 128]: each consumer loads its half and, at the end, stages its half
of the gradient in it for one TMA store of a whole, contiguous tile; the
score products contract over both halves (two wgmmas into one accumulator).
The ring's tiles are whole [64, 256]; the products take row (32-query or
32-key) and column (128) slices of them.

The contract is backward.py's: causal attention and sliding windows
bottom-right aligned (invisible blocks skipped, the blocks crossing an edge
of the band masked, P = 0 after the exponential so that rows that see no
key give 0 and not NaN), softcap and ALiBi (common.Scores), ragged
lengths padded once to multiples of OUTER_ROWS (common.pad_backward; the
grids cover the 64-row blocks that hold a real row), grouped-query attention
(dK, dV summed over the query heads of a kv head), bf16 and fp16, float32
lse and delta. Two ring slots (a third does not fit). With dq_persistent /
dkv_persistent a kernel runs as persistent CTAs, one per SM, the ring
running on across tiles; there is no room for a second set of outer tiles,
so a tile's rows load after the previous tile's stores have read theirs
(run_tiles' buffers=1).

In Mosaic's interpreter (interpret=True; jax 0.11.2 runs wgmma only into
fresh accumulators) the gradient products go into zeros and are added
(`_accumulate`); every operand is in shared memory already. Its race
detector does not see wgmma's shared-memory reads, so it cannot check the
shared tile's protection.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2 import defaults
from jax_flash2.config import MosaicBackwardConfig
from jax_flash2.mask import Mask
from jax_flash2.mosaic.common import (
    BWD_SMEM_RESERVE, LOG2_E, NUM_CONSUMERS, WGMMA_M, WIDE_HEAD_DIMS, PersistentSchedule, QTile, ScoreTile, Scores,
    backward_kernels, check_backward_smem, check_operands, copy_q_block, interpret_params_of, kv_range,
    kv_ring_producer, load_ids, grad_scores, observe_last_releases, optional_input, optional_ref, outer_grid,
    recomputed_probs, run_tiles, same_ids, segment_inputs, segment_range, segment_refs, specialized_kernel, swizzled,
    triangular, zero_padded_keys,
)

# Outer rows per CTA and rows per streamed block: one wgmma M.
ROWS = WGMMA_M
# Score columns per consumer (queries in dkv, keys in dq): its wgmma N.
COLS = ROWS // NUM_CONSUMERS


HEAD_DIMS = WIDE_HEAD_DIMS


def dkv_smem_bytes(config: MosaicBackwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of `dkv`: K and V (64 rows), the ring of Q, dO, lse and
  delta, the shared P^T and dS^T."""
  item = jnp.dtype(dtype).itemsize
  outer = 2 * ROWS * head_dim * item
  ring = config.stages * (2 * ROWS * head_dim * item + 2 * ROWS * 4)
  return outer + ring + 2 * ROWS * ROWS * item + BWD_SMEM_RESERVE


def dq_smem_bytes(config: MosaicBackwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of `dq`: Q, dO, lse and delta (64 rows), the ring of K and
  V, the shared dS."""
  item = jnp.dtype(dtype).itemsize
  outer = 2 * ROWS * head_dim * item + 2 * ROWS * 4
  ring = config.stages * 2 * ROWS * head_dim * item
  return outer + ring + ROWS * ROWS * item + BWD_SMEM_RESERVE


def check_config(config: MosaicBackwardConfig, head_dim: int, dtype, *, kernels=("dkv", "dq")) -> None:
  """Raises ValueError if `kernels` ("dkv", "dq") cannot run `config` at
  head_dim and dtype: the wide kernels take 64-row blocks, none of the
  options of the kernels at head_dim 64 and 128, and buffers within a
  Hopper CTA's shared memory."""
  if (config.block_q, config.block_kv) != (ROWS, ROWS):
    raise ValueError(f"head_dim {head_dim} takes block_q = block_kv = {ROWS}, got {config}")
  options = ("dq_softmax_overlap", "fused_dq", "early_vectors")
  if any(getattr(config, name) for name in options):
    raise ValueError(f"head_dim {head_dim} takes none of {options}, got {config}")
  check_backward_smem(config, head_dim, dtype, {"dkv": dkv_smem_bytes, "dq": dq_smem_bytes}, kernels)


def _accumulate(accs: tuple[jax.Array, ...], products, *, interpret: bool) -> tuple[jax.Array, ...]:
  """accs + what `products(refs)` issues into accumulators that hold accs:
  one wgmma group, waited for. In Mosaic's interpreter the products go into
  fresh accumulators and are added."""
  if interpret:
    def fresh(*refs):
      products(refs)
      return tuple(ref[...] for ref in refs)

    new = pl.run_scoped(fresh, *(plgpu.ACC(acc.shape, jnp.float32) for acc in accs))
    return tuple(acc + x for acc, x in zip(accs, new))
  return pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc in accs))


class _SharedTile:
  """The [64 x 64] tile (P^T and dS^T in dkv, dS in dq) that both consumers
  write their 32 columns of and both read whole, and its two barriers: at
  every step a consumer `write`s (once both consumers' products of the
  previous step completed: `free`; then it waits until both have written:
  `staged`), issues its products, and `release`s; `observe_last` in its
  epilogue waits for the last release, so that every phase of `free` is
  waited for (Mosaic's interpreter checks it)."""

  def __init__(self, staged, free, wg):
    self.staged, self.free, self.wg = staged, free, wg

  def write(self, step, pieces):
    """Stores this consumer's columns of each (tile, value) in `pieces`."""
    @pl.when(step > 0)
    @jax.named_scope("wait_free")
    def _():
      plgpu.barrier_wait(self.free)

    for tile, value in pieces:
      tile.at[:, pl.ds(self.wg * COLS, COLS)][...] = value
    plgpu.commit_smem()  # visible to the other consumer's wgmma (async proxy)
    plgpu.barrier_arrive(self.staged)
    with jax.named_scope("wait_staged"):
      plgpu.barrier_wait(self.staged)

  def release(self):
    plgpu.barrier_arrive(self.free)

  def observe_last(self, end_step):
    pl.when(end_step > 0)(lambda: plgpu.barrier_wait(self.free))


def _shared_tile_scratch(tiles: int, dtype) -> list:
  return [plgpu.SMEM((ROWS, ROWS), dtype, transforms=_tiles(dtype)) for _ in range(tiles)] + [
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # staged
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # free
  ]


def _tiles(dtype):
  """The layout of every tile here. The score products have N = 32 (a
  consumer's 32 query or key rows of a streamed tile as B), which Mosaic
  splits into two groups of 16 columns, so B's swizzle spans at most 16
  elements (32 bytes); A takes B's swizzle (one per wgmma), and every tile is
  an A or B of such a product or of one with the tiles it meets there."""
  return swizzled(COLS // 2, dtype)


def _outer_pair(head_dim: int, dtype) -> list:
  """The shared memory of the two outer tiles (K and V, or Q and dO), each
  as column halves, [2, 64, D/2]: a consumer loads one half."""
  return [plgpu.SMEM((NUM_CONSUMERS, ROWS, _halves(head_dim)[0]), dtype, transforms=_tiles(dtype)) for _ in range(2)]


def _ring_pair(stages: int, head_dim: int, dtype) -> list:
  """The ring's slots of the two streamed tiles (Q and dO, or K and V),
  [stages, 64, D] each."""
  return [plgpu.SMEM((stages, ROWS, head_dim), dtype, transforms=_tiles(dtype)) for _ in range(2)]


def _score_products(outer, inner, columns, halves):
  """(S, dP) of this consumer's 32 score columns, float32 [64, 32]: outer =
  (K, V) halves in dkv or (Q, dO) halves in dq, [2, 64, D/2]; inner = the
  streamed (Q, dO) or (K, V) tiles, [64, D], whose rows `columns` are this
  consumer's. Both products contract over both halves of head_dim; one wgmma
  group, waited for."""

  def products(s_ref, dp_ref):
    for acc, outer_ref, inner_ref in ((s_ref, outer[0], inner[0]), (dp_ref, outer[1], inner[1])):
      for h, cols in enumerate(halves):
        plgpu.wgmma(acc, outer_ref.at[h], inner_ref.at[columns, cols].transpose((1, 0)))
    return s_ref[...], dp_ref[...]

  acc = plgpu.ACC((ROWS, COLS), jnp.float32)
  return pl.run_scoped(products, acc, acc)


def _halves(head_dim: int):
  """The column slices of head_dim the two consumers own."""
  half = head_dim // NUM_CONSUMERS
  return half, [pl.ds(h * half, half) for h in range(NUM_CONSUMERS)]


# ---------------------------------------------------------------- dK, dV


@dataclasses.dataclass(frozen=True)
class _KVTile:
  """64 key rows of one (batch, kv head): a CTA's work. It visits Q blocks
  [lo, hi) of every query head of the group, [lo, full_lo) masked (the
  band's right edge: the diagonal) and [full_hi, hi) masked (its left edge).
  int32 scalars; full_hi and hi are num_q, an int, without a left edge."""

  batch: jax.Array
  kv_head: jax.Array
  k_start: jax.Array
  lo: jax.Array
  full_lo: jax.Array
  visits: jax.Array  # Q blocks per query head
  num_steps: jax.Array  # ring steps: group * visits
  full_hi: Any
  hi: Any


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, mask: Mask, group: int,
    schedule: PersistentSchedule | None, scores: Scores, stages: int, interpret: bool,
):
  # q_ref, do_ref: [batch, seq_q', heads, D]; k_ref, v_ref, dk_ref, dv_ref:
  # [batch, seq_k', kv_heads, D]; lse_ref, delta_ref: [batch, heads, seq_q']
  # (seq' padded to multiples of OUTER_ROWS). k_smem, v_smem: [2, 64, D/2]
  # (column halves; each consumer loads one and stages its half of dK, dV
  # in it); q_smem, do_smem: [stages, 64, D]; lse_smem, delta_smem:
  # [stages, 64]; p_smem, ds_smem: [64 keys, 64 queries], P^T and dS^T.
  # kv_ready: a barrier of 4 arrivals (both consumers' halves of K and V);
  # q_ready (Q, lse), do_ready (dO, delta): [stages], 2 arrivals (TMA);
  # q_consumed, do_consumed: [stages], 2 arrivals; staged, free: 2 arrivals.
  # slopes_ref (ALiBi only): float32 [batch or 1, heads].
  slopes_ref, refs = optional_ref(refs, scores.alibi)
  segments, refs = segment_refs(refs, mask.segments)
  (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready, q_consumed,
   do_consumed, p_smem, ds_smem, staged, free) = refs
  softmax_scale = scores.softmax_scale
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  half, halves = _halves(head_dim)
  wg = lax.axis_index("wg")
  num_q = pl.cdiv(mask.seq_q, ROWS)
  shared = _SharedTile(staged, free, wg)

  def tile_at(kv_index, kv_head, batch) -> _KVTile:
    k_start = kv_index * ROWS
    lo, full_lo = mask.q_blocks_right(k_start, ROWS, ROWS)
    if segments is not None:
      # The band's range under the ids' (clamped reads: a persistent CTA also
      # asks for the tile after its last).
      band = mask.q_blocks(k_start, ROWS, ROWS) if mask.left is not None else (lo, full_lo, num_q, num_q)
      ranges = segments.ranges
      b, group_index = jnp.minimum(batch, ranges.shape[0] - 1), jnp.clip(kv_index, 0, ranges.shape[1] - 1)
      lo, full_lo, full_hi, hi = segment_range(band, ranges, b, group_index, jnp.int32(0), jnp.int32(num_q))
      visits = hi - lo
      return _KVTile(batch, kv_head, k_start, lo, full_lo, visits, group * visits, full_hi, hi)
    if mask.left is None:
      visits = jnp.int32(num_q) - lo
      return _KVTile(batch, kv_head, k_start, lo, full_lo, visits, group * visits, num_q, num_q)
    lo, full_lo, full_hi, hi = mask.q_blocks(k_start, ROWS, ROWS)
    visits = hi - lo
    return _KVTile(batch, kv_head, k_start, lo, full_lo, visits, group * visits, full_hi, hi)

  @jax.named_scope("load")
  def load_step(tile: _KVTile, ring_base, step):
    """The producer's TMA copies of the tile's `step` into ring step
    ring_base + step: Q block lo + step % visits of query head step //
    visits of the group."""
    head = tile.kv_head * group + lax.div(step, tile.visits)
    q0 = (tile.lo + lax.rem(step, tile.visits)) * ROWS
    # lse completes Q's barrier, delta dO's.
    copy_q_block((q_ref, lse_ref, do_ref, delta_ref), (q_smem, lse_smem, do_smem, delta_smem),
                  (q_ready, q_ready, do_ready, do_ready), (q_consumed, do_consumed), ring_step=ring_base + step,
                  stages=stages, rows=(tile.batch, pl.ds(q0, ROWS), head), vec=(tile.batch, head, pl.ds(q0, ROWS)))

  def produce(tile: _KVTile, ring_base):
    pl.loop(0, tile.num_steps)(lambda step: load_step(tile, ring_base, step))

  def observe(end_step):
    observe_last_releases(q_consumed, do_consumed, end_step=end_step, stages=stages)

  def load_kv(tile: _KVTile, buffer):
    """This consumer's column half of K and V (a persistent CTA's next tile's
    once the last step's `staged` has passed: neither consumer's score
    products read K or V any more, and the stores have read this half)."""
    del buffer  # one set (run_tiles' buffers=1)
    rows = (tile.batch, pl.ds(tile.k_start, ROWS), tile.kv_head, pl.ds(wg * half, half))
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[wg], kv_ready)
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[wg], kv_ready)

  def gradients(tile: _KVTile, buffer, ring_base):
    """This consumer's column half of (dK unscaled, dV), [64, D/2]."""
    del buffer
    plgpu.barrier_wait(kv_ready)  # both halves: S^T and dP^T contract over all of head_dim
    queries = pl.ds(wg * COLS, COLS)  # this consumer's query columns of a Q block
    vec_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per query column
    my_half = pl.ds(wg * half, half)  # this consumer's columns of dK, dV

    def update(step, qb, dk, dv, *, slope, masked: bool):
      slot = lax.rem(ring_base + step, jnp.int32(stages))
      q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
      # (Named scopes: the regions of Mosaic GPU's profiler, where it is on.)
      with jax.named_scope("wait_q"):
        plgpu.barrier_wait(q_ready.at[slot])
        plgpu.barrier_wait(do_ready.at[slot])

      with jax.named_scope("scores"):  # S^T_c = K Q_c^T, dP^T_c = V dO_c^T: [keys, this consumer's queries]
        s_t, dp_t = _score_products((k_smem, v_smem), (q_tile, do_tile), queries, halves)
      with jax.named_scope("softmax"):
        lse = plgpu.load(lse_smem.at[slot, queries], layout=vec_layout) * LOG2_E

        def same_segment():
          kv_ids = load_ids(segments.kv.at[tile.batch, pl.ds(tile.k_start, ROWS)], layout=plgpu.Layout.WGMMA.reduce(1))
          q_ids = load_ids(segments.q.at[tile.batch, pl.ds(qb * ROWS + wg * COLS, COLS)], layout=vec_layout)
          return same_ids(kv_ids, q_ids, s_t.shape)

        p_t, dcap_t = recomputed_probs(s_t, lse, scores=scores, mask=mask, slope=slope,
                                       tile=ScoreTile(s_t.shape, tile.k_start, qb * ROWS + wg * COLS, transposed=True),
                                       masked=masked, lse_axis=1,
                                       same_segment=None if segments is None else same_segment)
        delta = plgpu.load(delta_smem.at[slot, queries], layout=vec_layout)
        ds_t = grad_scores(p_t, dp_t, delta, dcap_t, delta_axis=1)
      with jax.named_scope("stage"):
        shared.write(ring_base + step, ((p_smem, p_t.astype(dtype)), (ds_smem, ds_t.astype(dtype))))

      def grads(refs):
        # dV[:, half c] += P^T dO[:, half c], dK[:, half c] += dS^T Q[:, half c]:
        # all 64 queries of the block, from both consumers' columns.
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p_smem, do_tile.at[:, my_half])
        plgpu.wgmma(dk_ref, ds_smem, q_tile.at[:, my_half])

      with jax.named_scope("grads"):
        dv, dk = _accumulate((dv, dk), grads, interpret=interpret)
      shared.release()
      # Neither Q, dO, lse nor delta of this slot is read any more.
      plgpu.barrier_arrive(do_consumed.at[slot])
      plgpu.barrier_arrive(q_consumed.at[slot])
      return dk, dv

    def one_head(g, carry):
      # Query head kv_head * group + g: its Q blocks, in the producer's order.
      slope = scores.slope(slopes_ref, tile.batch, tile.kv_head * group + g)

      def block(qb, carry, *, masked: bool):
        return update(g * tile.visits + qb - tile.lo, qb, *carry, slope=slope, masked=masked)

      # Segment ids bound the Q blocks on both sides, like a band's two edges.
      if mask.right is not None or mask.segments:
        carry = lax.fori_loop(tile.lo, tile.full_lo, functools.partial(block, masked=True), carry)
      full_hi = jnp.int32(num_q) if mask.left is None and not mask.segments else tile.full_hi
      carry = lax.fori_loop(tile.full_lo, full_hi, functools.partial(block, masked=False), carry)
      if mask.left is not None or mask.segments:
        carry = lax.fori_loop(tile.full_hi, tile.hi, functools.partial(block, masked=True), carry)
      return carry

    acc = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = one_head(jnp.int32(0), (acc, acc)) if group == 1 else lax.fori_loop(0, group, one_head, (acc, acc))
    return zero_padded_keys(mask, k_ref.shape[1], tile.k_start, dk, dv)

  def store_gradients(tile: _KVTile, buffer, result):
    """Scales dK and stores this consumer's halves of dK and dV, staged in its
    halves of K and V: every product reading those completed before the
    last step's `staged` (or there was none)."""
    del buffer
    dk, dv = result
    k_smem.at[wg][...] = (dk * softmax_scale).astype(dtype)
    v_smem.at[wg][...] = dv.astype(dtype)
    plgpu.commit_smem()
    rows = (tile.batch, pl.ds(tile.k_start, ROWS), tile.kv_head, pl.ds(wg * half, half))
    plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[rows])
    plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[rows])

  run_tiles(schedule, tile_at, wg=wg, axis="kv", produce=produce, observe=observe, load=load_kv,
            compute=gradients, store=store_gradients, epilogue=shared.observe_last, buffers=1)


def _dkv_call(q, k, v, do, lse, delta, *, mask: Mask, scores: Scores, slopes, config: MosaicBackwardConfig,
              interpret, segment_ids=None) -> tuple[jax.Array, jax.Array]:
  """The dK/dV kernel on operands padded by `pad_backward`; segment_ids: (q
  ids, kv ids) or None."""
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  interpret_params, interpret = interpret_params_of(interpret)
  dtype, stages = q.dtype, config.stages
  scratch = [
      *_outer_pair(head_dim, dtype),  # K, V
      *_ring_pair(stages, head_dim, dtype),  # Q, dO
      plgpu.SMEM((stages, ROWS), jnp.float32),  # lse
      plgpu.SMEM((stages, ROWS), jnp.float32),  # delta
      plgpu.Barrier(num_arrivals=2 * NUM_CONSUMERS),  # K and V halves ready
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # Q, lse ready
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # dO, delta ready
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # Q, lse consumed
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # dO, delta consumed
      *_shared_tile_scratch(2, dtype),  # P^T, dS^T; staged, free
  ]
  num_kv = pl.cdiv(mask.seq_k, ROWS)  # 64-row blocks holding a real key; the rest of the padding stays unwritten
  schedule, grid, grid_names = outer_grid(num_kv, kv_heads, batch, axis="kv", persistent=config.dkv_persistent,
                                          causal=triangular(mask), interpret=interpret)
  kernel = functools.partial(_dkv_kernel, mask=mask, group=heads // kv_heads, schedule=schedule,
                             scores=scores, stages=stages, interpret=interpret)
  out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  ids = () if segment_ids is None else segment_inputs(*segment_ids, padded_q=q.shape[1], padded_k=k.shape[1],
                                                      rows=ROWS, block=ROWS, groups=k.shape[1] // ROWS,
                                                      q_outer=False)
  return specialized_kernel(kernel, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                            interpret_params=interpret_params,
                            name="flash2_bwd_dkv_wide_mosaic")(q, k, v, do, lse, delta, *optional_input(slopes),
                                                               *ids)


# ---------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, mask: Mask, group: int, num_q_blocks: int,
    schedule: PersistentSchedule | None, scores: Scores, stages: int, interpret: bool,
):
  # Arrays in GMEM as in _dkv_kernel. q_smem, do_smem: [2, 64, D/2] (column
  # halves; each consumer loads one and stages its half of dQ in Q's);
  # lse_smem, delta_smem: [64]; k_smem, v_smem: [stages, 64, D]; ds_smem:
  # [64 queries, 64 keys]. q_ready: a barrier of 6 arrivals (both halves of
  # Q and dO, lse, delta); k_ready, v_ready: [stages] (TMA); k_consumed,
  # v_consumed: [stages], 2 arrivals; staged, free: 2 arrivals; rows_read: 2
  # arrivals (both consumers have passed the tile's q_ready and read its lse
  # and delta). slopes_ref (ALiBi only): float32 [batch or 1, heads].
  slopes_ref, refs = optional_ref(refs, scores.alibi)
  segments, refs = segment_refs(refs, mask.segments)
  (dq_ref, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_consumed, v_consumed,
   ds_smem, staged, free, rows_read) = refs
  softmax_scale = scores.softmax_scale
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  half, halves = _halves(head_dim)
  wg = lax.axis_index("wg")
  shared = _SharedTile(staged, free, wg)
  tile_at = functools.partial(QTile.at, num_q_blocks=num_q_blocks, block_q=ROWS, block_kv=ROWS, mask=mask)
  if segments is not None:
    # Both consumers share the tile's rows: one row group of ROWS a tile.
    tile_at = functools.partial(tile_at, consumers=1, segment_ranges=segments.ranges)

  def load_rows(tile: QTile, buffer):
    """This consumer's column half of Q and dO; the first one's also lse and
    delta (a persistent CTA's next tile's once the last step's `staged` has
    passed: no score product reads Q or dO any more, and both consumers read
    lse and delta at their tile's start)."""
    del buffer  # one set (run_tiles' buffers=1)
    rows = (tile.batch, pl.ds(tile.q_start, ROWS), tile.head, pl.ds(wg * half, half))
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_ready)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], q_ready)

    @pl.when(wg == 0)
    def _():
      vec = (tile.batch, tile.head, pl.ds(tile.q_start, ROWS))
      plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, q_ready)
      plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, q_ready)

  def gradient(tile: QTile, buffer, ring_base):
    """This consumer's column half of dQ (unscaled), [64, D/2]."""
    del buffer
    plgpu.barrier_wait(q_ready)
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per query row
    lse = plgpu.load(lse_smem, layout=row_layout) * LOG2_E
    delta = plgpu.load(delta_smem, layout=row_layout)
    # Neither consumer may load the next tile's rows before the other has
    # read this tile's: a tile whose queries see no key (causal, seq_q >
    # seq_k) has no step at which they meet otherwise.
    plgpu.barrier_arrive(rows_read)
    plgpu.barrier_wait(rows_read)
    # Both consumers share the rows, so the same K/V blocks: [lo, full_lo)
    # and [full_hi, hi) masked; lo = full_lo = 0 without a left edge.
    lo, full_lo, full_hi, hi = kv_range(mask, tile.q_start, ROWS, ROWS)
    if segments is not None:
      lo, full_lo, full_hi, hi = segment_range((lo, full_lo, full_hi, hi), segments.ranges, tile.batch,
                                               lax.div(tile.q_start, jnp.int32(ROWS)), tile.kv_lo, tile.kv_end)
      q_ids = load_ids(segments.q.at[tile.batch, pl.ds(tile.q_start, ROWS)], layout=row_layout)
    slope = scores.slope(slopes_ref, tile.batch, tile.head)
    keys = pl.ds(wg * COLS, COLS)  # this consumer's key columns of a K/V block
    my_half = pl.ds(wg * half, half)

    def step(kb, dq, *, masked: bool):
      slot = lax.rem(ring_base + tile.step_of(kb), jnp.int32(stages))
      k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])

      with jax.named_scope("scores"):  # S_c = Q K_c^T, dP_c = dO V_c^T: [queries, this consumer's keys]
        s, dp = _score_products((q_smem, do_smem), (k_tile, v_tile), keys, halves)
      plgpu.barrier_arrive(v_consumed.at[slot])  # V is no longer read
      with jax.named_scope("softmax"):

        def same_segment():
          kv_ids = load_ids(segments.kv.at[tile.batch, pl.ds(kb * ROWS + wg * COLS, COLS)],
                            layout=plgpu.Layout.WGMMA.reduce(0))
          return same_ids(q_ids, kv_ids, s.shape)

        p, dcap = recomputed_probs(s, lse, scores=scores, mask=mask, slope=slope,
                                   tile=ScoreTile(s.shape, tile.q_start, kb * ROWS + wg * COLS),
                                   masked=masked, lse_axis=0, same_segment=None if segments is None else same_segment)
        ds = grad_scores(p, dp, delta, dcap, delta_axis=0)
      with jax.named_scope("stage"):
        shared.write(ring_base + tile.step_of(kb), ((ds_smem, ds.astype(dtype)),))

      def dq_product(refs):
        # dQ[:, half c] += dS K[:, half c]: all 64 keys, both consumers' columns.
        (dq_ref,) = refs
        plgpu.wgmma(dq_ref, ds_smem, k_tile.at[:, my_half])

      with jax.named_scope("dq"):
        (dq,) = _accumulate((dq,), dq_product, interpret=interpret)
      shared.release()
      plgpu.barrier_arrive(k_consumed.at[slot])  # K is no longer read
      return dq

    dq = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)
    # Segment ids bound the K/V blocks on both sides, like a band's two edges.
    if mask.left is not None or mask.segments:
      dq = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), dq)
    if mask.right is not None or mask.segments or mask.seq_k % ROWS:  # a diagonal, ids, or padding
      dq = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), dq)
    return dq

  def store_dq(tile: QTile, buffer, dq):
    """Scales this consumer's half of dQ and stores it, staged in its half of
    Q: every product reading Q completed before the last step's `staged`."""
    del buffer
    q_smem.at[wg][...] = (dq * softmax_scale).astype(dtype)
    plgpu.commit_smem()
    rows = (tile.batch, pl.ds(tile.q_start, ROWS), tile.head, pl.ds(wg * half, half))
    plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])

  produce, observe = kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed,
                                      group=group, block_kv=ROWS, stages=stages)
  run_tiles(schedule, tile_at, wg=wg, axis="q", produce=produce, observe=observe, load=load_rows,
            compute=gradient, store=store_dq, epilogue=shared.observe_last, buffers=1)


def _dq_call(q, k, v, do, lse, delta, *, mask: Mask, scores: Scores, slopes, config: MosaicBackwardConfig,
             interpret, segment_ids=None) -> jax.Array:
  """The dQ kernel on operands padded by `pad_backward`; segment_ids: (q
  ids, kv ids) or None."""
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  interpret_params, interpret = interpret_params_of(interpret)
  dtype, stages = q.dtype, config.stages
  scratch = [
      *_outer_pair(head_dim, dtype),  # Q, dO
      plgpu.SMEM((ROWS,), jnp.float32),  # lse
      plgpu.SMEM((ROWS,), jnp.float32),  # delta
      *_ring_pair(stages, head_dim, dtype),  # K, V
      plgpu.Barrier(num_arrivals=2 * NUM_CONSUMERS + 2),  # Q, dO halves, lse, delta ready
      plgpu.Barrier(num_barriers=stages),  # K ready
      plgpu.Barrier(num_barriers=stages),  # V ready
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # K consumed
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # V consumed
      *_shared_tile_scratch(1, dtype),  # dS; staged, free
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # rows read
  ]
  num_q_blocks = pl.cdiv(mask.seq_q, ROWS)  # 64-row blocks holding a real query
  schedule, grid, grid_names = outer_grid(num_q_blocks, heads, batch, axis="q", persistent=config.dq_persistent,
                                          causal=triangular(mask), interpret=interpret)
  kernel = functools.partial(_dq_kernel, mask=mask, group=heads // kv_heads, num_q_blocks=num_q_blocks,
                             schedule=schedule, scores=scores, stages=stages, interpret=interpret)
  ids = () if segment_ids is None else segment_inputs(*segment_ids, padded_q=q.shape[1], padded_k=k.shape[1],
                                                      rows=ROWS, block=ROWS, groups=num_q_blocks, q_outer=True)
  return specialized_kernel(kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch=scratch, grid=grid,
                            grid_names=grid_names, interpret_params=interpret_params,
                            name="flash2_bwd_dq_wide_mosaic")(q, k, v, do, lse, delta, *optional_input(slopes),
                                                              *ids)


# ---------------------------------------------------------------- entry points


def dkv(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
        causal: bool = False, window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
        alibi_slopes: jax.Array | None = None, q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None, softmax_scale: float | None = None,
        config: MosaicBackwardConfig | None = None,
        interpret: bool | plgpu.InterpretGPUParams = False) -> tuple[jax.Array, jax.Array]:
  """dK and dV at head_dim 256; arguments and results as backward.dkv (q, do:
  [batch, seq_q, heads, 256]; k, v: [batch, seq_k, kv_heads, 256]; lse,
  delta: float32 [batch, heads, seq_q]); config: block_q = block_kv = 64,
  defaults to `defaults.mosaic_backward(256)`."""
  return _gradients(("dkv",), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def dq(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
       causal: bool = False, window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
       alibi_slopes: jax.Array | None = None, q_segment_ids: jax.Array | None = None,
       kv_segment_ids: jax.Array | None = None, softmax_scale: float | None = None,
       config: MosaicBackwardConfig | None = None, interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """dQ at head_dim 256, like q; arguments as `dkv`."""
  return _gradients(("dq",), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
             causal: bool = False, window_size: tuple[int | None, int | None] = (None, None),
             softcap: float | None = None, alibi_slopes: jax.Array | None = None,
             q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
             softmax_scale: float | None = None, config: MosaicBackwardConfig | None = None,
             interpret: bool | plgpu.InterpretGPUParams = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) at head_dim 256 on one padding of the operands; arguments
  as `dkv`."""
  return _gradients(("dkv", "dq"), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def _gradients(names, q, k, v, do, lse, delta, config, interpret, **band_and_scores):
  """The gradients of the kernels `names` ("dkv", "dq") on the checked
  operands; config None takes the measured default tiling."""
  check_operands("the wide Mosaic GPU backward", HEAD_DIMS, q, k, v, do, lse, delta)
  if config is None:
    config = defaults.mosaic_backward(q.shape[-1], segments=band_and_scores.get("q_segment_ids") is not None)
  check_config(config, q.shape[-1], q.dtype, kernels=names)
  kernels = {"dkv": _dkv_call, "dq": _dq_call}
  return backward_kernels({name: kernels[name] for name in names}, q, k, v, do, lse, delta, config=config,
                          interpret=interpret, **band_and_scores)
