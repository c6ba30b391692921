"""FlashAttention-2 backward pass for Hopper (sm_90a) in one Mosaic GPU kernel: dQ folded into dK/dV.

The dK/dV kernel of backward.py (common.KVOuter) that computes dQ as well,
as FlashAttention-2's backward does, instead of a second kernel recomputing
S and dP (5 matmuls per block instead of 7); the head_dim-64 default.
Per Q block both consumers stage their dS^T in shared memory (double-
buffered by step), and each computes a piece of dQ_qb = dS K from both
halves of dS^T and both K tiles: at head_dim 128 half of dQ's columns at
every step, in the wgmma group of dV and dK; at head_dim 64 all of them at
every other step, the consumers taking turns (wgmma reads a column slice of
K only 64 columns wide, under its 128-byte swizzle). A consumer hands its
piece, through shared memory, to one warp of the producer warpgroup of its
own (the first warp issues the loads), which adds it to a float32 dQ in
global memory with a TMA reduce-add, so that the consumers never wait on
global memory.

No atomics in an arbitrary order: every Q block's additions come in an
order fixed on the host by `_dq_order` (a model of the persistent schedule
in which tiles visit their Q blocks staggered, `_visit`), enforced by a
semaphore per Q block and piece that counts the additions made, so the
gradients are deterministic. That needs every CTA resident at once (one
per SM; `_fused_schedule`): a GPU shared with other work only delays the
kernel, an SM limit such as MPS's would hang it.

At head_dim 64 the consumers hold their K and V rows in registers, the A
operands of S^T = K Q^T and dP^T = V dO^T, which then read only Q and dO
from shared memory.

In Mosaic's interpreter, which has neither semaphores nor TMA reduce-adds,
one CTA takes every tile in turn and the producer makes the additions
itself, by load, add and store, between its loads.

Full and causal attention only: windows, softcap and ALiBi take
backward.py's two kernels (backends.MosaicKernels routes them there). The
order of additions models the causal schedule (`_visit`, `_dq_order`), and
the interpreter runs neither the semaphores nor the reduce-adds that keep
it on the GPU, so a banded variant could not be checked on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2 import defaults
from jax_flash2.config import MosaicBackwardConfig
from jax_flash2.mask import NUMPY, Mask
from jax_flash2.mosaic.common import (
    NUM_CONSUMERS, OUTER_ROWS, WGMMA_M, KVOuter, KVOuterScratch, KVTile, Operands, PersistentSchedule, Scores,
    check_operands, check_smem, interpret_params_of, kv_outer_scratch, kv_outer_smem_bytes, pad_backward, run_tiles,
    sm_count, softmax_scale_of, specialized_kernel, swizzled, tile_table, unpad_seq,
)

HEAD_DIMS = (64, 128)


def _split(head_dim: int) -> bool:
  """Whether each consumer adds half of dQ's columns at every step (head_dim
  128) rather than all of them at every other step (64)."""
  return head_dim >= 2 * 64


def _piece_cols(head_dim: int) -> int:
  """Columns of dQ in one consumer's piece."""
  return head_dim // 2 if _split(head_dim) else head_dim


def _buffers(config: MosaicBackwardConfig) -> int:
  """Sets of K and V tiles a CTA keeps."""
  return 2 if config.dkv_persistent else 1


def smem_bytes(config: MosaicBackwardConfig, head_dim: int, dtype) -> int:
  """Shared memory of the fused kernel: the dK/dV kernel's, the dS^T of both
  consumers (double-buffered) and each consumer's staged float32 piece of
  dQ."""
  item = jnp.dtype(dtype).itemsize
  dq = 2 * OUTER_ROWS * config.block_q * item + NUM_CONSUMERS * config.block_q * _piece_cols(head_dim) * 4
  return kv_outer_smem_bytes(head_dim, dtype, block_q=config.block_q, stages=config.stages,
                             buffers=_buffers(config)) + dq


def check_config(config: MosaicBackwardConfig, head_dim: int, dtype) -> None:
  """Raises ValueError if the fused kernel cannot run `config` at head_dim
  and dtype: it needs fused_dq, and buffers within a Hopper CTA's shared
  memory."""
  if not config.fused_dq:
    raise ValueError(f"{config}: the fused kernel needs fused_dq=True (the two kernels are backward.py's)")
  check_smem(config, {"the fused kernel": smem_bytes(config, head_dim, dtype)}, head_dim)


