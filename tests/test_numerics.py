"""Edge-case numerics, the same on every path: a NaN in a query row makes that
row NaN (its lse too, not the -inf of a row that sees no key), an infinite
score likewise, and scores of any magnitude give finite, correct rows (the
row's largest term is exactly exp(0))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
PATHS = {
    "xla": dict(backend="xla"),
    "triton": dict(backend="triton", interpret=True, block_sizes=SMALL),
}


def _row_outputs(q, k, v, path, **kwargs):
  out, lse = flash_attention(q, k, v, return_lse=True, **PATHS[path], **kwargs)
  return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_non_finite_query_spoils_its_row_only(path, value, causal):
  """Query row 3 holds a NaN or an infinity. A NaN makes its output and lse
  NaN (not the -inf of a row that sees no key); an infinity makes them NaN
  where a visible score is +inf, and the row one that sees no key where all
  of its scores are -inf: on every path alike. Every other row is what it
  would be without it."""
  q, k, v, _ = random_inputs(0, 1, 40, 40, 2, 16)
  bad = q.at[0, 3, 1, 5].set(value)
  out, lse = _row_outputs(bad, k, v, path, causal=causal)
  xla_out, xla_lse = _row_outputs(bad, k, v, "xla", causal=causal)
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(xla_lse))
  np.testing.assert_array_equal(lse[np.isinf(lse)], xla_lse[np.isinf(lse)])
  np.testing.assert_array_equal(np.isnan(out), np.isnan(xla_out))
  if np.isnan(value):
    assert np.isnan(lse[0, 1, 3]) and np.isnan(out[0, 3, 1]).all()
  else:
    assert np.isnan(lse[0, 1, 3]) or (lse[0, 1, 3] == -np.inf and (out[0, 3, 1] == 0).all())
  want_out, want_lse = _row_outputs(q, k, v, "xla", causal=causal)
  keep = np.ones(40, bool)
  keep[3] = False
  np.testing.assert_allclose(out[0, keep, 1], want_out[0, keep, 1], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse[0, 1, keep], want_lse[0, 1, keep], rtol=1e-5)
  np.testing.assert_allclose(out[0, :, 0], want_out[0, :, 0], rtol=1e-5, atol=1e-6)  # the other head


def test_a_row_that_sees_no_key_is_still_zero_with_lse_minus_inf():
  q, k, v, _ = random_inputs(1, 1, 30, 10, 2, 16)  # causal, seq_q > seq_k: rows 0..19 see nothing
  for path in PATHS:
    out, lse = _row_outputs(q, k, v, path, causal=True)
    assert (out[0, :20] == 0).all() and (lse[0, :, :20] == -np.inf).all(), path


@pytest.mark.parametrize("dtype, magnitude", [(jnp.float32, 1e5), (jnp.float16, 6e4)], ids=["f32_1e5", "f16_6e4"])
@pytest.mark.parametrize("path", list(PATHS))
def test_huge_scores_give_finite_correct_rows(path, dtype, magnitude):
  """q, k near the dtype's reach (|q.k| * scale up to ~1e10): every row
  finite and as the float64 reference has it, no row of zeros, inf or NaN."""
  q, k, v, dout = random_inputs(2, 1, 48, 48, 2, 64)
  scale = lambda x: jnp.clip(x * magnitude / 3, -magnitude, magnitude).astype(dtype)
  q, k, v = scale(q), scale(k), v.astype(dtype)
  out, lse = _row_outputs(q, k, v, path, causal=True)
  want = reference_with_grads(q, k, v, dout.astype(dtype), causal=True)
  assert np.isfinite(out).all() and np.isfinite(lse).all()
  assert rel_err(out, want[0]) < (1e-5 if dtype == jnp.float32 else 2e-3)
  assert rel_err(lse, want[1]) < 1e-6


def test_mosaic_row_with_a_nan_is_nan():
  """The Mosaic forward too (its interpreter), where rows may see no key
  (causal, seq_q > seq_k): a NaN row's lse is NaN, a row seeing no key's -inf."""
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in random_inputs(3, 1, 256, 128, 2, 64))
  bad = q.at[0, 200, 0, 7].set(jnp.nan)  # row 200 sees keys 0..72
  out, lse = flash_attention(bad, k, v, causal=True, return_lse=True, backend="mosaic", interpret=True)
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  assert np.isnan(lse[0, 0, 200]) and np.isnan(out[0, 200, 0]).all()
  assert (lse[0, :, :128] == -np.inf).all() and (out[0, :128] == 0).all()
  assert np.isfinite(np.delete(lse[0, 0], 200)[128:]).all() and np.isfinite(lse[0, 1, 128:]).all()
