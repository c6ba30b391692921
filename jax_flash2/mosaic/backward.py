"""FlashAttention-2 backward pass for Hopper (sm_90a) in Pallas's Mosaic GPU backend.

Two kernels that take the forward's natural-log `lse` and `delta =
rowsum(dO * O)` (float32, [batch, heads, seq_q]) and return the gradients;
flash_attention's backward on Hopper (backend "mosaic", and "auto" where
config.hopper_choice says so).

`dkv` (K/V-outer). One CTA owns `OUTER_ROWS` = 128 key rows of one (batch,
kv head), split between two consumer warpgroups of 64 rows each; each keeps
its K and V tiles in shared memory and dK, dV in registers. A producer
warpgroup streams Q, dO, lse and delta blocks of `block_q` rows through a
ring of `stages` slots (for every query head of the kv head's group in turn:
grouped-query attention sums dK and dV in the accumulators). Per Q block each
consumer computes, transposed so that its own key rows are the wgmma M side:

  S^T  = K Q^T,  dP^T = V dO^T     (one wgmma group, SMEM operands, one wait)
  P^T  = exp2(S^T * scale*log2e - lse*log2e)
  dS^T = P^T * (dP^T - delta)
  dV  += P^T dO,  dK += dS^T Q      (one wgmma group, P^T and dS^T from
                                     registers, one wait)

and scales dK by softmax_scale once at the end; dK and dV leave through the
K and V tiles and TMA stores.

`dq` (Q-outer), the forward's structure: one CTA owns 128 query rows of one
(batch, head), two consumers of 64 rows (Q, dO, lse and delta of their rows
loaded once), a producer streams K and V blocks of `block_kv` rows:

  S = Q K^T and dP = dO V^T (one wgmma group), P = exp2(S * scale*log2e -
  lse*log2e), dS = P * (dP - delta), dQ += dS K (wgmma, dS from registers),
  dQ *= softmax_scale at the end.

With `BackwardConfig.fused_dq` there is one kernel: `dkv` computes dQ too,
as FlashAttention-2's backward does, instead of `dq` recomputing S and dP
(5 matmuls per block instead of 7). Both consumers stage their dS^T in
shared memory; each then computes its piece of dQ_i = dS_i K (half the
columns at head_dim 128, in the wgmma group of dV and dK; all of them every
other step at head_dim 64) and hands it, through shared memory, to the
producer warpgroup, which adds it to a float32 dQ in global memory with a
TMA reduce-add, so that the consumers never wait on global memory. No
atomics in an arbitrary order: every Q block's additions come in an order
fixed by `_dq_order` (a model of the persistent schedule in which tiles
visit their Q blocks staggered, `_visit`), enforced by a semaphore per Q
block and piece that counts the additions made, so the gradients are
deterministic. The CTAs are persistent, one per SM, all resident, which
the waits need. With `BackwardConfig.dq_adder_warp` the producer's second
warp makes the additions while its first issues the loads, and with
`dq_adder_warps` 2 its second and third warps each make one consumer's. The
head_dim-64 default takes this kernel with both; head_dim 128 the two.

With `BackwardConfig.dq_persistent` / `dkv_persistent` either kernel runs as
the forward's persistent CTAs (forward.PersistentSchedule: one per SM over
many tiles, causal tiles in pairs of equal work; the ring runs on across
tiles and the outer tiles are double-buffered). Off by default until timed.

Causal attention is bottom-right aligned (query i sees key j iff
j <= i + seq_k - seq_q): blocks entirely outside are skipped, only blocks
crossing the diagonal are masked (P set to 0 after the exponential, so that
rows that see no key at all, lse = -inf, give 0 and not NaN). A consumer
whose range starts (dkv) or ends (dq) a block away from its neighbour's
drains those ring slots (waits ready, arrives consumed) so that barrier
phases stay in step.

Ragged lengths, as in forward.py: the kernels work on whole blocks, and
`dkv`, `dq` and `backward` pad seq_q and seq_k to multiples of OUTER_ROWS
(which every block_q and block_kv divides, so that one padding serves both
kernels; whole-block lengths are passed through without a copy) and slice
the gradients back. Bounds and masks use the real lengths; no streamed
block of padding alone is visited. Keys past seq_k: under causal attention
the diagonal's mask hides them from every real query; otherwise dq masks
them (P = 0) in its last K/V block, and dkv, where they are rows of the outer
tile and reach only their own rows of dK and dV, zeroes those rows once at
the end rather than masking every Q block. Padded query rows get lse = +inf,
so P = exp2(S - inf) = 0, and dO = 0, delta = 0, so dS = 0: they add
nothing to dK and dV, and their dQ rows (0) are sliced away.

Per ring slot there are ready barriers (completed by the TMA engine) for each
streamed array and consumed barriers (two arrivals): dkv releases Q, lse, dO
and delta after its second wgmma group; dq releases V after dP = dO V^T and
K after dQ += dS K (K is read twice).

Supported: bf16 and fp16; head_dim 64 and 128 here, 256 in
backward_wide.py (64 outer rows per CTA, the consumers splitting head_dim;
`dkv`, `dq` and `backward` route it there); grouped-query attention; any
seq_q, seq_k >= 1. Otherwise NotImplementedError.

In Mosaic's interpreter (interpret=True; jax 0.11.2 runs wgmma only from
shared-memory operands into fresh accumulators), P^T / dS^T (dS for dq) take
a detour through shared memory and the products are added afterwards, as in
forward.py; the compiled kernel never takes that branch.

Status: runs on the H200 and passes its GPU tests at the Triton path's bar,
ragged lengths included (session 4; persistent by default since session 6;
speed in bench/NOTES.md). The fused kernel passes its GPU tests, bit-for-bit
deterministic. At head_dim 128 it is slower than the two kernels (12-50%
at 4k, 4-10% at 16k; sessions 7-11; with two adder warps level with them
without a mask, 12-19% behind causal, session 15). At 64, with the additions in a warp of
their own (dq_adder_warp) and K and V in registers (kv_registers), it is
2-4.5% faster than them and the default (session 12). Its reduce-adds
were what it lost (`dq_addition_experiment`: 17% faster without them, 10%
with half of each CTA's), and most of that was one warp making them all in
a chain: each addition must land, and be counted, before the next one's
turn. With a warp per consumer (dq_adder_warps 2) it is 7-15% faster again
(session 14), 16k at 12.0 ms against 11.7 without any additions (session
12). Designs that halved the additions did worse: a cluster pair summing
its pieces (60-75% slower, session 12), tiles of 256 key rows (their own
work 21% slower; session 13, commit 9e2cf89), three consumers of 64 key
rows (spilling at 160 registers, 1.6-2.4x slower; session 14, commit
84ea775). Checked on CPU: lowering for CUDA,
compilation to sm_90a SASS (tools/mosaic_bwd_cpu_compile.py: HGMMA, no
spills except a few scalars in the causal dkv at head_dim 128; dkv at
block_q 128 and head_dim 128 spills heavily: S^T and dP^T then take 128
registers), and dq, dk, dv against the reference's gradients in Mosaic's
interpreter (tests/test_mosaic.py; its race detector finds no race here and
does find one when the producer skips the Q-consumed wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2.mosaic import poly_exp2
from jax_flash2.mosaic.forward import (
    CONSUMER_REGISTERS,
    LOG2_E,
    NUM_CONSUMERS,
    SMEM_LIMIT,
    SUPPORTED_DTYPES,
    WGMMA_M,
    PersistentSchedule,
    QTile,
    _kv_block_bounds,
    _sm_count,
    interpret_params_of,
    kv_ring_producer,
    observe_last_releases,
    outer_grid,
    pad_seq,
    q_tile_work,
    run_tiles,
    specialized_kernel,
    tile_table,
    unpad_seq,
    visible,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# What Mosaic adds to the buffers counted by `dkv_smem_bytes` /
# `dq_smem_bytes` (barriers, 1 KiB alignment of swizzled tiles): 96-688
# bytes in the head_dim-128 kernels (sm_90a compiles, session 7), where a
# third ring slot beside persistent CTAs' second outer tiles leaves ~850
# bytes of the 227 KiB. An estimate: Mosaic itself refuses a kernel that
# does not fit.
BWD_SMEM_RESERVE = 1024
# Served by backward_wide.py (dK + dV of 64 rows do not fit a warpgroup's registers).
WIDE_HEAD_DIMS = (256,)
# Rows of the outer operand per CTA: 64 per consumer warpgroup (K/V rows for
# dkv, Q rows for dq).
OUTER_ROWS = NUM_CONSUMERS * WGMMA_M


@dataclasses.dataclass(frozen=True)
class _DQExperiment:
  """Measurement only (`dq_addition_experiment`): the fused kernel's tiles
  whose index is a multiple of `every` add their pieces of dQ (none when
  0), or with `alternate` the steps whose index plus the tile's is (each
  tile adds at every other step, its neighbour at the others); `ordered`
  False drops the waits for the additions before one's own.
  `elementwise` False (`elementwise_experiment`): P = S and dS = dP.
  `staging` False: the consumers compute their pieces of dQ but hand none to
  the producer (no staging store, no dq_staged / dq_free handshake; the
  producer only loads). `lockstep` False: a consumer's dQ product does not
  wait for the other consumer's dS^T (it reads whatever is there).
  (Register atomics in place of the hand-over, unordered, were 30-50%
  slower: session 11, commit 526d782 and bench/NOTES.md.)"""
  every: int = 1
  alternate: bool = False
  ordered: bool = True
  elementwise: bool = True
  staging: bool = True
  lockstep: bool = True


_DQ_EXPERIMENT: _DQExperiment | None = None  # None: the kernel as it is


@contextlib.contextmanager
def dq_addition_experiment(every: int = 1, *, alternate: bool = False, ordered: bool = True, staging: bool = True,
                           lockstep: bool = True):
  """Measurement only; the gradients come out wrong. The fused kernels traced
  inside skip the reduce-adds of dQ of the K/V tiles whose index is not a
  multiple of `every` (every = 2: half the traffic, as two CTAs summing
  their pieces before one reduce-add would give; 0: no additions), keeping
  everything else (the semaphores' order, the staging); with ordered=False
  no adder waits for the additions ranked before its own (`_dq_order`), as
  a nondeterministic kernel would not. How fast the fused kernel would run
  if its reduce-adds or their order cost less (bench/NOTES.md, sessions
  7-8; tools/mosaic_bwd_bench.py, variants with `adders=N`, `unordered=1`).
  staging=False, lockstep=False: without the hand-over of the pieces to the
  producer, without the wait for the other consumer's dS^T (`_DQExperiment`;
  `staging=0`, `lockstep=0`; session 11). alternate=True with every = 2:
  every tile adds at every other step, its neighbour at the others, as a
  cluster pair taking turns at summing both pieces and adding them would
  (`alternate=1`; session 12: 10% faster at head_dim 64; the pair itself,
  built, was 60-75% slower, commit 81ed68f)."""
  with _experimenting(every=every, alternate=alternate, ordered=ordered, staging=staging, lockstep=lockstep):
    yield


@contextlib.contextmanager
def elementwise_experiment():
  """Measurement only; the gradients come out wrong. The dK/dV and dQ
  kernels traced inside skip their element-wise work (P = S: no
  exponentials, no lse; dS = dP: no delta), keeping the matmuls, the ring
  and every wait: how fast the kernels would run if that work were free
  (bench/NOTES.md, session 10; tools/mosaic_bwd_bench.py, `elementwise=0`)."""
  with _experimenting(elementwise=False):
    yield


@contextlib.contextmanager
def _experimenting(**changes):
  """The experiments in force, with `changes` (_DQExperiment fields), for
  the kernels traced inside; as they were after."""
  global _DQ_EXPERIMENT
  saved = _DQ_EXPERIMENT
  _DQ_EXPERIMENT = dataclasses.replace(_experiment(), **changes)
  try:
    yield
  finally:
    _DQ_EXPERIMENT = saved


def _experiment() -> _DQExperiment:
  """The measurement experiments in force (nested ones combine)."""
  return _DQ_EXPERIMENT or _DQExperiment()


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiling of the Mosaic GPU backward kernels.

  Attributes:
    block_q: query rows per ring slot of `dkv` (64 or 128).
    block_kv: key/value rows per ring slot of `dq` (64 or 128).
    stages: ring slots (>= 2).
    softmax_overlap: let the element-wise work of a step run while the
      tensor cores finish the product issued before it (as the forward's
      option of that name), in both kernels: dkv computes P^T while dP^T =
      V dO^T runs and dS^T while dV += P^T dO runs; dq computes P while dP
      runs. dkv loses 1-11% (session 5), hence off by default.
    dq_softmax_overlap: the same in the dQ kernel alone, on by default at
      head_dim 64 and 128: 1-5% off its time at most lengths (session 8).
    dq_persistent: run the dQ kernel (Q-outer, the forward's structure) as
      the forward's persistent CTAs (forward.MosaicConfig.persistent): one
      per SM over many tiles, each tile's start and end overlapping the
      neighbouring tiles' work. Costs a second set of Q, dO, lse and delta
      rows in shared memory. On in the defaults (`default_backward_config`).
    dkv_persistent: the same for the dK/dV kernel (K/V-outer; causal tiles
      paired K/V block 0 with the last, ...). Costs a second set of K and V
      tiles (at head_dim 128 room for a ring slot: stages 2). On in the
      defaults at head_dim 64 and 128. With fused_dq (whose CTAs are
      persistent anyway) it says whether they keep that second set.
    fused_dq: fold dQ into the dK/dV kernel (FlashAttention-2's single
      backward kernel): each K/V tile adds dS K into a float32 dQ in global
      memory, in an order fixed per Q block (semaphores; see `_dq_order`),
      so that gradients stay deterministic; S and dP are computed once, not
      twice. Needs block_q 64, and all its CTAs resident at once (one per
      SM; a GPU shared with other work only delays it, an SM limit such as
      MPS's would hang it). On at head_dim 64 (with dq_adder_warp and
      kv_registers: 2-4.5% faster than the two kernels, session 12; with
      dq_adder_warps 2 another 7-15%, session 14); off at 128, where it was
      slower with one adder warp (bench/NOTES.md, sessions 6-12) and with
      two level without a mask, 12-19% behind causal (session 15).
    kv_registers: with fused_dq, the consumers hold their K and V rows in
      registers, loaded once per tile, for S^T = K Q^T and dP^T = V dO^T,
      which then read only Q and dO from shared memory. head_dim 64 only
      (32 more registers). 0.3-1.4% off the fused kernel (session 12). Not
      for the two kernels: ptxas 13.0 miscompiles their non-causal dK/dV
      loop with it (the loop hands K's registers to P^T; session 10,
      tools/mosaic_cpu_compile.py's A-clobber check), not the fused one.
    early_vectors: the dK/dV kernel (and the fused one) loads each Q
      block's lse and delta from shared memory between issuing S^T, dP^T
      and waiting for them, not after: Nsight Compute (session 16, d128)
      found ~7% of its consumers' time in the multiply of lse waiting for
      those loads. Their 32 registers (head_dim 128: 16 columns each) are
      then live across the wait. Not in the softmax_overlap step. On in the
      head_dim-64 default (the fused kernel 1-2% faster causal, even without
      a mask); off at 128, where the two kernels ran even with it and spill
      more causal (session 17).
    q_registers: the dQ kernel's consumers hold their Q and dO rows in
      registers for S = Q K^T and dP = dO V^T, which then read only K and V
      from shared memory (head_dim 64 and 128: no spills on sm_90a). On in
      the defaults: 0-9% off the dQ kernel's time (session 9).
    dq_consumers: consumer warpgroups of the dQ kernel, 2 or 3 (head_dim
      64 only: 160 registers each; 192 Q rows per CTA, three consumers'
      element-wise work beside one another's matmuls, as the forward's
      MosaicConfig.consumers). Three were no faster on the H200 (session
      8), hence two by default.
    dq_turns: with fused_dq, the two consumers take turns at adding dQ,
      each a whole-width piece at every other step, instead of each adding
      half the columns at every step (`_dq_piece`); at head_dim 64 they
      always take turns. At head_dim 128 slower than the split (session 7).
    balanced: causal persistent CTAs of either kernel (not the fused one,
      whose CTAs run in lockstep rounds) take their tiles from a balanced
      table, as forward.MosaicConfig.balanced. Off: no gain at head_dim
      128 (session 15: -6% to +3% of the two kernels' time, the dK/dV
      kernel spilling 40-90 bytes more).
    dq_adder_warp: with fused_dq, the producer warpgroup's second warp adds
      the pieces of dQ while its first warp issues the loads, so that the
      loads never wait behind the additions' waits (FlashAttention-3's dQ
      writer warp; session 11). Compiled kernels only: in Mosaic's
      interpreter the producer does both in turn.
    dq_adder_warps: with dq_adder_warp, warps of the producer that add
      dQ, 1 or 2: with 2 the second and third warps each add one
      consumer's pieces, so that one piece's addition need not land (and be
      counted) before the next piece's starts. Each adder's steps are a
      chain: wait for the piece, for the additions ranked before it, add,
      wait until it has landed, count it; one warp alone was the kernel's
      bottleneck. On in the head_dim-64 default: 7-15% faster (session 14).
      At head_dim 128 the fused kernel with two draws level with the two
      kernels without a mask and stays 12-19% behind causal (session 15).
    dkv_poly_columns, dq_poly_columns: the last columns of each P^T tile of
      the dK/dV kernel (of block_q) and each P tile of the dQ kernel (of
      block_kv) whose exponentials are a polynomial on the FP32 units
      instead of the SFU's ex2 (as forward.MosaicConfig.poly_columns;
      `poly_exp2.py`). Multiples of 8; 0: ex2 alone. Off: no faster at
      head_dim 64 (session 9).
  The outer block is fixed: OUTER_ROWS (128) rows per CTA, 64 per consumer.
  Both kernels pad seq_q and seq_k to multiples of OUTER_ROWS (ragged
  lengths; see the module docstring).
  """

  block_q: int = 64
  block_kv: int = 64
  stages: int = 2
  softmax_overlap: bool = False
  dq_softmax_overlap: bool = False
  dq_persistent: bool = False
  dkv_persistent: bool = False
  balanced: bool = False
  fused_dq: bool = False
  dq_turns: bool = False
  dq_adder_warp: bool = False
  dq_adder_warps: int = 1
  kv_registers: bool = False
  early_vectors: bool = False
  q_registers: bool = False
  dq_consumers: int = NUM_CONSUMERS
  dkv_poly_columns: int = 0
  dq_poly_columns: int = 0

  def __post_init__(self):
    for name in ("softmax_overlap", "dq_softmax_overlap", "dq_persistent", "dkv_persistent", "balanced", "fused_dq",
                 "dq_turns", "kv_registers", "early_vectors", "q_registers", "dq_adder_warp"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"BackwardConfig.{name} must be a bool, got {getattr(self, name)!r}")
    for name in ("block_q", "block_kv", "stages", "dq_consumers", "dq_adder_warps", "dkv_poly_columns",
                 "dq_poly_columns"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"BackwardConfig.{name} must be an int, got {value!r}")
    for name in ("block_q", "block_kv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"BackwardConfig.{name} must be 64 or 128, got {getattr(self, name)}")
    if self.dq_consumers not in CONSUMER_REGISTERS:
      raise ValueError(f"BackwardConfig.dq_consumers must be 2 or 3, got {self.dq_consumers}")
    if not 2 <= self.stages <= 8:
      raise ValueError(f"BackwardConfig.stages must be between 2 and 8, got {self.stages}")
    if self.fused_dq and self.block_q != WGMMA_M:
      raise ValueError(f"BackwardConfig.fused_dq needs block_q {WGMMA_M}, got {self.block_q}")
    if self.fused_dq and self.softmax_overlap:
      raise ValueError("BackwardConfig.fused_dq does not take softmax_overlap")
    if self.early_vectors and self.softmax_overlap:
      raise ValueError("BackwardConfig.early_vectors is for the step without softmax_overlap")
    if self.dq_adder_warps not in (1, 2):
      raise ValueError(f"BackwardConfig.dq_adder_warps must be 1 or 2, got {self.dq_adder_warps}")
    if self.dq_adder_warps != 1 and not self.dq_adder_warp:
      raise ValueError("BackwardConfig.dq_adder_warps needs dq_adder_warp")
    if self.dq_adder_warp and not self.fused_dq:
      raise ValueError("BackwardConfig.dq_adder_warp needs fused_dq")
    if self.kv_registers and not self.fused_dq:
      raise ValueError("BackwardConfig.kv_registers needs fused_dq (ptxas 13.0 miscompiles the dK/dV kernel's "
                       "loop with it)")
    poly_exp2.check_poly_columns("BackwardConfig.dkv_poly_columns", self.dkv_poly_columns, self.block_q)
    poly_exp2.check_poly_columns("BackwardConfig.dq_poly_columns", self.dq_poly_columns, self.block_kv)

  def unfused(self) -> BackwardConfig:
    """This tiling with dQ in a kernel of its own: fused_dq off, and the
    options that need it (the head_dim-64 default fuses dQ; softmax_overlap,
    for one, takes the two kernels)."""
    return dataclasses.replace(self, fused_dq=False, dq_adder_warp=False, dq_adder_warps=1, kv_registers=False)

  @property
  def dkv_buffers(self) -> int:
    """Sets of K and V tiles the dK/dV kernel keeps."""
    return 2 if self.dkv_persistent else 1

  def dkv_smem_bytes(self, head_dim: int, dtype) -> int:
    if head_dim in WIDE_HEAD_DIMS:
      return _wide().dkv_smem_bytes(self, head_dim, dtype)
    item = jnp.dtype(dtype).itemsize
    kv = self.dkv_buffers * 2 * OUTER_ROWS * head_dim * item
    ring = self.stages * (2 * self.block_q * head_dim * item + 2 * self.block_q * 4)
    fused = 0
    if self.fused_dq:  # dS^T, double-buffered; the staged pieces of dQ (float32)
      piece = _dq_piece(head_dim, self.dq_turns)
      fused = 2 * OUTER_ROWS * self.block_q * item + piece.buffers * self.block_q * piece.cols * 4
    return kv + ring + fused + BWD_SMEM_RESERVE

  @property
  def dq_buffers(self) -> int:
    """Sets of Q, dO, lse and delta rows the dQ kernel keeps."""
    return 2 if self.dq_persistent else 1

  def dq_smem_bytes(self, head_dim: int, dtype) -> int:
    if head_dim in WIDE_HEAD_DIMS:
      return _wide().dq_smem_bytes(self, head_dim, dtype)
    item = jnp.dtype(dtype).itemsize
    rows = self.dq_consumers * WGMMA_M
    q = self.dq_buffers * (2 * rows * head_dim * item + 2 * rows * 4)
    ring = self.stages * 2 * self.block_kv * head_dim * item
    return q + ring + BWD_SMEM_RESERVE


def default_backward_config(head_dim: int) -> BackwardConfig:
  """The tiling per head_dim, measured on the H200 (bench/NOTES.md, sessions
  5-6). dkv keeps dK and dV in registers (128 per thread at head_dim 128),
  so its Q blocks stay at 64 rows: ptxas spills the causal dkv at block_q
  128 even at head_dim 64. dq holds only dQ and takes 128-row K/V blocks at
  head_dim 64. Both kernels run as persistent CTAs (2-13% faster at head_dim
  64, 0-6% at 128 up to 8k, within 2% at 16k), whose second outer buffers
  leave room for two ring slots at head_dim 128. Three dQ consumers at
  head_dim 64 (dq_consumers; 64-row K/V blocks, 128 spill) gave -13% to +32%
  of the dQ kernel's time, no gain overall (session 8): two. The dQ kernel
  overlaps its softmax with dP's product (1-5% faster at most lengths,
  session 8; the dK/dV kernel loses with it, session 5) and takes Q and dO
  from registers (q_registers: 0-9% faster, session 9). Their causal tiles
  stay in pairs: from the balanced table (balanced) the two d128 kernels
  were 6% faster to 3% slower, no gain (session 15).

  At head_dim 64 one kernel computes dQ as well (fused_dq, as
  `fused_backward_config`), with its additions in warps of their own, one
  per consumer, and K and V in registers: 2-4.5% faster than the two
  kernels at 4k-16k, both masks, with one adder warp (session 12), 7-15%
  faster again with two (session 14). It loads each Q block's lse and delta
  while S^T and dP^T are on the tensor cores (early_vectors: 1-2% faster
  causal, even without a mask, session 17; at head_dim 128 even, with more
  spills). The dQ kernel's fields stay for `dq` called alone."""
  if head_dim <= 64:
    return BackwardConfig(block_q=64, block_kv=128, stages=4, dq_softmax_overlap=True, dq_persistent=True,
                          dkv_persistent=True, q_registers=True, fused_dq=True, dq_adder_warp=True,
                          dq_adder_warps=2, kv_registers=True, early_vectors=True)
  if head_dim in WIDE_HEAD_DIMS:
    # backward_wide.py: 64-row blocks, room for two ring slots; persistent dQ
    # CTAs (2-17% faster; persistent dK/dV CTAs spill and lose up to 11%).
    return BackwardConfig(block_q=64, block_kv=64, stages=2, dq_persistent=True)
  return BackwardConfig(block_q=64, block_kv=64, stages=2, dq_softmax_overlap=True, dq_persistent=True,
                        dkv_persistent=True, q_registers=True)


def _wide():
  """backward_wide.py, the head_dim-256 kernels (imported late: it imports this module)."""
  from jax_flash2.mosaic import backward_wide

  return backward_wide


def fused_backward_config(head_dim: int) -> BackwardConfig:
  """The tiling of the fused kernel (dQ folded into dK/dV): the deepest ring
  beside its dS^T and dQ staging, and, at head_dim 64, room for a second set
  of K and V tiles."""
  if head_dim <= 64:
    return BackwardConfig(block_q=64, block_kv=128, stages=4, dkv_persistent=True, fused_dq=True)
  return BackwardConfig(block_q=64, block_kv=64, stages=2, fused_dq=True)


def _check_inputs(q, k, v, do, lse, delta, config: BackwardConfig, kernels: tuple[str, ...]) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have one shape, got {k.shape} and {v.shape}")
  if do.shape != q.shape:
    raise ValueError(f"do must have q's shape {q.shape}, got {do.shape}")
  batch, seq_q, heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k's batch and head_dim must match q's: q {q.shape}, k {k.shape}")
  if heads % k.shape[2]:
    raise ValueError(f"q's heads ({heads}) must be a multiple of k's ({k.shape[2]})")
  for name, x in (("lse", lse), ("delta", delta)):
    if x.shape != (batch, heads, seq_q) or x.dtype != jnp.float32:
      raise ValueError(
          f"{name} must be float32 [batch, heads, seq_q] = {(batch, heads, seq_q)}, got {x.dtype} {x.shape}")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, do)}
  if len(dtypes) != 1:
    raise ValueError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"the Mosaic GPU backward supports bfloat16 and float16, got {q.dtype}")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(f"the Mosaic GPU backward supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
  if "dkv" in kernels and config.kv_registers and head_dim != 64:
    raise NotImplementedError(f"BackwardConfig.kv_registers needs head_dim 64 (registers), got {head_dim}")
  if "dq" in kernels and config.dq_consumers != NUM_CONSUMERS and head_dim != 64:
    raise NotImplementedError(
        f"BackwardConfig.dq_consumers {config.dq_consumers} needs head_dim 64 (registers), got {head_dim}")
  for kernel in kernels:
    smem = getattr(config, f"{kernel}_smem_bytes")(head_dim, q.dtype)
    if smem > SMEM_LIMIT:
      raise ValueError(
          f"{config} needs {smem} bytes of shared memory for {kernel} at head_dim {head_dim}, more "
          f"than the {SMEM_LIMIT} a Hopper CTA has: lower stages or the block sizes"
      )


def _q_block_bounds(k_start, rows: int, seq_q: int, seq_k: int, block_q: int, causal: bool, *, xp=jnp):
  """(lo, full_lo): key rows [k_start, k_start + rows) are seen by no query of
  Q blocks [0, lo), by some of blocks [lo, full_lo) (the diagonal) and by
  every query of blocks [full_lo, num_q). seq_q, seq_k are the real lengths:
  num_q = cdiv(seq_q, block_q), no block of padded queries alone; keys past
  seq_k count as seen by every query when attention is not causal (see
  _dkv_kernel). int32 scalars (numpy's with xp=np, on the host)."""
  num_q = pl.cdiv(seq_q, block_q)
  if not causal:
    return xp.int32(0), xp.int32(0)
  offset = seq_k - seq_q  # query i sees key j iff j <= i + offset
  # Block b holds a query that sees key k_start iff (b + 1) * block_q - 1 + offset >= k_start.
  lo = xp.minimum(xp.clip(k_start - offset, 0, None) // block_q, num_q)
  # Block b is fully visible iff b * block_q + offset >= k_start + rows - 1 (never, for keys of
  # padding: that would need b * block_q >= seq_q, past the last block; so the diagonal's mask
  # hides them from every real query).
  full_lo = xp.clip(k_start + (rows - 1 - offset + block_q - 1), 0, None) // block_q
  full_lo = xp.clip(full_lo, lo, num_q)
  return lo.astype(jnp.int32), full_lo.astype(jnp.int32)


def _kv_tile_work(num_kv: int, *, group: int, block_q: int, seq_q: int, seq_k: int) -> tuple[int, ...]:
  """The ring steps of each causal K/V tile of the dK/dV kernel (its Q
  blocks from the first consumer's diagonal on, for every query head of the
  group; block 0 the heaviest): the work a balanced PersistentSchedule
  evens out."""
  num_q = pl.cdiv(seq_q, block_q)
  return tuple(
      group * (num_q - int(_q_block_bounds(kv * OUTER_ROWS, WGMMA_M, seq_q, seq_k, block_q, True, xp=np)[0]))
      for kv in range(num_kv)
  )


def _swizzled(head_or_cols: int, dtype):
  swizzle = plgpu.find_swizzle(head_or_cols * jnp.dtype(dtype).itemsize * 8, "tile")
  return (
      plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle),
  )


# ------------------------------------------------- dQ in the dK/dV kernel


@dataclasses.dataclass(frozen=True)
class _DQPiece:
  """The piece of dQ a consumer of the fused kernel adds per Q block: half
  the columns at every step for each consumer (split), or all of them at
  every other step, the consumers taking turns. wgmma reads its K operand
  with 128-byte swizzling, so a column slice of K must be 64 columns wide:
  at head_dim 64 they always take turns. Each consumer stages its pieces in
  a float32 buffer of its own (`buffers` = 2), except whole-width pieces at
  head_dim 128: two 64 x 128 buffers (64 KiB) do not fit beside the ring,
  so the consumers share one and each waits for the producer to have read
  the other's piece."""

  cols: int
  split: bool

  def per_row(self, head_dim: int) -> int:
    """Pieces of dQ per Q block (the semaphores' count per block)."""
    return head_dim // self.cols

  @property
  def buffers(self) -> int:
    return NUM_CONSUMERS if self.split or self.cols <= 64 else 1


def _dq_piece(head_dim: int, turns: bool) -> _DQPiece:
  split = not turns and head_dim >= 2 * 64
  return _DQPiece(head_dim // 2 if split else head_dim, split)


def _visit(kv_index, position, num_visits, lo, *, num_q, num_kv, causal: bool, where=jnp.where,
           div=lax.div, rem=lax.rem):
  """The Q block a K/V tile of the fused kernel visits at `position` of its
  num_visits = num_q - lo blocks per query head (int32 scalars in the kernel,
  numpy arrays in `_dq_order`, which passes numpy's where, div and rem).

  Every tile adds into every Q block it visits, so the tiles that run
  together should visit different Q blocks at any one time, and each Q block
  should see its adders a few steps apart (the order of the additions is
  fixed; an adder that comes too soon waits). Not causal: tile j starts at
  Q block j * num_q / num_kv and wraps around. Causal (tiles paired heavy
  with light, forward.PersistentSchedule): the heavy tile j (2j < num_kv)
  climbs from its diagonal, the light tile, which runs second, descends to
  it; at equal lengths tile j's heavy walk is at block lo + t at time t,
  two blocks apart from its neighbours, and light walks meet neither each
  other nor a heavy one (odd against even blocks)."""
  if causal:
    return where(2 * kv_index >= num_kv, lo + num_visits - 1 - position, lo + position)
  return rem(position + div(kv_index * num_q, num_kv), num_visits)


def _fused_schedule(num_kv: int, kv_heads: int, batch: int, *, causal: bool, interpret: bool,
                    fill_rounds: bool = True) -> PersistentSchedule:
  """The fused kernel's persistent CTAs, which wait on each other: all of
  them must be resident at once (one per SM). Where it costs no round of
  tiles, the tiles of one (batch, kv head) run in the same round(s), so that
  the order of additions into its dQ can be computed for one head and hold
  for every head (`_dq_order`): the CTA count is then a multiple of the CTAs
  one head needs (tiles or pairs of tiles), or divides it. Where that would
  take more rounds than the SMs allow (48 K/V blocks a head at 6144 keys: 64
  heads would run 32 rounds on 96 CTAs, or 24 on 128), the fewest CTAs that
  take the fewest rounds, heads split across rounds, and `_dq_order` orders
  every head's additions (fill_rounds False: whole heads per round always,
  as before session 14; a measurement switch). Causal tiles pair only
  within a head: an odd number of K/V blocks runs unpaired. In the
  interpreter one CTA takes every tile in turn (no semaphores there; see
  _dkv_kernel)."""
  paired = causal and num_kv % 2 == 0
  per_head = num_kv // 2 if paired else num_kv
  units = per_head * kv_heads * batch
  if interpret:
    num_ctas = 1
  else:
    sms = _sm_count()
    if per_head <= sms:
      num_ctas = per_head * min(sms // per_head, kv_heads * batch)
    else:
      num_ctas = max(d for d in range(1, sms + 1) if per_head % d == 0)
    rounds = -(-units // sms)
    if fill_rounds and -(-units // num_ctas) > rounds:
      num_ctas = -(-units // rounds)
  return PersistentSchedule(num_kv, kv_heads, batch, num_ctas, paired)


def _heads_alike(schedule: PersistentSchedule) -> bool:
  """Whether every (batch, kv head) of the fused schedule runs its tiles as
  the first one does (whole heads per round or whole rounds per head), so
  that one head's order of additions serves all (`_dq_order`)."""
  per_head = schedule.num_blocks // 2 if schedule.paired else schedule.num_blocks
  return schedule.num_ctas % per_head == 0 or per_head % schedule.num_ctas == 0


def _dq_order(schedule: PersistentSchedule, *, seq_q: int, seq_k: int, block_q: int, group: int,
              causal: bool) -> np.ndarray:
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
  num_q = -(-seq_q // block_q)
  steps = group * num_q
  with jax.ensure_compile_time_eval():  # numbers, also under a trace
    k_starts = jnp.arange(num_kv, dtype=jnp.int32) * OUTER_ROWS
    lo = np.asarray(_q_block_bounds(k_starts, WGMMA_M, seq_q, seq_k, block_q, causal)[0])
    # Every CTA's tiles in its order: [cta, i] grids of (block, head, batch).
    counts = np.asarray(schedule.tile_count(jnp.arange(schedule.num_ctas, dtype=jnp.int32)))
    cta, i = np.meshgrid(np.arange(schedule.num_ctas), np.arange(counts.max()), indexing="ij")
    block, head, batch = (np.asarray(x) for x in schedule.tile(jnp.asarray(cta, jnp.int32), jnp.asarray(i, jnp.int32)))
  lo = np.broadcast_to(lo, (num_kv,))
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
  qb = _visit(block, position, np.maximum(visits, 1), lo[block], num_q=num_q, num_kv=num_kv, causal=causal,
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


# ---------------------------------------------------------------- dK, dV


def _copy_q_block(gmem, smem, ready, released, *, ring_step, stages: int, rows, vec) -> None:
  """A dK/dV producer's TMA copies of one Q block into ring step
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


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, *refs,
    seq_q: int, seq_k: int, group: int, schedule: PersistentSchedule | None, causal: bool, softmax_scale: float,
    config: BackwardConfig, interpret: bool,
):
  # q_ref, do_ref: [batch, seq_q', heads, D]; k_ref, v_ref, dk_ref, dv_ref:
  # [batch, seq_k', kv_heads, D]; lse_ref, delta_ref: [batch, heads, seq_q'];
  # seq_q', seq_k': the real seq_q, seq_k padded to multiples of OUTER_ROWS.
  # tiles_ref: the persistent schedule's table (forward.tile_table).
  # k_smem, v_smem: [buffers, 2, 64, D] (one tile per consumer, reused for
  # dK, dV; two buffers in a persistent CTA, which loads the next tile's K
  # and V while the current one's gradients are stored); q_smem, do_smem:
  # [stages, block_q, D]; lse_smem, delta_smem: [stages, block_q].
  # kv_ready: [buffers * 2] barriers of 2 arrivals (K and V copies);
  # *_ready: [stages] (TMA); q_consumed (Q, lse), do_consumed (dO, delta):
  # [stages], 2 arrivals.
  # With fused_dq: ranks_ref, an input, int32 [units, num_kv, group * num_q]
  # (`_dq_order`); dq_ref, an output, float32 [batch * heads * num_q *
  # pieces, block_q, piece columns], dQ unscaled, piece by piece; ds_smem:
  # [2, 2, 64, block_q], dS^T of both consumers, double-buffered by step;
  # dq_smem: [_DQPiece.buffers, block_q, piece columns] f32, the consumers'
  # pieces of dQ on their way out; ds_ready: [2] barriers of 2 arrivals;
  # tile_done: a barrier of 2 arrivals (neither consumer reads the other's K
  # tile any more); dq_staged, dq_free: [2] barriers of 1 arrival (a
  # consumer's piece is in dq_smem; the producer has read it).
  # staging (interpret mode only): [2, 64, block_q], P^T and dS^T for wgmma;
  # with fused_dq also dq_old: [2, block_q, piece columns] f32 and
  # dq_loaded, [2] barriers (the interpreter adds into dQ by load, add and
  # store).
  # schedule: None for one CTA per tile (grid kv x heads x batch), else the
  # persistent CTAs' tiles (forward.PersistentSchedule over K/V blocks).
  fused = config.fused_dq
  # Measurement only (`dq_addition_experiment`): the pieces of dQ handed to
  # the producer, the dQ product waiting for the other consumer's dS^T.
  hand_over, lockstep = _experiment().staging, _experiment().lockstep
  # The additions in a warp of their own (none to make without a hand-over).
  adder_warp = fused and hand_over and config.dq_adder_warp and not interpret
  refs = list(refs)
  ranks_ref = refs.pop(0) if fused else None
  dk_ref, dv_ref = refs.pop(0), refs.pop(0)
  dq_ref = refs.pop(0) if fused else None
  (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
   kv_ready, q_ready, do_ready, lse_ready, delta_ready, q_consumed, do_consumed) = refs[:13]
  refs = refs[13:]
  if fused:
    ds_smem, dq_smem, ds_ready, tile_done, dq_staged, dq_free = refs[:6]
    refs = refs[6:]
  staging = refs.pop(0) if interpret else None
  if interpret and fused:
    dq_old, dq_loaded = refs
  rows, block_q, stages = WGMMA_M, config.block_q, config.stages
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  wg = lax.axis_index("wg")
  num_q = pl.cdiv(seq_q, block_q)
  num_kv = k_ref.shape[1] // OUTER_ROWS
  qk_scale = softmax_scale * LOG2_E

  @dataclasses.dataclass(frozen=True)
  class KVTile:
    """OUTER_ROWS key rows of one (batch, kv head): a CTA's unit of work. It
    visits Q blocks [lo, num_q) of every query head of the group: the first
    consumer's keys come first, so its range covers both. int32 scalars."""
    batch: jax.Array
    kv_head: jax.Array
    kv_index: jax.Array  # K/V block
    k_start: jax.Array  # first key row
    lo: jax.Array
    num_steps: jax.Array  # ring steps: Q blocks the producer loads for it

    @property
    def visits(self):
      """Q blocks visited per query head."""
      return jnp.int32(num_q) - self.lo

    def q_block(self, position):
      """The Q block at `position` of the visits for one query head: in
      order from lo, or as `_visit` spreads the fused kernel's tiles."""
      if not fused:
        return self.lo + position
      return _visit(self.kv_index, position, self.visits, self.lo, num_q=jnp.int32(num_q), num_kv=jnp.int32(num_kv),
                    causal=causal)

    def step_of(self, g, qb):
      """The tile's ring step of Q block qb of query head g of the group."""
      return g * self.visits + (qb - self.lo)

  def tile_at(kv_index, kv_head, batch) -> KVTile:
    # K/V block 0 sees the most Q blocks when causal: in grid order it runs
    # first, the heaviest-first order of the Q-outer kernels.
    k_start = kv_index * OUTER_ROWS
    lo, _ = _q_block_bounds(k_start, rows, seq_q, seq_k, block_q, causal)
    return KVTile(batch, kv_head, kv_index, k_start, lo, group * (jnp.int32(num_q) - lo))

  def load_q_blocks(tile: KVTile, ring_base):
    """The producer's work for one tile: TMA copies of Q, dO, lse and delta
    of its Q blocks into the ring's steps ring_base, ring_base + 1, ...;
    with fused_dq also the additions of the consumers' pieces of dQ
    (`add_pieces`), `stages` steps behind the copies: the step whose slot a
    copy waits for is the one whose pieces come next."""
    def load(step):
      head = tile.kv_head * group + lax.div(step, tile.visits)
      q0 = tile.q_block(lax.rem(step, tile.visits)) * block_q
      _copy_q_block((q_ref, lse_ref, do_ref, delta_ref), (q_smem, lse_smem, do_smem, delta_smem),
                    (q_ready, lse_ready, do_ready, delta_ready), (q_consumed, do_consumed),
                    ring_step=ring_base + step, stages=stages, rows=(tile.batch, pl.ds(q0, block_q), head),
                    vec=(tile.batch, head, pl.ds(q0, block_q)))

    load = jax.named_scope("load")(load)
    if not fused or not hand_over or adder_warp:
      pl.loop(0, tile.num_steps)(load)
      return
    lag = jnp.minimum(jnp.int32(stages), tile.num_steps)
    pl.loop(0, lag)(load)

    @pl.loop(lag, tile.num_steps)
    def _(step):
      load(step)
      add_pieces(tile, ring_base, step - stages)

    pl.loop(tile.num_steps - lag, tile.num_steps)(lambda step: add_pieces(tile, ring_base, step))

  def observe(end_step):
    # Q and lse are released on q_consumed, dO and delta on do_consumed.
    observe_last_releases(q_consumed, do_consumed, end_step=end_step, stages=stages)

  def load_kv(tile: KVTile, buffer):
    """Starts the copies of this consumer's K and V rows of `tile`."""
    kv_rows = (tile.batch, pl.ds(tile.k_start + wg * rows, rows), tile.kv_head)
    ready = kv_ready.at[buffer * NUM_CONSUMERS + wg]
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem.at[buffer, wg], ready)

  piece = _dq_piece(head_dim, config.dq_turns)
  piece_cols, split = piece.cols, piece.split
  own_buffer = piece.buffers == NUM_CONSUMERS  # a staging buffer per consumer
  pieces = piece.per_row(head_dim)  # pieces of dQ per step: every column of the Q block

  def owner(ring_step):
    """The consumer whose turn it is at ring step `ring_step` (dq_turns)."""
    return lax.rem(ring_step, jnp.int32(NUM_CONSUMERS))

  def first_column(consumer):
    """The first column of dQ in `consumer`'s pieces."""
    return consumer * piece_cols if split else 0
  heads = q_ref.shape[2]

  def ranks_unit(tile: KVTile):
    """The tile's (batch, kv head) in ranks_ref: 0 where every head has one order."""
    if ranks_ref.shape[0] == 1:
      return jnp.int32(0)
    return tile.batch * k_ref.shape[2] + tile.kv_head

  if fused and not interpret:
    # One counter per Q block and piece of dQ: the additions made into it.
    # Zero at every call (Mosaic GPU zero-fills its global scratch).
    additions = pl.get_global(plgpu.SemaphoreType.REGULAR((q_ref.shape[0] * heads * num_q * pieces,)))

  def count_additions(counters):
    """The producer's wait for the additions into dQ it has just issued (one
    semaphore index per piece) to land; then it counts them, so that the
    next adders may go. Counted at once, not at the next step: the next
    adder into a Q block (another CTA, a couple of steps later by
    `_dq_order`) waits for this count, and the consumers no longer wait
    for it (their pieces were released when read)."""
    if interpret:
      return  # the interpreter's additions are complete when issued
    with jax.named_scope("landed"):
      plgpu.wait_smem_to_gmem(0)  # written, not only read from shared memory
    for counter in counters:
      plgpu.semaphore_signal(additions.at[counter], 1, memory_scope="gpu")

  @jax.named_scope("add_dq")
  def add_pieces(tile: KVTile, ring_base, step, consumer=None):
    """The producer adds the consumers' pieces of dQ_qb += dS K of the
    tile's `step` (Q block qb of query head g; float32, unscaled) into
    dq_ref, each after the `rank` additions that precede it (`_dq_order`),
    then counts them once they have landed (`count_additions`). A TMA
    reduce-add, the first (rank 0) a plain store. The consumers never wait
    on global memory for dQ: only for the producer to have read their last
    piece (dq_free). `consumer` (split pieces): only that consumer's (an
    adder warp of its own, dq_adder_warps 2).

    Mosaic's interpreter has neither semaphores nor reduce-adds: there one
    CTA takes every tile in turn, and the producer adds by load, add and
    store."""
    ring_step = ring_base + step
    g = lax.div(step, tile.visits)
    qb = tile.q_block(lax.rem(step, tile.visits))
    head = tile.kv_head * group + g
    rank = ranks_ref[ranks_unit(tile), tile.kv_index, step]
    counters = []
    # Split pieces: both consumers', every step; else the turn's owner's.
    adders = [consumer] if consumer is not None else range(NUM_CONSUMERS) if split else [owner(ring_step)]
    for consumer in adders:
      piece = consumer if split else 0  # the columns of dQ it adds
      counter = ((tile.batch * heads + head) * num_q + qb) * pieces + piece
      target = dq_ref.at[counter]  # contiguous: one counter per piece
      staged = dq_smem.at[consumer if own_buffer else 0]
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
        experiment = _experiment()
        if experiment.ordered:
          with jax.named_scope("wait_rank"):
            plgpu.semaphore_wait(additions.at[counter], rank, decrement=False, memory_scope="gpu")
        adds = jnp.bool_(experiment.every == 1)
        if experiment.every > 1:
          index = tile.kv_index + (step if experiment.alternate else 0)
          adds = lax.rem(index, jnp.int32(experiment.every)) == 0
        plgpu.copy_smem_to_gmem(staged, target, predicate=(rank == 0) & adds)
        plgpu.copy_smem_to_gmem(staged, target, predicate=(rank > 0) & adds, reduction_op="add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(dq_free.at[consumer])
      counters.append(counter)
    count_additions(counters)

  # The piece staged last in this consumer's buffer, which the producer must
  # have read before the consumer stages its own: its own, `gap` ring steps
  # before (own buffers), or the other consumer's, the step before (one
  # shared buffer). Each consumer waits for every phase of that piece's
  # dq_free barrier in turn, the last in its epilogue.
  previous_owner = wg if own_buffer else 1 - wg
  gap = NUM_CONSUMERS if own_buffer and not split else 1

  def stage_piece(dq, ring_step):
    """Hands this consumer's piece of dQ to the producer (`add_pieces`)."""
    staged = dq_smem.at[wg if own_buffer else 0]

    @pl.when(ring_step >= gap)
    @jax.named_scope("wait_dq_free")
    def _():
      plgpu.barrier_wait(dq_free.at[previous_owner])

    staged[...] = dq
    plgpu.commit_smem()
    plgpu.barrier_arrive(dq_staged.at[wg])

  def dq_product(acc_ref, buf, buffer):
    """acc += this consumer's piece of dS K: dS from both consumers' dS^T in
    ds_smem[buf] (transposed), K from both K tiles of `buffer`."""
    columns = pl.ds(first_column(wg), piece_cols)
    for c in range(NUM_CONSUMERS):
      plgpu.wgmma(acc_ref, ds_smem.at[buf, c].transpose((1, 0)), k_smem.at[buffer, c, :, columns])

  def last_release(end_step):
    """A consumer's epilogue: the producer's read of the last piece of dQ
    this consumer would wait for next (every barrier phase is waited for)."""
    if not fused or not hand_over:
      return
    if own_buffer:  # this consumer's last piece, if it staged any
      staged_any = end_step > (0 if split else wg)
    else:  # the last piece, if the other consumer's
      staged_any = (end_step > 0) & (owner(end_step - 1) == previous_owner)
    pl.when(staged_any)(lambda: plgpu.barrier_wait(dq_free.at[previous_owner]))

  def gradients(tile: KVTile, buffer, ring_base):
    """(dK unscaled, dV) of this consumer's rows of `tile`, its Q blocks at
    the ring's steps from ring_base; its K and V rows are in `buffer`."""
    k_start = tile.k_start + wg * rows
    k_tile, v_tile = k_smem.at[buffer, wg], v_smem.at[buffer, wg]
    plgpu.barrier_wait(kv_ready.at[buffer * NUM_CONSUMERS + wg])
    # The A operands of S^T and dP^T: K and V from shared memory, or loaded
    # once per tile into registers (kv_registers; the interpreter reads
    # them from shared memory either way).
    k_a, v_a = k_tile, v_tile
    if config.kv_registers and not interpret:
      k_a, v_a = (plgpu.load(t, layout=plgpu.Layout.WGMMA) for t in (k_tile, v_tile))
    lo, full_lo = _q_block_bounds(k_start, rows, seq_q, seq_k, block_q, causal)
    vec_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per query column

    def slot_of(g, qb):
      return lax.rem(ring_base + tile.step_of(g, qb), jnp.int32(stages))

    def load_lse(slot):
      plgpu.barrier_wait(lse_ready.at[slot])
      return plgpu.load(lse_smem.at[slot], layout=vec_layout)

    def load_delta(slot):
      plgpu.barrier_wait(delta_ready.at[slot])
      return plgpu.load(delta_smem.at[slot], layout=vec_layout)

    def probs_t(s_t, qb, slot, *, masked: bool, lse=None):
      """P^T [keys, queries] from S^T and the lse of the Q block in `slot`
      (loaded here unless given)."""
      if not _experiment().elementwise:
        if lse is None:
          plgpu.barrier_wait(lse_ready.at[slot])
        return s_t
      lse = (load_lse(slot) if lse is None else lse) * LOG2_E
      p_t = poly_exp2.exp2(s_t * qk_scale - lax.broadcast_in_dim(lse, s_t.shape, [1]), config.dkv_poly_columns)
      if masked:
        key = k_start + plgpu.broadcasted_iota(jnp.int32, s_t.shape, 0, layout=plgpu.Layout.WGMMA)
        query = qb * block_q + plgpu.broadcasted_iota(jnp.int32, s_t.shape, 1, layout=plgpu.Layout.WGMMA)
        # After the exponential: queries with lse = -inf (no visible key)
        # give 0, not NaN.
        p_t = jnp.where(visible(query, key, seq_q=seq_q, seq_k=seq_k, causal=causal), p_t, 0.0)
      return p_t

    def grad_scores_t(p_t, dp_t, slot, *, delta=None):
      """dS^T = P^T * (dP^T - delta), delta of the Q block in `slot`
      (loaded here unless given)."""
      if not _experiment().elementwise:
        if delta is None:
          plgpu.barrier_wait(delta_ready.at[slot])
        return dp_t
      delta = load_delta(slot) if delta is None else delta
      return p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))

    def wait_q_block(qb, g):
      """(slot, Q tile, dO tile) of Q block qb of head g, once loaded."""
      slot = slot_of(g, qb)
      plgpu.barrier_wait(q_ready.at[slot])
      plgpu.barrier_wait(do_ready.at[slot])
      return slot, q_smem.at[slot], do_smem.at[slot]

    def release_q_block(slot):
      # Neither Q, dO, lse nor delta of this slot is read any more.
      plgpu.barrier_arrive(do_consumed.at[slot])
      plgpu.barrier_arrive(q_consumed.at[slot])

    def issue_scores(s_ref, dp_ref, q_tile, do_tile):
      # S^T = K Q^T and dP^T = V dO^T (K and V in SMEM, or registers): two groups.
      plgpu.wgmma(s_ref, k_a, q_tile.transpose((1, 0)))
      plgpu.wgmma(dp_ref, v_a, do_tile.transpose((1, 0)))

    def update(qb, slot, dk, dv, *, masked: bool, ring_step=None):
      """dK and dV with Q block qb (in `slot`) added; with fused_dq also
      this consumer's piece of dQ of ring step `ring_step`, handed to the
      producer."""
      # Two wgmma groups per block, one wait each: (S^T, dP^T) with both
      # operands in SMEM, then (dV, dK) with P^T and dS^T from registers
      # (and the piece of dQ, fused, split).
      # (Named scopes: regions of the profiler's traces, see forward.profiling.)
      with jax.named_scope("wait_q"):
        plgpu.barrier_wait(q_ready.at[slot])
        plgpu.barrier_wait(do_ready.at[slot])
      q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]

      def scores(s_ref, dp_ref):
        issue_scores(s_ref, dp_ref, q_tile, do_tile)
        # early_vectors: lse and delta load while the tensor cores work, so
        # that the shared-memory loads' latency is off the softmax's path.
        vectors = (load_lse(slot), load_delta(slot)) if config.early_vectors else (None, None)
        return s_ref[...], dp_ref[...], vectors  # waits for both products

      score_acc = plgpu.ACC((rows, block_q), jnp.float32)
      with jax.named_scope("scores"):
        s_t, dp_t, (lse, delta) = pl.run_scoped(scores, score_acc, score_acc)  # [keys, queries]
      with jax.named_scope("softmax"):
        p_t = probs_t(s_t, qb, slot, masked=masked, lse=lse)
        ds_t = grad_scores_t(p_t, dp_t, slot, delta=delta).astype(dtype)
      if fused:
        # Both consumers' dS^T rows make the dS of dQ = dS K.
        buf = lax.rem(ring_step, jnp.int32(2))
        with jax.named_scope("stage_ds"):
          ds_smem.at[buf, wg][...] = ds_t
          plgpu.commit_smem()
          plgpu.barrier_arrive(ds_ready.at[buf])
        fresh = plgpu.ACC((block_q, piece_cols), jnp.float32)

      if interpret:
        stage = staging.at[wg]
        stage[...] = p_t.astype(dtype)
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

        dk = dk + pl.run_scoped(dk_fresh, plgpu.ACC(dk.shape, jnp.float32))
      elif fused and split:
        def grads(refs):
          dv_ref, dk_ref, dq_ref = refs
          plgpu.wgmma(dv_ref, p_t.astype(dtype), do_tile)
          plgpu.wgmma(dk_ref, ds_t, q_tile)
          if lockstep:
            plgpu.barrier_wait(ds_ready.at[buf])  # the other consumer's dS^T, under dV and dK
          dq_product(dq_ref, buf, buffer)

        zero = plgpu.layout_cast(jnp.zeros((block_q, piece_cols), jnp.float32), plgpu.Layout.WGMMA)
        with jax.named_scope("grads"):
          dv, dk, dq = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zero)))
      else:
        def grads(refs):
          dv_ref, dk_ref = refs
          plgpu.wgmma(dv_ref, p_t.astype(dtype), do_tile)
          plgpu.wgmma(dk_ref, ds_t, q_tile)

        with jax.named_scope("grads"):
          dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))  # one wait
      release_q_block(slot)
      if fused:
        @jax.named_scope("dq")
        def own_piece():
          if split and not interpret:
            piece = dq  # from the group above
          else:
            if lockstep:
              plgpu.barrier_wait(ds_ready.at[buf])

            def product(acc_ref):
              dq_product(acc_ref, buf, buffer)
              return acc_ref[...]

            piece = pl.run_scoped(product, fresh)
          if hand_over:
            stage_piece(piece, ring_step)
          else:
            # Stored never (ranks are >= 0, which ptxas cannot know): keeps
            # the product from being dead code.
            @pl.when(ranks_ref[0, tile.kv_index, 0] < 0)
            def _():
              dq_smem.at[wg if own_buffer else 0][...] = piece

        if split:
          own_piece()
        else:  # the consumers take turns
          pl.when(owner(ring_step) == wg)(own_piece)
      return dk, dv

    def step(qb, carry, *, g, masked: bool):
      dk, dv = carry
      return update(qb, slot_of(g, qb), dk, dv, masked=masked)

    def overlapped_step(qb, carry, *, g, masked: bool):
      # Four wgmma groups retiring in order, S^T, dP^T, dV, dK; each wait
      # leaves the group after it running: P^T is computed under dP^T, dS^T
      # under dV.
      dk, dv = carry
      slot, q_tile, do_tile = wait_q_block(qb, g)

      def body(s_ref, dp_ref, dv_ref, dk_ref):
        issue_scores(s_ref, dp_ref, q_tile, do_tile)
        p_t = probs_t(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), qb, slot, masked=masked)
        if interpret:
          # P^T and dS^T through shared memory (see `step`); dV and dK
          # start from zero and are added below.
          stage = staging.at[wg]
          stage[...] = p_t.astype(dtype)
          plgpu.commit_smem()
          plgpu.wgmma(dv_ref, stage, do_tile)
        else:
          dv_ref[...] = dv
          plgpu.wgmma(dv_ref, p_t.astype(dtype), do_tile)
        ds_t = grad_scores_t(p_t, plgpu.wgmma_accumulator_load(dp_ref, wait_n=1), slot)
        if interpret:
          dv_new = plgpu.wgmma_accumulator_load(dv_ref, wait_n=0)  # the staged P^T is read
          stage[...] = ds_t.astype(dtype)
          plgpu.commit_smem()
          plgpu.wgmma(dk_ref, stage, q_tile)
          return dk + plgpu.wgmma_accumulator_load(dk_ref, wait_n=0), dv + dv_new
        dk_ref[...] = dk
        plgpu.wgmma(dk_ref, ds_t.astype(dtype), q_tile)
        dk_new = plgpu.wgmma_accumulator_load(dk_ref, wait_n=0)
        return dk_new, plgpu.wgmma_accumulator_load(dv_ref, wait_n=None)  # both complete

      score_acc, grad_acc = plgpu.ACC((rows, block_q), jnp.float32), plgpu.ACC(dk.shape, jnp.float32)
      dk, dv = pl.run_scoped(body, score_acc, score_acc, grad_acc, grad_acc)
      release_q_block(slot)
      return dk, dv

    def drain(qb, _, *, g):
      # Q blocks before this warpgroup's diagonal that the other consumer
      # needs: release their slots without computing (see forward.py).
      slot = slot_of(g, qb)
      plgpu.barrier_wait(q_ready.at[slot])
      plgpu.barrier_wait(lse_ready.at[slot])
      plgpu.barrier_wait(do_ready.at[slot])
      plgpu.barrier_wait(delta_ready.at[slot])
      release_q_block(slot)

    def fused_step(position, carry, *, g, masked: bool):
      # `step` on the Q block at `position` of the tile's visits, with this
      # step's piece of dQ.
      dk, dv = carry
      ring_step = ring_base + g * tile.visits + position
      return update(tile.q_block(position), lax.rem(ring_step, jnp.int32(stages)), dk, dv, masked=masked,
                    ring_step=ring_step)

    acc = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)

    block_step = overlapped_step if config.softmax_overlap else step

    def one_head(g, carry):
      # Query head kv_head * group + g: its Q blocks, in the producer's order.
      if causal:
        lax.fori_loop(tile.lo, lo, functools.partial(drain, g=g), None)
        carry = lax.fori_loop(lo, full_lo, functools.partial(block_step, g=g, masked=True), carry)
      return lax.fori_loop(full_lo, num_q, functools.partial(block_step, g=g, masked=False), carry)

    def one_head_fused(g, carry):
      # Both consumers take every step of the tile (their pieces of dQ need
      # each other's dS^T), so the second one computes, masked, the Q blocks
      # before its own diagonal (P = 0 there). The masked blocks come first
      # when the tile climbs, last when it descends (`_visit`).
      visit = functools.partial(fused_step, g=g)
      if not causal:
        return lax.fori_loop(0, tile.visits, functools.partial(visit, masked=False), carry)
      num_masked = full_lo - tile.lo
      descending = 2 * tile.kv_index >= num_kv
      first = jnp.where(descending, 0, num_masked)
      last = jnp.where(descending, tile.visits - num_masked, tile.visits)
      carry = lax.fori_loop(0, first, functools.partial(visit, masked=True), carry)
      carry = lax.fori_loop(first, last, functools.partial(visit, masked=False), carry)
      return lax.fori_loop(last, tile.visits, functools.partial(visit, masked=True), carry)

    if fused:
      # The other consumer's K rows take part in this consumer's dQ products.
      plgpu.barrier_wait(kv_ready.at[buffer * NUM_CONSUMERS + 1 - wg])
      carry = (acc, acc)
      dk, dv = one_head_fused(jnp.int32(0), carry) if group == 1 else lax.fori_loop(0, group, one_head_fused, carry)
      # dK and dV are staged in the K and V tiles next: the other consumer
      # must be done reading this one's K.
      plgpu.barrier_arrive(tile_done)
      plgpu.barrier_wait(tile_done)
    elif group == 1:
      dk, dv = one_head(jnp.int32(0), (acc, acc))
    else:
      dk, dv = lax.fori_loop(0, group, one_head, (acc, acc))
    if not causal and k_ref.shape[1] > seq_k:
      # Keys past seq_k were not masked (the diagonal hides them under causal
      # attention): their P^T is exp2(-lse) and not 0. A key's P^T and dS^T
      # reach only its own rows of dV and dK, so zeroing those rows once here
      # serves as well as a mask on every Q block of this warpgroup would.
      key = k_start + plgpu.broadcasted_iota(jnp.int32, dk.shape, 0, layout=plgpu.Layout.WGMMA)
      dk, dv = (jnp.where(key < seq_k, x, 0.0) for x in (dk, dv))

    return dk, dv

  def store_gradients(tile: KVTile, buffer, result):
    """Scales dK and starts the TMA stores of dK and dV, staged in the K and
    V tiles (every wgmma reading them has completed)."""
    dk, dv = result
    k_tile, v_tile = k_smem.at[buffer, wg], v_smem.at[buffer, wg]
    kv_rows = (tile.batch, pl.ds(tile.k_start + wg * rows, rows), tile.kv_head)
    k_tile[...] = (dk * softmax_scale).astype(dtype)
    v_tile[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[kv_rows])
    plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[kv_rows])

  def add_tile_pieces(tile: KVTile, ring_base, consumer=None):
    """An adder warp's work for one tile (dq_adder_warp): `add_pieces` of
    every step, in order; or, with a warp per consumer (dq_adder_warps 2),
    of `consumer`'s pieces alone: every step's half of the columns (split),
    or the steps of its turns (the ring steps of its parity). Either way
    one warp waits on every phase of a consumer's dq_staged barrier and
    arrives on its dq_free."""
    if consumer is None or split:
      pl.loop(0, tile.num_steps)(lambda step: add_pieces(tile, ring_base, step, consumer))
    else:  # consumer c's turns: (ring_base + step) % 2 == c, its pieces (the turn's owner's, `add_pieces`)
      first = lax.rem(ring_base + consumer, jnp.int32(NUM_CONSUMERS))
      pl.loop(first, tile.num_steps, step=NUM_CONSUMERS)(lambda step: add_pieces(tile, ring_base, step))

  adders = [add_tile_pieces]
  if config.dq_adder_warps == 2:
    adders = [functools.partial(add_tile_pieces, consumer=c) for c in range(NUM_CONSUMERS)]
  run_tiles(schedule, tile_at, wg=wg, axis="kv", produce=load_q_blocks, observe=observe, load=load_kv,
            compute=gradients, store=store_gradients, epilogue=last_release, buffers=config.dkv_buffers,
            produce_aside=adders if adder_warp else (), tiles_ref=tiles_ref)