# ---------------------------------------------------------------- the order of additions


def _visit(kv_index, position, num_visits, lo, *, num_q, num_kv, causal: bool, where=jnp.where,
           div=lax.div, rem=lax.rem):
  """The Q block a K/V tile visits at `position` of its num_visits = num_q -
  lo blocks per query head (int32 scalars in the kernel, numpy arrays in
  `_dq_order`, which passes numpy's where, div and rem).

  Every tile adds into every Q block it visits, so the tiles that run
  together should visit different Q blocks at any one time, and each Q block
  should see its adders a few steps apart (the order of the additions is
  fixed; an adder that comes too soon waits). Not causal: tile j starts at
  Q block j * num_q / num_kv and wraps around. Causal (tiles paired heavy
  with light, PersistentSchedule): the heavy tile j (2j < num_kv) climbs
  from its diagonal, the light tile, which runs second, descends to it; at
  equal lengths tile j's heavy walk is at block lo + t at time t, two blocks
  apart from its neighbours, and light walks meet neither each other nor a
  heavy one (odd against even blocks)."""
  if causal:
    return where(2 * kv_index >= num_kv, lo + num_visits - 1 - position, lo + position)
  return rem(position + div(kv_index * num_q, num_kv), num_visits)


@dataclasses.dataclass(frozen=True)
class _SpreadTile(KVTile):
  """A KVTile visiting its Q blocks in `_visit`'s order."""

  num_kv: int
  causal: bool

  def q_block(self, position):
    return _visit(self.kv_index, position, self.visits, self.lo, num_q=jnp.int32(self.num_q),
                  num_kv=jnp.int32(self.num_kv), causal=self.causal)


