"""FlashAttention-2 forward pass for Hopper (sm_90a) in Pallas's Mosaic GPU backend.

Groundwork for the Hopper fast path: the same algorithm as
jax_flash2/triton/forward.py, written against the Hopper hardware directly.

One CTA owns `block_q` query rows of one (batch, head) and runs three
warpgroups (128 threads each):

* two consumer warpgroups, each owning `block_q // 2` query rows. Each keeps
  its Q tile in shared memory and, in registers, the running row max `m_i`,
  the running row sum `l_i` and the unnormalised output `acc`. S = Q K^T and
  acc += P V run on the tensor cores as wgmma (A and B of Q K^T from shared
  memory; P of P V straight from registers);
* one producer warpgroup that only issues TMA copies of K and V blocks into a
  ring of `stages` shared-memory slots, and gives its registers to the
  consumers (setmaxnreg).

Each ring slot has four mbarriers: K ready, V ready (the TMA engine completes
them), K consumed, V consumed (both consumers arrive). K and V are separate
so that Q K^T can start while V is still in flight, and so that a K slot can
be refilled while P V still reads the V slot of the same step.

With `softmax_overlap` (the default) each consumer is software-pipelined as
in FlashAttention-3: one step issues S = Q K^T of its block and P V of the
previous block back to back and computes its softmax while the tensor cores
still run that P V.

With `persistent` (the default at head_dim 64 and 128) the grid is one CTA
per SM instead of one per tile, and each CTA takes tiles in turn
(`PersistentSchedule`; causal tiles in pairs of equal work). The K/V ring
runs on from tile to tile, so the producer loads the next tile's blocks while
the consumers finish the current one, and the next tile's Q arrives during
the current one's output store: a tile's start and end overlap other work
(+31% at 2k, bench/NOTES.md). The dQ kernel (backward.py) shares this
machinery.

The softmax is online and in base 2: the softmax scale and log2(e) fold into
one factor, `m_i` is kept in that scaled domain, and p = exp2(s * scale - m).
The output is divided by `l_i` once, at the end; the log-sum-exp is written in
natural log for a backward pass.

Causal attention is bottom-right aligned (query i sees key j iff
j <= i + seq_k - seq_q, as in FlashAttention-2 and jax_flash2.reference).
Each consumer visits only the K/V blocks at or left of its diagonal; only the
blocks crossing the diagonal are masked element-wise.

Ragged lengths: the kernel works on whole blocks, so `forward` zero-pads q
to a multiple of `block_q` and k, v to a multiple of `block_kv` along the
sequence axis and slices the output and lse back (lengths that are whole
blocks are passed through, without a copy). Inside, every bound and mask uses
the real lengths: the last K/V block, partial, takes the masked path, where
keys past seq_k get probability 0 (under causal attention the diagonal hides
them already: the last real query sees keys up to seq_k - 1). Query rows past
seq_q are computed like any other and sliced away. `pad_seq`, `unpad_seq`
and `visible` are shared with the backward kernels.

Supported: bf16 and fp16; head_dim 64, 128 and 256; grouped-query attention
(heads a multiple of kv_heads); any seq_q, seq_k >= 1. Not supported
(NotImplementedError): other head dims, float32 and other dtypes, and every
extra of the Triton path (masks, windows, softcap, ALiBi, bias, segment ids,
dropout). The backward kernels are in backward.py.

Status: runs on the H200 and passes its GPU tests at the Triton path's bar,
ragged lengths, the softmax overlap and persistent CTAs included (sessions
4-5; speed in bench/NOTES.md). Checked on CPU: lowering for CUDA, compilation
to sm_90a SASS through Mosaic's own compiler (tools/mosaic_cpu_compile.py:
HGMMA, TMA, setmaxnreg, no spills), and the numbers through Mosaic's
interpreter with its race detector (tests/test_mosaic.py, bench/NOTES.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash2.mosaic import poly_exp2

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Consumer warpgroups per CTA (the forward and the dQ kernel may take 3:
# MosaicConfig.consumers, BackwardConfig.dq_consumers); the producer
# warpgroup comes after them.
NUM_CONSUMERS = 2
# wgmma works on M = 64 rows per warpgroup instruction.
WGMMA_M = 64
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory one CTA may use on H100/H200 (227 KiB), less what Mosaic
# reserves for itself (reduction scratch, barriers); see `smem_bytes`.
SMEM_LIMIT = 227 * 1024
_SMEM_RESERVE = 4 * 1024
# setmaxnreg budgets per thread, by consumer warpgroups: 2 x 240 + 24 and
# 3 x 160 + 24 (x 128 threads) fit the 64K registers of an SM; the producer
# only computes addresses.
CONSUMER_REGISTERS = {2: 240, 3: 160}
PRODUCER_REGISTERS = 24
# Mosaic's profiler for the kernels compiled while `profiling` is active:
# (events per warpgroup, directory of the traces), or None.
_PROFILE: tuple[int, str] | None = None


@contextlib.contextmanager
def profiling(events: int, directory: str):
  """Compiles the Mosaic kernels traced inside with Mosaic GPU's profiler:
  each call writes a Perfetto trace of the kernel's named regions
  (jax.named_scope in the kernel bodies) per warpgroup to `directory`
  (tools/mosaic_profile.py). A development aid: profiled kernels run
  slower, and the events of a CTA's warpgroups are buffered in its shared
  memory (48 bytes an event for three warpgroups)."""
  global _PROFILE
  saved, _PROFILE = _PROFILE, (events, directory)
  try:
    yield
  finally:
    _PROFILE = saved


def compiler_params() -> plgpu.CompilerParams:
  """The Mosaic kernels' compiler parameters: approximate exp2 and
  reciprocal, and the profiler under `profiling`."""
  if _PROFILE is None:
    return plgpu.CompilerParams(approx_math=True)
  events, directory = _PROFILE
  # Bounds-checked: a kernel with more events than room keeps its first ones.
  return plgpu.CompilerParams(approx_math=True, profile_space=events, profile_dir=directory,
                              profile_bounds_check=True)


def specialized_kernel(body, *, out_type, scratch, grid, grid_names, interpret_params, name: str,
                       consumers: int = NUM_CONSUMERS):
  """plgpu.kernel as every kernel here runs: `consumers` consumer
  warpgroups and a producer (thread axis "wg"), `compiler_params()`; the
  interpreter where interpret_params says so."""
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
                      num_threads=consumers + 1, thread_name="wg", compiler_params=compiler_params(),
                      interpret=interpret_params, kernel_name=name)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiling of the Mosaic GPU forward kernel.

  Attributes:
    block_q: query rows per CTA, split evenly between the consumer
      warpgroups (64 or 128 rows each: 128 or 256 with two consumers, 192
      or 384 with three). 256 spills registers with block_kv 128 (ptxas,
      head_dim 64).
    block_kv: key/value rows per ring slot (64, 128 or 256).
    stages: ring slots of K and V in shared memory (>= 2: with one slot the
      next load could only start once both consumers finished the current
      block, so copies and tensor cores would take turns).
    softmax_overlap: software-pipeline each consumer (FlashAttention-3's
      intra-warpgroup overlap): a step issues Q K^T of its block and P V of
      the previous block together and computes its softmax while the tensor
      cores still run that P V, instead of leaving them idle during the
      softmax. Costs P of one block in registers. Problems with rows that see
      no key (causal, seq_q > seq_k) keep the plain loop.
    persistent: launch one CTA per SM, each taking tiles (block_q rows of a
      (batch, head)) in turn, instead of one CTA per tile. The producer then
      loads the next tile's K/V while the consumers finish the current one,
      and the next tile's Q is in flight during the output store: the start
      and end of each tile (launch, first loads, store) overlap other work.
      Costs a second Q buffer in shared memory.
    early_q: with persistent, each consumer loads the next tile's Q rows at
      the start of the current tile (once the previous tile's output store
      has read that buffer) instead of at its end, where the load's latency
      stalls the next tile's first step: most felt by short tiles (causal,
      d64: ~16 K/V blocks a tile at 4k). Off: within noise (session 15:
      d64 -1% to +3%, d128 -7% to +5%, runs disagreeing in sign).
    balanced: with persistent and causal, the CTAs take their tiles from
      a table built on the host that evens out their work
      (PersistentSchedule.table), instead of heavy-light pairs dealt
      round-robin, whose last round only some CTAs take: by the tiles'
      steps, the busiest CTA then works 3% longer than the mean at 2k-4k
      (d128 everywhere), 9% at 8k and 5% at 16k (d64, three consumers,
      whose 43 and 86 Q blocks a head pair unevenly); balanced, 0.2-0.5%
      (tools/schedule_model.py). Measured (session 15): the causal
      forward 2-7% faster at d64 and d128, 2k-16k. On in the defaults.
    pingpong: the two consumers take turns on the tensor cores (as
      FlashAttention-3's warpgroup ping-pong): each issues one step's
      matmuls only after the other has issued its own, so that one
      consumer's softmax runs under the other's matmuls rather than both
      computing softmaxes while the tensor cores idle. Needs softmax_overlap
      (one turn per step); problems that keep the plain loop ignore it.
      Two consumers only.
    consumers: consumer warpgroups per CTA, 2 or 3 (160 registers each
      instead of 240). Three, as FlashAttention-3 runs at head_dim 64, give
      the tensor cores two other consumers' matmuls to run while one
      computes its softmax, which at head_dim 64 takes about as long as its
      matmuls; and a 192-row Q tile reads K and V a third less often per
      FLOP. The head_dim-64 default from 2k (8k causal; sessions 8, 13,
      15).
    q_registers: each consumer loads its Q rows into registers once per tile
      and takes them from there as the A operand of every S = Q K^T, which
      then reads only K from shared memory (a third of the bytes at block_kv
      128; bench/NOTES.md, session 8's model). Costs D / 4 registers per
      thread per 64 rows. The interpreter reads Q from shared memory either
      way. Off: on the H200 no faster without a mask and 1-4% slower causal
      at head_dim 64, 2-3% slower causal at 128 (sessions 9, 13).
    poly_columns: the last `poly_columns` columns of each S tile take their
      exponentials as a polynomial on the FP32 units instead of the SFU's
      ex2 (FlashAttention-4's trick; `poly_exp2.py`). A multiple of 8 up to
      block_kv; 0: ex2 alone. Off: on the H200 it was no faster at 16
      columns and 2-18% slower at 32-48 (session 9): the SFU is not what
      binds there, and the polynomial's nine instructions per score cost
      more issue slots than the one SFU instruction they replace.
  Sequence lengths need not be multiples of the blocks: `forward` pads them
  (ragged lengths; see the module docstring).
  """

  block_q: int = 128
  block_kv: int = 128
  stages: int = 2
  softmax_overlap: bool = False
  persistent: bool = False
  early_q: bool = False
  balanced: bool = False
  pingpong: bool = False
  consumers: int = NUM_CONSUMERS
  q_registers: bool = False
  poly_columns: int = 0

  def __post_init__(self):
    for name in ("softmax_overlap", "persistent", "early_q", "balanced", "pingpong", "q_registers"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"MosaicConfig.{name} must be a bool, got {getattr(self, name)!r}")
    if self.early_q and not self.persistent:
      raise ValueError("MosaicConfig.early_q needs persistent=True (the next tile's Q goes to a second buffer)")
    if self.pingpong and not self.softmax_overlap:
      raise ValueError("MosaicConfig.pingpong needs softmax_overlap=True (a turn is one overlapped step)")
    for name in ("block_q", "block_kv", "stages", "consumers", "poly_columns"):
      if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
        raise ValueError(f"MosaicConfig.{name} must be an int, got {getattr(self, name)!r}")
    if self.consumers not in CONSUMER_REGISTERS:
      raise ValueError(f"MosaicConfig.consumers must be 2 or 3, got {self.consumers}")
    if self.pingpong and self.consumers != 2:
      raise ValueError("MosaicConfig.pingpong takes two consumers (they pass the turn to each other)")
    if self.block_q not in (self.consumers * WGMMA_M, 2 * self.consumers * WGMMA_M):
      raise ValueError(
          f"MosaicConfig.block_q must be {self.consumers * WGMMA_M} or {2 * self.consumers * WGMMA_M} (64 or "
          f"128 rows for each of the {self.consumers} consumer warpgroups), got {self.block_q}"
      )
    if self.block_kv not in (64, 128, 256):
      raise ValueError(f"MosaicConfig.block_kv must be 64, 128 or 256, got {self.block_kv}")
    if not 2 <= self.stages <= 8:
      raise ValueError(f"MosaicConfig.stages must be between 2 and 8, got {self.stages}")
    poly_exp2.check_poly_columns("MosaicConfig.poly_columns", self.poly_columns, self.block_kv)

  @property
  def rows_per_consumer(self) -> int:
    return self.block_q // self.consumers

  @property
  def q_buffers(self) -> int:
    return 2 if self.persistent else 1

  def smem_bytes(self, head_dim: int, dtype: jnp.dtype) -> int:
    """Shared memory of one CTA: the Q tiles (reused for the output; two
    sets when persistent), the K and V ring, the lse staging rows and a
    reserve for Mosaic's own use."""
    item = jnp.dtype(dtype).itemsize
    q = self.q_buffers * self.block_q * head_dim * item
    kv = 2 * self.stages * self.block_kv * head_dim * item
    lse = self.block_q * 4
    return q + kv + lse + _SMEM_RESERVE


