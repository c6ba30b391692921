"""Logit softcapping (`softcap=`), interpret mode, float32, against the reference."""

from __future__ import annotations

import pytest

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


@pytest.mark.parametrize("softcap, causal, window", [
    (2.0, False, None),  # a tight cap: most scores saturate the tanh
    (30.0, True, None),
    (5.0, True, (9, 0)),
], ids=str)
def test_matches_reference(softcap, causal, window):
  # Scores of order 10: the cap changes them and its gradient matters.
  q, k, v, dout = random_inputs(int(softcap), 2, 35, 41, 4, 16)
  q = q * 3.0
  k, v = k[:, :, :2], v[:, :, :2]  # with GQA too

  got = flash_with_grads(q, k, v, dout, softcap=softcap, causal=causal, window_size=window, block_sizes=MIXED)
  want = reference_with_grads(q, k, v, dout, softcap=softcap, causal=causal, window=window or (None, None))
  uncapped = reference_with_grads(q, k, v, dout, causal=causal, window=window or (None, None))
  assert_matches_reference(got, want, dout)
  for name, ref, other in zip(("out", "lse", "dq", "dk", "dv"), want, uncapped):
    assert rel_err(other, ref) > 1e-3, f"{name}: the cap should change the result"


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf")])
def test_bad_softcap(softcap):
  q, k, v, _ = random_inputs(0, 1, 8, 8, 1, 8)
  with pytest.raises(ValueError, match="softcap"):
    flash_attention(q, k, v, softcap=softcap, backend="xla")
