"""jax_flash2: FlashAttention-2 for JAX, as Pallas GPU kernels."""

from jax_flash2.api import flash_attention, plan
from jax_flash2.backends import Backend, PassPlan, Plan
from jax_flash2.config import (BlockSizes, DecodeConfig, KernelConfig, MosaicBackwardConfig, MosaicConfig,
                               MosaicForwardConfig)
from jax_flash2.decode import decode_plan, flash_decode, write_kv_cache
from jax_flash2.ring import RingLayout, RingStrategy, ring_attention, zigzag_order
from jax_flash2.varlen import flash_attention_varlen

__all__ = [
    "Backend",
    "BlockSizes",
    "DecodeConfig",
    "KernelConfig",
    "MosaicBackwardConfig",
    "MosaicConfig",
    "MosaicForwardConfig",
    "PassPlan",
    "Plan",
    "RingLayout",
    "RingStrategy",
    "decode_plan",
    "flash_attention",
    "flash_attention_varlen",
    "flash_decode",
    "plan",
    "ring_attention",
    "write_kv_cache",
    "zigzag_order",
]
__version__ = "0.1.0"
