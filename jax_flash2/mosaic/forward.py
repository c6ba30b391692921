"""FlashAttention-2 forward pass for Hopper (sm_90a) in Pallas's Mosaic GPU backend.

One CTA owns `block_q` query rows of one (batch, head), split between its
consumer warpgroups (common.py: warp specialization, the ring, persistent
CTAs). Each consumer keeps its Q rows in shared memory and, in registers,
the running row max m_i, the running row sum l_i and the unnormalised
output acc; per K/V block of the ring

  S = Q K^T                     (wgmma, both operands in shared memory)
  m_new = max(m_i, rowmax(S) * scale * log2(e))
  P = exp2(S * scale * log2(e) - m_new),  alpha = exp2(m_i - m_new)
  l_i = l_i * alpha + rowsum(P),  acc = acc * alpha + P V   (P from registers)

and at the end out = acc / l_i and lse = (m_i + log2(l_i)) * ln(2), the
natural log-sum-exp a backward pass takes (attention sinks join l_i and m_i
first: jax_flash2.merge.join_sink_rows). K and V have ready and consumed
barriers of their own, so that Q K^T can start while V is still in flight
and a K slot refills while P V still reads the V slot of the same step.

With `softmax_overlap` each consumer is software-pipelined as in
FlashAttention-3: a step issues S = Q K^T of its block and P V of the
previous block back to back and computes its softmax while the tensor cores
still run that P V.

A band (causal attention, a sliding window; bottom-right aligned) bounds
the K/V blocks: a tile's producer loads only the blocks some consumer's
rows see (common.q_tile_blocks), each consumer computes the ones its own
rows see and masks only those crossing an edge of the band, and drains the
slots its neighbours still need before its left edge and past its right
one. A softcap or ALiBi (common.Scores) takes the scores to base 2 before
the softmax's max, on every block; plain scores keep the scale folded into
the exponential.

Supported: bf16 and fp16; head_dim 64, 128 and 256; grouped-query attention
(heads a multiple of kv_heads); causal, windows, softcap and ALiBi, alone
or together; any seq_q, seq_k >= 1 (ragged lengths are padded to whole
blocks and sliced back; keys past seq_k get probability 0 in the last,
masked K/V block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2 import defaults
from jax_flash2.config import MosaicForwardConfig
from jax_flash2.mask import Mask
from jax_flash2.merge import join_sink_rows
from jax_flash2.mosaic.common import (
    LN_2, LOG2_E, SUPPORTED_HEAD_DIMS, PersistentSchedule, QTile, ScoreTile, Scores, at_least, band_of, check_operands,
    check_per_head, check_smem, interpret_params_of, kv_range, kv_ring_producer, load_ids, optional_input,
    optional_ref, outer_grid, pad_seq, per_head, q_tile_work, run_tiles, same_ids, scores_of, segment_inputs,
    segment_range, segment_refs, specialized_kernel, swizzled, tile_table, triangular, unpad_seq, with_segment_ids,
)

# Shared memory Mosaic takes beside the forward's buffers (barriers,
# alignment): 608-624 bytes by its own count at head_dim 64-256
# (test_smem_estimates_hold_mosaics_count), none for reductions
# (common.compiler_params).
SMEM_RESERVE = 1024


def q_buffers(config: MosaicForwardConfig) -> int:
  """Sets of Q tiles a CTA keeps: two in a persistent CTA, which loads the
  next tile's Q while the current one's output is stored."""
  return 2 if config.persistent else 1


def smem_bytes(config: MosaicForwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of one CTA: the Q tiles (reused for the output), the K
  and V ring, the lse staging rows and Mosaic's reserve."""
  item = jnp.dtype(dtype).itemsize
  q = q_buffers(config) * config.block_q * head_dim * item
  kv = 2 * config.stages * config.block_kv * head_dim * item
  lse = config.block_q * 4
  return q + kv + lse + SMEM_RESERVE


def check_config(config: MosaicForwardConfig, head_dim: int, dtype) -> None:
  """Raises ValueError if the forward cannot run `config` at head_dim and
  dtype: its buffers would exceed a Hopper CTA's shared memory."""
  check_smem(config, {"the forward": smem_bytes(config, head_dim, dtype)}, head_dim)


