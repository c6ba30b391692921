"""The Pallas kernels in interpret mode (CPU), float32, against a float64 reference.

Interpret mode poisons for us: every output buffer starts as NaN and reads past
the end of an input return NaN (see test_interpret_mode_poisons_outputs), so a
block the kernel fails to write, or a ragged tail it fails to mask, shows up as
an infinite error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention
from jax_flash2 import defaults

# Tiles of 16 make even small sequences span several blocks, ragged tails and
# diagonal blocks included.
SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
# Unequal tiles exercise the index arithmetic where block_q != block_k.
MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(32, 16))

FP32_TOL = 1e-5

# (batch, seq_q, seq_k, heads, head_dim)
SHAPES = [
    (1, 1, 1, 1, 8),  # one token
    (2, 37, 53, 3, 40),  # ragged, seq_q < seq_k, head_dim not a power of two
    (1, 53, 37, 2, 24),  # seq_q > seq_k: causal leaves rows with no key
    (2, 64, 64, 2, 64),  # whole blocks only
    (1, 17, 1, 2, 8),  # a single key
    (1, 33, 80, 1, 96),
    (1, 20, 20, 1, 256),
]


def _run_eager(q, k, v, dout, dlse, **kwargs):
  """Op by op, outside jit (the other tests use conftest.flash_with_grads: one
  jitted program, much cheaper to compile)."""
  def f(q, k, v):
    return flash_attention(q, k, v, return_lse=True, interpret=True, **kwargs)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((dout, dlse)))


def _check_against_reference(
    shape, causal, block_sizes, seed, softmax_scale=None, lse_cotangent=False, kv_heads=None
):
  batch, seq_q, seq_k, heads, head_dim = shape
  q, k, v, dout = random_inputs(seed, batch, seq_q, seq_k, heads, head_dim)
  if kv_heads is not None:  # grouped-query attention: fewer K/V heads
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  dlse = jnp.zeros((batch, heads, seq_q), jnp.float32)
  if lse_cotangent:
    dlse = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(dlse.shape, np.float32))
  got = flash_with_grads(q, k, v, dout, dlse, causal=causal, block_sizes=block_sizes, softmax_scale=softmax_scale)
  want = reference_with_grads(q, k, v, dout, dlse, causal=causal, softmax_scale=softmax_scale)
  assert_matches_reference(got, want, dout, FP32_TOL)
  return got


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, causal):
  seed = hash((shape, causal)) % 2**31
  _check_against_reference(shape, causal, SMALL, seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 70, 45, 2, 32), (1, 45, 70, 2, 32)], ids=lambda s: "x".join(map(str, s)))
def test_unequal_tiles(shape, causal):
  _check_against_reference(shape, causal, MIXED, seed=7)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1), (6, 3)], ids=["gqa4-2", "mqa3-1", "gqa6-3"])
def test_grouped_query_attention(heads, kv_heads, causal):
  _check_against_reference((2, 37, 29, heads, 16), causal, MIXED, seed=heads * 10 + kv_heads, kv_heads=kv_heads)


def test_default_block_sizes():
  # The production tiles (128 x 64 and friends), shrunk to the sequence.
  _check_against_reference((1, 130, 200, 1, 64), True, None, seed=3)


def test_softmax_scale_and_lse_cotangent():
  _check_against_reference((1, 40, 24, 2, 16), True, SMALL, seed=11, softmax_scale=0.3, lse_cotangent=True)


def test_fully_masked_rows_are_zero_with_finite_gradients():
  # causal with seq_q > seq_k: query i sees key j iff j <= i - 20, so the
  # first 20 rows see nothing.
  out, lse, dq, dk, dv = _check_against_reference((1, 30, 10, 2, 16), True, SMALL, seed=5)
  np.testing.assert_array_equal(np.asarray(out[:, :20]), 0.0)
  assert np.all(np.asarray(lse[:, :, :20]) == -np.inf)
  assert np.all(np.isfinite(np.asarray(lse[:, :, 20:])))
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))
  np.testing.assert_array_equal(np.asarray(dq[:, :20]), 0.0)


def test_gradients_are_deterministic():
  q, k, v, dout = random_inputs(0, 1, 40, 40, 2, 16)
  dlse = jnp.zeros((1, 2, 40), jnp.float32)
  first = _run_eager(q, k, v, dout, dlse, causal=True, block_sizes=SMALL)
  second = _run_eager(q, k, v, dout, dlse, causal=True, block_sizes=SMALL)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
  q, k, v, dout = random_inputs(2, 1, 48, 40, 2, 32, dtype)
  dlse = jnp.zeros((1, 2, 48), jnp.float32)
  got = flash_with_grads(q, k, v, dout, dlse, causal=True, block_sizes=SMALL)
  want = reference_with_grads(q, k, v, dout, causal=True)
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    assert x.dtype == (jnp.float32 if name == "lse" else dtype), name
    assert rel_err(x, ref) < 1e-2, name


def test_interpret_mode_poisons_outputs():
  """The premise of this file: an output block nobody writes reads NaN."""

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]

  x = jnp.ones((32,), jnp.float32)
  out = pl.pallas_call(
      kernel,
      grid=(2,),
      in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
      out_specs=pl.BlockSpec((16,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((32,), jnp.float32),
      interpret=True,
  )(x)
  assert np.all(np.asarray(out[:16]) == 1.0)
  assert np.all(np.isnan(np.asarray(out[16:])))
  assert rel_err(out, x) == float("inf")


def test_bias_caps_the_pipeline_depth():
  # head_dim 256's three-stage forward and dQ overflow shared memory once a
  # bias tile streams beside K and V (the H200 refused 240 KiB); the rest of
  # the tiling stays as measured.
  plain = defaults.block_sizes(256, False)
  biased = defaults.block_sizes(256, False, has_bias=True)
  assert (plain.fwd.num_stages, plain.dq.num_stages) == (3, 3)
  for name in ("fwd", "dkv", "dq"):
    a, b = getattr(plain, name), getattr(biased, name)
    assert b.num_stages == min(a.num_stages, 2)
    assert (b.block_q, b.block_k, b.num_warps) == (a.block_q, a.block_k, a.num_warps)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_tiles_fit_shared_memory(head_dim, causal):
  # The 16-bit tilings need twice their shared memory in float32 (the H200
  # refused 352 KiB for head_dim 128's causal forward); float32 gets tiles
  # cut to the budget, 16-bit inputs keep the measured ones.
  measured = defaults.block_sizes(head_dim, causal)
  assert defaults.block_sizes(head_dim, causal, itemsize=2) == measured
  fp32 = defaults.block_sizes(head_dim, causal, itemsize=4)
  for name, streams_kv in (("fwd", True), ("dkv", False), ("dq", True)):
    c, m = getattr(fp32, name), getattr(measured, name)
    resident, streamed = (c.block_q, c.block_k) if streams_kv else (c.block_k, c.block_q)
    assert 4 * head_dim * 2 * (resident + streamed * (c.num_stages - 1)) <= defaults.FLOAT32_SMEM_BUDGET
    assert c.num_stages <= 2 and c.block_q <= m.block_q and c.block_k <= m.block_k and c.num_warps == m.num_warps
