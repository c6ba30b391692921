"""The kernels' configurations: frozen, validated on construction.

`KernelConfig` is one Triton-lowering kernel's tile and launch parameters,
and `BlockSizes` one per kernel of that family (forward, dK/dV, dQ).
`MosaicForwardConfig` and `MosaicBackwardConfig` tile the Mosaic GPU
(Hopper) kernels, and `MosaicConfig` holds one of each; `DecodeConfig` runs
flash_decode's kernel. A bad value fails where it is written rather than
deep inside a compile. The measured defaults
are in jax_flash2.defaults; an explicit config always wins.
"""

from __future__ import annotations

import dataclasses

_VALID_WARPS = (1, 2, 4, 8, 16)
# Triton's tensor-core dot needs every tile dimension to be at least 16.
_MIN_BLOCK = 16


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _check_fields(owner: str, config, bools: tuple[str, ...], ints: tuple[str, ...]) -> None:
  for name in bools:
    if not isinstance(getattr(config, name), bool):
      raise TypeError(f"{owner}.{name} must be a bool, got {getattr(config, name)!r}")
  for name in ints:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool):
      raise TypeError(f"{owner}.{name} must be an int, got {value!r}")


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
    _check_fields("KernelConfig", self, (), ("block_q", "block_k", "num_warps", "num_stages"))
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not _is_power_of_two(value) or value < _MIN_BLOCK:
        raise ValueError(f"KernelConfig.{name} must be a power of two >= {_MIN_BLOCK}, got {value!r}")
    if self.num_warps not in _VALID_WARPS:
      raise ValueError(f"KernelConfig.num_warps must be one of {_VALID_WARPS}, got {self.num_warps!r}")
    if self.num_stages < 1:
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




