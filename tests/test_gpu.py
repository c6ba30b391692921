"""The compiled kernels on an NVIDIA GPU, in bf16 and fp16 at realistic sizes.

The bar (after flash-attention's tests): against a float32 reference, the
kernel's error is at most 2x (3x for gradients) the error of the same math
done plainly in the input dtype, and under 1e-2 relative.

Run with `pytest -m gpu`; skipped where no GPU of compute capability >= 8.0 is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_within_plain_error, random_inputs, reference_with_grads, rel_err
from jax_flash2 import dropout, flash_attention, plan, reference

pytestmark = pytest.mark.gpu

# (batch, seq_q, seq_k, heads, head_dim)
SHAPES = [
    (2, 1024, 1024, 4, 64),
    (1, 2048, 2048, 4, 128),
    (1, 1000, 1537, 3, 128),  # ragged, seq_q < seq_k
    (1, 1537, 1000, 3, 128),  # ragged, seq_q > seq_k: causal leaves rows with no key
    (1, 4096, 4096, 2, 256),
    (2, 777, 777, 2, 80),  # head_dim padded to 128 inside
    (1, 8192, 8192, 1, 128),
]
# fp16 on a subset: the kernels are dtype-generic, and the suite must fit a lease.
FP16_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[5]]


@jax.jit
def _poison():
  # Fill and free a large buffer with NaN first, so that an output block the
  # kernel never writes is likely to read NaN rather than stale zeros.
  return jnp.full((1 << 28,), jnp.nan, jnp.float32)


def _flash(q, k, v, dout, mask, slopes, segment_ids, rng, causal, window=None, softcap=None, rate=0.0,
           backend="triton", *, sinks=None, dlse=None):
  """(out, lse, dq, dk, dv), and dsinks with sinks; dlse None means zeros."""
  q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)

  def f(q, k, v, *sinks):
    return flash_attention(q, k, v, mask=mask, causal=causal, window_size=window, softcap=softcap,
                           alibi_slopes=slopes, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                           sinks=sinks[0] if sinks else None, dropout_rate=rate, dropout_rng=rng, return_lse=True,
                           backend=backend)

  (out, lse), vjp = jax.vjp(f, q, k, v, *(() if sinks is None else (sinks,)))
  return (out, lse, *vjp((dout, jnp.zeros_like(lse) if dlse is None else dlse)))


_flash_jit = jax.jit(_flash, static_argnums=(8, 9, 10, 11, 12))


def _check(shape, dtype, causal, mask=None, kv_heads=None, window=None, softcap=None, slopes=None,
           segment_ids=None, dropout_rate=0.0, backend="triton", sinks=False):
  """sinks: with random sinks and a random lse cotangent, dsinks checked too."""
  batch, seq_q, seq_k, heads, head_dim = shape
  q, k, v, dout = random_inputs(hash((shape, causal)) % 2**31, batch, seq_q, seq_k, heads, head_dim, dtype)
  if kv_heads is not None:
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  extra = {}
  if sinks:
    draw = np.random.default_rng(seq_q)
    # Around log(seq_k): the sink takes a sizeable share of each row.
    extra = dict(sinks=jnp.asarray(np.log(seq_k) + draw.standard_normal(heads, np.float32), jnp.float32),
                 dlse=jnp.asarray(draw.standard_normal((batch, heads, seq_q), np.float32)))
  _poison().block_until_ready()
  rng = jax.random.PRNGKey(3)
  got = _flash_jit(q, k, v, dout, mask, slopes, segment_ids, rng, causal, window, softcap, dropout_rate, backend,
                   **extra)
  ref = dict(mask=mask, causal=causal, window=window or (None, None), softcap=softcap, alibi_slopes=slopes,
             segment_ids=segment_ids, **extra)
  if dropout_rate:
    ref["dropout"] = (dropout_rate, dropout.seed_words(rng), False)
  dlse = ref.pop("dlse", None)
  want = reference_with_grads(q, k, v, dout, dlse, dtype=jnp.float32, **ref)
  if sinks:
    ref["sinks"] = ref["sinks"].astype(dtype)
  plain = reference_with_grads(q, k, v, dout, dlse, dtype=dtype, **ref)
  assert_within_plain_error(got, want, plain, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_matches_reference(shape, causal):
  _check(shape, jnp.bfloat16, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FP16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp16_matches_reference(shape, causal):
  _check(shape, jnp.float16, causal)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_mask(causal, head_dim):
  # Key padding per batch row plus a random pattern: partial, hidden and
  # fully visible tiles all occur. head_dim 256: the mask's tiles beside the
  # deepest K/V pipelines of the default tiles.
  shape = (2, 1500, 1300, 4, head_dim)
  lengths = jnp.array([1300, 700])
  keep = jnp.arange(shape[2])[None, :] < lengths[:, None]  # [batch, seq_k]
  pattern = jax.random.bernoulli(jax.random.PRNGKey(0), 0.9, (1, 1, shape[1], shape[2]))
  _check(shape, jnp.bfloat16, causal, mask=keep[:, None, None, :] & pattern)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_attention(causal):
  _check((2, 2048, 2048, 16, 128), jnp.bfloat16, causal, kv_heads=4)


@pytest.mark.parametrize("window", [(256, 0), (300, 300), (None, 100)], ids=str)
def test_sliding_window(window):
  _check((1, 4096, 3000, 4, 128), jnp.bfloat16, False, window=window)


def test_softcap():
  _check((2, 2048, 2048, 4, 128), jnp.bfloat16, True, softcap=30.0)


def test_alibi():
  slopes = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
  _check((2, 2048, 2048, 4, 128), jnp.bfloat16, True, slopes=slopes)


def test_packed_segments():
  lengths = jnp.array([100, 400, 548, 1000, 100])  # 5 sequences packed in 2048
  ids = jnp.repeat(jnp.arange(5, dtype=jnp.int32), lengths, total_repeat_length=2048)[None]
  _check((1, 2048, 2048, 4, 128), jnp.bfloat16, True, segment_ids=(ids, ids))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout(causal):
  """The hash mask compiled by the Triton lowering matches the reference's."""
  _check((2, 1000, 1000, 4, 64), jnp.bfloat16, causal, kv_heads=2, dropout_rate=0.2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape, kv_heads", [
    (jnp.bfloat16, (1, 2048, 2048, 8, 128), 2),
    (jnp.float16, (1, 1537, 1000, 3, 128), None),  # ragged; causal leaves rows with no key (lse = sink)
    (jnp.bfloat16, (2, 1024, 1024, 4, 64), None),
], ids=["bf16_gqa_2048", "fp16_ragged", "bf16_d64"])
def test_sinks(dtype, shape, kv_heads, causal):
  """Attention sinks with their gradient (dsinks held to the same rule)."""
  _check(shape, dtype, causal, kv_heads=kv_heads, sinks=True)


