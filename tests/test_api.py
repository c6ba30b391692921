"""The public API on CPU: argument errors, backend choice, and composition with
jit, vmap, checkpoint and grad (kernels in interpret mode)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention
from jax_flash2 import backends

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
KERNEL = dict(interpret=True, block_sizes=SMALL)


def _qkv(seq_q=24, seq_k=24, dtype=jnp.float32, seed=0):
  return random_inputs(seed, 2, seq_q, seq_k, 2, 16, dtype)[:3]


# ---------------------------------------------------------------- bad input


def _bad_input_cases():
  q, k, v = _qkv()
  f64 = q.astype(jnp.float64)
  yield "rank", (q[0], k, v), {}, ValueError, "q must have rank 4"
  yield "rank_k", (q, k[..., None], v), {}, ValueError, "k must have rank 4"
  yield "batch", (q, k[:1], v[:1]), {}, ValueError, "batch"
  yield "heads", (q[:, :, :1], k, v), {}, ValueError, "multiple of k/v's heads"
  yield "head_dim", (q, k[..., :8], v[..., :8]), {}, ValueError, "head_dim"
  yield "kv_seq", (q, k, v[:, :5]), {}, ValueError, "k and v must have the same shape"
  yield "dtype", (f64, f64, f64), {}, TypeError, "dtype float64"
  yield "int_dtype", (q.astype(jnp.int32), k, v), {}, TypeError, "q has dtype int32"
  yield "mixed_dtype", (q, k.astype(jnp.bfloat16), v), {}, TypeError, "share one dtype"
  yield "head_dim_12", (q[..., :12], k[..., :12], v[..., :12]), {}, ValueError, "multiple of 8"
  big = jnp.zeros((1, 4, 1, 264), jnp.float32)
  yield "head_dim_264", (big, big, big), {}, ValueError, "head_dim must be"
  yield "scale_zero", (q, k, v), {"softmax_scale": 0.0}, ValueError, "softmax_scale"
  yield "scale_neg", (q, k, v), {"softmax_scale": -1.0}, ValueError, "softmax_scale"
  yield "scale_nan", (q, k, v), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"
  yield "scale_str", (q, k, v), {"softmax_scale": "x"}, TypeError, "softmax_scale"
  yield "backend", (q, k, v), {"backend": "cuda"}, ValueError, "backend must be one of"
  yield "interpret_xla", (q, k, v), {"backend": "xla", "interpret": True}, ValueError, "interpret=True"
  yield "block_sizes", (q, k, v), {"block_sizes": (64, 64)}, TypeError, "block_sizes"
  yield "causal", (q, k, v), {"causal": "yes"}, TypeError, "causal"
  yield "not_array", ([[1.0]], k, v), {}, TypeError, "q must be an array"
  # Flags and numbers that are not what they claim: never read as truthy or as 1.0.
  for flag in ("return_lse", "interpret", "dropout_broadcast"):
    yield f"{flag}_str", (q, k, v), {flag: "no"}, TypeError, f"{flag} must be a bool"
  yield "scale_bool", (q, k, v), {"softmax_scale": True}, TypeError, "softmax_scale must be a float, got bool"
  yield "softcap_bool", (q, k, v), {"softcap": True}, TypeError, "softcap must be a float, got bool"
  yield "rate_bool", (q, k, v), {"dropout_rate": True}, TypeError, "dropout_rate must be a float, got bool"
  keys = jax.random.split(jax.random.key(0), 3)
  yield "rng_batch", (q, k, v), {"dropout_rate": 0.1, "dropout_rng": keys}, ValueError, r"dropout_rng must be a single PRNG key \(shape \(\)"
  raw = jax.random.split(jax.random.PRNGKey(0), 3)
  yield "rng_raw_batch", (q, k, v), {"dropout_rate": 0.1, "dropout_rng": raw}, ValueError, r"shape \(2,\) for a raw uint32 key\), got shape \(3, 2\)"
  yield "triton_without_gpu", (q, k, v), {"backend": "triton"}, ValueError, "backend='triton': the Triton kernels need an NVIDIA GPU"
  yield "mosaic_without_hopper", (q, k, v), {"backend": "mosaic"}, ValueError, "backend='mosaic': the Mosaic kernels need a Hopper GPU"


@pytest.mark.parametrize("args, kwargs, error, message", [c[1:] for c in _bad_input_cases()],
                         ids=[c[0] for c in _bad_input_cases()])
def test_bad_input_raises_naming_the_argument(args, kwargs, error, message):
  with pytest.raises(error, match=message):
    flash_attention(*args, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=16, block_k=16, num_warps=4.0), "num_warps must be an int"),
    (dict(block_q=16, block_k=16, num_stages=True), "num_stages must be an int"),
    (dict(block_q=24, block_k=16), "block_q must be a power of two"),
    (dict(block_q=8, block_k=16), "block_q must be a power of two >= 16"),
    (dict(block_q=16, block_k=16, num_warps=3), "num_warps"),
    (dict(block_q=16, block_k=16, num_stages=0), "num_stages"),
])
def test_kernel_config_validates(kwargs, message):
  with pytest.raises((TypeError, ValueError), match=message):
    KernelConfig(**kwargs)


def test_block_sizes_validates():
  with pytest.raises(TypeError, match="BlockSizes.dkv must be a KernelConfig"):
    BlockSizes(fwd=KernelConfig(16, 16), dkv=(16, 16), dq=KernelConfig(16, 16))


# ---------------------------------------------------------------- backends


def test_auto_backend_falls_back_to_xla_with_one_warning(monkeypatch):
  """Without a GPU, "auto" runs XLA and says so once per call site (Python's
  default filter), pointing at the caller's line, not at jax_flash2."""
  monkeypatch.setattr(backends, "default_compute_capability", lambda: None)
  q, k, v = _qkv()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(2):
      out = flash_attention(q, k, v)
  fallback = [w for w in caught if "not the flash kernel" in str(w.message)]
  assert len(fallback) == 1
  assert fallback[0].filename == __file__
  assert "no NVIDIA GPU" in str(fallback[0].message) and "plan()" in str(fallback[0].message)
  assert rel_err(out, reference_with_grads(q, k, v, q)[0]) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_xla_backend_matches_reference_with_grads(causal):
  q, k, v, dout = random_inputs(4, 1, 20, 30, 2, 16)
  f = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="xla", return_lse=True)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  got = (out, lse, *vjp((dout, jnp.zeros_like(lse))))
  want = reference_with_grads(q, k, v, dout, causal=causal)
  for x, ref in zip(got, want):
    assert rel_err(x, ref) < 1e-5


