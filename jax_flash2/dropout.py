"""Attention dropout from a counter-based hash, shared by the kernels and the
plain-jnp reference.

The dropout mask is never stored. Whether probability P[b, h, i, j] is kept
is a hash of (seed, b * heads + h, i, j), so the backward kernels regenerate
exactly the mask the forward kernel drew, tile by tile in any order, and the
reference (and the XLA backend) computes the same mask in plain jnp: the same
key gives the same output on every backend.

The hash is the MurmurHash3 finaliser (a bijective mixer of 32-bit words),
applied to the row and the column separately and once more to their
combination. It works on int32 with logical shifts (the bit patterns of a
uint32 hash, without unsigned types in the kernels) and wraps on overflow, as
both XLA and Triton do. It is a statistical, not a cryptographic, generator:
good enough that the keep rate and the independence of neighbouring elements
match Bernoulli draws (tests/test_dropout.py checks both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _int32(x: int) -> np.int32:
  """A uint32 constant as the int32 with the same bits."""
  return np.array(x, np.uint32).view(np.int32)


_MIX_1 = _int32(0x85EBCA6B)
_MIX_2 = _int32(0xC2B2AE35)
_GOLDEN = _int32(0x9E3779B9)  # spreads consecutive counters before mixing


def _fmix32(x: jax.Array) -> jax.Array:
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * _MIX_1
  x = x ^ lax.shift_right_logical(x, jnp.int32(13))
  x = x * _MIX_2
  return x ^ lax.shift_right_logical(x, jnp.int32(16))


def threshold(rate: float) -> int:
  """The 31-bit cut: an element is dropped iff its 31-bit hash is below it."""
  return min(int(round(rate * 2.0**31)), 2**31 - 1)


def keep(seed_0, seed_1, head, rows: jax.Array, cols: jax.Array, rate: float) -> jax.Array:
  """bool, broadcast of rows and cols: which probabilities survive dropout.

  seed_0, seed_1: int32 scalars (see `seed_words`); head: int32, the flat
  (batch * heads + head) index of the problem, scalar or broadcastable;
  rows, cols: int32 query and key positions, broadcastable against each other
  ([q, 1] and [1, k] for a [q, k] tile, or the transposes).
  """
  row_key = _fmix32(seed_0 ^ (head * _GOLDEN))
  r = _fmix32(rows * _GOLDEN + row_key)
  c = _fmix32(cols * _GOLDEN + seed_1)
  h = _fmix32(r ^ c)
  return lax.shift_right_logical(h, jnp.int32(1)) >= threshold(rate)


def seed_words(rng: jax.Array) -> jax.Array:
  """int32 [2] from a JAX PRNG key (typed, or a raw uint32 [2] key)."""
  bits = jax.random.bits(rng, (2,), jnp.uint32)
  return lax.bitcast_convert_type(bits, jnp.int32)


def multiplier(seed, head, rows: jax.Array, cols: jax.Array, rate: float) -> jax.Array:
  """float32: 1 / (1 - rate) where kept, 0 where dropped (so the expectation
  of the dropped probabilities is the probabilities)."""
  kept = keep(seed[0], seed[1], head, rows, cols, rate)
  return jnp.where(kept, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))
