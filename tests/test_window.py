"""Sliding windows (`window_size=`): kernels against the reference, and the
block ranges the loops walk checked against brute force."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention
from jax_flash2.reference import band_visible
from jax_flash2.mask import Mask
from jax_flash2.mosaic.common import in_span
from jax_flash2.problem import Problem
from jax_flash2.triton import common

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


def _run(q, k, v, dout, **kwargs):
  return flash_with_grads(q, k, v, dout, block_sizes=MIXED, **kwargs)


@pytest.mark.parametrize("seqs, window", [
    ((45, 45), (4, 0)),
    ((45, 45), (0, 0)),
    ((30, 70), (8, 8)),
    ((30, 70), (None, 5)),
    ((70, 30), (10, None)),
    ((70, 30), (20, 3)),
], ids=str)
def test_matches_reference(seqs, window):
  seq_q, seq_k = seqs
  q, k, v, dout = random_inputs(hash((seqs, window)) % 2**31, 1, seq_q, seq_k, 2, 16)
  got = _run(q, k, v, dout, window_size=window)
  want = reference_with_grads(q, k, v, dout, window=window)
  assert_matches_reference(got, want, dout)


def test_combines_with_causal_mask_and_gqa():
  q, k, v, dout = random_inputs(3, 2, 40, 50, 4, 16)
  k, v = k[:, :, :2], v[:, :, :2]
  mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (2, 1, 40, 50))
  got = _run(q, k, v, dout, window_size=(12, 6), causal=True, mask=mask)
  # causal caps the right side at 0
  want = reference_with_grads(q, k, v, dout, mask=mask, window=(12, 0))
  assert_matches_reference(got, want, dout)


@pytest.mark.parametrize("window", [(-1, 0), (1, 2, 3), "x", (1.5, None), (True, 0)], ids=str)
def test_bad_windows(window):
  q, k, v, _ = random_inputs(0, 1, 8, 8, 1, 8)
  with pytest.raises((TypeError, ValueError), match="window_size"):
    flash_attention(q, k, v, window_size=window, backend="xla")


def _problem(seq_q, seq_k, left, right):
  return Problem(mask=Mask(seq_q, seq_k, window_left=left, window_right=right), head_dim=16, softmax_scale=1.0,
                 dtype="float32")


def _tiles_seen(visible, block_q, block_k, padded_rows_count: bool):
  """[Q blocks, K blocks] of (any visible, all visible) from a dense band.

  Padding columns (past seq_k) are never visible. Padding rows (past seq_q)
  are too when padded_rows_count; otherwise they are ignored, as a Q-outer
  program ignores them (it never stores them).
  """
  seq_q, seq_k = visible.shape
  nq, nk = -(-seq_q // block_q), -(-seq_k // block_k)
  padded = np.zeros((nq * block_q, nk * block_k), bool)
  padded[:seq_q, :seq_k] = visible
  any_seen = padded.reshape(nq, block_q, nk, block_k).any(axis=(1, 3))
  if not padded_rows_count:
    padded[seq_q:, :seq_k] = True
  return any_seen, padded.reshape(nq, block_q, nk, block_k).all(axis=(1, 3))


BANDS = list(itertools.product([(16, 16), (33, 47), (47, 33), (64, 16)], [None, 0, 5, 20], [None, 0, 7, 40]))


@pytest.mark.parametrize("seqs, left, right", BANDS)
def test_block_ranges_are_tight(seqs, left, right):
  """Every tile with a visible score is walked, no tile outside [lo, hi) is
  walked needlessly at the edges, and only wholly visible tiles skip the mask."""
  seq_q, seq_k = seqs
  problem = _problem(seq_q, seq_k, left, right)
  band = np.asarray(band_visible(seq_q, seq_k, left, right))
  as_int = lambda x: int(x)
  any_seen, all_seen = _tiles_seen(band, 8, 8, padded_rows_count=False)
  for qb in range(any_seen.shape[0]):
    lo, full_lo, full_hi, hi = map(as_int, common.kv_block_range(problem, jnp.int32(qb * 8), 8, 8))
    seen = np.nonzero(any_seen[qb])[0]
    if len(seen):
      assert (lo, hi) == (seen[0], seen[-1] + 1), qb
    assert all(all_seen[qb, kb] for kb in range(full_lo, full_hi)), qb
    assert full_hi - full_lo == all_seen[qb].sum(), qb  # no visible tile pays for the mask
  any_seen, all_seen = _tiles_seen(band, 8, 8, padded_rows_count=True)
  for kb in range(any_seen.shape[1]):
    lo, full_lo, full_hi, hi = map(as_int, common.q_block_range(problem, jnp.int32(kb * 8), 8, 8))
    seen = np.nonzero(any_seen[:, kb])[0]
    if len(seen):
      assert (lo, hi) == (seen[0], seen[-1] + 1), kb
    assert all(all_seen[qb, kb] for qb in range(full_lo, full_hi)), kb
    assert full_hi - full_lo == all_seen[:, kb].sum(), kb


@pytest.mark.parametrize("seqs", [(40, 40), (25, 60), (60, 25)], ids=str)
@pytest.mark.parametrize("causal, left, right", [
    (False, 5, 0), (False, 0, 7), (False, None, 3), (False, 9, None), (True, None, None), (True, 12, 4),
    (False, 30, 45),
], ids=str)
@pytest.mark.parametrize("check_keys", [False, True], ids=["band", "band_and_keys"])
def test_spans_see_what_visible_sees(seqs, causal, left, right, check_keys):
  """The Mosaic kernels' element mask (one compare a score against each
  row's span: Mask.key_span, Mask.query_span and in_span) hides exactly
  what Mask.visible does, on positions past both ends too, rows with an
  empty span included."""
  seq_q, seq_k = seqs
  mask = Mask(seq_q, seq_k, causal=causal, window_left=left, window_right=right)
  queries, keys = jnp.arange(seq_q + 17, dtype=jnp.int32), jnp.arange(seq_k + 19, dtype=jnp.int32)
  want = np.asarray(mask.visible(queries[:, None], keys[None, :], check_queries=False, check_keys=check_keys))
  # The end of the keys alone is one bound for every row, as the kernels broadcast it.
  first, last = (None if b is None else jnp.broadcast_to(b, queries.shape)
                 for b in mask.key_span(queries, check_keys=check_keys))
  columns = jnp.broadcast_to(keys, want.shape)
  np.testing.assert_array_equal(np.asarray(in_span(columns, first, last)), want)
  # Transposed (the dK/dV kernels' S^T): a row a key, the queries that see it.
  want_t = np.asarray(mask.visible(queries[None, :], keys[:, None], check_queries=False, check_keys=False))
  first, last = mask.query_span(keys)
  columns = jnp.broadcast_to(queries, want_t.shape)
  np.testing.assert_array_equal(np.asarray(in_span(columns, first, last)), want_t)
  assert want.any() and not want.all()