# Persistent CTAs in Mosaic's interpreter: few, so that each takes several tiles.
_PERSISTENT_INTERPRET_CTAS = 2
# SMs of an H100 SXM / H200, for lowering where no GPU is attached.
_HOPPER_SMS = 132


def _sm_count() -> int:
  """SMs of the GPU the kernel will run on: one persistent CTA each."""
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:  # no GPU here (lowering for CUDA on a CPU host)
    return _HOPPER_SMS


# head_dim 64 takes three consumer warpgroups (192-row Q tiles) from these
# lengths of seq_q on, without a mask / causal: measured on the H200
# (bench/NOTES.md, sessions 8 and 13; the last Q block unpadded) +14-16% at
# 8k-16k without a mask, more at 4k, +11% at 2k (session 13; session 8's -3%
# there was with 2k padded to whole 192-row blocks); +4-7% causal at 8k-16k,
# equal causal at 4k and -26% at 2k with paired tiles. With balanced tiles
# (session 15) three were 1.6% faster causal at 4k in tools/mosaic_bench.py
# but 4% slower in the bench CLI (0.769 against 0.737 ms, separate runs):
# two stay there.
THREE_CONSUMERS_MIN_SEQ = {False: 2048, True: 8192}


def default_config(head_dim: int, *, seq_q: int = 0, causal: bool = False) -> MosaicConfig:
  """The tiling per head_dim (and, at head_dim 64, length): the deepest ring
  that fits shared memory with 128-row K/V blocks (64 for head_dim 256), the
  softmax overlapped with P V, and persistent CTAs where their second Q
  buffer fits (head_dim 64 and 128; bench/NOTES.md, sessions 4 and 5), their
  causal tiles from a balanced table (session 15); at
  head_dim 64 and long seq_q three consumer warpgroups: 192-row Q tiles
  read K and V a third less often per query row, and three consumers' softmax
  keeps the tensor cores busier (session 7's profile: the d64 forward is
  bound by its element-wise work)."""
  if head_dim <= 64:
    config = MosaicConfig(block_q=128, block_kv=128, stages=4, softmax_overlap=True, persistent=True, balanced=True)
    if seq_q >= THREE_CONSUMERS_MIN_SEQ[bool(causal)]:
      config = dataclasses.replace(config, block_q=3 * WGMMA_M, consumers=3)
    return config
  if head_dim <= 128:
    return MosaicConfig(block_q=128, block_kv=128, stages=2, softmax_overlap=True, persistent=True, balanced=True)
  return MosaicConfig(block_q=128, block_kv=64, stages=2, softmax_overlap=True)


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, config: MosaicConfig) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have one shape, got {k.shape} and {v.shape}")
  batch, seq_q, heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k's batch and head_dim must match q's: q {q.shape}, k {k.shape}")
  if heads % k.shape[2]:
    raise ValueError(f"q's heads ({heads}) must be a multiple of k's ({k.shape[2]})")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if len(dtypes) != 1:
    raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Mosaic GPU forward supports bfloat16 and float16 (wgmma operands), got {q.dtype}"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise NotImplementedError(
        f"the Mosaic GPU forward supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    )
  smem = config.smem_bytes(head_dim, q.dtype)
  if smem > SMEM_LIMIT:
    raise ValueError(
        f"{config} needs {smem} bytes of shared memory at head_dim {head_dim}, more than the "
        f"{SMEM_LIMIT} a Hopper CTA has: lower stages or block_kv"
    )


