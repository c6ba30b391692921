"""jax_flash2: FlashAttention-2 for JAX, as Pallas GPU kernels."""

from jax_flash2.api import flash_attention
from jax_flash2.config import BlockSizes, KernelConfig

__all__ = ["BlockSizes", "KernelConfig", "flash_attention"]
__version__ = "0.1.0"
