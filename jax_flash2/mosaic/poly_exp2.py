"""exp2 of a score tile, split between the SFU and the FMA units.

The Mosaic kernels' exponentials run on the SM's special-function units
(`ex2.approx`, 16 per cycle per SM on Hopper), their other element-wise work
and the polynomial below on the FP32 units (128 per cycle). At head_dim 64 the
forward's tensor-core work per score (4 * 64 FLOP at ~4k FLOP per cycle per
SM) takes as long as its exponential, so the SFU could set the pace; the
backward's kernels spend half (dK/dV) and two thirds (dQ) of their matmul
time on the SFU. Computing part of each tile's exponentials as a polynomial
on the FP32 units (FlashAttention-4's trick) moves work from that unit to
one with room.

2^x for x <= 0 (a probability's exponent) as 2^j * 2^f, j = round(x),
f = x - j in [-1/2, 1/2]:

- j comes from the float addition x + C with C = 1.5 * 2^23 + 127: at that
  magnitude one ulp is 1, so the sum is rounded to an integer and its low
  mantissa bits hold j + 127, the biased exponent of 2^j. Shifting the sum's
  bits left by 23 moves those bits into the exponent field and shifts the
  constant's own bits out: 2^j, exactly, with no conversion instruction.
- 2^f is a cubic with p(0) = 1, fitted here for least relative error on
  [-1/2, 1/2] (1.0e-4, under a bfloat16 or float16 P's own rounding: 2^-9
  and 2^-12 relative).
- x is clamped at -127 first: j + 127 = 0 gives 2^j = +0.0, so masked
  scores (-inf) still give exactly 0, as ex2 does.

Eight FP32 instructions and one shift against one SFU instruction (eight
FP32 instructions' worth of the SFU's throughput): the polynomial is no
cheaper per element, only elsewhere, so a tile takes it for some of its
columns (`poly_columns`) and ex2 for the rest.

Measured on the H200 (bench/NOTES.md, session 9): no faster anywhere, and
slower the more columns take it. So the SFU is not what binds these
kernels there; and each instruction also takes an issue slot (one warp
instruction per cycle per SM sub-partition), one for ex2, nine for the
polynomial. The option stays, off, for GPUs or kernels where the SFU is
the bound.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# 2^f ~ 1 + f (C1 + f (C2 + f C3)) on [-1/2, 1/2]; relative error < 1.02e-4
# (float32 evaluation included; tests/test_poly_exp2.py checks it).
C1, C2, C3 = 0.69328288, 0.24221021, 0.05500862
ROUND = 1.5 * 2.0**23 + 127  # x + ROUND: j + 127 in the low mantissa bits
MIN_EXPONENT = -127.0  # 2^j = +0.0 at and below it
COLUMN_TILE = 8  # a WGMMA-layout register tile's columns: the split's unit


def polynomial(x: jnp.ndarray) -> jnp.ndarray:
  """2^x of float32 x <= ~1 on the FP32 units (a cubic and an exponent shift)."""
  x = jnp.maximum(x, MIN_EXPONENT)
  # The barrier keeps XLA (the interpreter's compiler) from folding
  # (x + ROUND) - ROUND into x; it emits no instruction on the GPU.
  t = lax.optimization_barrier(x + ROUND)
  f = x - (t - ROUND)
  two_j = lax.bitcast_convert_type(lax.shift_left(lax.bitcast_convert_type(t, jnp.int32), jnp.int32(23)), jnp.float32)
  return two_j * (1.0 + f * (C1 + f * (C2 + f * C3)))


def exp2(x: jnp.ndarray, poly_columns: int) -> jnp.ndarray:
  """2^x of a [rows, columns] float32 tile: ex2 on the first columns, the
  polynomial on the last `poly_columns` (a multiple of COLUMN_TILE; 0: ex2
  alone). Slicing and concatenating whole register tiles moves no data."""
  if not poly_columns:
    return jnp.exp2(x)
  split = x.shape[-1] - poly_columns
  if split == 0:
    return polynomial(x)
  return jnp.concatenate([jnp.exp2(x[:, :split]), polynomial(x[:, split:])], axis=1)


def check_poly_columns(owner: str, value: int, width: int) -> None:
  """Raises ValueError unless the int `value` (owner's field) is a multiple
  of COLUMN_TILE between 0 and the tile's `width`."""
  if not (0 <= value <= width and value % COLUMN_TILE == 0):
    raise ValueError(f"{owner} must be a multiple of {COLUMN_TILE} between 0 and {width}, got {value}")