def _settings(q: jax.Array, config: BackwardConfig | None, softmax_scale: float | None):
  head_dim = q.shape[-1]
  config = default_backward_config(head_dim) if config is None else config
  return config, float(head_dim ** -0.5 if softmax_scale is None else softmax_scale)


def _pad(q, k, v, do, lse, delta, *, q_rows: int = OUTER_ROWS):
  """The operands padded along their sequence axes, for both kernels: q,
  do, lse and delta to multiples of q_rows, k and v of OUTER_ROWS (an
  operand already a multiple is returned as it is). Padded query rows get
  lse = +inf, so that P = exp2(S - lse) = 0 there (finite S: Q is 0), and
  dO = 0, delta = 0, so that dS = P * (dP - delta) = 0 as well."""
  q, do = pad_seq(q, q_rows), pad_seq(do, q_rows)
  k, v = pad_seq(k, OUTER_ROWS), pad_seq(v, OUTER_ROWS)
  lse = pad_seq(lse, q_rows, axis=2, value=jnp.inf)
  delta = pad_seq(delta, q_rows, axis=2)
  return q, k, v, do, lse, delta


def dkv(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
    causal: bool = False, softmax_scale: float | None = None, config: BackwardConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
  """dK and dV of FlashAttention-2 on Hopper via Mosaic GPU.

  Args:
    q, do: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads,
      head_dim] (heads a multiple of kv_heads); bf16 or fp16, one dtype; any
      lengths (ragged ones are padded to whole blocks and sliced back).
    lse: float32 [batch, heads, seq_q], natural log, as the forward writes it.
    delta: float32 [batch, heads, seq_q], rowsum(dO * O).
    causal, softmax_scale: as in the forward.
    config: tiling; defaults to `default_backward_config(head_dim)`.
    interpret: run Mosaic GPU's interpreter (CPU) instead of compiling.

  Returns:
    (dk, dv), like k. (With config.fused_dq the kernel computes dQ as well,
    which only `backward` returns.)
  """
  if q.shape[-1] in WIDE_HEAD_DIMS:
    return _wide().dkv(q, k, v, do, lse, delta, causal=causal, softmax_scale=softmax_scale, config=config,
                       interpret=interpret)
  config, softmax_scale = _settings(q, config, softmax_scale)
  _check_inputs(q, k, v, do, lse, delta, config, ("dkv",))
  seq_q, seq_k = q.shape[1], k.shape[1]
  dk, dv, *_ = _dkv_call(*_pad(q, k, v, do, lse, delta), seq_q=seq_q, seq_k=seq_k, causal=causal,
                         softmax_scale=softmax_scale, config=config, interpret=interpret)
  return unpad_seq(dk, seq_k), unpad_seq(dv, seq_k)


def _dkv_call(q, k, v, do, lse, delta, *, seq_q: int, seq_k: int, causal: bool, softmax_scale: float,
              config: BackwardConfig, interpret) -> tuple[jax.Array, ...]:
  """The dK/dV kernel on operands padded by `_pad`, of real lengths seq_q,
  seq_k: (dk, dv), and with config.fused_dq also dQ (float32, unscaled; Q
  blocks that no key is visible to are left unwritten, see `_finish_dq`)."""
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  interpret_params, interpret = interpret_params_of(interpret)
  dtype, stages, block_q = q.dtype, config.stages, config.block_q
  transforms = _swizzled(head_dim, dtype)
  buffers = config.dkv_buffers
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
  num_kv = k.shape[1] // OUTER_ROWS
  group = heads // kv_heads
  out_type = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
  ranks = []
  if config.fused_dq:
    piece = _dq_piece(head_dim, config.dq_turns)
    scratch += [
        plgpu.SMEM((2, NUM_CONSUMERS, WGMMA_M, block_q), dtype, transforms=_swizzled(block_q, dtype)),  # dS^T
        plgpu.SMEM((piece.buffers, block_q, piece.cols), jnp.float32,
                   transforms=_swizzled(piece.cols, jnp.float32)),  # pieces of dQ
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=2),  # dS^T staged
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS),  # tile done
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # a piece of dQ staged
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # ... and read by the producer
    ]
    schedule = _fused_schedule(num_kv, kv_heads, batch, causal=causal, interpret=interpret)
    grid, grid_names = (schedule.num_ctas,), ("cta",)
    ranks = [jnp.asarray(_dq_order(schedule, seq_q=seq_q, seq_k=seq_k, block_q=block_q, group=group, causal=causal))]
    # dQ piece by piece, each piece of block_q rows contiguous (`_finish_dq`
    # puts the rows back in q's layout): a TMA reduce-add then writes 16 KiB
    # in one run, not 64 rows of 256 bytes heads * head_dim * 4 bytes apart.
    num_pieces = batch * heads * pl.cdiv(seq_q, block_q) * piece.per_row(head_dim)
    out_type.append(jax.ShapeDtypeStruct((num_pieces, block_q, piece.cols), jnp.float32))
  else:
    # K/V blocks fastest: CTAs running together share one (batch, kv head)
    # and read the same Q and dO from L2. Block 0 (causal: the most Q
    # blocks) runs first.
    work = None
    if causal and config.balanced:
      work = _kv_tile_work(num_kv, group=group, block_q=block_q, seq_q=seq_q, seq_k=seq_k)
    schedule, grid, grid_names = outer_grid(num_kv, kv_heads, batch, axis="kv", persistent=config.dkv_persistent,
                                            causal=causal, interpret=interpret, work=work)
  if interpret:
    scratch.append(plgpu.SMEM((NUM_CONSUMERS, WGMMA_M, block_q), dtype, transforms=_swizzled(block_q, dtype)))
    if config.fused_dq:
      scratch += [
          plgpu.SMEM((NUM_CONSUMERS, block_q, piece.cols), jnp.float32, transforms=_swizzled(piece.cols, jnp.float32)),
          plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # dQ loaded
      ]
  kernel = functools.partial(
      _dkv_kernel, seq_q=seq_q, seq_k=seq_k, group=group, schedule=schedule, causal=causal,
      softmax_scale=softmax_scale, config=config, interpret=interpret,
  )
  return specialized_kernel(kernel, out_type=tuple(out_type), scratch=scratch, grid=grid, grid_names=grid_names,
                            interpret_params=interpret_params, name="flash2_bwd_dkv_mosaic")(
                                q, k, v, do, lse, delta, tile_table(schedule), *ranks)