def test_sinks_with_dropout_and_a_window():
  _check((2, 2048, 2048, 4, 128), jnp.bfloat16, True, kv_heads=2, window=(512, 0), dropout_rate=0.2, sinks=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bias_and_its_gradient(causal, head_dim):
  """A relative-position style bias shared over the batch: out, dq, dk, dv and
  dbias against float32, within 3x the plain bf16 error."""
  q, k, v, dout = random_inputs(4, 2, 1024, 1024, 4, head_dim, jnp.bfloat16)
  bias = jax.random.normal(jax.random.PRNGKey(5), (1, 4, 1024, 1024), jnp.float32).astype(jnp.bfloat16)

  def grads(attend):
    # The arrays are the jitted function's arguments, not constants it closes
    # over: XLA would fold a reference over constants at compile time (minutes).
    def run(q, k, v, bias, dout):
      out, vjp = jax.vjp(attend, q, k, v, bias)
      return (out, *vjp(dout))

    return jax.jit(run)(q, k, v, bias, dout)

  got = grads(lambda q, k, v, b: flash_attention(q, k, v, bias=b, causal=causal, backend="triton"))
  plain = lambda dtype: grads(lambda q, k, v, b: reference.attention(q, k, v, bias=b, causal=causal,
                                                                     compute_dtype=dtype)[0])
  want, base = plain(jnp.float32), plain(jnp.bfloat16)
  for name, x, ref, b in zip(("out", "dq", "dk", "dv", "dbias"), got, want, base):
    err, base_err = rel_err(x, ref), rel_err(b, ref)
    assert err < 1e-2, f"{name}: relative error {err:.3g}"
    assert err <= 3.0 * base_err, f"{name}: error {err:.3g} > 3 x plain bf16 {base_err:.3g}"


def test_gradients_are_bitwise_deterministic():
  q, k, v, dout = random_inputs(1, 2, 2048, 2048, 4, 128, jnp.bfloat16)
  first = _flash_jit(q, k, v, dout, None, None, None, None, True)
  second = _flash_jit(q, k, v, dout, None, None, None, None, True)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_nan_at_16k(causal):
  q, k, v, dout = random_inputs(2, 1, 16384, 16384, 4, 128, jnp.bfloat16)
  for x in _flash_jit(q, k, v, dout, None, None, None, None, causal):
    assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))