def _fused_schedule(num_kv: int, kv_heads: int, batch: int, *, causal: bool, interpret: bool) -> PersistentSchedule:
  """The kernel's persistent CTAs, which wait on each other: all of them
  must be resident at once (one per SM). Where it costs no round of tiles,
  the tiles of one (batch, kv head) run in the same round(s), so that the
  order of additions into its dQ can be computed for one head and hold for
  every head (`_dq_order`): the CTA count is then a multiple of the CTAs
  one head needs (tiles or pairs of tiles), or divides it. Where that would
  take more rounds than the SMs allow (48 K/V blocks a head at 6144 keys: 64
  heads would run 32 rounds on 96 CTAs, or 24 on 128), the fewest CTAs that
  take the fewest rounds, heads split across rounds, and `_dq_order` orders
  every head's additions. Causal tiles pair only within a head: an odd
  number of K/V blocks runs unpaired. In the interpreter one CTA takes
  every tile in turn."""
  paired = causal and num_kv % 2 == 0
  per_head = num_kv // 2 if paired else num_kv
  units = per_head * kv_heads * batch
  if interpret:
    num_ctas = 1
  else:
    sms = sm_count()
    if per_head <= sms:
      num_ctas = per_head * min(sms // per_head, kv_heads * batch)
    else:
      num_ctas = max(d for d in range(1, sms + 1) if per_head % d == 0)
    rounds = -(-units // sms)
    if -(-units // num_ctas) > rounds:
      num_ctas = -(-units // rounds)
  return PersistentSchedule(num_kv, kv_heads, batch, num_ctas, paired)


def _heads_alike(schedule: PersistentSchedule) -> bool:
  """Whether every (batch, kv head) of the schedule runs its tiles as the
  first one does (whole heads per round or whole rounds per head), so that
  one head's order of additions serves all (`_dq_order`)."""
  per_head = schedule.num_blocks // 2 if schedule.paired else schedule.num_blocks
  return schedule.num_ctas % per_head == 0 or per_head % schedule.num_ctas == 0


def _dq_order(schedule: PersistentSchedule, *, mask: Mask, block_q: int, group: int) -> np.ndarray:
  """rank[u, j, s]: how many additions into the dQ block that K/V block j of
  (batch, kv head) u adds into at its step s (of `group` query heads x its Q
  blocks) come before its own, int32 [units, num_kv, group * num_q] (unused
  steps 0), units = 1 where every head runs alike (`_heads_alike`: u is 0
  for all), else batch * kv_heads (u = batch * kv_heads + kv_head).

  The order is that of a model of the schedule in which every step takes
  one unit of time: CTA c's tiles run one after another, and additions into
  one Q block go by time, then by CTA. A CTA waits, before adding, for its
  rank's worth of additions (one semaphore per Q block and piece). The order
  is a total one that every CTA's own sequence of steps follows, so with
  all CTAs resident the earliest addition not yet made can always be made:
  no deadlock, whatever the real timing; the model only decides how often
  an adder waits."""
  num_kv = schedule.num_blocks
  num_units = 1 if _heads_alike(schedule) else schedule.heads * schedule.batch
  num_q = -(-mask.seq_q // block_q)
  steps = group * num_q
  lo = np.broadcast_to(mask.q_blocks_right(np.arange(num_kv) * OUTER_ROWS, WGMMA_M, block_q, NUMPY)[0], (num_kv,))
  with jax.ensure_compile_time_eval():  # numbers, also under a trace
    # Every CTA's tiles in its order: [cta, i] grids of (block, head, batch).
    counts = np.asarray(schedule.tile_count(jnp.arange(schedule.num_ctas, dtype=jnp.int32)))
    cta, i = np.meshgrid(np.arange(schedule.num_ctas), np.arange(counts.max()), indexing="ij")
    block, head, batch = (np.asarray(x) for x in schedule.tile(jnp.asarray(cta, jnp.int32), jnp.asarray(i, jnp.int32)))
  valid = i < counts[:, None]
  visits = np.where(valid, num_q - lo[block], 0)
  start = np.cumsum(group * visits, axis=1) - group * visits  # the tile's first time step on its CTA
  unit = batch * schedule.heads + head
  # The modelled tiles (all of them, or the first head's where every head
  # repeats its pattern), a row each; their steps, a column each (`used`
  # where the tile has that step).
  keep = valid & (unit < num_units)
  cta, block, unit, visits, start = (x[keep][:, None] for x in (cta, block, unit, visits, start))
  step = np.arange(steps)[None, :]
  used = step < group * visits
  position = step % np.maximum(visits, 1)
  qb = _visit(block, position, np.maximum(visits, 1), lo[block], num_q=num_q, num_kv=num_kv, causal=mask.causal,
              where=np.where, div=np.floor_divide, rem=np.remainder)
  # The dQ block each addition goes into: (unit, query head g, Q block).
  key = unit * steps + (step // np.maximum(visits, 1)) * num_q + qb
  full = lambda x: np.broadcast_to(x, used.shape)[used]
  tile_unit, tile_block, step, key, time, cta = (full(x) for x in (unit, block, step, key, start + step, cta))
  # Rank: an addition's place among its block's, by time, then by CTA.
  order = np.lexsort((cta, time, key))
  first = np.searchsorted(key[order], key[order], side="left")
  ranks = np.zeros((num_units, num_kv, steps), np.int32)
  ranks[tile_unit[order], tile_block[order], step[order]] = np.arange(order.size) - first
  return ranks


# ---------------------------------------------------------------- the kernel


def _fused_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, ranks_ref, dk_ref, dv_ref, dq_ref, *scratch,
    mask: Mask, group: int, schedule: PersistentSchedule, softmax_scale: float, config: MosaicBackwardConfig,
    interpret: bool,
):
  # Operands and the first scratch: common.Operands, common.KVOuterScratch
  # (and the interpreter's staging tile). tiles_ref: the schedule's
  # placeholder table. ranks_ref: int32 [units, num_kv, group * num_q]
  # (`_dq_order`); dq_ref: float32 [batch * heads * num_q * pieces, block_q,
  # piece columns], dQ unscaled, piece by piece.
  # Then ds_smem: [2, 2, 64, block_q], dS^T of both consumers,
  # double-buffered by step; dq_smem: [2, block_q, piece columns] f32, each
  # consumer's piece of dQ on its way out; ds_ready: [2] barriers of 2
  # arrivals; tile_done: a barrier of 2 arrivals (neither consumer reads the
  # other's K tile any more); dq_staged, dq_free: [2] barriers of 1 arrival
  # (a consumer's piece is in dq_smem; its adder has read it). In the
  # interpreter also dq_old: [2, block_q, piece columns] f32 and dq_loaded,
  # [2] barriers (the producer adds into dQ by load, add and store).
  wg = lax.axis_index("wg")
  head_dim = q_ref.shape[-1]
  block_q, stages = config.block_q, config.stages
  num_kv = k_ref.shape[1] // OUTER_ROWS
  tile_type = functools.partial(_SpreadTile, num_kv=num_kv, causal=mask.causal)
  smem, staging, scratch = KVOuterScratch.take(scratch, interpret=interpret)
  kv = KVOuter(Operands(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), dk_ref, dv_ref, smem, staging, wg=wg,
               mask=mask, group=group, block_q=block_q, stages=stages, scores=Scores(softmax_scale),
               early_vectors=config.early_vectors, interpret=interpret, tile_type=tile_type)
  ds_smem, dq_smem, ds_ready, tile_done, dq_staged, dq_free = scratch[:6]
  if interpret:
    dq_old, dq_loaded = scratch[6:]
  num_q, heads = kv.num_q, q_ref.shape[2]
  split, piece_cols = _split(head_dim), _piece_cols(head_dim)
  pieces = head_dim // piece_cols  # pieces of dQ per step: every column of the Q block

  def owner(ring_step):
    """The consumer whose turn it is at ring step `ring_step` (not split)."""
    return lax.rem(ring_step, jnp.int32(NUM_CONSUMERS))

  def ranks_unit(tile: KVTile):
    """The tile's (batch, kv head) in ranks_ref: 0 where every head has one order."""
    if ranks_ref.shape[0] == 1:
      return jnp.int32(0)
    return tile.batch * k_ref.shape[2] + tile.kv_head

  if not interpret:
    # One counter per Q block and piece of dQ: the additions made into it.
    # Zero at every call (Mosaic GPU zero-fills its global scratch).
    additions = pl.get_global(plgpu.SemaphoreType.REGULAR((q_ref.shape[0] * heads * num_q * pieces,)))

  # ------------------------------------------------ the producer

  def load_q_blocks(tile: KVTile, ring_base):
    """The first producer warp's work for one tile: the Q blocks' copies. In
    the interpreter the producer also makes the additions of the consumers'
    pieces of dQ (`add_pieces`), `stages` steps behind the copies: the step
    whose slot a copy waits for is the one whose pieces come next."""
    load = lambda step: kv.load_q_block(tile, ring_base, step)
    if not interpret:
      pl.loop(0, tile.num_steps)(load)
      return
    lag = jnp.minimum(jnp.int32(stages), tile.num_steps)
    pl.loop(0, lag)(load)

    @pl.loop(lag, tile.num_steps)
    def _(step):
      load(step)
      add_pieces(tile, ring_base, step - stages)

    pl.loop(tile.num_steps - lag, tile.num_steps)(lambda step: add_pieces(tile, ring_base, step))

  def count_additions(counters):
    """The adder's wait for the additions into dQ it has just issued (one
    semaphore index per piece) to land; then it counts them, so that the
    next adders may go. Counted at once: the next adder into a Q block
    (another CTA, a couple of steps later by `_dq_order`) waits for this
    count, and the consumers do not (their pieces were released when
    read)."""
    if interpret:
      return  # the interpreter's additions are complete when issued
    with jax.named_scope("landed"):
      plgpu.wait_smem_to_gmem(0)  # written, not only read from shared memory
    for counter in counters:
      plgpu.semaphore_signal(additions.at[counter], 1, memory_scope="gpu")

  @jax.named_scope("add_dq")
  def add_pieces(tile: KVTile, ring_base, step, consumer=None):
    """Adds the consumers' pieces of dQ_qb += dS K of the tile's `step` (Q
    block qb of query head g; float32, unscaled) into dq_ref, each after the
    `rank` additions that precede it (`_dq_order`), then counts them once
    they have landed (`count_additions`). A TMA reduce-add, the first (rank
    0) a plain store. `consumer` (split pieces): only that consumer's; else
    both consumers' (split) or the turn's owner's."""
    ring_step = ring_base + step
    g = lax.div(step, tile.visits)
    qb = tile.q_block(lax.rem(step, tile.visits))
    head = tile.kv_head * group + g
    rank = ranks_ref[ranks_unit(tile), tile.kv_index, step]
    counters = []
    adders = [consumer] if consumer is not None else range(NUM_CONSUMERS) if split else [owner(ring_step)]
    for consumer in adders:
      piece = consumer if split else 0  # the columns of dQ it adds
      counter = ((tile.batch * heads + head) * num_q + qb) * pieces + piece
      target = dq_ref.at[counter]  # contiguous: one counter per piece
      staged = dq_smem.at[consumer]
      with jax.named_scope("wait_staged"):
        plgpu.barrier_wait(dq_staged.at[consumer])
      if interpret:
        old = dq_old.at[consumer]
        plgpu.copy_gmem_to_smem(target, old, dq_loaded.at[consumer])
        plgpu.barrier_wait(dq_loaded.at[consumer])
        staged[...] = staged[...] + jnp.where(rank > 0, old[...], 0.0)  # rank 0 finds no dQ there yet
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staged, target)
        plgpu.wait_smem_to_gmem(0)
      else:
        with jax.named_scope("wait_rank"):
          plgpu.semaphore_wait(additions.at[counter], rank, decrement=False, memory_scope="gpu")
        plgpu.copy_smem_to_gmem(staged, target, predicate=rank == 0)
        plgpu.copy_smem_to_gmem(staged, target, predicate=rank > 0, reduction_op="add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(dq_free.at[consumer])
      counters.append(counter)
    count_additions(counters)

  def add_tile_pieces(tile: KVTile, ring_base, consumer: int):
    """An adder warp's work for one tile: `consumer`'s pieces, every step's
    half of the columns (split) or the steps of its turns (the ring steps
    of its parity). One warp waits on every phase of the consumer's
    dq_staged barrier and arrives on its dq_free: one piece's addition need
    not land, and be counted, before the other consumer's starts."""
    if split:
      pl.loop(0, tile.num_steps)(lambda step: add_pieces(tile, ring_base, step, consumer))
    else:
      first = lax.rem(ring_base + consumer, jnp.int32(NUM_CONSUMERS))
      pl.loop(first, tile.num_steps, step=NUM_CONSUMERS)(lambda step: add_pieces(tile, ring_base, step))

  # ------------------------------------------------ the consumers

  # A consumer stages a piece once its adder has read the one it staged
  # `gap` ring steps before; it waits for every phase of its dq_free barrier
  # in turn, the last in its epilogue.
  gap = 1 if split else NUM_CONSUMERS

  def stage_piece(dq, ring_step):
    """Hands this consumer's piece of dQ to its adder (`add_pieces`)."""
    staged = dq_smem.at[wg]

    @pl.when(ring_step >= gap)
    @jax.named_scope("wait_dq_free")
    def _():
      plgpu.barrier_wait(dq_free.at[wg])

    staged[...] = dq
    plgpu.commit_smem()
    plgpu.barrier_arrive(dq_staged.at[wg])

  def dq_product(acc_ref, buf, buffer):
    """acc += this consumer's piece of dS K: dS from both consumers' dS^T in
    ds_smem[buf] (transposed), K from both K tiles of `buffer`."""
    columns = pl.ds(wg * piece_cols if split else 0, piece_cols)
    for c in range(NUM_CONSUMERS):
      plgpu.wgmma(acc_ref, ds_smem.at[buf, c].transpose((1, 0)), kv.smem.k.at[buffer, c, :, columns])

  def last_release(end_step):
    """A consumer's epilogue: its adder's read of its last piece, if it
    staged any (every barrier phase is waited for)."""
    staged_any = end_step > (0 if split else wg)
    pl.when(staged_any)(lambda: plgpu.barrier_wait(dq_free.at[wg]))

  def gradients(tile: KVTile, buffer, ring_base):
    """(dK unscaled, dV) of this consumer's rows of `tile`, its Q blocks at
    the ring's steps from ring_base, and its pieces of dQ handed over; its K
    and V rows are in `buffer`."""
    k_start, k_a, v_a = kv.wait_kv(tile, buffer)
    if head_dim == 64 and not interpret:  # K and V into registers, once per tile
      k_a, v_a = (plgpu.load(t, layout=plgpu.Layout.WGMMA) for t in (k_a, v_a))
    _, full_lo, _, _ = kv.q_blocks(k_start)

    def step(position, carry, *, g, masked: bool):
      # The Q block at `position` of the tile's visits: dK, dV and this
      # step's piece of dQ.
      dk, dv = carry
      ring_step = ring_base + g * tile.visits + position
      qb, slot = tile.q_block(position), lax.rem(ring_step, jnp.int32(stages))
      p_t, ds_t, q_tile, do_tile = kv.p_and_ds_t(k_a, v_a, k_start, qb, slot, masked=masked)
      # Both consumers' dS^T rows make the dS of dQ = dS K.
      buf = lax.rem(ring_step, jnp.int32(2))
      with jax.named_scope("stage_ds"):
        ds_smem.at[buf, wg][...] = ds_t
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready.at[buf])

      def dq_after_ds(acc_ref):
        plgpu.barrier_wait(ds_ready.at[buf])  # the other consumer's dS^T
        dq_product(acc_ref, buf, buffer)

      if split and not interpret:  # this consumer's piece in the group of dV and dK
        zero = plgpu.layout_cast(jnp.zeros((block_q, piece_cols), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv, piece = kv.add_grads(dk, dv, p_t, ds_t, q_tile, do_tile, also=(zero, dq_after_ds))
      else:
        dk, dv = kv.add_grads(dk, dv, p_t, ds_t, q_tile, do_tile)
      kv.release_q_block(slot)

      @jax.named_scope("dq")
      def own_piece():
        if split and not interpret:
          stage_piece(piece, ring_step)
          return
        plgpu.barrier_wait(ds_ready.at[buf])  # the other consumer's dS^T

        def product(acc_ref):
          dq_product(acc_ref, buf, buffer)
          return acc_ref[...]

        stage_piece(pl.run_scoped(product, plgpu.ACC((block_q, piece_cols), jnp.float32)), ring_step)

      if split:
        own_piece()
      else:  # the consumers take turns
        pl.when(owner(ring_step) == wg)(own_piece)
      return dk, dv

    def one_head(g, carry):
      # Query head kv_head * group + g. Both consumers take every step of the
      # tile (their pieces of dQ need each other's dS^T), so the second one
      # computes, masked, the Q blocks before its own diagonal (P = 0
      # there). The masked blocks come first when the tile climbs, last when
      # it descends (`_visit`).
      visit = functools.partial(step, g=g)
      if not mask.causal:
        return lax.fori_loop(0, tile.visits, functools.partial(visit, masked=False), carry)
      num_masked = full_lo - tile.lo
      descending = 2 * tile.kv_index >= num_kv
      first = jnp.where(descending, 0, num_masked)
      last = jnp.where(descending, tile.visits - num_masked, tile.visits)
      carry = lax.fori_loop(0, first, functools.partial(visit, masked=True), carry)
      carry = lax.fori_loop(first, last, functools.partial(visit, masked=False), carry)
      return lax.fori_loop(last, tile.visits, functools.partial(visit, masked=True), carry)

    acc = plgpu.layout_cast(jnp.zeros((WGMMA_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    # The other consumer's K rows take part in this consumer's dQ products.
    plgpu.barrier_wait(kv.smem.kv_ready.at[buffer * NUM_CONSUMERS + 1 - wg])
    carry = (acc, acc)
    dk, dv = one_head(jnp.int32(0), carry) if group == 1 else lax.fori_loop(0, group, one_head, carry)
    # dK and dV are staged in the K and V tiles next: the other consumer
    # must be done reading this one's K.
    plgpu.barrier_arrive(tile_done)
    plgpu.barrier_wait(tile_done)
    return kv.zero_padded_keys(k_start, dk, dv)

  adders = () if interpret else [functools.partial(add_tile_pieces, consumer=c) for c in range(NUM_CONSUMERS)]
  run_tiles(schedule, kv.tile_at, wg=wg, axis="kv", produce=load_q_blocks, observe=kv.observe, load=kv.load_kv,
            compute=gradients, store=kv.store_gradients, epilogue=last_release, buffers=_buffers(config),
            produce_aside=adders, tiles_ref=tiles_ref)


def _fused_call(q, k, v, do, lse, delta, *, mask: Mask, softmax_scale: float, config: MosaicBackwardConfig,
                interpret) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The fused kernel on operands padded by `pad_backward`: (dk, dv, dQ
  float32 unscaled piece by piece; Q blocks that no key is visible to are
  left unwritten, see `_finish_dq`)."""
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  interpret_params, interpret = interpret_params_of(interpret)
  dtype, block_q, cols = q.dtype, config.block_q, _piece_cols(head_dim)
  scratch = kv_outer_scratch(head_dim, dtype, block_q=block_q, stages=config.stages, buffers=_buffers(config),
                             interpret=interpret)
  scratch += [
      plgpu.SMEM((2, NUM_CONSUMERS, WGMMA_M, block_q), dtype, transforms=swizzled(block_q, dtype)),  # dS^T
      plgpu.SMEM((NUM_CONSUMERS, block_q, cols), jnp.float32, transforms=swizzled(cols, jnp.float32)),  # pieces of dQ
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=2),  # dS^T staged
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # tile done
      plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # a piece of dQ staged
      plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # ... and read by its adder
  ]
  if interpret:
    scratch += [
        plgpu.SMEM((NUM_CONSUMERS, block_q, cols), jnp.float32, transforms=swizzled(cols, jnp.float32)),
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # dQ loaded
    ]
  num_kv = k.shape[1] // OUTER_ROWS
  group = heads // kv_heads
  schedule = _fused_schedule(num_kv, kv_heads, batch, causal=mask.causal, interpret=interpret)
  ranks = jnp.asarray(_dq_order(schedule, mask=mask, block_q=block_q, group=group))
  # dQ piece by piece, each piece of block_q rows contiguous (`_finish_dq`
  # puts the rows back in q's layout): a TMA reduce-add then writes 16 KiB
  # in one run, not 64 rows of 256 bytes heads * head_dim * 4 bytes apart.
  num_pieces = batch * heads * pl.cdiv(mask.seq_q, block_q) * (head_dim // cols)
  out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype),
              jax.ShapeDtypeStruct((num_pieces, block_q, cols), jnp.float32))
  kernel = functools.partial(_fused_kernel, mask=mask, group=group, schedule=schedule, softmax_scale=softmax_scale,
                             config=config, interpret=interpret)
  return specialized_kernel(kernel, out_type=out_type, scratch=scratch, grid=(schedule.num_ctas,),
                            grid_names=("cta",), interpret_params=interpret_params, name="flash2_bwd_dkv_mosaic")(
                                q, k, v, do, lse, delta, tile_table(schedule), ranks)


def _finish_dq(dq, shape, *, mask: Mask, softmax_scale: float, dtype) -> jax.Array:
  """dQ of `shape` ([batch, seq_q, heads, head_dim]) from the kernel's
  float32 sum, piece by piece ([batch * heads * Q blocks * pieces per block,
  block_q, piece columns]): scaled, cast, in q's layout, and 0 in the rows
  that see no key (causal, seq_q > seq_k: their Q blocks may be
  unwritten)."""
  batch, _, heads, head_dim = shape
  num_blocks, block_q, cols = dq.shape
  dq = dq.reshape(batch, heads, num_blocks // (batch * heads * (head_dim // cols)), head_dim // cols, block_q, cols)
  dq = dq.transpose(0, 2, 4, 1, 3, 5).reshape(batch, -1, heads, head_dim)[:, :mask.seq_q] * softmax_scale
  if mask.causal and mask.seq_q > mask.seq_k:
    sees_a_key = jnp.arange(dq.shape[1]) + mask.offset >= 0
    dq = jnp.where(sees_a_key[None, :, None, None], dq, 0.0)
  return dq.astype(dtype)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
             causal: bool = False, softmax_scale: float | None = None, config: MosaicBackwardConfig | None = None,
             interpret: bool | plgpu.InterpretGPUParams = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """dQ, dK and dV of FlashAttention-2 on Hopper via Mosaic GPU, in one
  kernel, deterministic. Arguments as backward.dkv (head_dim 64 or 128);
  config, with fused_dq True (block_q 64), defaults to
  `defaults.mosaic_backward(head_dim)`, which fuses at head_dim 64.

  Returns:
    (dq, dk, dv), each like its primal.
  """
  check_operands("the fused Mosaic GPU backward", HEAD_DIMS, q, k, v, do, lse, delta)
  head_dim = q.shape[-1]
  if config is None:
    config = defaults.mosaic_backward(head_dim)
  check_config(config, head_dim, q.dtype)
  softmax_scale = softmax_scale_of(softmax_scale, head_dim)
  mask = Mask(q.shape[1], k.shape[1], causal=causal)
  dk, dv, dq = _fused_call(*pad_backward(q, k, v, do, lse, delta), mask=mask, softmax_scale=softmax_scale,
                           config=config, interpret=interpret)
  dq = _finish_dq(dq, q.shape, mask=mask, softmax_scale=softmax_scale, dtype=q.dtype)
  return dq, unpad_seq(dk, mask.seq_k), unpad_seq(dv, mask.seq_k)
