"""ALiBi (`alibi_slopes=`), interpret mode, float32, against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


@pytest.mark.parametrize("per_batch, kv_heads, causal, softcap", [
    (False, 4, False, None),
    (True, 2, True, None),  # per-batch slopes, GQA
    (False, 1, True, 5.0),  # MQA, with a softcap before the bias
], ids=str)
def test_matches_reference(per_batch, kv_heads, causal, softcap):
  q, k, v, dout = random_inputs(kv_heads, 2, 37, 45, 4, 16)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  shape = (2, 4) if per_batch else (4,)
  slopes = jax.random.uniform(jax.random.PRNGKey(1), shape, jnp.float32, 0.05, 0.5)

  got = flash_with_grads(q, k, v, dout, alibi_slopes=slopes, causal=causal, softcap=softcap, block_sizes=MIXED)
  want = reference_with_grads(q, k, v, dout, alibi_slopes=slopes, causal=causal, softcap=softcap)
  without = reference_with_grads(q, k, v, dout, causal=causal, softcap=softcap)
  assert_matches_reference(got, want, dout)
  for name, ref, other in zip(("out", "lse", "dq", "dk", "dv"), want, without):
    assert rel_err(other, ref) > 1e-3, f"{name}: the bias should change the result"


@pytest.mark.parametrize("slopes, error", [
    (jnp.ones((3,)), ValueError),
    (jnp.ones((2, 2, 4)), ValueError),
    (jnp.ones((4,), jnp.int32), TypeError),
    ([0.1] * 4, TypeError),
])
def test_bad_slopes(slopes, error):
  q, k, v, _ = random_inputs(0, 2, 8, 8, 4, 8)
  with pytest.raises(error, match="alibi_slopes"):
    flash_attention(q, k, v, alibi_slopes=slopes, backend="xla")