# ---------------------------------------------------------------- Hopper kernels

hopper = pytest.mark.skipif(
    not any(str(getattr(d, "compute_capability", "")).startswith("9") for d in jax.devices()),
    reason="the Mosaic GPU kernels need a Hopper GPU",
)
# Shapes the Mosaic kernels serve, whole blocks and ragged (padded inside),
# and d256, whose backward falls back to the Triton kernels.
MOSAIC_SHAPES = [
    (2, 1024, 1024, 4, 64),
    (1, 4100, 4500, 2, 128),  # ragged and long: "auto" pads it for the Mosaic kernels too
    (1, 2048, 2048, 4, 128),
    (1, 1024, 2048, 4, 128),  # seq_q < seq_k: bottom-right causal
    (1, 2048, 1024, 4, 128),  # seq_q > seq_k: causal leaves rows with no key
    (1, 8192, 8192, 1, 128),
    (1, 2048, 2048, 2, 256),
    (1, 1000, 1537, 3, 128),  # ragged, seq_q < seq_k
    (1, 1537, 1000, 3, 128),  # ragged, seq_q > seq_k: rows with no key
    (2, 777, 777, 2, 64),  # ragged, both lengths
    (1, 1000, 1000, 2, 256),  # ragged, d256 forward
]


@hopper
@pytest.mark.parametrize("backend", ["mosaic", "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mosaic_bf16_matches_reference(shape, causal, backend):
  _check(shape, jnp.bfloat16, causal, backend=backend)


@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
# Three of MOSAIC_SHAPES: whole blocks, rows that see no key, and ragged.
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 4, 64), (1, 2048, 1024, 4, 128), (1, 1537, 1000, 3, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_mosaic_fp16_matches_reference(shape, causal):
  _check(shape, jnp.float16, causal, backend="mosaic")


@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 2048, 2048, 8, 128), (2, 1000, 1300, 8, 64)], ids=["2048", "ragged"])
def test_mosaic_grouped_query_attention(shape, causal):
  _check(shape, jnp.bfloat16, causal, kv_heads=2, backend="mosaic")


@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape", [(jnp.bfloat16, (1, 2048, 2048, 4, 128)), (jnp.float16, (1, 2048, 1024, 4, 64))],
                         ids=["bf16_2048", "fp16_rows_without_keys"])
def test_mosaic_sinks(dtype, shape, causal):
  """The sinks joined to the Mosaic kernels' natural-log lse."""
  _check(shape, dtype, causal, backend="mosaic", sinks=True)


@hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mosaic_gradients_are_bitwise_deterministic_and_finite_at_16k(head_dim):
  # head_dim 64: one kernel adds every K/V tile's dQ, in a fixed order.
  q, k, v, dout = random_inputs(5, 1, 16384, 16384, 4, head_dim, jnp.bfloat16)
  first = _flash_jit(q, k, v, dout, None, None, None, None, True, None, None, 0.0, "mosaic")
  second = _flash_jit(q, k, v, dout, None, None, None, None, True, None, None, 0.0, "mosaic")
  for a, b in zip(first, second):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(a).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["in_place", "slots"])