# wgmma works on 64 rows per warpgroup instruction: the Mosaic kernels' row unit.
_WGMMA_ROWS = 64


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
  """Tiling of the Mosaic GPU (Hopper) forward kernel.

  Attributes:
    block_q: query rows per CTA, split evenly between the consumer
      warpgroups (64 or 128 rows each).
    block_kv: key/value rows per ring slot (64, 128 or 256).
    stages: ring slots of K and V in shared memory (2 to 8).
    softmax_overlap: each consumer issues Q K^T of a block and P V of the
      one before together and computes its softmax while the tensor cores
      run that P V (FlashAttention-3's intra-warpgroup overlap).
    persistent: one CTA per SM, each taking tiles in turn, so that a tile's
      first loads and last stores overlap its neighbours' work (a second Q
      buffer in shared memory).
    balanced: with persistent, causal tiles (and those of a window's right
      side alone, whose work grows with the Q block alike) come from a table
      built on the host that evens out the CTAs' work; a window with a left
      side has tiles of nearly equal work, dealt round-robin either way.
    consumers: consumer warpgroups per CTA, 2 or 3 (240 or 160 registers
      each).
  """

  block_q: int = 128
  block_kv: int = 128
  stages: int = 2
  softmax_overlap: bool = False
  persistent: bool = False
  balanced: bool = False
  consumers: int = 2

  def __post_init__(self):
    _check_fields("MosaicForwardConfig", self, ("softmax_overlap", "persistent", "balanced"),
                  ("block_q", "block_kv", "stages", "consumers"))
    if self.consumers not in (2, 3):
      raise ValueError(f"MosaicForwardConfig.consumers must be 2 or 3, got {self.consumers}")
    rows = self.consumers * _WGMMA_ROWS
    if self.block_q not in (rows, 2 * rows):
      raise ValueError(
          f"MosaicForwardConfig.block_q must be {rows} or {2 * rows} (64 or 128 rows for each of the "
          f"{self.consumers} consumer warpgroups), got {self.block_q}"
      )
    if self.block_kv not in (64, 128, 256):
      raise ValueError(f"MosaicForwardConfig.block_kv must be 64, 128 or 256, got {self.block_kv}")
    if not 2 <= self.stages <= 8:
      raise ValueError(f"MosaicForwardConfig.stages must be between 2 and 8, got {self.stages}")
    if self.balanced and not self.persistent:
      raise ValueError("MosaicForwardConfig.balanced needs persistent=True (it deals tiles to persistent CTAs)")

  @property
  def rows_per_consumer(self) -> int:
    return self.block_q // self.consumers


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """Tiling of the Mosaic GPU (Hopper) backward kernels.

  The dK/dV kernel owns 128 key rows per CTA (64 per consumer warpgroup)
  and streams Q blocks; the dQ kernel owns 128 query rows and streams K/V
  blocks; the fused kernel is the dK/dV kernel adding dQ too.

  Attributes:
    block_q: query rows per ring slot of the dK/dV kernel (64 or 128).
    block_kv: key/value rows per ring slot of the dQ kernel (64 or 128).
    stages: ring slots (2 to 8).
    dq_softmax_overlap: the dQ kernel computes P while dP = dO V^T is on
      the tensor cores.
    dq_persistent: the dQ kernel runs one CTA per SM over many tiles.
    dkv_persistent: the dK/dV kernel does (the fused kernel's CTAs are
      persistent anyway; for it this says whether they keep a second set
      of K and V tiles).
    fused_dq: one kernel: the dK/dV kernel also adds each K/V tile's dS K
      into a float32 dQ, in an order fixed per Q block (deterministic), so
      that S and dP are computed once rather than twice. Needs block_q 64
      and every CTA resident at once (one per SM).
    early_vectors: the dK/dV kernel loads each Q block's lse and delta
      while S^T and dP^T are on the tensor cores rather than after.
  """

  block_q: int = 64
  block_kv: int = 64
  stages: int = 2
  dq_softmax_overlap: bool = False
  dq_persistent: bool = False
  dkv_persistent: bool = False
  fused_dq: bool = False
  early_vectors: bool = False

  def __post_init__(self):
    _check_fields("MosaicBackwardConfig", self,
                  ("dq_softmax_overlap", "dq_persistent", "dkv_persistent", "fused_dq", "early_vectors"),
                  ("block_q", "block_kv", "stages"))
    for name in ("block_q", "block_kv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"MosaicBackwardConfig.{name} must be 64 or 128, got {getattr(self, name)}")
    if not 2 <= self.stages <= 8:
      raise ValueError(f"MosaicBackwardConfig.stages must be between 2 and 8, got {self.stages}")
    if self.fused_dq and self.block_q != _WGMMA_ROWS:
      raise ValueError(f"MosaicBackwardConfig.fused_dq needs block_q {_WGMMA_ROWS}, got {self.block_q}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """The Mosaic GPU kernels' tilings: `forward` for the forward pass,
  `backward` for the backward; None takes the measured default."""

  forward: MosaicForwardConfig | None = None
  backward: MosaicBackwardConfig | None = None

  def __post_init__(self):
    for name, kind in (("forward", MosaicForwardConfig), ("backward", MosaicBackwardConfig)):
      value = getattr(self, name)
      if value is not None and not isinstance(value, kind):
        raise TypeError(f"MosaicConfig.{name} must be a {kind.__name__} or None, got {type(value).__name__}")



@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How the split-KV decode kernel (flash_decode) runs a call.

  Attributes:
    block_k: K/V rows per loop step (power of two, >= 16; divides a paged
      cache's page_size).
    num_splits: runs each sequence's cache is cut into, one program each (>= 1).
    num_warps: warps per program (1, 2, 4, 8 or 16).
    num_stages: software-pipelining depth of the loop's loads (>= 1).
  """

  block_k: int
  num_splits: int
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _check_fields("DecodeConfig", self, (), ("block_k", "num_splits", "num_warps", "num_stages"))
    if not _is_power_of_two(self.block_k) or self.block_k < _MIN_BLOCK:
      raise ValueError(f"DecodeConfig.block_k must be a power of two >= {_MIN_BLOCK}, got {self.block_k!r}")
    if self.num_warps not in _VALID_WARPS:
      raise ValueError(f"DecodeConfig.num_warps must be one of {_VALID_WARPS}, got {self.num_warps!r}")
    for name in ("num_splits", "num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"DecodeConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