def _finish_dq(dq, shape, *, seq_q: int, seq_k: int, causal: bool, softmax_scale: float, dtype) -> jax.Array:
  """dQ of `shape` ([batch, seq_q, heads, head_dim]) from the fused kernel's
  float32 sum, piece by piece ([batch * heads * Q blocks * pieces per block,
  block_q, piece columns], `_dkv_kernel`): scaled, cast, in q's layout, and
  0 in the rows that see no key (causal, seq_q > seq_k: their Q blocks may
  be unwritten)."""
  batch, _, heads, head_dim = shape
  num_blocks, block_q, cols = dq.shape
  dq = dq.reshape(batch, heads, num_blocks // (batch * heads * (head_dim // cols)), head_dim // cols, block_q, cols)
  dq = dq.transpose(0, 2, 4, 1, 3, 5).reshape(batch, -1, heads, head_dim)[:, :seq_q] * softmax_scale
  if causal and seq_q > seq_k:
    sees_a_key = jnp.arange(dq.shape[1]) + (seq_k - seq_q) >= 0
    dq = jnp.where(sees_a_key[None, :, None, None], dq, 0.0)
  return dq.astype(dtype)


# ---------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, dq_ref,
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
    q_ready, k_ready, v_ready, k_consumed, v_consumed, *staging,
    seq_q: int, seq_k: int, group: int, num_q_blocks: int, schedule: PersistentSchedule | None, causal: bool,
    softmax_scale: float, config: BackwardConfig, interpret: bool,
):
  # Arrays in GMEM as in _dkv_kernel (padded to multiples of OUTER_ROWS;
  # with three consumers the last Q block may reach past them by whole
  # consumer tiles, which the TMA engine zero-fills and which store
  # nothing). C = config.dq_consumers (2, or 3).
  # q_smem, do_smem: [buffers, C, 64, D] (per consumer; Q's tile stages dQ
  # at the end; two buffers in a persistent CTA, which loads the next tile's
  # rows while the current one's dQ is stored); lse_smem, delta_smem:
  # [buffers, C, 64]; k_smem, v_smem: [stages, block_kv, D].
  # q_ready: [buffers * C] barriers of 4 arrivals (Q, dO, lse, delta);
  # k_ready, v_ready: [stages] (TMA); k_consumed, v_consumed: [stages], C
  # arrivals. staging (interpret mode only): [C, 64, block_kv], dS for wgmma.
  # schedule: None for one CTA per tile (grid q x heads x batch), else the
  # persistent CTAs' tiles (forward.PersistentSchedule).
  rows, block_kv, stages, consumers = WGMMA_M, config.block_kv, config.stages, config.dq_consumers
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  if interpret:
    [staging] = staging
  wg = lax.axis_index("wg")
  qk_scale = softmax_scale * LOG2_E

  tile_at = functools.partial(QTile.at, num_q_blocks=num_q_blocks, block_q=consumers * rows, block_kv=block_kv,
                              seq_q=seq_q, seq_k=seq_k, causal=causal, consumers=consumers)

  def load_rows(tile: QTile, buffer):
    """Starts the copies of this consumer's Q, dO, lse and delta rows of
    `tile` into `buffer`."""
    q_rows = (tile.batch, pl.ds(tile.q_start + wg * rows, rows), tile.head)
    vec = (tile.batch, tile.head, pl.ds(tile.q_start + wg * rows, rows))
    ready = q_ready.at[buffer * consumers + wg]
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[buffer, wg], ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[buffer, wg], ready)

  def gradient(tile: QTile, buffer, ring_base):
    """This consumer's rows of dQ for `tile` (unscaled), its K/V blocks at the
    ring's steps ring_base, ring_base + 1, ...; its rows are in `buffer`."""
    q_start = tile.q_start + wg * rows
    q_tile, do_tile = q_smem.at[buffer, wg], do_smem.at[buffer, wg]
    plgpu.barrier_wait(q_ready.at[buffer * consumers + wg])
    # The A operands of S and dP: Q and dO from shared memory, or loaded once
    # per tile into registers (q_registers; not in the interpreter).
    q_a, do_a = q_tile, do_tile
    if config.q_registers and not interpret:
      q_a, do_a = (plgpu.load(t, layout=plgpu.Layout.WGMMA) for t in (q_tile, do_tile))
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per query row
    lse = plgpu.load(lse_smem.at[buffer, wg], layout=row_layout) * LOG2_E
    delta = plgpu.load(delta_smem.at[buffer, wg], layout=row_layout)
    full_hi, hi = _kv_block_bounds(q_start, rows, seq_q, seq_k, block_kv, causal)

    def slot_of(kb):
      return lax.rem(ring_base + kb, jnp.int32(stages))

    def probs(s, kb, *, masked: bool):
      if not _experiment().elementwise:
        return s
      p = poly_exp2.exp2(s * qk_scale - lax.broadcast_in_dim(lse, s.shape, [0]), config.dq_poly_columns)
      if masked:
        row = q_start + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        col = kb * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        p = jnp.where(visible(row, col, seq_q=seq_q, seq_k=seq_k, causal=causal), p, 0.0)
      return p

    def issue_scores(s_ref, dp_ref, k_tile, v_tile):
      # S = Q K^T and dP = dO V^T (Q and dO in SMEM, or registers): two groups.
      plgpu.wgmma(s_ref, q_a, k_tile.transpose((1, 0)))
      plgpu.wgmma(dp_ref, do_a, v_tile.transpose((1, 0)))

    def add_dq(dq, ds, k_tile):
      """dQ + dS K, waited for."""
      if interpret:
        ds_stage = staging.at[wg]
        ds_stage[...] = ds.astype(dtype)
        plgpu.commit_smem()

        def dq_fresh(acc_ref):
          plgpu.wgmma(acc_ref, ds_stage, k_tile)
          return acc_ref[...]

        return dq + pl.run_scoped(dq_fresh, plgpu.ACC(dq.shape, jnp.float32))

      def dq_step(dq_ref):
        plgpu.wgmma(dq_ref, ds.astype(dtype), k_tile)

      return pl.run_state(dq_step)(plgpu.ACC.init(dq))

    def step(kb, dq, *, masked: bool):
      slot = slot_of(kb)
      k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
      # Two wgmma groups per block, one wait each: (S, dP) with both operands
      # in SMEM, then dQ with dS from registers.
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])

      def scores(s_ref, dp_ref):
        issue_scores(s_ref, dp_ref, k_tile, v_tile)
        return s_ref[...], dp_ref[...]  # waits for both

      def probs_under_dp(s_ref, dp_ref):
        issue_scores(s_ref, dp_ref, k_tile, v_tile)
        # Groups retire in order: wait for S alone, compute P while dP runs.
        # (ptxas hoists the wait for dP above part of it; keeping it below,
        # behind a one-iteration loop, was slower: bench/NOTES.md, session 11.)
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        return probs(s, kb, masked=masked), dp_ref[...]

      tile_acc = plgpu.ACC((rows, block_kv), jnp.float32)
      if config.softmax_overlap or config.dq_softmax_overlap:
        with jax.named_scope("scores"):
          p, dp = pl.run_scoped(probs_under_dp, tile_acc, tile_acc)
        plgpu.barrier_arrive(v_consumed.at[slot])  # V is no longer read
      else:
        with jax.named_scope("scores"):
          s, dp = pl.run_scoped(scores, tile_acc, tile_acc)
        plgpu.barrier_arrive(v_consumed.at[slot])
        with jax.named_scope("softmax"):
          p = probs(s, kb, masked=masked)
      with jax.named_scope("dq"):
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0])) if _experiment().elementwise else dp
        dq = add_dq(dq, ds, k_tile)
      plgpu.barrier_arrive(k_consumed.at[slot])  # K is no longer read
      return dq

    def drain(kb, _):
      slot = slot_of(kb)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])

    dq = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(0, full_hi, functools.partial(step, masked=False), dq)
    if causal or seq_k % block_kv:  # a diagonal, or a last block partly of padding
      dq = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), dq)
    if causal:
      lax.fori_loop(hi, tile.num_steps, drain, None)
    return dq

  def store_dq(tile: QTile, buffer, dq):
    """Scales dQ and starts its TMA store, staged in the Q tile (every wgmma
    reading it has completed); nothing for a tile wholly past the array's
    end (see forward.store_output)."""
    q_tile = q_smem.at[buffer, wg]
    q_tile[...] = (dq * softmax_scale).astype(dtype)
    plgpu.commit_smem()
    q_start = tile.q_start + wg * rows
    pl.when(q_start < dq_ref.shape[1])(
        lambda: plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[tile.batch, pl.ds(q_start, rows), tile.head]))

  produce, observe = kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed,
                                      group=group, block_kv=block_kv, stages=stages)
  run_tiles(schedule, tile_at, wg=wg, axis="q", produce=produce, observe=observe, load=load_rows, compute=gradient,
            store=store_dq, consumers=consumers, tiles_ref=tiles_ref)


