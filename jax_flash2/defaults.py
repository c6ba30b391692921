"""The measured defaults: tilings per kernel and head_dim, and where the
Hopper kernels run under backend="auto".

Every table here was measured on an H200 (bf16, batch x seq = 16k tokens,
hidden 2048, seq 2k to 16k, cuDNN in the same runs); an explicit config
passed to flash_attention always wins over them.
"""

from __future__ import annotations

import dataclasses

from jax_flash2.config import BlockSizes, KernelConfig, MosaicBackwardConfig, MosaicForwardConfig

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


def block_sizes(head_dim_padded: int, causal: bool, *, has_bias: bool = False) -> BlockSizes:
  """The Triton kernels' tiles for a head_dim (padded to a power of two),
  mask and whether a bias is read. Head dims under 64 take the head_dim-64
  tiles."""
  configs = _TRITON_TILES[max(64, head_dim_padded), bool(causal)]
  if has_bias:
    configs = [dataclasses.replace(c, num_stages=min(c.num_stages, BIAS_MAX_STAGES)) for c in configs]
  fwd, dkv, dq = configs
  return BlockSizes(fwd=fwd, dkv=dkv, dq=dq)


# ---------------------------------------------------------------- Mosaic kernels

# head_dim 64 takes three consumer warpgroups (192-row Q tiles) from these
# lengths of seq_q on (without a mask / causal): 11-16% faster from 2k
# without a mask, 4-7% causal from 8k; at 4k causal three were as fast as
# two, and slower at 2k.
THREE_CONSUMERS_MIN_SEQ = {False: 2048, True: 8192}


def mosaic_forward(head_dim: int, *, seq_q: int, causal: bool) -> MosaicForwardConfig:
  """The Mosaic forward's tiling: the deepest ring that fits shared memory
  with 128-row K/V blocks (64 at head_dim 256), the softmax overlapped with
  P V, persistent CTAs where their second Q buffer fits (head_dim 64 and
  128) with causal tiles from a balanced table; at head_dim 64 and long
  seq_q three consumer warpgroups, whose softmax keeps the tensor cores
  busier (the head_dim-64 forward is bound by its element-wise work)."""
  if head_dim <= 64:
    config = MosaicForwardConfig(block_q=128, block_kv=128, stages=4, softmax_overlap=True, persistent=True,
                                 balanced=True)
    if seq_q >= THREE_CONSUMERS_MIN_SEQ[bool(causal)]:
      config = dataclasses.replace(config, block_q=192, consumers=3)
    return config
  if head_dim <= 128:
    return MosaicForwardConfig(block_q=128, block_kv=128, stages=2, softmax_overlap=True, persistent=True,
                               balanced=True)
  return MosaicForwardConfig(block_q=128, block_kv=64, stages=2, softmax_overlap=True)


def mosaic_backward(head_dim: int, *, fused: bool = True) -> MosaicBackwardConfig:
  """The Mosaic backward's tiling. fused: whether the problem may take the
  fused kernel (full and causal attention; windows, softcap and ALiBi take
  the two kernels at head_dim 64 too, with its tiles otherwise).

  head_dim 64: one kernel computes dQ as well (fused_dq), faster than two
  by 9-20%, with lse and delta loaded under the score products (1-2% faster
  causal). head_dim 128: the dK/dV and dQ kernels, both persistent; the dK/dV
  kernel keeps dK and dV in registers (128 per thread), so its Q blocks stay
  at 64 rows; the dQ kernel overlaps its softmax with dP's product. The
  fused kernel is level with them there without a mask and 12-19% behind
  causal. head_dim 256 (backward_wide.py): 64-row blocks, two ring slots,
  persistent dQ CTAs (persistent dK/dV CTAs spill)."""
  if head_dim <= 64:
    return MosaicBackwardConfig(block_q=64, block_kv=128, stages=4, dq_softmax_overlap=True, dq_persistent=True,
                                dkv_persistent=True, fused_dq=fused, early_vectors=True)
  if head_dim <= 128:
    return MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, dq_softmax_overlap=True, dq_persistent=True,
                                dkv_persistent=True)
  return MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, dq_persistent=True)


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