def test_varlen(dtype, layout):
  """flash_attention_varlen at realistic lengths (an empty sequence, one
  with no keys, causal + window + sinks, GQA) against each sequence alone."""
  from conftest import cu_seqlens, varlen_reference_with_grads
  from jax_flash2 import flash_attention_varlen

  lens_q = (1000, 0, 3000, 517, 2048)
  lens_k = lens_q if layout == "in_place" else (1500, 0, 2000, 0, 2048)
  heads, kv_heads, head_dim = 8, 2, 128
  draw = np.random.default_rng(len(layout))
  q, dout = (jnp.asarray(draw.standard_normal((sum(lens_q), heads, head_dim)), dtype) for _ in range(2))
  k, v = (jnp.asarray(draw.standard_normal((sum(lens_k), kv_heads, head_dim)), dtype) for _ in range(2))
  dlse = jnp.asarray(draw.standard_normal((heads, sum(lens_q))), jnp.float32)
  sinks = jnp.asarray(np.log(1000.0) + draw.standard_normal(heads), jnp.float32)
  cu_q = cu_seqlens(lens_q)
  cu_k = cu_q if layout == "in_place" else cu_seqlens(lens_k)

  @jax.jit
  def run(q, k, v, sinks):
    f = lambda q, k, v, sinks: flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(700, None),
                                                      sinks=sinks, return_lse=True)
    (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
    return (out, lse, *vjp((dout, dlse)))

  _poison().block_until_ready()
  got = run(q, k, v, sinks)
  options = dict(causal=True, window=(700, None))
  want = varlen_reference_with_grads(q, k, v, dout, dlse, lens_q, lens_k, sinks=sinks, dtype=jnp.float32, **options)
  plain = varlen_reference_with_grads(q, k, v, dout, dlse, lens_q, lens_k, sinks=sinks.astype(dtype), dtype=dtype,
                                      **options)
  assert_within_plain_error(got, want, plain, dtype)


# The options the Mosaic kernels serve besides full and causal attention
# (issue 27), each alone and all together, at realistic sizes: (causal,
# window, softcap, ALiBi, ragged lengths (seq_q, seq_k) or None).
MOSAIC_OPTIONS = {
    "sliding": (True, (512, 0), None, False, None),
    "both_sides": (False, (300, 300), None, False, None),
    "left_only": (False, (1024, None), None, False, None),
    # seq_q > seq_k + right: the first rows see no key.
    "right_only_unseen_rows": (False, (None, 100), None, False, (4096, 3000)),
    "softcap": (True, None, 30.0, False, None),
    "alibi": (True, None, None, True, None),
    "all_ragged": (True, (700, 0), 20.0, True, (2500, 3100)),
}
# (batch, seq, heads, head_dim), GQA by 4: the bench's 16k tokens at d64 and
# d128, fewer at d256.
MOSAIC_OPTION_SHAPES = {64: (4, 4096, 8, 64), 128: (2, 4096, 8, 128), 256: (1, 4096, 4, 256)}


@hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", list(MOSAIC_OPTIONS))
def test_mosaic_options_match_reference(option, head_dim, dtype):
  """backend="mosaic" runs both passes on the Mosaic kernels (the two-kernel
  backward at head_dim 64), within 2x (3x for gradients) the error of the
  plain math in the input dtype against float32."""
  causal, window, softcap, alibi, lengths = MOSAIC_OPTIONS[option]
  batch, seq, heads, _ = MOSAIC_OPTION_SHAPES[head_dim]
  seq_q, seq_k = lengths or (seq, seq)
  shape = (batch, seq_q, seq_k, heads, head_dim)
  slopes = 2.0 ** -jnp.arange(1, heads + 1, dtype=jnp.float32) if alibi else None
  q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_k, heads // 4, head_dim), dtype)
  planned = plan(q, kv, kv, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                 backend="mosaic")
  assert (planned.forward.backend, planned.backward.backend) == ("mosaic", "mosaic")
  _check(shape, dtype, causal, kv_heads=heads // 4, window=window, softcap=softcap, slopes=slopes,
         backend="mosaic")


@hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal, window", [(True, None), (False, (512, 256))], ids=["causal", "window"])
def test_mosaic_segment_ids_match_reference(causal, window, head_dim, dtype):
  """Packed sequences (8 runs of random lengths a row) on backend="mosaic":
  both passes on the Mosaic kernels, within 2x (3x for gradients) the error
  of the plain math in the input dtype."""
  batch, seq, heads, _ = MOSAIC_OPTION_SHAPES[head_dim]
  rng = np.random.default_rng(head_dim)
  cuts = [np.sort(rng.choice(np.arange(1, seq), 7, replace=False)) for _ in range(batch)]
  ids = jnp.asarray(np.stack([np.searchsorted(c, np.arange(seq), side="right") for c in cuts]), jnp.int32)
  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq, heads // 4, head_dim), dtype)
  planned = plan(q, kv, kv, causal=causal, window_size=window, q_segment_ids=ids, kv_segment_ids=ids,
                 backend="mosaic")
  assert (planned.forward.backend, planned.backward.backend) == ("mosaic", "mosaic")
  _check((batch, seq, seq, heads, head_dim), dtype, causal, kv_heads=heads // 4, window=window,
         segment_ids=(ids, ids), backend="mosaic")
