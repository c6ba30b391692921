"""Packed sequences (`q_segment_ids`, `kv_segment_ids`), interpret mode, float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


def _packed(lengths_per_row: list[list[int]]) -> jax.Array:
  """int32 [batch, sum(lengths)]: segment i of a row repeated lengths[i] times."""
  return jnp.array([np.repeat(np.arange(len(row)), row) for row in lengths_per_row], jnp.int32)


def _run(q, k, v, dout, ids, block_sizes, **kwargs):
  return flash_with_grads(q, k, v, dout, q_segment_ids=ids[0], kv_segment_ids=ids[1], block_sizes=block_sizes,
                          **kwargs)


@pytest.mark.parametrize("causal, kv_heads, block_sizes", [
    (False, 3, SMALL),
    (True, 3, MIXED),
    (True, 1, SMALL),  # MQA
], ids=str)
def test_matches_reference(causal, kv_heads, block_sizes):
  ids = _packed([[10, 25, 13], [48]])
  q, k, v, dout = random_inputs(5, 2, 48, 48, 3, 16)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  got = _run(q, k, v, dout, (ids, ids), block_sizes, causal=causal)
  want = reference_with_grads(q, k, v, dout, causal=causal, segment_ids=(ids, ids))
  assert_matches_reference(got, want, dout)


def test_unsorted_ids_and_unequal_lengths_with_a_mask():
  # Ids need not be sorted or contiguous; the tile skip must stay safe.
  q_ids = jax.random.randint(jax.random.PRNGKey(0), (2, 37), 0, 3)
  kv_ids = jax.random.randint(jax.random.PRNGKey(1), (2, 45), 0, 3)
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.8, (2, 1, 37, 45))
  q, k, v, dout = random_inputs(6, 2, 37, 45, 2, 16)
  got = _run(q, k, v, dout, (q_ids, kv_ids), MIXED, mask=mask, window_size=(20, 5))
  want = reference_with_grads(q, k, v, dout, mask=mask, window=(20, 5), segment_ids=(q_ids, kv_ids))
  assert_matches_reference(got, want, dout)


def test_tiles_between_segments_are_never_read():
  """Segments [0, 16) and [16, 48): with tiles of 16 the tiles pairing them are
  skipped, so NaN in the K/V of one segment cannot reach the other."""
  ids = _packed([[16, 32]])
  q, k, v, dout = random_inputs(7, 1, 48, 48, 2, 16)
  poisoned = lambda x: x.at[:, :16].set(jnp.nan)
  out, lse, dq, dk, dv = _run(q, poisoned(k), poisoned(v), dout, (ids, ids), SMALL)
  want = reference_with_grads(q, k, v, dout, segment_ids=(ids, ids))
  for name, x, ref in zip(("out", "lse", "dq"), (out, lse, dq), want):
    assert rel_err(x[:, 16:] if name != "lse" else x[:, :, 16:], ref[:, 16:] if name != "lse" else ref[:, :, 16:]) < 1e-5
  assert np.all(np.isfinite(np.asarray(dk[:, 16:]))) and np.all(np.isfinite(np.asarray(dv[:, 16:])))


def test_bad_segment_ids():
  q, k, v, _ = random_inputs(0, 2, 8, 8, 1, 8)
  ids = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match="together"):
    flash_attention(q, k, v, q_segment_ids=ids, backend="xla")
  with pytest.raises(ValueError, match="q_segment_ids must have shape"):
    flash_attention(q, k, v, q_segment_ids=ids[:, :5], kv_segment_ids=ids, backend="xla")
  with pytest.raises(TypeError, match="kv_segment_ids must be integers"):
    flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids.astype(jnp.float32), backend="xla")


def test_vmap_folds_segment_ids_and_alibi_slopes():
  ids = jnp.stack([_packed([[10, 22]]), _packed([[32]])])  # [2 (vmapped), 1, 32]
  q, k, v, _ = random_inputs(8, 2, 32, 32, 2, 16)
  q, k, v = (x[:, None] for x in (q, k, v))  # [2 (vmapped), 1, 32, 2, 16]
  slopes = jnp.array([0.3, 0.1], jnp.float32)  # shared by the vmapped instances

  def attend(q, k, v, ids):
    return flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, alibi_slopes=slopes,
                           causal=True, interpret=True, block_sizes=SMALL)

  got = jax.vmap(attend)(q, k, v, ids)
  for i in range(2):
    want = reference_with_grads(q[i], k[i], v[i], q[i], causal=True, alibi_slopes=slopes,
                                segment_ids=(ids[i], ids[i]))[0]
    assert rel_err(got[i], want) < 1e-5, i
