"""float32 held to FlashAttention's own test rule: against a float64
reference, the kernels' error is at most 2x (3x for gradients) the error of
the same math done plainly in float32. Interpret mode, so the kernels' dots
are XLA's CPU dots; at 16 columns those round as the plain math's do (a
64-column CPU dot rounds about twice as much, whatever computes it), and
tests/test_gpu.py holds the compiled kernels to the same rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import (assert_within_plain_error, flash_with_grads, has_supported_gpu, random_inputs, reference_with_grads,
                      seed_of)
from jax_flash2 import BlockSizes, KernelConfig, dropout, flash_attention

TILES = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))
RNG = jax.random.PRNGKey(1)

CASES = {
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), options
    "gqa_window_softcap_d80": ((2, 70, 90, 4, 2, 80), dict(causal=True, window_size=(20, 0), softcap=5.0)),
    "dropout_d256": ((1, 48, 40, 2, 1, 256), dict(dropout_rate=0.3)),
    "alibi_causal_d64": ((1, 64, 64, 2, 2, 64), dict(causal=True, alibi=True)),
    "ragged_full_d128": ((1, 37, 53, 2, 1, 128), dict()),
}


def _kernel_grads(q, k, v, dout, *, compiled: bool, **kwargs):
  """(out, lse, dq, dk, dv): interpreted at TILES, or compiled at the defaults."""
  if not compiled:
    return flash_with_grads(q, k, v, dout, block_sizes=TILES, **kwargs)

  def f(q, k, v):
    return flash_attention(q, k, v, return_lse=True, backend="triton", **kwargs)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((dout, jnp.zeros_like(lse))))


def problem(case: str, seed: int):
  """(q, k, v, dout, the kernel's keywords, the reference's keywords) of
  CASES[case], drawn from `seed`."""
  (batch, seq_q, seq_k, heads, kv_heads, head_dim), options = CASES[case]
  q, k, v, dout = random_inputs(seed, batch, seq_q, seq_k, heads, head_dim, jnp.float32)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  kernel, ref = {}, {}
  for name in ("causal", "softcap"):
    if name in options:
      kernel[name] = ref[name] = options[name]
  if "window_size" in options:
    kernel["window_size"] = ref["window"] = options["window_size"]
  if options.get("dropout_rate"):
    kernel.update(dropout_rate=options["dropout_rate"], dropout_rng=RNG)
    ref["dropout"] = (options["dropout_rate"], dropout.seed_words(RNG), False)
  if options.get("alibi"):
    kernel["alibi_slopes"] = ref["alibi_slopes"] = 2.0 ** -jnp.arange(1, heads + 1, dtype=jnp.float32)
  return q, k, v, dout, kernel, ref


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["interpret", "gpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_within_flash_attentions_rule(case, compiled):
  if compiled and not has_supported_gpu():
    pytest.skip("needs an NVIDIA GPU of compute capability 8.0 or newer")
  q, k, v, dout, kernel, ref = problem(case, seed_of(case))
  got = _kernel_grads(q, k, v, dout, compiled=compiled, **kernel)
  want = reference_with_grads(q, k, v, dout, **ref)
  plain = reference_with_grads(q, k, v, dout, dtype=jnp.float32, **ref)
  # The README's limit: compiled at head_dim 256, float32 errs up to 3x plain
  # float32 attention, its output too (2.2-2.9x measured on the H200).
  wide = compiled and q.shape[-1] == 256
  assert_within_plain_error(got, want, plain, jnp.float32, limit=None, out_factor=3.0 if wide else 2.0)
