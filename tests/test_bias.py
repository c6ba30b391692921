"""An additive bias (`bias=`) and its gradient, interpret mode, float32,
against the float64 reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, rel_err
from jax_flash2 import BlockSizes, KernelConfig, dropout, flash_attention, reference

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


def _reference(q, k, v, dout, bias, **kwargs):
  """(out, lse, dq, dk, dv, dbias) in float64 (jitted: array kwargs are operands, the rest static)."""
  arrays = {name: x for name, x in kwargs.items() if isinstance(x, jax.Array)}
  static = tuple(sorted((name, x) for name, x in kwargs.items() if name not in arrays))
  return _reference_jit(q, k, v, dout, bias, arrays, static)


@functools.partial(jax.jit, static_argnums=6)
def _reference_jit(q, k, v, dout, bias, arrays, static):
  f = lambda q, k, v, bias: reference.attention(q, k, v, bias=bias, compute_dtype=jnp.float64, **arrays,
                                                **dict(static))
  args = [x.astype(jnp.float64) for x in (q, k, v, bias)]
  (out, lse), vjp = jax.vjp(f, *args)
  return (out, lse, *vjp((dout.astype(jnp.float64), jnp.zeros_like(lse))))


def _flash(q, k, v, dout, bias, **kwargs):
  """(out, lse, dq, dk, dv, dbias) of the kernels, one jitted program."""
  return flash_with_grads(q, k, v, dout, bias=bias, wrt=("bias",), block_sizes=MIXED, **kwargs)


def _check(got, want, dout):
  assert_matches_reference(got[:5], want[:5], dout)
  assert got[5].shape == want[5].shape
  assert rel_err(got[5], want[5]) < 1e-5, f"dbias: relative error {rel_err(got[5], want[5]):.3g}"


BATCH, SEQ_Q, SEQ_K, HEADS = 2, 35, 41, 4


@pytest.mark.parametrize("bias_shape, causal, kv_heads", [
    ((BATCH, HEADS, SEQ_Q, SEQ_K), False, 4),  # one bias per problem
    ((1, HEADS, SEQ_Q, SEQ_K), True, 2),  # relative-position style: shared over batch; GQA
    ((SEQ_Q, SEQ_K), True, 1),  # one [seq_q, seq_k] for all; MQA
    ((BATCH, 1, 1, SEQ_K), False, 4),  # key padding as a bias: dbias sums over heads and queries
], ids=str)
def test_matches_reference(bias_shape, causal, kv_heads):
  q, k, v, dout = random_inputs(6, BATCH, SEQ_Q, SEQ_K, HEADS, 16)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  bias = 2.0 * jax.random.normal(jax.random.PRNGKey(1), bias_shape, jnp.float32)
  _check(_flash(q, k, v, dout, bias, causal=causal), _reference(q, k, v, dout, bias, causal=causal), dout)


def test_with_every_other_feature():
  """Bias after softcap and ALiBi, under a window, a dense mask, segment ids
  (the tile-flag path of the dBias kernel writes zeros for skipped tiles)
  and dropout."""
  q, k, v, dout = random_inputs(7, BATCH, SEQ_Q, SEQ_K, HEADS, 16)
  q = 2.0 * q
  bias = jax.random.normal(jax.random.PRNGKey(2), (1, HEADS, SEQ_Q, SEQ_K), jnp.float32)
  mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (BATCH, 1, SEQ_Q, SEQ_K))
  q_ids = jnp.repeat(jnp.array([[0, 1, 2]] * BATCH, jnp.int32), jnp.array([10, 15, 10]), axis=1,
                     total_repeat_length=SEQ_Q)
  kv_ids = jnp.repeat(jnp.array([[0, 1, 2]] * BATCH, jnp.int32), jnp.array([12, 17, 12]), axis=1,
                      total_repeat_length=SEQ_K)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625], jnp.float32)
  rng = jax.random.PRNGKey(9)
  common = dict(mask=mask, softcap=5.0, alibi_slopes=slopes, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                window_size=(20, 3))
  got = _flash(q, k, v, dout, bias, dropout_rate=0.2, dropout_rng=rng, **common)
  want = _reference(q, k, v, dout, bias, dropout_rate=0.2, dropout_seed=dropout.seed_words(rng), **common)
  _check(got, want, dout)


def test_minus_infinity_hides_keys_and_whole_rows():
  """A bias of -inf works as a mask: keys it hides get no weight, a row it
  hides entirely gives zeros, and nothing is NaN."""
  q, k, v, dout = random_inputs(8, 1, 24, 24, 2, 16)
  bias = jnp.zeros((1, 2, 24, 24), jnp.float32).at[:, :, :, 20:].set(-jnp.inf).at[:, 1, 5, :].set(-jnp.inf)
  out, lse, dq, dk, dv, dbias = _flash(q, k, v, dout, bias)
  want = _reference(q, k, v, dout, jnp.where(jnp.isinf(bias), 0.0, bias), mask=jnp.isfinite(bias))
  assert_matches_reference((out, lse, dq, dk, dv), want[:5], dout)
  assert np.isfinite(np.asarray(dbias)).all()
  assert (np.asarray(out[0, 5, 1]) == 0).all() and lse[0, 1, 5] == -jnp.inf


def test_dbias_kernel_runs_only_when_asked():
  q, k, v, dout = random_inputs(0, 1, 30, 30, 2, 16)
  bias = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 30, 30), jnp.float32)
  attend = lambda q, bias: flash_attention(q, k, v, bias=bias, interpret=True, block_sizes=MIXED)
  loss = lambda q, bias: jnp.sum(attend(q, bias) * dout)
  without = jax.jit(jax.grad(loss)).lower(q, bias).compile().as_text()
  with_dbias = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, bias).compile().as_text()
  # Interpret mode inlines the kernels; their ops keep the pallas_call's name.
  assert "flash2_bwd_dbias" in with_dbias and "flash2_bwd_dbias" not in without
  assert "flash2_bwd_dq" in without


@pytest.mark.parametrize("bias, error, match", [
    (jnp.zeros((3, 35, 41), jnp.float32), ValueError, "bias heads axis is 3"),
    (jnp.zeros((1, 1, 1, 1, 1), jnp.float32), ValueError, "broadcastable"),
    (jnp.zeros((35, 41), jnp.int32), TypeError, "bias has dtype int32"),
    ("bias", TypeError, "bias must be an array"),
])
def test_bad_bias(bias, error, match):
  q, k, v, _ = random_inputs(0, BATCH, SEQ_Q, SEQ_K, HEADS, 8)
  with pytest.raises(error, match=match):
    flash_attention(q, k, v, bias=bias, backend="xla")


def test_vmap_with_a_bias():
  q, k, v, dout = random_inputs(5, 3, 20, 20, 2, 16)
  bias = jax.random.normal(jax.random.PRNGKey(6), (3, 1, 2, 20, 20), jnp.float32)  # mapped with the inputs
  f = lambda q, k, v, b: flash_attention(q, k, v, bias=b, causal=True, interpret=True, block_sizes=MIXED)
  got = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None], bias)
  want = jax.jit(jax.vmap(lambda q, k, v, b: reference.attention(q, k, v, bias=b, causal=True)[0]))(
      q[:, None], k[:, None], v[:, None], bias)
  assert rel_err(got, want) < 1e-5