def interpret_params_of(
    interpret: bool | plgpu.InterpretGPUParams,
) -> tuple[plgpu.InterpretGPUParams | None, bool]:
  """(the interpreter's parameters or None, whether to interpret) from a
  kernel's `interpret` argument: False, True, or InterpretGPUParams."""
  params = plgpu.InterpretGPUParams() if interpret is True else (interpret or None)
  return params, params is not None


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


def visible(query: jax.Array, key: jax.Array, *, seq_q: int, seq_k: int, causal: bool) -> jax.Array:
  """Whether query `query` sees key `key` (int32 positions, broadcast), for
  the real lengths seq_q, seq_k. Keys at or past seq_k are padding; causal
  attention needs no test for them, since the diagonal stops the last real
  query at key seq_k - 1 (padded queries may see padded keys: their rows are
  sliced away, or have P = 0 in the backward)."""
  if causal:
    return key <= query + (seq_k - seq_q)  # bottom-right alignment
  return key < seq_k


def _kv_block_bounds(q_start: jax.Array, rows: int, seq_q: int, seq_k: int, block_kv: int, causal: bool, *, xp=jnp):
  """(full_hi, hi): this warpgroup's rows [q_start, q_start + rows) see every
  key of K/V blocks [0, full_hi), some keys of blocks [full_hi, hi) (those
  crossing the diagonal, and a last block that is partly padding: they take
  the masked path) and none from hi on. seq_q, seq_k are the real lengths:
  no block past the last real key is visited. int32 scalars (numpy's with
  xp=np, on the host)."""
  num_kv = pl.cdiv(seq_k, block_kv)
  num_full = seq_k // block_kv  # blocks with no padding
  if not causal:
    return xp.int32(num_full), xp.int32(num_kv)
  offset = seq_k - seq_q  # bottom-right alignment: row i sees keys j <= i + offset
  # Last key the last row sees is q_start + rows - 1 + offset.
  hi = xp.clip(q_start + (rows + offset + block_kv - 1), 0, None) // block_kv
  hi = xp.minimum(hi, num_kv)
  # Block kb is fully visible to the first row iff kb * block_kv + block_kv - 1 <= q_start + offset
  # (never a partial block for a real row; rows of padding are kept off it too).
  full_hi = xp.clip(q_start + (offset + 1), 0, None) // block_kv
  full_hi = xp.minimum(full_hi, xp.minimum(hi, num_full))
  return full_hi.astype(jnp.int32), hi.astype(jnp.int32)


