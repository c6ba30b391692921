"""Block-size configurations for the Pallas kernels and their selection.

A `KernelConfig` describes one kernel launch: the tile of queries and keys a
program works on, and the Triton launch parameters. `BlockSizes` bundles one
config per kernel (forward, backward dK/dV, backward dQ). Both are frozen and
validated on construction, so a bad value fails where it is written rather
than deep inside a compile.

Defaults come from `default_block_sizes`, a table measured on the H200
(bench/NOTES.md records the sweeps). An explicit `block_sizes=` always wins.
"""

from __future__ import annotations

import dataclasses

_VALID_WARPS = (1, 2, 4, 8, 16)
# Triton's tensor-core dot needs every tile dimension to be at least 16.
_MIN_BLOCK = 16


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling and launch parameters of one Pallas kernel.

  Attributes:
    block_q: query rows per tile (power of two, >= 16).
    block_k: key/value rows per tile (power of two, >= 16).
    num_warps: warps per program (1, 2, 4, 8 or 16).
    num_stages: software-pipelining depth of the inner loop's loads (>= 1).
  """

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or not _is_power_of_two(value) or value < _MIN_BLOCK:
        raise ValueError(f"KernelConfig.{name} must be a power of two >= {_MIN_BLOCK}, got {value!r}")
    if self.num_warps not in _VALID_WARPS:
      raise ValueError(f"KernelConfig.num_warps must be one of {_VALID_WARPS}, got {self.num_warps!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"KernelConfig.num_stages must be an int >= 1, got {self.num_stages!r}")

  def fit(self, seq_q: int, seq_k: int) -> KernelConfig:
    """Shrinks the tiles to the sequence lengths (short sequences waste less)."""
    return dataclasses.replace(
        self,
        block_q=min(self.block_q, _next_block(seq_q)),
        block_k=min(self.block_k, _next_block(seq_k)),
    )


def _next_block(n: int) -> int:
  return max(_MIN_BLOCK, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """One `KernelConfig` per kernel of the Triton-lowering path.

  Attributes:
    fwd: the forward kernel (Q-outer): block_q rows of Q per program, block_k
      rows of K/V per loop step.
    dkv: the backward dK/dV kernel (KV-outer): block_k rows of K/V per program,
      block_q rows of Q/dO per loop step.
    dq: the backward dQ kernel (Q-outer): block_q rows of Q/dO per program,
      block_k rows of K/V per loop step.
  """

  fwd: KernelConfig
  dkv: KernelConfig
  dq: KernelConfig

  def __post_init__(self):
    for name in ("fwd", "dkv", "dq"):
      if not isinstance(getattr(self, name), KernelConfig):
        raise TypeError(f"BlockSizes.{name} must be a KernelConfig, got {type(getattr(self, name)).__name__}")

  def fit(self, seq_q: int, seq_k: int) -> BlockSizes:
    return BlockSizes(
        fwd=self.fwd.fit(seq_q, seq_k),
        dkv=self.dkv.fit(seq_q, seq_k),
        dq=self.dq.fit(seq_q, seq_k),
    )



# Measured on the H200 (bf16, batch x seq = 16k tokens, seq 8k) by
# bench/tune.py; bench/NOTES.md has the sweeps. Keyed by (padded head_dim,
# causal); values are (fwd, dkv, dq). At head_dim 256 the causal dq kernel
# takes the non-causal sweep's best (its own sweep did not finish).
_H200_TABLE: dict[tuple[int, bool], tuple[KernelConfig, KernelConfig, KernelConfig]] = {
    (64, False): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 64, 4, 2)),
    (64, True): (KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 128, 4, 3)),
    (128, False): (KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3)),
    (128, True): (KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 2), KernelConfig(64, 128, 4, 3)),
    (256, False): (KernelConfig(64, 64, 4, 3), KernelConfig(64, 64, 8, 2), KernelConfig(128, 32, 8, 3)),
    (256, True): (KernelConfig(64, 64, 4, 3), KernelConfig(64, 64, 8, 2), KernelConfig(128, 32, 8, 3)),
}


def padded_head_dim(head_dim: int) -> int:
  """The power of two the kernels tile head_dim to (Triton blocks need one)."""
  return max(_MIN_BLOCK, 1 << (head_dim - 1).bit_length())


# A bias streams one more tile per step through shared memory beside K and V.
# With three pipeline stages that overflows an SM's 227 KiB at head_dim 256
# (the H200 refused 240 KiB, session 4), so biased problems run at most two.
BIAS_MAX_STAGES = 2


def default_block_sizes(head_dim: int, causal: bool, *, has_bias: bool = False) -> BlockSizes:
  """The measured default for a head_dim (8..256), mask and whether a bias is
  read (which caps the pipeline depth: BIAS_MAX_STAGES)."""
  # Head dims under 64 pad to 16 or 32 and run best with the head_dim-64 tiles.
  configs = _H200_TABLE[max(64, padded_head_dim(head_dim)), bool(causal)]
  if has_bias:
    configs = [dataclasses.replace(c, num_stages=min(c.num_stages, BIAS_MAX_STAGES)) for c in configs]
  fwd, dkv, dq = configs
  return BlockSizes(fwd=fwd, dkv=dkv, dq=dq)


@dataclasses.dataclass(frozen=True)
class HopperChoice:
  """Which passes backend="auto" runs with the Mosaic GPU (Hopper) kernels
  instead of the Triton-lowering ones, where the Mosaic kernels serve the
  problem at all."""

  forward: bool
  backward: bool


# Measured on the H200 (bf16, 16k tokens, hidden 2048, seq 2k-16k; bench/NOTES.md,
# sessions 3 and 4): the Mosaic forward, with the softmax overlapped with P V,
# is 2-7% faster than the Triton one at head_dim 64 without a mask, 6-34%
# elsewhere; the Mosaic backward is 7-16% faster at head_dim 64 and 11% at 128
# (2k). At head_dim 256 (session 7, 2k and 8k) the Mosaic forward is 1.5-1.7x
# the Triton one and the Mosaic backward (backward_wide.py) 1.15-1.34x.
_HOPPER_TABLE: dict[tuple[int, bool], HopperChoice] = {
    (64, False): HopperChoice(forward=True, backward=True),
    (64, True): HopperChoice(forward=True, backward=True),
    (128, False): HopperChoice(forward=True, backward=True),
    (128, True): HopperChoice(forward=True, backward=True),
    (256, False): HopperChoice(forward=True, backward=True),
    (256, True): HopperChoice(forward=True, backward=True),
}


# Ragged lengths reach the Mosaic kernels padded to whole 128-row blocks (a
# copy of q, k, v and of the outputs, O(tokens)), which the longer loops pay
# for. Measured on the H200 (bench CLI, 16k tokens, session 5): at 4000 the
# Mosaic kernels beat the Triton ones in 7 of 8 passes (head_dim 64/128,
# forward and forward+backward, both masks: +1% to +36%; the d64 non-causal
# forward -2%); at 1000 the Triton forward wins by 12-35% and forward+backward
# splits within 5%. "auto" takes them when both lengths are at least this.
HOPPER_RAGGED_MIN_SEQ = 4000


def hopper_choice(head_dim: int, causal: bool) -> HopperChoice:
  """Where backend="auto" uses the Mosaic GPU kernels on a Hopper GPU."""
  return _HOPPER_TABLE.get((head_dim, bool(causal)), HopperChoice(forward=False, backward=False))
