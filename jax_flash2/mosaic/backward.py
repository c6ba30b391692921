"""FlashAttention-2 backward pass for Hopper (sm_90a) in two Mosaic GPU kernels.

Both take the forward's natural-log `lse` and `delta = rowsum(dO * O)`
(float32, [batch, heads, seq_q]); head_dim 64 and 128 (backward_fused.py
folds dQ into the dK/dV kernel; backward_wide.py serves head_dim 256).

`dkv` (K/V-outer; common.KVOuter). One CTA owns OUTER_ROWS = 128 key rows
of one (batch, kv head), 64 per consumer warpgroup, each keeping its K and V
tiles in shared memory and dK, dV in registers. The producer streams Q, dO,
lse and delta blocks of `block_q` rows through the ring, for every query
head of the kv head's group in turn (grouped-query attention sums dK and dV
in the accumulators). Per Q block: S^T = K Q^T and dP^T = V dO^T, P^T, dS^T
= P^T * (dP^T - delta), dV += P^T dO, dK += dS^T Q. A consumer whose first
visible Q block comes after its neighbour's drains those slots.

`dq` (Q-outer), the forward's structure: one CTA owns 128 query rows of one
(batch, head), 64 per consumer, with their Q, dO, lse and delta loaded once
(Q and dO into registers, the A operands of the score products); the
producer streams K and V blocks of `block_kv` rows:

  S = Q K^T, dP = dO V^T (one wgmma group), P = exp2(S * scale * log2(e) -
  lse * log2(e)), dS = P * (dP - delta), dQ += dS K (dS from registers)

and dQ *= softmax_scale at the end. With `dq_softmax_overlap` P is
computed while dP is still on the tensor cores. K is released after dQ's
product, V after dP's.

A band (causal attention, a sliding window) bounds the inner blocks as in
the forward: the dK/dV tile's producer loads the Q blocks its keys' band
touches (common.KVOuter.tile_at), the dQ tile's the K/V blocks
(common.q_tile_blocks); each consumer masks only the blocks crossing an
edge and drains the ones only its neighbour needs. A softcap or ALiBi
(common.Scores) changes the recomputed P, and the softcap's derivative
multiplies dS. These options take these two kernels at head_dim 64 too:
the fused kernel (backward_fused.py) serves full and causal attention
only.

Ragged lengths: `dkv`, `dq` and `backward` pad seq_q and seq_k to multiples
of OUTER_ROWS once (common.pad_backward) and slice the gradients back;
bounds and masks use the real lengths. Keys past seq_k: under causal
attention the diagonal's mask hides them from every real query; otherwise
dq masks them (P = 0) in its last K/V block, and dkv zeroes their rows of
dK and dV once at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2 import defaults
from jax_flash2.config import MosaicBackwardConfig
from jax_flash2.mask import Mask
from jax_flash2.mosaic.common import (
    BWD_SMEM_RESERVE, LOG2_E, NUM_CONSUMERS, OUTER_ROWS, WGMMA_M, KVOuter, KVOuterScratch, Operands, PersistentSchedule,
    QTile, ScoreTile, Scores, backward_kernels, check_backward_smem, check_operands, grad_scores,
    interpret_params_of, kv_outer_scratch, kv_outer_smem_bytes, kv_range, kv_ring_producer, load_ids, optional_input,
    optional_ref, outer_grid, recomputed_probs, run_tiles, same_ids, score_bias, segment_inputs, segment_range,
    segment_refs, specialized_kernel, swizzled, tile_table, triangular,
)

HEAD_DIMS = (64, 128)


def _dkv_buffers(config: MosaicBackwardConfig) -> int:
  """Sets of K and V tiles the dK/dV kernel keeps."""
  return 2 if config.dkv_persistent else 1


def dkv_smem_bytes(config: MosaicBackwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of `dkv`: K and V (two sets when persistent), the ring of
  Q, dO, lse and delta."""
  return kv_outer_smem_bytes(head_dim, dtype, block_q=config.block_q, stages=config.stages,
                             buffers=_dkv_buffers(config))


def _dq_buffers(config: MosaicBackwardConfig) -> int:
  """Sets of Q, dO, lse and delta rows the dQ kernel keeps."""
  return 2 if config.dq_persistent else 1