def load_kv_blocks(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed, *,
                   batch, kv_head, num_steps, first_step, block_kv: int, stages: int) -> None:
  """TMA copies of K/V blocks 0..num_steps-1 of (batch, kv_head) into the
  ring, block i into the ring's step `first_step + i` (slot (first_step + i)
  % stages): a persistent CTA keeps one ring across its tiles. A slot is
  refilled once both consumers released what it held `stages` steps before."""

  @pl.loop(0, num_steps)
  def _load(step):
    ring_step = first_step + step
    slot = lax.rem(ring_step, jnp.int32(stages))
    kv_rows = (batch, pl.ds(step * block_kv, block_kv), kv_head)

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
                   block_kv=block_kv, stages=stages)

  def observe(end_step):
    observe_last_releases(k_consumed, v_consumed, end_step=end_step, stages=stages)

  return produce, observe


@dataclasses.dataclass(frozen=True)
class Turns:
  """Two consumer warpgroups taking turns at issuing wgmma groups
  (FlashAttention-3's ping-pong). Consumer w waits for barriers[w] before it
  issues a group and passes the turn to the other right after issuing, so
  that the groups reach the tensor cores one consumer's after the other's
  and, as FlashAttention-3 reasons, one consumer's element-wise work runs
  under the other's matmuls. (On the H200 it has not paid: the forward's
  MosaicConfig.pingpong and the backward's, since removed; bench/NOTES.md,
  sessions 5 and 10.) Both consumers must take the same number of turns (a
  consumer with nothing to compute in a step takes and passes its turns all
  the same); consumer 1 gives consumer 0 the first turn (`start`) and
  consumer 0 observes the last pass (`end`). With barriers None every
  method does nothing."""

  barriers: object  # [2] barriers of one arrival each, or None
  wg: jax.Array

  def take(self) -> None:
    if self.barriers is not None:
      plgpu.barrier_wait(self.barriers.at[self.wg])

  def pass_on(self) -> None:
    if self.barriers is not None:
      plgpu.barrier_arrive(self.barriers.at[1 - self.wg])

  def start(self) -> None:
    if self.barriers is not None:
      pl.when(self.wg == 1)(lambda: plgpu.barrier_arrive(self.barriers.at[0]))

  def end(self) -> None:
    if self.barriers is not None:
      pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(self.barriers.at[0]))