def _forward_kernel(
    q_ref, k_ref, v_ref, tiles_ref, *refs,
    mask: Mask, group: int, num_q_blocks: int, schedule: PersistentSchedule | None, scores: Scores,
    has_sinks: bool, config: MosaicForwardConfig, interpret: bool,
):
  # q_ref, out_ref: [batch, seq_q', heads, D] in GMEM; k_ref, v_ref: [batch,
  # seq_k', heads // group, D]; lse_ref: [batch, heads, seq_q'] f32; seq_q',
  # seq_k': the real lengths (mask) padded to whole blocks (seq_q on the GPU
  # only to whole consumer tiles; see `forward`); tiles_ref: the persistent
  # schedule's table (`tile_table`); slopes_ref (ALiBi only), sinks_ref
  # (sinks only): float32 [batch or 1, heads]; with segment ids, q_ids_ref,
  # kv_ids_ref: int32 [batch, seq_q'] / [batch, seq_k'] and ranges_ref: int32
  # [batch, Q row groups, 4], each consumer's K/V block range under them
  # (mask.segment_block_ranges).
  # C = config.consumers. q_smem: [buffers, C, rows, D] (one Q tile per
  # consumer, reused for its output; `q_buffers`); k_smem, v_smem: [stages,
  # block_kv, D] (the ring); lse_smem: [C, rows] f32.
  # q_ready: [buffers * C] barriers; k_ready, v_ready: [stages] barriers the
  # TMA engine completes; k_consumed, v_consumed: [stages] barriers of C
  # arrivals. staging (interpreter only): [C, rows, block_kv], P on its way
  # to wgmma.
  # schedule: None for one CTA per tile (grid q x heads x batch); else the
  # persistent CTAs' tiles.
  slopes_ref, refs = optional_ref(refs, scores.alibi)
  sinks_ref, refs = optional_ref(refs, has_sinks)
  segments = mask.segments
  ids, refs = segment_refs(refs, segments)
  ranges_ref = ids.ranges if segments else None
  (out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_consumed, v_consumed,
   *staging) = refs
  rows, block_kv, stages, consumers = config.rows_per_consumer, config.block_kv, config.stages, config.consumers
  dtype = q_ref.dtype
  p_staging = staging[0] if interpret else None
  wg = lax.axis_index("wg")
  qk_scale = scores.softmax_scale * LOG2_E
  causal = mask.causal
  # Only a right edge with seq_q > seq_k + right (causal attention with
  # seq_q > seq_k) has rows that see no key at all, the first ones: they
  # keep m_i = -inf and l_i = 0, which needs guards (see below).
  # Under segment ids any row may see no key.
  may_see_nothing = segments or (mask.right is not None and mask.seq_q > mask.seq_k + mask.right)
  # Under a left edge a row meets its first blocks, masked, before any key
  # it sees: its m_i may still be -inf after one (the same guard).
  unseen_first = mask.left is not None or segments
  # The overlapped steps start with a block: every consumer needs one. Under
  # a left edge a consumer of padding rows far enough past seq_q has none.
  padding_past_band = mask.left is not None and (
      num_q_blocks * config.block_q - rows + mask.offset - mask.left >= k_ref.shape[1])
  # Under segment ids a consumer may have no block at all (the overlapped
  # steps need one each): they take the plain steps.
  overlap = config.softmax_overlap and not (may_see_nothing or padding_past_band)
  # A band's edge (the causal diagonal, a window's sides), or a last block partly of padding.
  any_masked = mask.has_band or segments or bool(mask.seq_k % block_kv)
  # Segment ids hide keys anywhere, the padding past seq_k included.
  check_keys = segments or not causal
  tile_at = functools.partial(QTile.at, num_q_blocks=num_q_blocks, block_q=config.block_q, block_kv=block_kv,
                              mask=mask, consumers=consumers, segment_ranges=ranges_ref)

  def load_q(tile: QTile, buffer):
    plgpu.copy_gmem_to_smem(q_ref.at[tile.batch, pl.ds(tile.q_start + wg * rows, rows), tile.head],
                            q_smem.at[buffer, wg], q_ready.at[buffer * consumers + wg])

  def attend(tile: QTile, q_tile, ring_base):
    """One consumer's rows of `tile` against its K/V blocks, which occupy the
    ring's steps ring_base, ring_base + 1, ...: (acc, m_i, l_i), acc not yet
    divided by l_i."""
    q_start = tile.q_start + wg * rows
    # This consumer's K/V blocks: [lo, full_lo) and [full_hi, hi) cross an
    # edge of the band (or hold the padding past seq_k) and take the
    # element mask; lo = full_lo = 0 without a left edge.
    lo, full_lo, full_hi, hi = kv_range(mask, q_start, rows, block_kv)
    if segments:
      lo, full_lo, full_hi, hi = segment_range((lo, full_lo, full_hi, hi), ranges_ref, tile.batch,
                                               lax.div(q_start, jnp.int32(rows)), tile.kv_lo, tile.kv_end)
      q_ids = load_ids(ids.q.at[tile.batch, pl.ds(q_start, rows)], layout=plgpu.Layout.WGMMA.reduce(1))
    slope = scores.slope(slopes_ref, tile.batch, tile.head)

    def slot_of(kb):
      return lax.rem(ring_base + tile.step_of(kb), jnp.int32(stages))

    def issue_scores(s_ref, slot):
      # Starts S = Q K^T of the K block in `slot` on the tensor cores.
      plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))

    def scores_now(slot):
      """S = Q K^T [rows, block_kv] of the K block in `slot`, waited for;
      the slot is released to the producer once read."""
      plgpu.barrier_wait(k_ready.at[slot])

      def qk(s_ref):
        issue_scores(s_ref, slot)
        return s_ref[...]  # waits for the wgmma

      s = pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32))
      # The K slot is no longer read: let the producer refill it while the
      # softmax runs.
      plgpu.barrier_arrive(k_consumed.at[slot])
      return s

    def online_softmax(kb, s, m_i, l_i, *, masked: bool):
      """The online-softmax update for K/V block kb's scores s [rows,
      block_kv]: (p, m_new, l_new, alpha), alpha rescaling what was
      accumulated under the old max m_i."""

      score_tile = ScoreTile(s.shape, q_start, kb * block_kv)
      if scores.modified:
        # Softcap and ALiBi need the scaled scores: base 2 from here on.
        s = scores.log2(s, *(score_tile.positions() if scores.alibi else (None, None)), slope)[0]
      if masked:
        visible = score_tile.visible(mask, check_keys=check_keys)
        if segments:
          kv_ids = load_ids(ids.kv.at[tile.batch, pl.ds(kb * block_kv, block_kv)], layout=plgpu.Layout.WGMMA.reduce(0))
          visible &= same_ids(q_ids, kv_ids, s.shape)
        s = jnp.where(visible, s, -jnp.inf)
      to_log2 = (lambda x: x) if scores.modified else (lambda x: x * qk_scale)
      m_new = jnp.maximum(m_i, to_log2(jnp.max(s, axis=1)))
      if masked and (may_see_nothing or unseen_first):
        # A row with only masked scores so far keeps m = -inf; shift it by 0
        # so that exp2 gives 0 rather than exp2(-inf + inf) = NaN.
        m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(to_log2(s) - lax.broadcast_in_dim(m_new, s.shape, [0]))
      return p, m_new, l_i * alpha + jnp.sum(p, axis=1), alpha

    def rescale(acc, alpha):
      return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def stage_p(p):
      # Mosaic's interpreter (jax 0.11.2) runs wgmma only from operands in
      # shared memory and only into a fresh scoped accumulator: P takes a
      # detour through shared memory and P V is added afterwards. The same
      # sum; the compiled kernel never takes this branch.
      p_staging.at[wg][...] = p.astype(dtype)
      plgpu.commit_smem()

    def add_pv(acc, p, slot):
      """acc + P V for the V block in `slot`, waited for."""
      if interpret:
        stage_p(p)

        def pv_fresh(pv_ref):
          plgpu.wgmma(pv_ref, p_staging.at[wg], v_smem.at[slot])
          return pv_ref[...]

        return acc + pl.run_scoped(pv_fresh, plgpu.ACC(acc.shape, jnp.float32))

      # The tensor cores add P V onto the rescaled accumulator in place.
      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

      return pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma

    def step(kb, carry, *, masked: bool):
      acc, m_i, l_i = carry
      slot = slot_of(kb)
      p, m_new, l_i, alpha = online_softmax(kb, scores_now(slot), m_i, l_i, masked=masked)
      acc = rescale(acc, alpha)
      plgpu.barrier_wait(v_ready.at[slot])
      acc = add_pv(acc, p, slot)
      plgpu.barrier_arrive(v_consumed.at[slot])
      return acc, m_new, l_i

    def overlapped_step(kb, carry, *, masked: bool):
      # carry: acc (under the running max m_i) without block kb-1's P V yet,
      # and that block's P (under m_i too). This step starts S_kb = Q K_kb^T
      # and acc + P_{kb-1} V_{kb-1} back to back, waits for S_kb alone (wgmma
      # groups complete in order), runs block kb's softmax while the tensor
      # cores finish P V, and only then rescales acc to the new max. (Named
      # scopes: the regions of Mosaic GPU's profiler, where it is on.)
      acc, m_i, l_i, p_prev = carry
      slot, prev = slot_of(kb), slot_of(kb - 1)
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])

      def body(s_ref, o_ref):
        issue_scores(s_ref, slot)
        if interpret:  # P through shared memory (see stage_p); the sum is added below
          plgpu.wgmma(o_ref, p_staging.at[wg], v_smem.at[prev])
        else:
          o_ref[...] = acc
          plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
        with jax.named_scope("wait_scores"):
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_kb done; P V may still run
        plgpu.barrier_arrive(k_consumed.at[slot])
        with jax.named_scope("softmax"):
          update = online_softmax(kb, s, m_i, l_i, masked=masked)
        with jax.named_scope("wait_pv"):
          o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
        return o, *update

      with jax.named_scope("step"):
        o, p, m_new, l_i, alpha = pl.run_scoped(
            body, plgpu.ACC((rows, block_kv), jnp.float32), plgpu.ACC(acc.shape, jnp.float32)
        )
      plgpu.barrier_arrive(v_consumed.at[prev])
      if interpret:
        o = acc + o
        stage_p(p)  # P V of kb-1 has read the old P
      return rescale(o, alpha), m_new, l_i, p.astype(dtype)

    def first_overlapped_step(kb, carry, *, masked: bool):
      # The first block: scores and softmax only; its P V starts with the next block's scores.
      acc, m_i, l_i = carry
      p, m_new, l_i, _ = online_softmax(kb, scores_now(slot_of(kb)), m_i, l_i, masked=masked)  # acc is 0: no rescale
      if interpret:
        stage_p(p)
      return acc, m_new, l_i, p.astype(dtype)

    def drain(kb, _):
      # Blocks past this warpgroup's diagonal (or before its left edge) that
      # the other consumers still need: release the slots without computing. Waiting on the ready
      # barriers first keeps this warpgroup's barrier phases in step and
      # guarantees that its arrival counts toward this block's phase, not an
      # earlier one still owed by another consumer.
      slot = slot_of(kb)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])

    acc = plgpu.layout_cast(jnp.zeros((rows, q_ref.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    if mask.left is not None or segments:
      lax.fori_loop(tile.kv_lo, lo, drain, None)  # before this warpgroup's left edge
    if overlap:
      # Every warpgroup sees at least its block lo here (hi > lo). That first
      # block takes the masked path wherever any block may need it: exact
      # either way. The other blocks after it: [lo + 1, hi), in the stretches.
      with jax.named_scope("first_block"):  # the tile's phases outside `step`, for the profiler
        carry = first_overlapped_step(lo, (acc, m_i, l_i), masked=any_masked)
      after_first = 1 if isinstance(lo, int) else lo + 1
      if mask.left is not None:
        carry = lax.fori_loop(after_first, jnp.maximum(full_lo, after_first),
                              functools.partial(overlapped_step, masked=True), carry)
      carry = lax.fori_loop(at_least(full_lo, after_first), full_hi, functools.partial(overlapped_step, masked=False),
                            carry)
      if any_masked:
        carry = lax.fori_loop(jnp.maximum(full_hi, after_first), hi, functools.partial(overlapped_step, masked=True),
                              carry)
      acc, m_i, l_i, p = carry
      last = slot_of(hi - 1)
      with jax.named_scope("last_pv"):
        plgpu.barrier_wait(v_ready.at[last])
        acc = add_pv(acc, p, last)
      plgpu.barrier_arrive(v_consumed.at[last])
    else:
      carry = (acc, m_i, l_i)
      if mask.left is not None or segments:
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
      carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
      if any_masked:
        carry = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
      acc, m_i, l_i = carry
    if mask.right is not None or segments:
      lax.fori_loop(hi, tile.kv_end, drain, None)  # past this warpgroup's right edge
    return acc, m_i, l_i

  def store_output(tile: QTile, q_tile, acc, m_i, l_i):
    """Divides acc by l_i (the sink joined to it first, with sinks) and
    starts the TMA stores of the output and lse, staged in shared memory
    (q_tile, whose Q every wgmma has read by now)."""
    scale = None
    if has_sinks:
      sink = per_head(sinks_ref, tile.batch, tile.head) * LOG2_E
      m_i, l_i, scale = join_sink_rows(m_i, l_i, sink)
    # Only a -inf sink leaves a row that saw no key with l_i = 0.
    guarded = may_see_nothing or has_sinks
    if guarded:
      seen = l_i != 0.0  # a row with a NaN has l_i = NaN: its lse stays NaN
      l_i = jnp.where(seen, l_i, 1.0)  # rows that saw no key: zeros, lse = -inf (the sink)
    # One division per row at the end (a reciprocal, then multiplies).
    out = acc * lax.broadcast_in_dim(1.0 / l_i if scale is None else scale / l_i, acc.shape, [0])
    lse = (m_i + jnp.log2(l_i)) * LN_2
    if guarded:
      lse = jnp.where(seen, lse, -jnp.inf)
    q_start = tile.q_start + wg * rows
    q_tile[...] = out.astype(dtype)
    lse_smem.at[wg][...] = lse
    # Ordinary stores must be made visible to the TMA engine (the async proxy)
    # before it reads shared memory.
    plgpu.commit_smem()
    # A tile wholly past the arrays' end (of a last Q block that `forward`
    # left unpadded) stores nothing: the TMA engine would drop its output
    # rows, but its lse rows would land on the next head's first ones.
    @pl.when(q_start < out_ref.shape[1])
    def _():
      plgpu.copy_smem_to_gmem(q_tile, out_ref.at[tile.batch, pl.ds(q_start, rows), tile.head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[tile.batch, tile.head, pl.ds(q_start, rows)])

  def compute(tile: QTile, buffer, ring_base):
    with jax.named_scope("wait_rows"):
      plgpu.barrier_wait(q_ready.at[buffer * consumers + wg])
    return attend(tile, q_smem.at[buffer, wg], ring_base)

  def store(tile: QTile, buffer, result):
    store_output(tile, q_smem.at[buffer, wg], *result)

  produce, observe = kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed,
                                      group=group, block_kv=block_kv, stages=stages)
  run_tiles(schedule, tile_at, wg=wg, axis="q", produce=produce, observe=observe, load=load_q, compute=compute,
            store=store, consumers=consumers, tiles_ref=tiles_ref)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
    softmax_scale: float | None = None,
    config: MosaicForwardConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
  """FlashAttention-2 forward on Hopper via Mosaic GPU.

  Args:
    q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads,
      head_dim] with heads a multiple of kv_heads; bf16 or fp16; any
      lengths (ragged ones are padded to whole blocks and sliced back).
    causal: bottom-right aligned causal mask.
    window_size: (left, right) sliding window, bottom-right aligned as
      causal (jax_flash2.mask.Mask); None on a side leaves it unbounded;
      causal caps the right side at 0.
    softcap: scores (after softmax_scale) become softcap * tanh(scores /
      softcap); None for none.
    alibi_slopes: float32 [batch or 1, heads]: adds -slope * |i + seq_k -
      seq_q - j| to the scores (after the softcap); None for none.
    q_segment_ids, kv_segment_ids: int32 [batch, seq_q] / [batch, seq_k],
      both or neither: query i sees key j only if their ids are equal.
    sinks: float32 [batch or 1, heads]: one logit per query head in every
      row's softmax denominator, carrying no value (jax_flash2.merge.
      join_sinks); None for none.
    softmax_scale: multiplies the scores; defaults to head_dim ** -0.5.
    config: tiling; defaults to `defaults.mosaic_forward(head_dim,
      seq_q=..., causal=...)`.
    interpret: run Mosaic GPU's interpreter (CPU) instead of compiling:
      True, or plgpu.InterpretGPUParams (e.g. detect_races=True).

  Returns:
    out: like q. lse: float32 [batch, heads, seq_q], natural log. Rows that
      see no key (a band's right edge with seq_q > seq_k + right: causal
      with seq_q > seq_k) get zeros and lse = -inf (the sink, with sinks).

  Raises:
    NotImplementedError: head_dim not in (64, 128, 256), dtypes other than
      bf16/fp16.
    ValueError: inconsistent operands, or a config whose buffers do not fit
      shared memory.
  """
  check_operands("the Mosaic GPU forward", SUPPORTED_HEAD_DIMS, q, k, v)
  batch, seq_q, heads, head_dim = q.shape
  seq_k, kv_heads = k.shape[1], k.shape[2]
  mask = band_of(seq_q, seq_k, causal, window_size)
  mask = with_segment_ids(mask, q_segment_ids, kv_segment_ids, batch)
  segments = mask.segments
  scores = scores_of(q, mask, softmax_scale, softcap, alibi_slopes)
  check_per_head("sinks", sinks, q)
  if config is None:
    config = defaults.mosaic_forward(head_dim, seq_q=seq_q, causal=causal, segments=segments)
  check_config(config, head_dim, q.dtype)
  interpret_params, interpret = interpret_params_of(interpret)
  rows, dtype, consumers = config.rows_per_consumer, q.dtype, config.consumers
  # The kernel works on whole blocks; it bounds and masks with the real
  # seq_q, seq_k, and the rows of padding are sliced off its results.
  if interpret or seq_q % rows:
    q = pad_seq(q, config.block_q)
  # else a last Q block past seq_q (192-row blocks over multiples of 128)
  # needs no copy: its consumers' tiles lie wholly inside q or wholly past
  # its end, where the TMA engine loads zeros and the kernel stores nothing.
  k, v = pad_seq(k, config.block_kv), pad_seq(v, config.block_kv)
  num_q_blocks = pl.cdiv(q.shape[1], config.block_q)
  id_inputs = ()
  if segments:
    # Each consumer's K/V block range under the ids, computed once per call
    # outside the kernel; groups past seq_q (a last Q block partly past it)
    # get the empty range.
    id_inputs = segment_inputs(q_segment_ids, kv_segment_ids, padded_q=q.shape[1], padded_k=k.shape[1], rows=rows,
                               block=config.block_kv, groups=num_q_blocks * consumers, q_outer=True)

  # head_dim is a multiple of 64: every tile takes the 128-byte swizzle.
  transforms = swizzled(head_dim, dtype)
  buffers = q_buffers(config)
  scratch = [
      plgpu.SMEM((buffers, consumers, rows, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((config.stages, config.block_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((config.stages, config.block_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((consumers, rows), jnp.float32),
      plgpu.Barrier(num_barriers=buffers * consumers),
      plgpu.Barrier(num_barriers=config.stages),
      plgpu.Barrier(num_barriers=config.stages),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=config.stages),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=config.stages),
  ]
  if interpret:
    scratch.append(plgpu.SMEM((consumers, rows, config.block_kv), dtype, transforms=swizzled(config.block_kv, dtype)))
  # Persistent CTAs: work that grows with the Q block (causal attention, a
  # right edge alone) goes in heavy-light pairs, or from the balanced table;
  # a window's tiles, of nearly equal work, go round-robin in order
  # (common.triangular says why).
  work = None
  if triangular(mask) and config.balanced:
    work = q_tile_work(num_q_blocks, block_q=config.block_q, block_kv=config.block_kv, mask=mask,
                       consumers=consumers)
  schedule, grid, grid_names = outer_grid(num_q_blocks, heads, batch, axis="q", persistent=config.persistent,
                                          causal=triangular(mask), interpret=interpret, work=work)
  kernel = functools.partial(
      _forward_kernel, mask=mask, group=heads // kv_heads, num_q_blocks=num_q_blocks, schedule=schedule,
      scores=scores, has_sinks=sinks is not None, config=config, interpret=interpret,
  )
  out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((batch, heads, q.shape[1]), jnp.float32))
  out, lse = specialized_kernel(kernel, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                                interpret_params=interpret_params, name="flash2_fwd_mosaic",
                                consumers=consumers)(q, k, v, tile_table(schedule), *optional_input(alibi_slopes),
                                                     *optional_input(sinks), *id_inputs)
  return unpad_seq(out, seq_q), unpad_seq(lse, seq_q, axis=2)
