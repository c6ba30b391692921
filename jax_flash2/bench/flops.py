"""FLOP and byte counts (FlashAttention convention)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash2.bench.spec import Shape

# Backward = 2.5x forward (five matmuls against two), fwd+bwd = 3.5x.
_MODE_TIMES_TWO = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}


def forward_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> int:
  """4 * B * H * Sq * Sk * D (two matmuls, 2 FLOPs per multiply-add), halved when causal."""
  flops = 4 * batch * heads * seq_q * seq_k * head_dim
  return flops // 2 if causal else flops


def mode_flops(shape: Shape, mode: str) -> int:
  """FLOPs of one call in `mode` ("fwd", "bwd" or "fwd+bwd"), exact integer."""
  if mode not in _MODE_TIMES_TWO:
    raise ValueError(f"unknown mode {mode!r}; expected one of {tuple(_MODE_TIMES_TWO)}")
  fwd = forward_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, shape.causal)
  # fwd is always even (a multiple of 2 even after causal halving).
  return fwd * _MODE_TIMES_TWO[mode] // 2


def tflops_per_s(flops: int, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12


def min_fwd_bwd_bytes(shape: Shape) -> int:
  """Bytes a fwd+bwd cannot avoid holding: q, k, v, dout, out, dq, dk, dv and a float32 lse."""
  item = jnp.dtype(shape.dtype).itemsize
  q = shape.batch * shape.seqlen * shape.heads * shape.head_dim * item
  kv = shape.batch * shape.seqlen * shape.kv_heads * shape.head_dim * item
  lse = shape.batch * shape.heads * shape.seqlen * 4
  # q, dout, out, dq are q-sized; k, v, dk, dv are kv-sized.
  return 4 * q + 4 * kv + lse
