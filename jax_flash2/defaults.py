"""The measured defaults: tilings per kernel and head_dim, and where the
Hopper kernels run under backend="auto".

Every table here was measured on an H200 (bf16, batch x seq = 16k tokens,
hidden 2048, seq 2k to 16k, cuDNN in the same runs); an explicit config
passed to flash_attention always wins over them.
"""

from __future__ import annotations

import dataclasses

from jax_flash2.config import BlockSizes, DecodeConfig, KernelConfig, MosaicBackwardConfig, MosaicForwardConfig

# ---------------------------------------------------------------- Triton kernels

# Keyed by (head_dim padded to a power of two, causal); (fwd, dkv, dq), swept
# at seq 8k. At head_dim 256 the causal dQ kernel takes the non-causal best.
_TRITON_TILES: dict[tuple[int, bool], tuple[KernelConfig, KernelConfig, KernelConfig]] = {
    (64, False): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 64, 4, 2)),
    (64, True): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 128, 4, 3)),
    (128, False): (KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3)),
    (128, True): (KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 128, 4, 3)),
    (256, False): (KernelConfig(64, 64, 4, 3), KernelConfig(64, 64, 8, 2), KernelConfig(128, 32, 8, 3)),
    (256, True): (KernelConfig(64, 64, 4, 3), KernelConfig(64, 64, 8, 2), KernelConfig(128, 32, 8, 3)),
}

# A bias streams one more tile per step through shared memory beside K and
# V; with three pipeline stages that overflows an SM's 227 KiB at head_dim
# 256, so biased problems run at most two.
BIAS_MAX_STAGES = 2


# float32 tiles take twice the shared memory of the measured 16-bit ones
# (on an H200, 2026-12-02, the head_dim-128 causal forward asked for 352 KiB
# of the 227 available); they are cut down until the tiles they hold fit
# this budget, leaving room for the compiler's own scratch.
FLOAT32_SMEM_BUDGET = 160 * 1024