def dq(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
    causal: bool = False, softmax_scale: float | None = None, config: BackwardConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
  """dQ of FlashAttention-2 on Hopper via Mosaic GPU; arguments as `dkv`.

  Returns:
    dq, like q.
  """
  if q.shape[-1] in WIDE_HEAD_DIMS:
    return _wide().dq(q, k, v, do, lse, delta, causal=causal, softmax_scale=softmax_scale, config=config,
                      interpret=interpret)
  config, softmax_scale = _settings(q, config, softmax_scale)
  _check_inputs(q, k, v, do, lse, delta, config, ("dq",))
  seq_q, seq_k = q.shape[1], k.shape[1]
  dq = _dq_call(*_pad(q, k, v, do, lse, delta), seq_q=seq_q, seq_k=seq_k, causal=causal,
                softmax_scale=softmax_scale, config=config, interpret=interpret)
  return unpad_seq(dq, seq_q)


def _dq_call(q, k, v, do, lse, delta, *, seq_q: int, seq_k: int, causal: bool, softmax_scale: float,
             config: BackwardConfig, interpret) -> jax.Array:
  """The dQ kernel on operands padded by `_pad`, of real lengths seq_q, seq_k."""
  interpret_params, interpret = interpret_params_of(interpret)
  consumers = config.dq_consumers
  padded_q = q.shape[1]
  if interpret:  # the interpreter slices, it does not zero-fill: whole blocks
    q, k, v, do, lse, delta = _pad(q, k, v, do, lse, delta, q_rows=consumers * WGMMA_M)
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  dtype, stages, block_kv = q.dtype, config.stages, config.block_kv
  transforms = _swizzled(head_dim, dtype)
  buffers = config.dq_buffers
  scratch = [
      plgpu.SMEM((buffers, consumers, WGMMA_M, head_dim), dtype, transforms=transforms),  # Q
      plgpu.SMEM((buffers, consumers, WGMMA_M, head_dim), dtype, transforms=transforms),  # dO
      plgpu.SMEM((buffers, consumers, WGMMA_M), jnp.float32),  # lse
      plgpu.SMEM((buffers, consumers, WGMMA_M), jnp.float32),  # delta
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),  # K
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),  # V
      plgpu.Barrier(num_arrivals=4, num_barriers=buffers * consumers),  # Q, dO, lse, delta
      plgpu.Barrier(num_barriers=stages),  # K ready
      plgpu.Barrier(num_barriers=stages),  # V ready
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # K consumed
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # V consumed
  ]
  if interpret:
    scratch.append(plgpu.SMEM((consumers, WGMMA_M, block_kv), dtype, transforms=_swizzled(block_kv, dtype)))
  num_q_blocks = pl.cdiv(q.shape[1], consumers * WGMMA_M)
  work = None
  if causal and config.balanced:
    work = q_tile_work(num_q_blocks, block_q=consumers * WGMMA_M, block_kv=block_kv, seq_q=seq_q, seq_k=seq_k,
                       consumers=consumers)
  schedule, grid, grid_names = outer_grid(num_q_blocks, heads, batch, axis="q", persistent=config.dq_persistent,
                                          causal=causal, interpret=interpret, work=work)
  kernel = functools.partial(
      _dq_kernel, seq_q=seq_q, seq_k=seq_k, group=heads // kv_heads, num_q_blocks=num_q_blocks,
      schedule=schedule, causal=causal, softmax_scale=softmax_scale, config=config, interpret=interpret,
  )
  dq = specialized_kernel(kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch=scratch, grid=grid,
                          grid_names=grid_names, interpret_params=interpret_params, name="flash2_bwd_dq_mosaic",
                          consumers=consumers)(q, k, v, do, lse, delta, tile_table(schedule))
  return unpad_seq(dq, padded_q)


