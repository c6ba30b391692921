"""Dense masks (`mask=`) in the Pallas kernels, interpret mode, float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(32, 16))
BATCH, SEQ_Q, SEQ_K, HEADS, HEAD_DIM = 2, 37, 53, 3, 16


def _run(q, k, v, dout, mask, causal, block_sizes):
  return flash_with_grads(q, k, v, dout, mask=mask, causal=causal, block_sizes=block_sizes)


def _random_mask(seed, shape, dtype=jnp.bool_):
  visible = jax.random.bernoulli(jax.random.PRNGKey(seed), 0.6, shape)
  return visible.astype(dtype)


MASK_SHAPES = {
    "full": (BATCH, HEADS, SEQ_Q, SEQ_K),
    "per_batch": (BATCH, 1, SEQ_Q, SEQ_K),
    "shared": (1, 1, SEQ_Q, SEQ_K),
    "2d": (SEQ_Q, SEQ_K),
    "key_padding": (BATCH, 1, 1, SEQ_K),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", list(MASK_SHAPES))
def test_matches_reference(mask_kind, causal):
  q, k, v, dout = random_inputs(1, BATCH, SEQ_Q, SEQ_K, HEADS, HEAD_DIM)
  mask = _random_mask(2, MASK_SHAPES[mask_kind])
  got = _run(q, k, v, dout, mask, causal, SMALL)
  want = reference_with_grads(q, k, v, dout, mask=mask, causal=causal)
  assert_matches_reference(got, want, dout)


@pytest.mark.parametrize("mask_heads", [1, 4], ids=["shared", "per_head"])
def test_grouped_query_attention_with_a_mask(mask_heads):
  q, k, v, dout = random_inputs(11, 2, 33, 40, 4, HEAD_DIM)
  k, v = k[:, :, :2], v[:, :, :2]  # 4 query heads share 2 K/V heads
  mask = _random_mask(12, (2, mask_heads, 33, 40)).at[:, :, :, 16:32].set(False)
  got = _run(q, k, v, dout, mask, True, MIXED)
  want = reference_with_grads(q, k, v, dout, mask=mask, causal=True)
  assert_matches_reference(got, want, dout)


def test_numeric_masks_mean_nonzero_is_visible():
  # flax's make_attention_mask builds float32 masks of 0 and 1. (float and
  # int masks in one test: they share the boolean mask's run.)
  q, k, v, dout = random_inputs(3, 1, 20, 24, 2, HEAD_DIM)
  visible = _random_mask(4, (1, 1, 20, 24))
  want = _run(q, k, v, dout, visible, False, MIXED)
  for dtype in (jnp.float32, jnp.int32):
    numeric = visible.astype(dtype) * 3  # any nonzero value means visible
    got = _run(q, k, v, dout, numeric, False, MIXED)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(dtype))


def test_hidden_tiles_are_never_read():
  """Keys 16..31 are hidden from every query: with tiles of 16 those tiles
  must be skipped, so NaN there cannot reach any output or gradient."""
  q, k, v, dout = random_inputs(5, 1, 40, 48, 2, HEAD_DIM)
  mask = _random_mask(6, (1, 1, 40, 48)).at[..., 16:32].set(False)
  poisoned = lambda x: x.at[:, 16:32].set(jnp.nan)
  got = _run(q, poisoned(k), poisoned(v), dout, mask, True, SMALL)
  want = reference_with_grads(q, k, v, dout, mask=mask, causal=True)
  assert_matches_reference(got, want, dout)
  np.testing.assert_array_equal(np.asarray(got[3][:, 16:32]), 0.0)  # dk of hidden keys
  np.testing.assert_array_equal(np.asarray(got[4][:, 16:32]), 0.0)  # dv of hidden keys


def test_fully_masked_rows_give_zeros_and_finite_gradients():
  q, k, v, dout = random_inputs(7, 1, 30, 30, 2, HEAD_DIM)
  mask = _random_mask(8, (1, 2, 30, 30)).at[:, :, 3].set(False).at[:, :, 17:].set(False)
  out, lse, dq, dk, dv = _run(q, k, v, dout, mask, False, SMALL)
  rows = np.array([3, *range(17, 30)])
  np.testing.assert_array_equal(np.asarray(out[:, rows]), 0.0)
  assert np.all(np.asarray(lse)[:, :, rows] == -np.inf)
  np.testing.assert_array_equal(np.asarray(dq[:, rows]), 0.0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))


def test_xla_backend_takes_the_same_mask():
  q, k, v, dout = random_inputs(9, BATCH, SEQ_Q, SEQ_K, HEADS, HEAD_DIM)
  mask = _random_mask(10, MASK_SHAPES["per_batch"])
  kernel = flash_attention(q, k, v, mask=mask, causal=True, interpret=True, block_sizes=SMALL)
  xla = flash_attention(q, k, v, mask=mask, causal=True, backend="xla")
  assert rel_err(kernel, xla) < 1e-5


@pytest.mark.parametrize("shape, message", [
    ((BATCH, HEADS, SEQ_Q, SEQ_K + 1), "seq_k axis"),
    ((3, 1, SEQ_Q, SEQ_K), "batch axis"),
    ((1, 2, 1, SEQ_Q, SEQ_K), "broadcastable"),
])
def test_bad_mask_shapes(shape, message):
  q, k, v, _ = random_inputs(0, BATCH, SEQ_Q, SEQ_K, HEADS, HEAD_DIM)
  with pytest.raises(ValueError, match=message):
    flash_attention(q, k, v, mask=jnp.ones(shape, bool), backend="xla")


def test_bad_mask_type():
  q, k, v, _ = random_inputs(0, 1, 8, 8, 1, 8)
  with pytest.raises(TypeError, match="mask must be an array"):
    flash_attention(q, k, v, mask=[[True]], backend="xla")