def dq_smem_bytes(config: MosaicBackwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of `dq`: Q, dO, lse and delta (two sets when
  persistent), the ring of K and V."""
  item = jnp.dtype(dtype).itemsize
  q = _dq_buffers(config) * (2 * OUTER_ROWS * head_dim * item + 2 * OUTER_ROWS * 4)
  ring = config.stages * 2 * config.block_kv * head_dim * item
  return q + ring + BWD_SMEM_RESERVE


# ---------------------------------------------------------------- dK, dV


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, *refs,
    mask: Mask, group: int, schedule: PersistentSchedule | None, scores: Scores,
    config: MosaicBackwardConfig, interpret: bool,
):
  # Operands and scratch: common.Operands (slopes_ref with ALiBi only),
  # common.KVOuterScratch (and the interpreter's staging tile). tiles_ref:
  # the persistent schedule's table (common.tile_table). schedule: None for
  # one CTA per tile (grid kv x heads x batch), else the persistent CTAs'
  # tiles over K/V blocks.
  slopes_ref, refs = optional_ref(refs, scores.alibi)
  segments, (dk_ref, dv_ref, *scratch) = segment_refs(refs, mask.segments)
  wg = lax.axis_index("wg")
  smem, staging, _ = KVOuterScratch.take(scratch, interpret=interpret)
  kv = KVOuter(Operands(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, slopes_ref), dk_ref, dv_ref, smem, staging,
               wg=wg, mask=mask, group=group, block_q=config.block_q, stages=config.stages, scores=scores,
               early_vectors=config.early_vectors, interpret=interpret, segments=segments)
  # Segment ids bound the Q blocks on both sides, like a band's two edges.
  before, after = mask.right is not None or mask.segments, mask.left is not None or mask.segments
  head_dim = q_ref.shape[-1]

  def produce(tile, ring_base):
    pl.loop(0, tile.num_steps)(lambda step: kv.load_q_block(tile, ring_base, step))

  def gradients(tile, buffer, ring_base):
    """(dK unscaled, dV) of this consumer's rows of `tile`, its Q blocks at
    the ring's steps from ring_base; its K and V rows are in `buffer`."""
    k_start, k_tile, v_tile = kv.wait_kv(tile, buffer)
    lo, full_lo, full_hi, hi = kv.q_range(tile, k_start)

    def slot_of(g, qb):
      return lax.rem(ring_base + tile.step_of(g, qb), jnp.int32(config.stages))

    def step(qb, carry, *, g, slope, masked: bool):
      dk, dv = carry
      slot = slot_of(g, qb)
      p_t, ds_t, q_tile, do_tile = kv.p_and_ds_t(k_tile, v_tile, k_start, qb, slot, masked=masked, slope=slope,
                                                 batch=tile.batch)
      dk, dv = kv.add_grads(dk, dv, p_t, ds_t, q_tile, do_tile)
      kv.release_q_block(slot)
      return dk, dv

    def drain(qb, _, *, g):
      # Q blocks before this warpgroup's diagonal (or past its left edge)
      # that the other consumer needs: release their slots without computing
      # (waiting for them first keeps the barrier phases in step).
      slot = slot_of(g, qb)
      for ready in (kv.smem.q_ready, kv.smem.lse_ready, kv.smem.do_ready, kv.smem.delta_ready):
        plgpu.barrier_wait(ready.at[slot])
      kv.release_q_block(slot)

    def one_head(g, carry):
      # Query head kv_head * group + g: its Q blocks, in the producer's order:
      # [lo, full_lo) cross the band's right edge (the diagonal), [full_hi,
      # hi) its left edge; full_hi = hi = num_q without one.
      visit = functools.partial(step, g=g, slope=scores.slope(slopes_ref, tile.batch, tile.kv_head * group + g))
      if before:
        lax.fori_loop(tile.lo, lo, functools.partial(drain, g=g), None)
        carry = lax.fori_loop(lo, full_lo, functools.partial(visit, masked=True), carry)
      carry = lax.fori_loop(full_lo, full_hi, functools.partial(visit, masked=False), carry)
      if after:
        carry = lax.fori_loop(full_hi, hi, functools.partial(visit, masked=True), carry)
        lax.fori_loop(hi, tile.end, functools.partial(drain, g=g), None)
      return carry

    acc = plgpu.layout_cast(jnp.zeros((WGMMA_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = one_head(jnp.int32(0), (acc, acc)) if group == 1 else lax.fori_loop(0, group, one_head, (acc, acc))
    return kv.zero_padded_keys(k_start, dk, dv)

  run_tiles(schedule, kv.tile_at, wg=wg, axis="kv", produce=produce, observe=kv.observe, load=kv.load_kv,
            compute=gradients, store=kv.store_gradients, buffers=_dkv_buffers(config), tiles_ref=tiles_ref)


def _dkv_call(q, k, v, do, lse, delta, *, mask: Mask, scores: Scores, slopes, config: MosaicBackwardConfig,
              interpret, segment_ids=None) -> tuple[jax.Array, jax.Array]:
  """The dK/dV kernel on operands padded by `pad_backward`: (dk, dv);
  segment_ids: (q ids, kv ids) or None."""
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  interpret_params, interpret = interpret_params_of(interpret)
  scratch = kv_outer_scratch(head_dim, q.dtype, block_q=config.block_q, stages=config.stages,
                             buffers=_dkv_buffers(config), interpret=interpret)
  # K/V blocks fastest: CTAs running together share one (batch, kv head)
  # and read the same Q and dO from L2. Block 0 (causal: the most Q
  # blocks) runs first; persistent CTAs pair heavy and light blocks where
  # the band is triangular (common.triangular).
  schedule, grid, grid_names = outer_grid(k.shape[1] // OUTER_ROWS, kv_heads, batch, axis="kv",
                                          persistent=config.dkv_persistent, causal=triangular(mask),
                                          interpret=interpret)
  kernel = functools.partial(_dkv_kernel, mask=mask, group=heads // kv_heads, schedule=schedule,
                             scores=scores, config=config, interpret=interpret)
  out_type = (jax.ShapeDtypeStruct(k.shape, q.dtype), jax.ShapeDtypeStruct(v.shape, q.dtype))
  ids = () if segment_ids is None else segment_inputs(
      *segment_ids, padded_q=q.shape[1], padded_k=k.shape[1], rows=WGMMA_M, block=config.block_q,
      groups=k.shape[1] // WGMMA_M, q_outer=False)
  return specialized_kernel(kernel, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                            interpret_params=interpret_params, name="flash2_bwd_dkv_mosaic")(
                                q, k, v, do, lse, delta, tile_table(schedule), *optional_input(slopes), *ids)


# ---------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, *refs,
    mask: Mask, group: int, num_q_blocks: int, schedule: PersistentSchedule | None, scores: Scores,
    config: MosaicBackwardConfig, interpret: bool,
):
  # Operands in GMEM as common.Operands (slopes_ref with ALiBi only); dq_ref like q_ref.
  # q_smem, do_smem: [buffers, 2, 64, D] (per consumer; Q's tile stages dQ
  # at the end; two buffers in a persistent CTA, which loads the next tile's
  # rows while the current one's dQ is stored); lse_smem, delta_smem:
  # [buffers, 2, 64]; k_smem, v_smem: [stages, block_kv, D].
  # q_ready: [buffers * 2] barriers of 4 arrivals (Q, dO, lse, delta);
  # k_ready, v_ready: [stages] (TMA); k_consumed, v_consumed: [stages], 2
  # arrivals. staging (interpreter only): [2, 64, block_kv], dS for wgmma.
  # schedule: None for one CTA per tile (grid q x heads x batch), else the
  # persistent CTAs' tiles.
  slopes_ref, refs = optional_ref(refs, scores.alibi)
  segments, refs = segment_refs(refs, mask.segments)
  (dq_ref, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_consumed, v_consumed,
   *staging) = refs
  softmax_scale = scores.softmax_scale
  rows, block_kv, stages = WGMMA_M, config.block_kv, config.stages
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  if interpret:
    [staging] = staging
  wg = lax.axis_index("wg")
  tile_at = functools.partial(QTile.at, num_q_blocks=num_q_blocks, block_q=OUTER_ROWS, block_kv=block_kv,
                              mask=mask, segment_ranges=None if segments is None else segments.ranges)
  # Segment ids bound the K/V blocks on both sides, like a band's two edges.
  before = mask.left is not None or mask.segments
  after = mask.right is not None or mask.segments or bool(mask.seq_k % block_kv)

  def load_rows(tile: QTile, buffer):
    """Starts the copies of this consumer's Q, dO, lse and delta rows of
    `tile` into `buffer`."""
    q_rows = (tile.batch, pl.ds(tile.q_start + wg * rows, rows), tile.head)
    vec = (tile.batch, tile.head, pl.ds(tile.q_start + wg * rows, rows))
    ready = q_ready.at[buffer * NUM_CONSUMERS + wg]
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[buffer, wg], ready)

  def gradient(tile: QTile, buffer, ring_base):
    """This consumer's rows of dQ for `tile` (unscaled), its K/V blocks at the
    ring's steps ring_base, ring_base + 1, ...; its rows are in `buffer`."""
    q_start = tile.q_start + wg * rows
    q_tile, do_tile = q_smem.at[buffer, wg], do_smem.at[buffer, wg]
    with jax.named_scope("wait_rows"):
      plgpu.barrier_wait(q_ready.at[buffer * NUM_CONSUMERS + wg])
    # The A operands of S and dP: Q and dO, loaded once per tile into
    # registers (the interpreter reads them from shared memory).
    q_a, do_a = q_tile, do_tile
    if not interpret:
      q_a, do_a = (plgpu.load(t, layout=plgpu.Layout.WGMMA) for t in (q_tile, do_tile))
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per query row
    # A row that sees no key has lse -inf (no unmasked block holds one): 0
    # in its place keeps a hidden score's exp2(-inf - lse) at 0, not NaN.
    lse = plgpu.load(lse_smem.at[buffer, wg], layout=row_layout) * LOG2_E
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = plgpu.load(delta_smem.at[buffer, wg], layout=row_layout)
    # As in the forward: [lo, full_lo) and [full_hi, hi) take the element
    # mask; lo = full_lo = 0 without a left edge.
    lo, full_lo, full_hi, hi = kv_range(mask, q_start, rows, block_kv)
    if segments is not None:
      lo, full_lo, full_hi, hi = segment_range((lo, full_lo, full_hi, hi), segments.ranges, tile.batch,
                                               lax.div(q_start, jnp.int32(rows)), tile.kv_lo, tile.kv_end)
      q_ids = load_ids(segments.q.at[tile.batch, pl.ds(q_start, rows)], layout=row_layout)
    slope = scores.slope(slopes_ref, tile.batch, tile.head)

    def slot_of(kb):
      return lax.rem(ring_base + tile.step_of(kb), jnp.int32(stages))

    def same_segment(kb):
      """bool [rows, block_kv]: where this consumer's rows share K/V block kb's segment ids."""
      kv_ids = load_ids(segments.kv.at[tile.batch, pl.ds(kb * block_kv, block_kv)],
                        layout=plgpu.Layout.WGMMA.reduce(0))
      return same_ids(q_ids, kv_ids, (rows, block_kv))

    def add_dq(dq, ds, k_tile):
      """dQ + dS K in the interpreter, waited for: it reads wgmma's A operand
      from shared memory and lowers no wgmma inside run_state."""
      ds_stage = staging.at[wg]
      ds_stage[...] = ds.astype(dtype)
      plgpu.commit_smem()

      def dq_fresh(acc_ref):
        plgpu.wgmma(acc_ref, ds_stage, k_tile)
        return acc_ref[...]

      return dq + pl.run_scoped(dq_fresh, plgpu.ACC(dq.shape, jnp.float32))

    def step(kb, dq, *, masked: bool):
      slot = slot_of(kb)
      k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
      # S and dP, then dQ += dS K with dS from registers. (Named scopes: the
      # regions of Mosaic GPU's profiler.)
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
      # A masked block's S accumulator starts from the mask, 0 for a visible
      # pair and -inf for a hidden one, so each compare feeds its select before
      # the products issue. Masking P instead, ptxas computed the compares while
      # the products ran and kept their predicates (64 a thread at head_dim 64)
      # packed in registers across them. A softcap's tanh would bring -inf back
      # to a finite score: there P is masked.
      mask_in_scores = masked and not scores.softcap
      score_tile = ScoreTile((rows, block_kv), q_start, kb * block_kv)
      ids = None if segments is None else functools.partial(same_segment, kb)
      zeros = plgpu.layout_cast(jnp.zeros((rows, block_kv), jnp.float32), plgpu.Layout.WGMMA)
      s_start = score_bias(score_tile, mask, same_segment=ids) if mask_in_scores else zeros

      def probs(s):
        """(P, the softcap's derivative or None) of the block's scores s."""
        return recomputed_probs(s, lse, scores=scores, mask=mask, tile=score_tile, slope=slope,
                                masked=masked and not mask_in_scores, lse_axis=0, same_segment=ids)

      def score_gradient(s_ref, dp_ref):
        """dS of the block, from S and dP issued into s_ref and dp_ref."""
        with jax.named_scope("scores"):
          plgpu.wgmma(s_ref, q_a, k_tile.transpose((1, 0)))
          plgpu.wgmma(dp_ref, do_a, v_tile.transpose((1, 0)))
          if config.dq_softmax_overlap:
            # Groups retire in order: wait for S alone, compute P while dP runs.
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
          else:
            s = s_ref[...]
          if interpret and mask_in_scores:  # its S accumulator started from 0
            s = s + s_start
          if config.dq_softmax_overlap:
            p, dcap = probs(s)
          dp = dp_ref[...]
        plgpu.barrier_arrive(v_consumed.at[slot])  # V is no longer read
        if not config.dq_softmax_overlap:
          with jax.named_scope("softmax"):
            p, dcap = probs(s)
        return grad_scores(p, dp, delta, dcap, delta_axis=0)

      if interpret:
        ds = pl.run_scoped(score_gradient, plgpu.ACC((rows, block_kv)), plgpu.ACC((rows, block_kv)))
        with jax.named_scope("dq"):
          dq = add_dq(dq, ds, k_tile)
      else:

        def products(refs):
          s_ref, dp_ref, dq_ref = refs
          ds = score_gradient(s_ref, dp_ref)
          with jax.named_scope("dq"):
            plgpu.wgmma(dq_ref, ds.astype(dtype), k_tile)

        _, _, dq = pl.run_state(products)((plgpu.ACC.init(s_start), plgpu.ACC.init(zeros), plgpu.ACC.init(dq)))
      plgpu.barrier_arrive(k_consumed.at[slot])  # K is no longer read
      return dq

    def drain(kb, _):
      slot = slot_of(kb)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])

    dq = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    if before:
      lax.fori_loop(tile.kv_lo, lo, drain, None)  # before this warpgroup's left edge
      dq = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), dq)
    if after:  # a diagonal, or a last block partly of padding
      dq = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), dq)
    if mask.right is not None or mask.segments:
      lax.fori_loop(hi, tile.kv_end, drain, None)  # past this warpgroup's right edge
    return dq

  def store_dq(tile: QTile, buffer, dq):
    """Scales dQ and starts its TMA store, staged in the Q tile (every wgmma
    reading it has completed); nothing for a tile wholly past the array's
    end."""
    q_tile = q_smem.at[buffer, wg]
    q_tile[...] = (dq * softmax_scale).astype(dtype)
    plgpu.commit_smem()
    q_start = tile.q_start + wg * rows
    pl.when(q_start < dq_ref.shape[1])(
        lambda: plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[tile.batch, pl.ds(q_start, rows), tile.head]))

  produce, observe = kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed,
                                      group=group, block_kv=block_kv, stages=stages)
  run_tiles(schedule, tile_at, wg=wg, axis="q", produce=produce, observe=observe, load=load_rows, compute=gradient,
            store=store_dq, tiles_ref=tiles_ref)