def run_tiles(schedule: PersistentSchedule | None, tile_at, *, wg, axis: str, produce, observe, load, compute,
              store, prologue=lambda: None, epilogue=lambda end_step: None, buffers: int = 2,
              consumers: int = NUM_CONSUMERS, produce_aside=(), early_load: bool = False, tiles_ref=None) -> None:
  """A warp-specialized CTA's two roles over its tiles; the kernels supply
  the work, as callables of a tile (QTile or the like: num_steps ring steps):

    produce(tile, ring_base): the producer's TMA copies of the tile's inner
      blocks into the ring's steps ring_base, ring_base + 1, ...;
    observe(end_step): the producer's wait for the release of the ring's
      last slots before end_step;
    load(tile, buffer): a consumer starts the copies of its outer rows;
    compute(tile, buffer, ring_base): waits for them and returns its result;
    store(tile, buffer, result): starts the result's TMA stores;
    prologue(), epilogue(end_step): a consumer's work before its first tile
      and after its last (end_step: the ring steps of all its tiles);
    produce_aside: callables (tile, ring_base), optional (persistent CTAs
      only): more producer work, each run by one more warp of the producer
      warpgroup (the second, third, ...) over the same tiles while its first
      warp runs `produce` and `observe`, so that none waits behind another.

  With schedule None the CTA takes the one tile of its grid position
  (tile_at(index on `axis`, head, batch)); else the schedule's tiles, with
  one ring through all of them and the outer rows double-buffered, the next
  tile's rows loading while the current one's results are stored (with
  `buffers` 1, where shared memory has no room for a second set: after the
  stores have read them); with `early_load` (two buffers) the next tile's
  rows load from the current tile's start, once the previous tile's stores
  have read their buffer. tiles_ref: the schedule's table (int32 in global
  memory; see PersistentSchedule.table), where it has one. wg: the
  warpgroup index; warpgroups [0, consumers) consume, warpgroup `consumers`
  produces."""
  producer, consumer_registers = consumers, CONSUMER_REGISTERS[consumers]
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
      prologue()
      store(tile, 0, compute(tile, 0, jnp.int32(0)))
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
    prologue()
    first = number_of(jnp.int32(0))
    load(tile_of(first), 0)

    def consume(i, carry):
      ring_base, number = carry
      # The next tile's number is read a whole tile before its rows load: a
      # table's entries come from global memory.
      next_number = number_of(i + 1)
      tile, next_tile = tile_of(number), tile_of(next_number)
      if buffers == 1:
        result = compute(tile, 0, ring_base)
        store(tile, 0, result)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the rows' buffer

        @pl.when(i + 1 < num_tiles)
        def _():
          load(next_tile, 0)

        return ring_base + tile.num_steps, next_number
      buffer = lax.rem(i, jnp.int32(2))

      def load_next():
        # The next tile's rows go to the other buffer, which staged the
        # previous tile's results: their stores must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pl.when(i + 1 < num_tiles)(lambda: load(next_tile, 1 - buffer))

      if early_load:  # before this tile: its stores just issued, the loads a whole tile ahead
        load_next()
      result = compute(tile, buffer, ring_base)
      if not early_load:  # after it: the stores issued a whole tile ago, the loads just in time
        load_next()
      store(tile, buffer, result)
      return ring_base + tile.num_steps, next_number

    end_step, _ = lax.fori_loop(0, num_tiles, consume, (jnp.int32(0), first))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # shared memory must outlive the stores' reads
    epilogue(end_step)


@dataclasses.dataclass(frozen=True)
class QTile:
  """block_q query rows of one (batch, head): the unit of work of a Q-outer
  kernel's CTA (the forward, dQ). Fields are int32 scalars."""

  batch: jax.Array
  head: jax.Array
  q_start: jax.Array  # first query row
  num_steps: jax.Array  # K/V blocks the producer loads for it

  @classmethod
  def at(cls, q_index, head, batch, *, num_q_blocks: int, block_q: int, block_kv: int, seq_q: int, seq_k: int,
         causal: bool, consumers: int = NUM_CONSUMERS) -> QTile:
    """The tile of grid position q_index (a causal kernel runs Q blocks
    heaviest first: those near the end of the sequence visit the most K/V
    blocks, and taking them first keeps them off the critical path at the
    tail)."""
    if causal:
      q_index = jnp.int32(num_q_blocks - 1) - q_index
    q_start = q_index * block_q
    return cls(batch, head, q_start, _q_tile_steps(q_start, block_q=block_q, block_kv=block_kv, seq_q=seq_q,
                                                   seq_k=seq_k, causal=causal, consumers=consumers))

  def kv_head(self, group: int) -> jax.Array:
    """The K/V head of this tile's query head (grouped-query attention)."""
    return lax.div(self.head, jnp.int32(group))


def _q_tile_steps(q_start, *, block_q: int, block_kv: int, seq_q: int, seq_k: int, causal: bool, consumers: int,
                  xp=jnp):
  """K/V blocks the producer loads for the Q tile from row q_start: every
  block any consumer needs; the last consumer's rows are the latest, so its
  bound covers them all."""
  rows = block_q // consumers
  _, hi = _kv_block_bounds(q_start + (consumers - 1) * rows, rows, seq_q, seq_k, block_kv, causal, xp=xp)
  return hi


def q_tile_work(num_q_blocks: int, *, block_q: int, block_kv: int, seq_q: int, seq_k: int,
                consumers: int = NUM_CONSUMERS) -> tuple[int, ...]:
  """The ring steps of each causal Q tile, numbered as QTile.at numbers
  them (block 0 the heaviest): the work a balanced PersistentSchedule
  evens out."""
  return tuple(
      int(_q_tile_steps((num_q_blocks - 1 - b) * block_q, block_q=block_q, block_kv=block_kv, seq_q=seq_q,
                        seq_k=seq_k, causal=True, consumers=consumers, xp=np))
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
  round too (`_balanced_table`); the kernel reads its tiles from that table
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
                   _PERSISTENT_INTERPRET_CTAS if interpret else _sm_count())
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
    return _balanced_table(self.num_blocks, self.heads * self.batch, self.num_ctas, self.work)

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

# A tile's cost in `_balanced_table` beyond its ring steps: its first loads,
# its last P V and its stores, about a step's time.
_TILE_OVERHEAD_STEPS = 1