def _fit_float32(config: KernelConfig, head_dim_padded: int, *, streams_kv: bool) -> KernelConfig:
  """Shrinks a 16-bit tiling for float32: fewer stages first, then the
  streamed tile, then the resident one. The forward and dQ kernels hold a
  Q tile (and dO) and stream K and V; the dK/dV kernel the other way round."""

  def smem(c: KernelConfig) -> int:
    resident, streamed = (c.block_q, c.block_k) if streams_kv else (c.block_k, c.block_q)
    return 4 * head_dim_padded * (2 * resident + 2 * streamed * max(1, c.num_stages - 1))

  config = dataclasses.replace(config, num_stages=min(config.num_stages, 2))
  stream, hold = ("block_k", "block_q") if streams_kv else ("block_q", "block_k")
  for name in (stream, hold, stream, hold):
    if smem(config) <= FLOAT32_SMEM_BUDGET:
      break
    config = dataclasses.replace(config, **{name: max(16, getattr(config, name) // 2)})
  return config


def block_sizes(head_dim_padded: int, causal: bool, *, has_bias: bool = False, itemsize: int = 2) -> BlockSizes:
  """The Triton kernels' tiles for a head_dim (padded to a power of two),
  mask, whether a bias is read and the inputs' bytes per element. Head
  dims under 64 take the head_dim-64 tiles."""
  configs = _TRITON_TILES[max(64, head_dim_padded), bool(causal)]
  if has_bias:
    configs = [dataclasses.replace(c, num_stages=min(c.num_stages, BIAS_MAX_STAGES)) for c in configs]
  fwd, dkv, dq = configs
  if itemsize > 2:
    fwd = _fit_float32(fwd, head_dim_padded, streams_kv=True)
    dkv = _fit_float32(dkv, head_dim_padded, streams_kv=False)
    dq = _fit_float32(dq, head_dim_padded, streams_kv=True)
  return BlockSizes(fwd=fwd, dkv=dkv, dq=dq)


# ---------------------------------------------------------------- Mosaic kernels

# head_dim 64 takes three consumer warpgroups (192-row Q tiles) from these
# lengths of seq_q on (without a mask / causal): 11-16% faster from 2k
# without a mask, 4-7% causal from 8k; at 4k causal three were as fast as
# two, and slower at 2k.
THREE_CONSUMERS_MIN_SEQ = {False: 2048, True: 8192}


def mosaic_forward(head_dim: int, *, seq_q: int, causal: bool, segments: bool = False) -> MosaicForwardConfig:
  """The Mosaic forward's tiling: the deepest ring that fits shared memory
  with 128-row K/V blocks (64 at head_dim 256), the softmax overlapped with
  P V, persistent CTAs where their second Q buffer fits (head_dim 64 and
  128) with causal tiles from a balanced table; at head_dim 64 and long
  seq_q three consumer warpgroups, whose softmax keeps the tensor cores
  busier (the head_dim-64 forward is bound by its element-wise work).

  segments: with segment ids a tile's work depends on the ids, which the
  persistent CTAs' static schedules (built for the band alone) cannot see:
  one CTA a tile, balanced by the hardware as CTAs finish, instead (on the
  H200 at head_dim 128, 16k causal: 8 sequences of ragged lengths 16% faster
  forward+backward, 8 equal ones unchanged; head_dim 64 and 256 follow
  unmeasured)."""
  if head_dim <= 64:
    config = MosaicForwardConfig(block_q=128, block_kv=128, stages=4, softmax_overlap=True, persistent=True,
                                 balanced=True)
    if seq_q >= THREE_CONSUMERS_MIN_SEQ[bool(causal)]:
      config = dataclasses.replace(config, block_q=192, consumers=3)
  elif head_dim <= 128:
    config = MosaicForwardConfig(block_q=128, block_kv=128, stages=2, softmax_overlap=True, persistent=True,
                                 balanced=True)
  else:
    config = MosaicForwardConfig(block_q=128, block_kv=64, stages=2, softmax_overlap=True)
  return dataclasses.replace(config, persistent=False, balanced=False) if segments else config


def mosaic_backward(head_dim: int, *, fused: bool = True, segments: bool = False) -> MosaicBackwardConfig:
  """The Mosaic backward's tiling. fused: whether the problem may take the
  fused kernel (full and causal attention; windows, softcap and ALiBi take
  the two kernels at head_dim 64 too, with its tiles otherwise); segments:
  with segment ids, one CTA a tile (as `mosaic_forward` says why).

  head_dim 64: one kernel computes dQ as well (fused_dq), faster than two
  by 9-20%, with lse and delta loaded under the score products (1-2% faster
  causal). head_dim 128: the dK/dV and dQ kernels, both persistent; the dK/dV
  kernel keeps dK and dV in registers (128 per thread), so its Q blocks stay
  at 64 rows; the dQ kernel overlaps its softmax with dP's product. The
  fused kernel is level with them there without a mask and 12-19% behind
  causal. head_dim 256 (backward_wide.py): 64-row blocks, two ring slots,
  persistent dQ CTAs (persistent dK/dV CTAs spill)."""
  if head_dim <= 64:
    config = MosaicBackwardConfig(block_q=64, block_kv=128, stages=4, dq_softmax_overlap=True, dq_persistent=True,
                                  dkv_persistent=True, fused_dq=fused, early_vectors=True)
  elif head_dim <= 128:
    config = MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, dq_softmax_overlap=True, dq_persistent=True,
                                  dkv_persistent=True)
  else:
    config = MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, dq_persistent=True)
  return dataclasses.replace(config, dq_persistent=False, dkv_persistent=False) if segments else config


# ---------------------------------------------------------------- where "auto" runs them

# The Mosaic kernels are faster than the Triton ones for every problem both
# serve at head_dim 64, 128 and 256, forward and backward, except at short
# ragged lengths: those are padded to whole 128-row blocks (a copy of q, k, v
# and the outputs) that the Mosaic kernels' speed pays for only from about
# this length (at 4000: +1% to +36% in 7 of 8 passes; at 1000 the Triton
# forward is 12-35% faster).
HOPPER_RAGGED_MIN_SEQ = 4000
# Rows of the blocks the Mosaic kernels pad ragged lengths to.
MOSAIC_BLOCK_ROWS = 128


def mosaic_pays_for_padding(seq_q: int, seq_k: int) -> bool:
  """Whether "auto" may take the Mosaic kernels at these lengths: whole
  128-row blocks, or long enough to pay for the padding."""
  whole = seq_q % MOSAIC_BLOCK_ROWS == 0 and seq_k % MOSAIC_BLOCK_ROWS == 0
  return whole or min(seq_q, seq_k) >= HOPPER_RAGGED_MIN_SEQ


# ---------------------------------------------------------------- decoding (flash_decode)

# Swept on the H200 (lab/tools/decode_sweep.py, 2026-12-02; bf16, head_dim
# 128, GQA 8:1): block_k 64, 4 warps, 3 stages and two waves of programs
# read batch-8 caches of 8k-32k at 71-89% of a copy, batch 1 at 128k 84%,
# 64-token pages 93%; one wave with 2 stages reads 55-68%, too few loads
# in flight. Larger blocks, 8 warps and more waves measured no better.

# K/V rows per block of the split-KV decode kernel; a paged cache takes the
# largest power of two dividing its page size, up to this.
DECODE_BLOCK_K = 64
# Splits per (batch, K/V head) where the SM count is unknown (CPU, interpret
# mode): a small fixed number, which the tests exercise.
DECODE_SPLITS_WITHOUT_GPU = 3
# At most this many splits: each adds a partial output to write and combine.
DECODE_MAX_SPLITS = 64
# Programs per SM the splits aim for: a second wave keeps loads in flight
# while the first one's programs finish.
DECODE_WAVES = 2
# Software-pipelining depth of the decode loop's K/V loads.
DECODE_STAGES = 3


def decode_block_k(page_size: int | None) -> int:
  """The decode kernel's K/V block: DECODE_BLOCK_K, or for a paged cache the
  largest power of two <= DECODE_BLOCK_K dividing page_size (a multiple of 16)."""
  if page_size is None:
    return DECODE_BLOCK_K
  return min(DECODE_BLOCK_K, page_size & -page_size)


def decode_splits(sm_count: int | None, batch: int, kv_heads: int, max_blocks: int) -> int:
  """Splits of each sequence's cache so that batch * kv_heads * splits
  programs fill the GPU DECODE_WAVES times (132 SMs on an H200), never more
  splits than a full-length cache has K/V blocks. sm_count None (no GPU):
  DECODE_SPLITS_WITHOUT_GPU."""
  if sm_count is None:
    wanted = DECODE_SPLITS_WITHOUT_GPU
  else:
    wanted = -(-DECODE_WAVES * sm_count // (batch * kv_heads))
  return max(1, min(wanted, max_blocks, DECODE_MAX_SPLITS))


def decode_config(page_size: int | None, sm_count: int | None, *, batch: int, kv_heads: int, max_seq: int,
                  num_splits: int | None = None) -> DecodeConfig:
  """The decode kernel's config; an explicit num_splits wins over decode_splits."""
  block_k = decode_block_k(page_size)
  if num_splits is None:
    num_splits = decode_splits(sm_count, batch, kv_heads, -(-max_seq // block_k))
  return DecodeConfig(block_k, num_splits, num_stages=DECODE_STAGES)