# ---------------------------------------------------------------- composition


def test_jit_matches_eager():
  q, k, v = _qkv(seq_q=20, seq_k=27)
  f = lambda q, k, v: flash_attention(q, k, v, causal=True, **KERNEL)
  np.testing.assert_array_equal(np.asarray(f(q, k, v)), np.asarray(jax.jit(f)(q, k, v)))


def test_vmap_over_a_leading_axis():
  q, k, v, _ = random_inputs(9, 3, 20, 20, 2, 16)  # batch axis 0 becomes the vmapped axis
  q, k, v = (x[:, None] for x in (q, k, v))  # [3, 1, seq, heads, d]
  f = lambda q, k, v: flash_attention(q, k, v, causal=True, **KERNEL)
  got = jax.vmap(f)(q, k, v)
  want = jnp.stack([reference_with_grads(q[i], k[i], v[i], q[i], causal=True)[0] for i in range(3)])
  assert rel_err(got, want) < 1e-5


def test_checkpoint_inside_grad():
  q, k, v, dout = random_inputs(3, 1, 24, 24, 2, 16)
  attn = lambda q, k, v: flash_attention(q, k, v, causal=True, **KERNEL)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * dout))
  plain = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(q, k, v)
  remat = jax.jit(jax.grad(loss(jax.checkpoint(attn)), argnums=(0, 1, 2)))(q, k, v)
  want = reference_with_grads(q, k, v, dout, causal=True)[2:]
  for p, r, w in zip(plain, remat, want):
    np.testing.assert_allclose(np.asarray(p), np.asarray(r), rtol=1e-6, atol=1e-6)
    assert rel_err(r, w) < 1e-5


def test_grad_through_a_two_layer_model():
  """Two attention layers with projections; gradients of the parameters match
  the same model built on the plain-jnp reference."""
  from jax_flash2 import reference

  d_model, heads, head_dim = 32, 2, 16
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {f"w{i}": jax.random.normal(keys[i], (d_model, 3 * heads * head_dim), jnp.float32) * 0.2 for i in range(2)}
  x = jax.random.normal(keys[4], (2, 18, d_model), jnp.float32)

  def model(params, x, attend):
    for i in range(2):
      qkv = (x @ params[f"w{i}"]).reshape(*x.shape[:2], 3, heads, head_dim)
      out = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
      x = x + out.reshape(*x.shape[:2], heads * head_dim)
    return jnp.mean(x**2)

  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, **KERNEL)
  ref = lambda q, k, v: reference.attention(q, k, v, causal=True)[0]
  loss, grads = jax.jit(jax.value_and_grad(model), static_argnums=2)(params, x, flash)
  params64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
  want_loss, want_grads = jax.jit(jax.value_and_grad(model), static_argnums=2)(params64, x.astype(jnp.float64), ref)
  assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
  for name in grads:
    assert rel_err(grads[name], want_grads[name]) < 1e-5, name