@functools.lru_cache(maxsize=64)
def _balanced_table(num_blocks: int, units: int, num_ctas: int, work: tuple[int, ...]) -> np.ndarray:
  """PersistentSchedule.table() of `units` (batch, head) pairs of num_blocks
  tiles each, tile b of a unit costing work[b] ring steps (plus
  _TILE_OVERHEAD_STEPS).

  Pairs dealt round-robin (the paired schedule) leave a last round of pairs
  that only some CTAs take: at 2048 pairs on 132 CTAs, 68 CTAs take one pair
  more than the rest (+3% of the kernel), and where a (batch, head) has an
  odd number of blocks the pairs are unequal too (+9% at 8k, d64, three
  consumers). Here every tile goes, in turn, to the CTA with the least work
  so far (greedy list scheduling): first the heavy-light pairs of each
  (batch, head) in order, as whole pairs, which keeps the CTAs that run
  together on few heads (their K/V shared in L2); then the last few rounds'
  worth of pairs as single tiles, heaviest first, which fill the CTAs up
  evenly (longest processing time first). Of tails of 1 to 4 rounds, the one
  whose busiest CTA works least (the shortest of equals: the fewest heads at
  once); at the bench shapes within 0.2-0.5% of the mean
  (tools/schedule_model.py)."""
  cost = np.asarray(work, np.int64) + _TILE_OVERHEAD_STEPS
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


