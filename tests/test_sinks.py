"""Attention sinks (`sinks=`, gpt-oss): one logit per query head in every
row's softmax denominator, carrying no value.

The float64 reference's sink column is checked against the softmax over
[scores, sink]; then XLA and the Triton kernels (interpret mode) in float32
against it at 1e-5, with every option, and the Mosaic kernels in Mosaic's
interpreter in float16 at FlashAttention's 2x/3x rule: out, lse, dq, dk, dv
and dsinks, random cotangents on out and lse. Then rows that see no key,
jit, vmap and bad inputs. The GPU versions are in test_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (assert_matches_reference, assert_within_plain_error, flash_with_grads, random_inputs,
                      reference_with_grads, rel_err, seed_of)
from jax_flash2 import BlockSizes, KernelConfig, dropout, flash_attention, reference

MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))
SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
RNG = jax.random.PRNGKey(5)


def _sinks(heads: int, seed: int = 0) -> jax.Array:
  """float32 [heads] around log(seq_k): the sink takes a sizeable share of
  each row (about half), so that an error in it shows."""
  return jnp.asarray(3.5 + 1.5 * np.random.default_rng(seed).standard_normal(heads, np.float32))


def _problem(seed, batch, seq_q, seq_k, heads, kv_heads, head_dim=16, dtype=jnp.float32):
  """q, k, v, dout, a random lse cotangent and sinks."""
  q, k, v, dout = random_inputs(seed, batch, seq_q, seq_k, heads, head_dim, dtype)
  dlse = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((batch, heads, seq_q), np.float32))
  return q, k[:, :, :kv_heads], v[:, :, :kv_heads], dout, dlse, _sinks(heads, seed)


def test_reference_is_the_softmax_over_a_sink_column():
  """reference.attention(sinks=) against the softmax over the scores with
  the sink appended as one more column that has no value: out, lse and the
  gradients, float64, with rows that see no key (causal, seq_q > seq_k)."""
  q, k, v, dout, dlse, sinks = (x.astype(jnp.float64) for x in _problem(0, 2, 12, 9, 2, 2))

  def appended(q, k, v, sinks):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(reference.band_visible(12, 9, None, 0), s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), jax.nn.logsumexp(s, axis=-1)

  def with_grads(f):
    def run(q, k, v, sinks, dout, dlse):
      (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
      return (out, lse, *vjp((dout, dlse)))

    return jax.jit(run)(q, k, v, sinks, dout, dlse)

  got = with_grads(lambda q, k, v, sinks: reference.attention(q, k, v, causal=True, sinks=sinks))
  want = with_grads(appended)
  for name, x, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
    np.testing.assert_allclose(x, w, rtol=1e-12, atol=1e-12, err_msg=name)
  # Rows 0..2 see no key: zeros, lse = sink.
  assert (got[0][:, :3] == 0).all()
  np.testing.assert_array_equal(got[1][:, :, :3], jnp.broadcast_to(sinks[None, :, None], (2, 2, 3)))


CASES = {
    # (batch, seq_q, seq_k, heads, kv_heads), flash options, reference options
    # seq_q > seq_k: the first 11 rows see no key.
    "causal_gqa": ((2, 40, 29, 4, 2), dict(causal=True), dict(causal=True)),
    "window_segments_mqa": ((2, 37, 45, 4, 1), dict(window_size=(9, 4)), dict(window=(9, 4))),
    "mask_bias_alibi_softcap": ((2, 33, 41, 4, 4), dict(softcap=5.0), dict(softcap=5.0)),
    "dropout_gqa": ((2, 35, 41, 4, 2), dict(causal=True, dropout_rate=0.3, dropout_rng=RNG),
                    dict(causal=True, dropout=(0.3, dropout.seed_words(RNG), False))),
}


def _arrays(case, batch, seq_q, seq_k, heads):
  """The array options of a case, the same for flash_attention and the reference."""
  keys = jax.random.split(jax.random.PRNGKey(2), 4)
  if case == "window_segments_mqa":
    q_ids = jnp.repeat(jnp.array([[0, 1, 2], [0, 0, 1]], jnp.int32), jnp.array([12, 13, 12]), axis=1,
                       total_repeat_length=seq_q)
    kv_ids = jnp.repeat(jnp.array([[0, 1, 2], [0, 0, 1]], jnp.int32), jnp.array([15, 15, 15]), axis=1,
                        total_repeat_length=seq_k)
    return dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids), dict(segment_ids=(q_ids, kv_ids))
  if case == "mask_bias_alibi_softcap":
    mask = jax.random.bernoulli(keys[0], 0.8, (batch, 1, seq_q, seq_k)).at[0, 0, 5].set(False)  # row 5 sees nothing
    bias = jax.random.normal(keys[1], (1, heads, seq_q, seq_k), jnp.float32)
    slopes = jax.random.uniform(keys[2], (heads,), jnp.float32, 0.05, 0.3)
    both = dict(mask=mask, bias=bias, alibi_slopes=slopes)
    return both, both
  return {}, {}


@pytest.mark.parametrize("backend", ["xla", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, backend):
  (batch, seq_q, seq_k, heads, kv_heads), options, ref_options = CASES[case]
  q, k, v, dout, dlse, sinks = _problem(seed_of(case), batch, seq_q, seq_k, heads, kv_heads)
  arrays, ref_arrays = _arrays(case, batch, seq_q, seq_k, heads)
  kernel = dict(backend="xla", interpret=False) if backend == "xla" else dict(block_sizes=MIXED)
  got = flash_with_grads(q, k, v, dout, dlse, wrt=("sinks",), sinks=sinks, **arrays, **options, **kernel)
  want = reference_with_grads(q, k, v, dout, dlse, sinks=sinks, **ref_arrays, **ref_options)
  assert_matches_reference(got, want, dout)
  # The sinks matter: without them every output differs.
  without = reference_with_grads(q, k, v, dout, dlse, **ref_arrays, **ref_options)
  for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), want, without):
    assert rel_err(x, w) > 1e-2, name
  if case == "causal_gqa":  # rows 0..10 see no key: zeros, lse = sink, no gradient
    out, lse, dq = got[:3]
    assert (out[:, :11] == 0).all() and (dq[:, :11] == 0).all()
    np.testing.assert_allclose(lse[:, :, :11], jnp.broadcast_to(sinks[None, :, None], (batch, heads, 11)),
                               rtol=1e-6)


@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads",
    # Whole blocks; causal GQA with seq_q > seq_k, whose first 128 rows see no key.
    [((1, 256, 256, 2, 64), jnp.float16, False, None), ((1, 256, 128, 2, 64), jnp.bfloat16, True, 1)],
    ids=["full_fp16", "causal_gqa_rows_without_keys_bf16"],
)
def test_mosaic_interpreter_within_flash_attentions_rule(shape, dtype, causal, kv_heads):
  """backend="mosaic" in Mosaic's interpreter (which takes float16 and
  bfloat16 only): against float64, the error of each of out, lse, dq, dk, dv
  and dsinks at most 2x (3x for gradients) that of the same math done
  plainly in the input dtype."""
  batch, seq_q, seq_k, heads, head_dim = shape
  q, k, v, dout, dlse, sinks = _problem(7, batch, seq_q, seq_k, heads, kv_heads or heads, head_dim, dtype)

  def f(q, k, v, sinks):
    return flash_attention(q, k, v, causal=causal, sinks=sinks, return_lse=True, backend="mosaic", interpret=True)

  (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
  got = (out, lse, *vjp((dout, dlse)))
  want = reference_with_grads(q, k, v, dout, dlse, causal=causal, sinks=sinks)
  plain = reference_with_grads(q, k, v, dout, dlse, causal=causal, sinks=sinks.astype(dtype), dtype=dtype)
  assert_within_plain_error(got, want, plain, dtype)
  if causal:
    assert (out[:, :128] == 0).all()
    np.testing.assert_allclose(lse[:, :, :128], jnp.broadcast_to(sinks[None, :, None], (1, heads, 128)))


def test_a_minus_inf_sink_is_no_sink():
  """sinks = -inf turns a head's sink off: that head is plain attention,
  rows that see no key keep lse = -inf, and nothing is NaN (dsinks 0), in
  the kernels' join and in the reference (the XLA backend)."""
  q, k, v, dout, dlse, _ = _problem(3, 1, 20, 12, 2, 2)  # causal: rows 0..7 see no key
  sinks = jnp.array([-jnp.inf, 2.0], jnp.float32)
  got = flash_with_grads(q, k, v, dout, dlse, wrt=("sinks",), sinks=sinks, causal=True, block_sizes=SMALL)
  want = reference_with_grads(q, k, v, dout, dlse, causal=True, sinks=sinks)
  assert_matches_reference(got, want, dout)
  assert got[5][0] == 0 and np.isneginf(got[1][:, 0, :8]).all()
  plain_out, plain_lse = reference_with_grads(q, k, v, dout, dlse, causal=True)[:2]
  assert rel_err(got[0][:, :, 0], plain_out[:, :, 0]) < 1e-5 and rel_err(got[1][:, 0], plain_lse[:, 0]) < 1e-5


