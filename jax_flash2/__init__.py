"""jax_flash2: FlashAttention-2 for JAX, as Pallas GPU kernels."""

from jax_flash2.api import flash_attention, plan
from jax_flash2.backends import Backend, PassPlan, Plan
from jax_flash2.config import BlockSizes, KernelConfig, MosaicBackwardConfig, MosaicConfig, MosaicForwardConfig
from jax_flash2.varlen import flash_attention_varlen

__all__ = [
    "Backend",
    "BlockSizes",
    "KernelConfig",
    "MosaicBackwardConfig",
    "MosaicConfig",
    "MosaicForwardConfig",
    "PassPlan",
    "Plan",
    "flash_attention",
    "flash_attention_varlen",
    "plan",
]
__version__ = "0.1.0"