def _forward_kernel(
    q_ref, k_ref, v_ref, tiles_ref, out_ref, lse_ref,
    q_smem, k_smem, v_smem, lse_smem,
    q_ready, k_ready, v_ready, k_consumed, v_consumed, *extra,
    seq_q: int, seq_k: int, group: int, num_q_blocks: int, schedule: PersistentSchedule | None,
    causal: bool, softmax_scale: float, config: MosaicConfig, interpret: bool,
):
  # q_ref, out_ref: [batch, seq_q', heads, D] in GMEM; k_ref, v_ref: [batch,
  # seq_k', heads // group, D] in GMEM; lse_ref: [batch, heads, seq_q'] f32;
  # seq_q', seq_k': the real seq_q, seq_k padded to whole blocks (seq_q on
  # the GPU only to whole consumer tiles; see `forward`); tiles_ref: the
  # persistent schedule's table (`tile_table`).
  # C = config.consumers (2, or 3). q_smem: [buffers, C, rows, D] (one Q
  # tile per consumer, reused for its output; two buffers in a persistent
  # CTA, which loads the next tile's Q while the current one's output is
  # stored); k_smem, v_smem: [stages, block_kv, D] (the ring); lse_smem:
  # [C, rows] f32.
  # q_ready: [buffers * C] barriers; k_ready, v_ready: [stages] barriers the
  # TMA engine completes; k_consumed, v_consumed: [stages] barriers of C
  # arrivals.
  # extra: turn (with pingpong, C = 2): [2] barriers of 1 arrival, turn[w]
  # passes the tensor cores to consumer w; p_staging (interpret mode only):
  # [C, rows, block_kv], P on its way to wgmma.
  # schedule: None for one CTA per tile (grid q x heads x batch); else the
  # persistent CTAs' tiles.
  rows, block_kv, stages = config.rows_per_consumer, config.block_kv, config.stages
  dtype = q_ref.dtype
  extra = list(extra)
  turn = extra.pop(0) if config.pingpong else None
  p_staging = extra.pop(0) if interpret else None
  wg = lax.axis_index("wg")
  qk_scale = softmax_scale * LOG2_E
  # Only causal attention with seq_q > seq_k has rows that see no key at
  # all: they keep m_i = -inf and l_i = 0, which needs guards (see below).
  may_see_nothing = causal and seq_q > seq_k
  overlap = config.softmax_overlap and not may_see_nothing
  pingpong = config.pingpong and overlap

  # Ping-pong (`Turns`): one turn per step's matmuls. Both consumers take
  # one per K/V block of the tile and one more (block 0's scores alone, then
  # one step per block, then the last block's P V; a consumer past its
  # diagonal passes its turn in the drain).
  turns = Turns(turn if pingpong else None, wg)
  take_turn, pass_turn = turns.take, turns.pass_on
  any_masked = causal or bool(seq_k % block_kv)  # a diagonal, or a last block partly of padding

  consumers = config.consumers
  tile_at = functools.partial(QTile.at, num_q_blocks=num_q_blocks, block_q=config.block_q, block_kv=block_kv,
                              seq_q=seq_q, seq_k=seq_k, causal=causal, consumers=consumers)

  def load_q(tile: QTile, buffer):
    plgpu.copy_gmem_to_smem(q_ref.at[tile.batch, pl.ds(tile.q_start + wg * rows, rows), tile.head],
                            q_smem.at[buffer, wg], q_ready.at[buffer * consumers + wg])

  def attend(tile: QTile, q_tile, ring_base):
    """One consumer's rows of `tile` against its K/V blocks, which occupy the
    ring's steps ring_base, ring_base + 1, ...: (acc, m_i, l_i), acc not yet
    divided by l_i."""
    q_start = tile.q_start + wg * rows
    full_hi, hi = _kv_block_bounds(q_start, rows, seq_q, seq_k, block_kv, causal)
    # The A operand of S = Q K^T: Q in shared memory, or in registers
    # (config.q_registers), loaded once for all of the tile's K blocks.
    q_a = q_tile
    if config.q_registers and not interpret:
      q_a = plgpu.load(q_tile, layout=plgpu.Layout.WGMMA)

    def slot_of(kb):
      return lax.rem(ring_base + kb, jnp.int32(stages))

    def issue_scores(s_ref, slot):
      # Starts S = Q K^T of the K block in `slot` on the tensor cores.
      plgpu.wgmma(s_ref, q_a, k_smem.at[slot].transpose((1, 0)))

    def scores_now(slot):
      """S = Q K^T [rows, block_kv] of the K block in `slot`, waited for;
      the slot is released to the producer once read."""
      plgpu.barrier_wait(k_ready.at[slot])

      def qk(s_ref):
        take_turn()
        issue_scores(s_ref, slot)
        pass_turn()
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
      if masked:
        row = q_start + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        col = kb * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where(visible(row, col, seq_q=seq_q, seq_k=seq_k, causal=causal), s, -jnp.inf)
      m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * qk_scale)
      if masked and may_see_nothing:
        # A row with only masked scores so far keeps m = -inf; shift it by 0
        # so that exp2 gives 0 rather than exp2(-inf + inf) = NaN.
        m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_i - m_new)
      p = poly_exp2.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]), config.poly_columns)
      return p, m_new, l_i * alpha + jnp.sum(p, axis=1), alpha

    def rescale(acc, alpha):
      return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def add_pv(acc, p, slot):
      """acc + P V for the V block in `slot`, waited for."""
      if interpret:
        # Mosaic's interpreter (jax 0.11.2) runs wgmma only from operands in
        # shared memory and only into a fresh scoped accumulator: P takes a
        # detour through shared memory and P V is added afterwards. The same
        # sum; the compiled kernel never takes this branch.
        p_tile = p_staging.at[wg]
        p_tile[...] = p.astype(dtype)
        plgpu.commit_smem()

        def pv_fresh(pv_ref):
          take_turn()
          plgpu.wgmma(pv_ref, p_tile, v_smem.at[slot])
          pass_turn()
          return pv_ref[...]

        return acc + pl.run_scoped(pv_fresh, plgpu.ACC(acc.shape, jnp.float32))

      # The tensor cores add P V onto the rescaled accumulator in place.
      def pv(acc_ref):
        take_turn()
        plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
        pass_turn()

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
      # cores finish P V, and only then rescales acc to the new max. (ptxas
      # hoists the wait for P V above most of the softmax; keeping it below,
      # behind a one-iteration loop, was no faster: bench/NOTES.md, session 11.)
      acc, m_i, l_i, p_prev = carry
      slot, prev = slot_of(kb), slot_of(kb - 1)
      # (Named scopes: regions of the profiler's traces, see `profiling`.)
      with jax.named_scope("wait_kv"):
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])

      def body(s_ref, o_ref):
        take_turn()
        issue_scores(s_ref, slot)
        if interpret:  # P through shared memory (see add_pv); the sum is added below
          plgpu.wgmma(o_ref, p_staging.at[wg], v_smem.at[prev])
        else:
          o_ref[...] = acc
          plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
        pass_turn()
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
        p_staging.at[wg][...] = p.astype(dtype)  # P V of kb-1 has read the old P
        plgpu.commit_smem()
      return rescale(o, alpha), m_new, l_i, p.astype(dtype)

    def first_overlapped_step(carry, *, masked: bool):
      # Block 0: scores and softmax only; its P V starts with block 1's scores.
      acc, m_i, l_i = carry
      p, m_new, l_i, _ = online_softmax(0, scores_now(slot_of(0)), m_i, l_i, masked=masked)  # acc is 0: no rescale
      if interpret:
        p_staging.at[wg][...] = p.astype(dtype)
        plgpu.commit_smem()
      return acc, m_new, l_i, p.astype(dtype)

    def drain(kb, _):
      # Blocks past this warpgroup's diagonal that the other consumer still
      # needs: release the slots without computing. Waiting on the ready
      # barriers first keeps this warpgroup's barrier phases in step and
      # guarantees that its arrival counts toward this block's phase, not an
      # earlier one still owed by the other consumer.
      slot = slot_of(kb)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])
      take_turn()
      pass_turn()

    acc = plgpu.layout_cast(jnp.zeros((rows, q_ref.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    if overlap:
      # Every warpgroup sees at least block 0 here (hi >= 1). Block 0 takes
      # the masked path wherever any block may need it: exact either way.
      carry = first_overlapped_step((acc, m_i, l_i), masked=any_masked)
      carry = lax.fori_loop(1, full_hi, functools.partial(overlapped_step, masked=False), carry)
      if any_masked:
        carry = lax.fori_loop(jnp.maximum(full_hi, 1), hi, functools.partial(overlapped_step, masked=True), carry)
      acc, m_i, l_i, p = carry
      last = slot_of(hi - 1)
      plgpu.barrier_wait(v_ready.at[last])
      acc = add_pv(acc, p, last)
      plgpu.barrier_arrive(v_consumed.at[last])
    else:
      carry = lax.fori_loop(0, full_hi, functools.partial(step, masked=False), (acc, m_i, l_i))
      if any_masked:
        carry = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
      acc, m_i, l_i = carry
    if causal:
      lax.fori_loop(hi, tile.num_steps, drain, None)
    return acc, m_i, l_i

  def store_output(tile: QTile, q_tile, acc, m_i, l_i):
    """Divides acc by l_i and starts the TMA stores of the output and lse,
    staged in shared memory (q_tile, whose Q every wgmma has read by now)."""
    # One division per row at the end (a reciprocal, then multiplies).
    if may_see_nothing:
      seen = l_i > 0.0
      l_i = jnp.where(seen, l_i, 1.0)  # rows that saw no key: zeros, lse = -inf
    out = acc * lax.broadcast_in_dim(1.0 / l_i, acc.shape, [0])
    lse = (m_i + jnp.log2(l_i)) * LN_2
    if may_see_nothing:
      lse = jnp.where(seen, lse, -jnp.inf)
    q_start = tile.q_start + wg * rows
    q_tile[...] = out.astype(dtype)
    lse_smem.at[wg][...] = lse
    # Ordinary stores must be made visible to the TMA engine (the async proxy)
    # before it reads shared memory.
    plgpu.commit_smem()
    # A tile wholly past the arrays' end (of a last Q block that `forward`
    # left unpadded) stores nothing: the TMA engine would drop its output
    # rows, but its lse rows landed on the next head's first ones (H200,
    # session 8).
    @pl.when(q_start < out_ref.shape[1])
    def _():
      plgpu.copy_smem_to_gmem(q_tile, out_ref.at[tile.batch, pl.ds(q_start, rows), tile.head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[tile.batch, tile.head, pl.ds(q_start, rows)])

  def compute(tile: QTile, buffer, ring_base):
    plgpu.barrier_wait(q_ready.at[buffer * consumers + wg])
    return attend(tile, q_smem.at[buffer, wg], ring_base)

  def store(tile: QTile, buffer, result):
    store_output(tile, q_smem.at[buffer, wg], *result)

  produce, observe = kv_ring_producer(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_consumed, v_consumed,
                                      group=group, block_kv=block_kv, stages=stages)
  run_tiles(schedule, tile_at, wg=wg, axis="q", produce=produce, observe=observe, load=load_q, compute=compute,
            store=store, prologue=turns.start, epilogue=lambda end_step: turns.end(), consumers=consumers,
            early_load=config.early_q, tiles_ref=tiles_ref)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    config: MosaicConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
  """FlashAttention-2 forward on Hopper via Mosaic GPU.

  Args:
    q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads,
      head_dim] with heads a multiple of kv_heads; bf16 or fp16; any
      lengths (ragged ones are padded to whole blocks and sliced back).
    causal: bottom-right aligned causal mask.
    softmax_scale: multiplies the scores; defaults to head_dim ** -0.5.
    config: tiling; defaults to `default_config(head_dim, seq_q=...,
      causal=...)`.
    interpret: run Mosaic GPU's interpreter (CPU) instead of compiling:
      True, or plgpu.InterpretGPUParams (e.g. detect_races=True).

  Returns:
    out: like q. lse: float32 [batch, heads, seq_q], natural log (-inf for
      rows that see no key, which only causal with seq_q > seq_k has).

  Raises:
    NotImplementedError: head_dim not in (64, 128, 256), dtypes other than
      bf16/fp16 (see the module docstring).
  """
  if config is None:
    config = default_config(q.shape[-1], seq_q=q.shape[1], causal=causal)
  _check_inputs(q, k, v, config)
  batch, seq_q, heads, head_dim = q.shape
  seq_k, kv_heads = k.shape[1], k.shape[2]
  if softmax_scale is None:
    softmax_scale = head_dim ** -0.5
  # The kernel works on whole blocks; it bounds and masks with the real
  # seq_q, seq_k, and the rows of padding are sliced off its results.
  interpret_params, interpret = interpret_params_of(interpret)
  rows, dtype, consumers = config.rows_per_consumer, q.dtype, config.consumers
  if interpret or seq_q % rows:
    q = pad_seq(q, config.block_q)
  # else a last Q block past seq_q (192-row blocks over multiples of 128)
  # needs no copy: its consumers' tiles lie wholly inside q or wholly past
  # its end, where the TMA engine loads zeros and the kernel stores nothing.
  k, v = pad_seq(k, config.block_kv), pad_seq(v, config.block_kv)
  num_q_blocks = pl.cdiv(q.shape[1], config.block_q)

  # 128-byte swizzle (64 elements of 16 bits per swizzled row) lets wgmma and
  # the TMA engine read the tiles without bank conflicts; head_dim is a
  # multiple of 64, so every supported tile takes it.
  swizzle = plgpu.find_swizzle(head_dim * jnp.dtype(dtype).itemsize * 8, "head_dim")
  transforms = (
      plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle),
  )
  scratch = [
      plgpu.SMEM((config.q_buffers, consumers, rows, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((config.stages, config.block_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((config.stages, config.block_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((consumers, rows), jnp.float32),
      plgpu.Barrier(num_barriers=config.q_buffers * consumers),
      plgpu.Barrier(num_barriers=config.stages),
      plgpu.Barrier(num_barriers=config.stages),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=config.stages),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=config.stages),
  ]
  if config.pingpong:
    scratch.append(plgpu.Barrier(num_barriers=consumers))  # turn
  if interpret:
    p_transforms = (
        plgpu.TilingTransform((8, 64)),
        plgpu.SwizzleTransform(128),
    )
    scratch.append(plgpu.SMEM((consumers, rows, config.block_kv), dtype, transforms=p_transforms))
  work = None
  if causal and config.balanced:
    work = q_tile_work(num_q_blocks, block_q=config.block_q, block_kv=config.block_kv, seq_q=seq_q, seq_k=seq_k,
                       consumers=consumers)
  schedule, grid, grid_names = outer_grid(num_q_blocks, heads, batch, axis="q", persistent=config.persistent,
                                          causal=causal, interpret=interpret, work=work)
  kernel = functools.partial(
      _forward_kernel, seq_q=seq_q, seq_k=seq_k, group=heads // kv_heads, num_q_blocks=num_q_blocks,
      schedule=schedule, causal=causal, softmax_scale=float(softmax_scale), config=config, interpret=interpret,
  )
  out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((batch, heads, q.shape[1]), jnp.float32))
  out, lse = specialized_kernel(kernel, out_type=out_type, scratch=scratch, grid=grid, grid_names=grid_names,
                                interpret_params=interpret_params, name="flash2_fwd_mosaic",
                                consumers=consumers)(q, k, v, tile_table(schedule))
  return unpad_seq(out, seq_q), unpad_seq(lse, seq_q, axis=2)