def test_jit_matches_eager():
  q, k, v, _, _, sinks = _problem(1, 1, 20, 27, 2, 2)
  f = lambda q, k, v, sinks: flash_attention(q, k, v, causal=True, sinks=sinks, interpret=True, block_sizes=SMALL)
  np.testing.assert_array_equal(np.asarray(f(q, k, v, sinks)), np.asarray(jax.jit(f)(q, k, v, sinks)))


def test_vmap_over_inputs_and_sinks():
  """vmap of the output and gradients, with sinks mapped (one set per
  element) and shared (their gradient summed over the elements): the sinks
  passed are their sum, so one program covers both."""
  q, k, v, dout, dlse, _ = _problem(4, 3, 20, 20, 2, 2)  # batch axis 0 becomes the vmapped axis
  q, k, v, dout, dlse = (x[:, None] for x in (q, k, v, dout, dlse))
  mapped = jnp.stack([_sinks(2, seed) for seed in range(3)]) - 3.5
  shared = _sinks(2, 9)

  def one(q, k, v, dout, dlse, mapped, shared):
    f = lambda q, k, v, mapped, shared: flash_attention(q, k, v, causal=True, sinks=mapped + shared,
                                                        return_lse=True, interpret=True, block_sizes=SMALL)
    (out, lse), vjp = jax.vjp(f, q, k, v, mapped, shared)
    return (out, lse, *vjp((dout, dlse)))

  got = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None)))(q, k, v, dout, dlse, mapped, shared)
  dshared = 0.0
  for i in range(3):
    want = reference_with_grads(q[i], k[i], v[i], dout[i], dlse[i], causal=True, sinks=mapped[i] + shared)
    assert_matches_reference([x[i] for x in got[:6]], want, dout[i])
    dshared += want[5]
  assert rel_err(got[6].sum(0), dshared) < 1e-5