def _dq_call(q, k, v, do, lse, delta, *, mask: Mask, scores: Scores, slopes, config: MosaicBackwardConfig,
             interpret, segment_ids=None) -> jax.Array:
  """The dQ kernel on operands padded by `pad_backward`; segment_ids: (q
  ids, kv ids) or None."""
  interpret_params, interpret = interpret_params_of(interpret)
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  dtype, stages, block_kv = q.dtype, config.stages, config.block_kv
  transforms = swizzled(head_dim, dtype)
  buffers = _dq_buffers(config)
  scratch = [
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M, head_dim), dtype, transforms=transforms),  # Q
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M, head_dim), dtype, transforms=transforms),  # dO
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M), jnp.float32),  # lse
      plgpu.SMEM((buffers, NUM_CONSUMERS, WGMMA_M), jnp.float32),  # delta
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),  # K
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),  # V
      plgpu.Barrier(num_arrivals=4, num_barriers=buffers * NUM_CONSUMERS),  # Q, dO, lse, delta
      plgpu.Barrier(num_barriers=stages),  # K ready
      plgpu.Barrier(num_barriers=stages),  # V ready
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # K consumed
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),  # V consumed
  ]
  if interpret:
    scratch.append(plgpu.SMEM((NUM_CONSUMERS, WGMMA_M, block_kv), dtype, transforms=swizzled(block_kv, dtype)))
  num_q_blocks = q.shape[1] // OUTER_ROWS
  schedule, grid, grid_names = outer_grid(num_q_blocks, heads, batch, axis="q", persistent=config.dq_persistent,
                                          causal=triangular(mask), interpret=interpret)
  kernel = functools.partial(
      _dq_kernel, mask=mask, group=heads // kv_heads, num_q_blocks=num_q_blocks, schedule=schedule,
      scores=scores, config=config, interpret=interpret,
  )
  ids = () if segment_ids is None else segment_inputs(
      *segment_ids, padded_q=q.shape[1], padded_k=k.shape[1], rows=WGMMA_M, block=block_kv,
      groups=q.shape[1] // WGMMA_M, q_outer=True)
  return specialized_kernel(kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch=scratch, grid=grid,
                            grid_names=grid_names, interpret_params=interpret_params,
                            name="flash2_bwd_dq_mosaic")(q, k, v, do, lse, delta, tile_table(schedule),
                                                         *optional_input(slopes), *ids)


# ---------------------------------------------------------------- entry points


def dkv(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
        causal: bool = False, window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
        alibi_slopes: jax.Array | None = None, q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None, softmax_scale: float | None = None,
        config: MosaicBackwardConfig | None = None,
        interpret: bool | plgpu.InterpretGPUParams = False) -> tuple[jax.Array, jax.Array]:
  """dK and dV of FlashAttention-2 on Hopper via Mosaic GPU.

  Args:
    q, do: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads,
      head_dim] (heads a multiple of kv_heads); bf16 or fp16, one dtype;
      head_dim 64 or 128; any lengths (ragged ones are padded to whole
      blocks and sliced back).
    lse: float32 [batch, heads, seq_q], natural log, as the forward writes it.
    delta: float32 [batch, heads, seq_q], rowsum(dO * O).
    causal, window_size, softcap, alibi_slopes, q_segment_ids,
      kv_segment_ids, softmax_scale: as in the forward
      (jax_flash2.mosaic.forward.forward).
    config: tiling, fused_dq False; defaults to
      `defaults.mosaic_backward(head_dim)` with fused_dq off.
    interpret: run Mosaic GPU's interpreter (CPU) instead of compiling.

  Returns:
    (dk, dv), like k.
  """
  return _gradients(("dkv",), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def dq(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
       causal: bool = False, window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
       alibi_slopes: jax.Array | None = None, q_segment_ids: jax.Array | None = None,
       kv_segment_ids: jax.Array | None = None, softmax_scale: float | None = None,
       config: MosaicBackwardConfig | None = None, interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """dQ of FlashAttention-2 on Hopper via Mosaic GPU, like q; arguments as
  `dkv`."""
  return _gradients(("dq",), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
             causal: bool = False, window_size: tuple[int | None, int | None] = (None, None),
             softcap: float | None = None, alibi_slopes: jax.Array | None = None,
             q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
             softmax_scale: float | None = None, config: MosaicBackwardConfig | None = None,
             interpret: bool | plgpu.InterpretGPUParams = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`dq` and `dkv` on one padding of the operands; arguments as `dkv`.

  Returns:
    (dq, dk, dv), each like its primal.
  """
  return _gradients(("dkv", "dq"), q, k, v, do, lse, delta, config, interpret, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)


def check_config(config: MosaicBackwardConfig, head_dim: int, dtype, *, kernels=("dkv", "dq")) -> None:
  """Raises ValueError if `kernels` ("dkv", "dq") cannot run `config` at
  head_dim and dtype: fused_dq (backward_fused's kernel), or buffers past a
  Hopper CTA's shared memory."""
  if config.fused_dq:
    raise ValueError(f"{config}: fused_dq is backward_fused's kernel; the two kernels here need fused_dq=False")
  check_backward_smem(config, head_dim, dtype, {"dkv": dkv_smem_bytes, "dq": dq_smem_bytes}, kernels)


def _gradients(names, q, k, v, do, lse, delta, config, interpret, **band_and_scores):
  """The gradients of the kernels `names` ("dkv", "dq") on the checked
  operands; config None takes the measured default tiling, with dQ in a
  kernel of its own."""
  check_operands("the Mosaic GPU dK/dV and dQ kernels (head_dim 256: backward_wide)", HEAD_DIMS, q, k, v, do, lse,
                 delta)
  if config is None:
    config = defaults.mosaic_backward(q.shape[-1], fused=False,
                                      segments=band_and_scores.get("q_segment_ids") is not None)
  check_config(config, q.shape[-1], q.dtype, kernels=names)
  kernels = {"dkv": _dkv_call, "dq": _dq_call}
  return backward_kernels({name: kernels[name] for name in names}, q, k, v, do, lse, delta, config=config,
                          interpret=interpret, **band_and_scores)