# ---------------------------------------------------------------- both


def backward(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, *,
    causal: bool = False, softmax_scale: float | None = None, config: BackwardConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`dq` and `dkv` on one padding of the operands (ragged lengths pad once,
  not once per kernel); arguments as `dkv`.

  Returns:
    (dq, dk, dv), each like its primal.
  """
  if q.shape[-1] in WIDE_HEAD_DIMS:
    return _wide().backward(q, k, v, do, lse, delta, causal=causal, softmax_scale=softmax_scale, config=config,
                            interpret=interpret)
  config, softmax_scale = _settings(q, config, softmax_scale)
  _check_inputs(q, k, v, do, lse, delta, config, ("dkv",) if config.fused_dq else ("dkv", "dq"))
  seq_q, seq_k = q.shape[1], k.shape[1]
  padded = _pad(q, k, v, do, lse, delta)
  kwargs = dict(seq_q=seq_q, seq_k=seq_k, causal=causal, softmax_scale=softmax_scale, config=config,
                interpret=interpret)
  if config.fused_dq:
    dk, dv, dq = _dkv_call(*padded, **kwargs)
    dq = _finish_dq(dq, q.shape, seq_q=seq_q, seq_k=seq_k, causal=causal, softmax_scale=softmax_scale, dtype=q.dtype)
  else:
    dk, dv = _dkv_call(*padded, **kwargs)
    dq = _dq_call(*padded, **kwargs)
  return unpad_seq(dq, seq_q), unpad_seq(dk, seq_k), unpad_seq(dv, seq_k)