@pytest.mark.parametrize("sinks, error, match", [
    (jnp.zeros((3,)), ValueError, r"sinks must have shape \[heads\] = \(4,\) \(q's heads\), got \(3,\)"),
    (jnp.zeros((2, 4)), ValueError, r"got \(2, 4\)"),
    (jnp.zeros((2,)), ValueError, r"= \(4,\)"),  # k's heads, not q's
    (jnp.zeros((4,), jnp.int32), TypeError, "sinks must be floating point, got dtype int32"),
    ([0.0] * 4, TypeError, "sinks must be an array, got list"),
])
def test_bad_sinks(sinks, error, match):
  q, k, v, _ = random_inputs(0, 2, 8, 8, 4, 8)
  with pytest.raises(error, match=match):
    flash_attention(q, k[:, :, :2], v[:, :, :2], sinks=sinks, backend="xla")


def test_bfloat16_sinks_are_used_as_float32_with_gradients_in_bfloat16():
  q, k, v, _ = random_inputs(0, 1, 8, 8, 4, 8)
  sinks = _sinks(4).astype(jnp.bfloat16)
  f = lambda s: flash_attention(q, k, v, sinks=s, return_lse=True, backend="xla")[1].sum()
  assert f(sinks) == f(sinks.astype(jnp.float32))
  assert jax.grad(f)(sinks).dtype == jnp.bfloat16
