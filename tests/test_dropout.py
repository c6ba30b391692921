"""Attention dropout (`dropout_rate=`, `dropout_rng=`): the kernels' mask is
jax_flash2.dropout's hash, the backward regenerates it, and its keep rate and
independence look like Bernoulli draws. Interpret mode, float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, dropout, flash_attention

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))
SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
RNG = jax.random.PRNGKey(7)


def _flash(q, k, v, rate, rng=RNG, **kwargs):
  return flash_attention(q, k, v, dropout_rate=rate, dropout_rng=rng, return_lse=True, interpret=True,
                         block_sizes=kwargs.pop("block_sizes", MIXED), **kwargs)


@pytest.mark.parametrize("rate, causal, kv_heads, window, broadcast", [
    (0.3, False, 4, None, True),  # one mask for every batch element and head
    (0.5, True, 2, None, False),  # GQA: dK/dV sum over a group whose heads draw different masks
    (0.1, True, 1, (7, 0), False),
], ids=str)
def test_matches_reference(rate, causal, kv_heads, window, broadcast):
  q, k, v, dout = random_inputs(3, 2, 35, 41, 4, 16)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  got = flash_with_grads(q, k, v, dout, dropout_rate=rate, dropout_rng=RNG, causal=causal, window_size=window,
                         dropout_broadcast=broadcast, block_sizes=MIXED)
  out = got[0]
  seed = dropout.seed_words(RNG)
  ref = dict(causal=causal, window=window or (None, None))
  want = reference_with_grads(q, k, v, dout, dropout=(rate, seed, broadcast), **ref)
  assert_matches_reference(got, want, dout)
  # Dropout did something: the output differs from attention without it.
  assert rel_err(out, reference_with_grads(q, k, v, dout, **ref)[0]) > 1e-2


def _kernel_keep_mask(rate, broadcast=False):
  """The kernel's mask read off its output: with V the identity (head_dim =
  seq_k), out[b, i, h, j] = P[i, j] * multiplier[i, j], and P > 0 everywhere."""
  batch, seq, heads = 2, 16, 2
  q, k, _, _ = random_inputs(5, batch, seq, seq, heads, 16)
  v = jnp.broadcast_to(jnp.eye(seq, dtype=jnp.float32)[None, :, None, :], (batch, seq, heads, seq))
  out = jax.jit(lambda q, k, v: _flash(q, k, v, rate, dropout_broadcast=broadcast, block_sizes=SMALL)[0])(q, k, v)
  return np.asarray(out != 0).transpose(0, 2, 1, 3)  # [batch, heads, seq_q, seq_k]


def test_kernel_mask_is_the_hash():
  rate = 0.4
  kept = _kernel_keep_mask(rate)
  seed = dropout.seed_words(RNG)
  batch, heads, seq = kept.shape[:3]
  head = jnp.arange(batch * heads, dtype=jnp.int32).reshape(batch, heads, 1, 1)
  rows = jnp.arange(seq, dtype=jnp.int32)[:, None]
  expected = dropout.keep(seed[0], seed[1], head, rows, rows.T, rate)
  np.testing.assert_array_equal(kept, np.asarray(expected))
  # Each (batch, head) draws its own mask...
  assert not np.array_equal(kept[0, 0], kept[0, 1]) and not np.array_equal(kept[0, 0], kept[1, 0])
  # ...unless broadcast, when all share one.
  shared = _kernel_keep_mask(rate, broadcast=True)
  assert (shared == shared[:1, :1]).all()


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_and_independence(rate):
  """1M draws: keep rate within 5 sigma of 1 - rate, and neighbours along
  rows, columns and heads uncorrelated (|r| under 5 / sqrt(n))."""
  seed = dropout.seed_words(jax.random.PRNGKey(11))
  head = jnp.arange(4, dtype=jnp.int32)[:, None, None]
  rows = jnp.arange(512, dtype=jnp.int32)[:, None]
  kept = np.asarray(dropout.keep(seed[0], seed[1], head, rows, rows.T, rate), np.float64)
  n = kept.size
  assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
  for a, b in ((kept[:, :, 1:], kept[:, :, :-1]), (kept[:, 1:], kept[:, :-1]), (kept[1:], kept[:-1])):
    r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert abs(r) < 5 / np.sqrt(a.size), r


def test_keys_and_the_xla_backend():
  """The same key gives the same output, also on the XLA backend and as a
  typed key; another key another output."""
  q, k, v, _ = random_inputs(1, 2, 29, 29, 2, 16)
  f = jax.jit(lambda q, k, v, rng: _flash(q, k, v, 0.2, rng=rng, causal=True, block_sizes=SMALL)[0])
  a = f(q, k, v, RNG)
  np.testing.assert_array_equal(a, f(q, k, v, RNG))
  assert rel_err(f(q, k, v, jax.random.PRNGKey(8)), a) > 1e-2
  xla = lambda rng: flash_attention(q, k, v, causal=True, dropout_rate=0.2, dropout_rng=rng, backend="xla")
  assert rel_err(xla(RNG), a) < 1e-5
  np.testing.assert_array_equal(xla(RNG), xla(jax.random.wrap_key_data(RNG)))


def test_vmap_draws_each_element_the_unbatched_mask_and_refuses_a_mapped_key():
  """With one key, vmap(f)(xs)[i] is f(xs[i]) (to rounding: a mask drawn for
  other batch indices would differ at O(1)), and the XLA backend's: the
  kernels' hash takes each element's own batch indices, not those of the
  folded batch (nested vmaps too)."""
  q, k, v, dout = random_inputs(2, 6, 24, 24, 2, 16)
  q, k, v, dout = (x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v, dout))  # 3 elements of batch 2
  f = lambda q, k, v: _flash(q, k, v, 0.3, block_sizes=SMALL)[0]
  grad = lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout)
  mapped, mapped_grads = jax.jit(jax.vmap(f))(q, k, v), jax.jit(jax.vmap(grad))(q, k, v, dout)
  nested = jax.jit(jax.vmap(jax.vmap(f)))(q[:, None], k[:, None], v[:, None])[:, 0]
  xla = lambda q, k, v: flash_attention(q, k, v, dropout_rate=0.3, dropout_rng=RNG, backend="xla")
  for i in range(3):
    alone = f(q[i], k[i], v[i])
    assert rel_err(mapped[i], alone) < 1e-6 and rel_err(nested[i], alone) < 1e-6, i
    for got, want in zip(mapped_grads, grad(q[i], k[i], v[i], dout[i])):
      assert rel_err(got[i], want) < 1e-6, i
    assert rel_err(alone, xla(q[i], k[i], v[i])) < 1e-5, i
  keys = jax.random.split(RNG, 3)
  with pytest.raises(NotImplementedError, match="dropout_rng"):
    jax.vmap(lambda q, key: _flash(q, k[0], v[0], 0.3, rng=key, block_sizes=SMALL)[0])(q, keys)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=RNG), ValueError, r"\[0, 1\)"),
    (dict(dropout_rate=-0.1, dropout_rng=RNG), ValueError, r"\[0, 1\)"),
    (dict(dropout_rate="a", dropout_rng=RNG), TypeError, "dropout_rate"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.uint32)), ValueError, "dropout_rng must be a single"),
    (dict(dropout_rate=0.1, dropout_rng=7), TypeError, "dropout_rng"),
])
def test_bad_dropout_arguments(kwargs, error, match):
  q, k, v, _ = random_inputs(0, 1, 8, 8, 1, 8)
  with pytest.raises(error, match=match):
    flash_attention(q, k, v, backend="xla", **kwargs)


def test_traced_rate_is_refused():
  q, k, v, _ = random_inputs(0, 1, 8, 8, 1, 8)
  with pytest.raises(TypeError, match="static"):
    jax.jit(lambda rate: flash_attention(q, k, v, dropout_rate=rate, dropout_rng=RNG, backend="xla"))(0.1)
