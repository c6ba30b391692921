"""The Mosaic kernels' exp2 on the FP32 units (jax_flash2.mosaic.poly_exp2),
against float64 exp2, where it runs: under jit, as in the interpreter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash2.mosaic import poly_exp2


def test_polynomial_is_within_its_relative_error_bound():
  # Every exponent a probability can have, down to the smallest normal
  # results (below them both this and ex2.approx.ftz flush to 0).
  x = jnp.linspace(-125.0, 1.0, 1_000_003, dtype=jnp.float32)
  got = np.asarray(jax.jit(poly_exp2.polynomial)(x), np.float64)
  want = np.exp2(np.asarray(x, np.float64))
  assert np.max(np.abs(got / want - 1)) < 1.02e-4
  # Integers are exact (f = 0: the cubic gives 1, 2^j is exact).
  ints = jnp.arange(-125, 2, dtype=jnp.float32)
  np.testing.assert_array_equal(jax.jit(poly_exp2.polynomial)(ints), np.exp2(np.asarray(ints)))


def test_polynomial_gives_exact_zero_for_masked_scores():
  x = jnp.array([-jnp.inf, -1e30, -200.0, -127.0], jnp.float32)
  got = jax.jit(poly_exp2.polynomial)(x)
  np.testing.assert_array_equal(got, np.zeros(4, np.float32))
  assert not np.any(np.signbit(got))


@pytest.mark.parametrize("poly_columns", [0, 8, 24, 64])
def test_exp2_splits_a_tile_by_columns(poly_columns):
  x = -jnp.abs(jax.random.normal(jax.random.key(poly_columns), (64, 64), jnp.float32)) * 8
  got = np.asarray(jax.jit(poly_exp2.exp2, static_argnums=1)(x, poly_columns))
  split = 64 - poly_columns
  # ex2 on the first columns, the polynomial on the rest.
  np.testing.assert_array_equal(got[:, :split], np.asarray(jnp.exp2(x[:, :split])))
  np.testing.assert_array_equal(got[:, split:], np.asarray(poly_exp2.polynomial(x[:, split:])))
  assert np.max(np.abs(got / np.exp2(np.asarray(x, np.float64)) - 1)) < 1.02e-4
