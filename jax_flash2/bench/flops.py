"""FLOP and byte counts.

Each cell's `flops_convention` says how its FLOPs were counted:

  "dense": no mask; the FlashAttention convention, forward 4*B*H*Sq*Sk*D
    (two matmuls, 2 FLOPs per multiply-add).
  "causal-half": plain causal (no window, no segments); the FlashAttention
    convention, half of "dense". Kept so that causal figures compare with
    published FlashAttention numbers.
  "visible": a window, segment ids or --varlen packing; forward 4*D*B*H
    times the number of (query, key) pairs the mask leaves visible (causal,
    if set, included; a varlen row: the sum over its sequences).
    Then TFLOP/s measures work actually needed, so a windowed or packed run
    compares with a full or causal one by TFLOP/s, and its speed-up by ms.

Backward counts 2.5x forward (five matmuls against two), fwd+bwd 3.5x, in
every convention. A softcap adds element-wise work (a tanh per score), no
matmul FLOPs: it leaves the count as it is.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash2.bench.spec import Shape

_MODE_TIMES_TWO = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}


def forward_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> int:
  """4 * B * H * Sq * Sk * D (two matmuls, 2 FLOPs per multiply-add), halved when causal."""
  flops = 4 * batch * heads * seq_q * seq_k * head_dim
  return flops // 2 if causal else flops


def _diagonals(n: int, lo: int, hi: int) -> int:
  """Pairs (i, j) in [0, n)^2 with lo <= j - i <= hi, for lo <= 0 <= hi.

  Diagonal d holds n - |d| pairs.
  """
  lo, hi = max(lo, -(n - 1)), min(hi, n - 1)

  def upto(m: int) -> int:  # sum over d in [0, m] of (n - d)
    return (m + 1) * n - m * (m + 1) // 2

  return upto(hi) + upto(-lo) - n  # diagonal 0 counted once


def visible_pairs(seqlen: int, causal: bool, window: tuple[int | None, int | None] | None, segments: int) -> int:
  """(query, key) pairs visible with seq_q == seq_k == seqlen.

  Key j is visible to query i iff i - left <= j <= i + right (right capped at
  0 by causal, None unbounded) and both lie in the same of `segments` equal
  contiguous segments. The band is the same in every segment, so it is
  `segments` times the count in one.
  """
  if segments < 1 or seqlen % segments:
    raise ValueError(f"seqlen {seqlen} is not a multiple of segments {segments}")
  left, right = window if window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  n = seqlen // segments
  lo = -(n - 1) if left is None else -left
  hi = n - 1 if right is None else right
  return segments * _diagonals(n, lo, hi)


def shape_visible_pairs(shape: Shape) -> int:
  """`visible_pairs` of one row of `shape`; a varlen row: the sum over its
  sequences, each its own seq_q == seq_k problem."""
  if shape.varlen is not None:
    return sum(visible_pairs(n, shape.causal, shape.window, 1) for n in shape.varlen)
  return visible_pairs(shape.seqlen, shape.causal, shape.window, shape.segments)


def flops_convention(shape: Shape) -> str:
  """"dense", "causal-half" or "visible" (see the module docstring)."""
  if shape.window is not None or shape.segments > 1 or shape.varlen is not None:
    return "visible"
  return "causal-half" if shape.causal else "dense"


def visible_fraction(shape: Shape) -> float:
  """Visible (query, key) pairs / seqlen^2, exact (whatever the FLOP convention)."""
  return shape_visible_pairs(shape) / shape.seqlen**2


def shape_forward_flops(shape: Shape) -> int:
  """Forward FLOPs of `shape` by its `flops_convention`."""
  if flops_convention(shape) == "visible":
    return 4 * shape.batch * shape.heads * shape.head_dim * shape_visible_pairs(shape)
  return forward_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, shape.causal)


def mode_flops(shape: Shape, mode: str) -> int:
  """FLOPs of one call in `mode` ("fwd", "bwd" or "fwd+bwd"), exact integer."""
  return forward_to_mode(shape_forward_flops(shape), mode)


def forward_to_mode(forward: int, mode: str) -> int:
  """`forward` FLOPs scaled to `mode`: x1, x2.5 (bwd) or x3.5 (fwd+bwd)."""
  if mode not in _MODE_TIMES_TWO:
    raise ValueError(f"unknown mode {mode!r}; expected one of {tuple(_MODE_TIMES_TWO)}")
  # Always even (4 * ..., and causal halving leaves a multiple of 2), so // 2 is exact.
  return forward * _MODE_TIMES_TWO[mode] // 2


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
