"""Shared test helpers: random inputs, the float64 reference, error metrics."""

from __future__ import annotations

import os

# Eight host devices for the sharding tests' meshes on CPU. Read when jax
# creates its CPU backend, so it must come before jax is imported; a caller's
# own XLA_FLAGS win.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash2 import reference

# The CPU suite compares against a float64 reference.
jax.config.update("jax_enable_x64", True)


def has_supported_gpu() -> bool:
  try:
    device = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  major = int(str(getattr(device, "compute_capability", "0.0")).split(".")[0])
  return major >= 8


def pytest_collection_modifyitems(config, items):
  if has_supported_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU of compute capability >= 8.0")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def random_inputs(seed: int, batch, seq_q, seq_k, heads, head_dim, dtype=jnp.float32):
  """Fresh normal q, k, v and a random output cotangent dout."""
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (batch, seq_q, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (batch, seq_k, heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (batch, seq_k, heads, head_dim), jnp.float32).astype(dtype)
  dout = jax.random.normal(kd, (batch, seq_q, heads, head_dim), jnp.float32).astype(dtype)
  return q, k, v, dout


def rel_err(x, ref, floor: float = 0.0) -> float:
  """||x - ref|| / max(||ref||, floor), in float64; inf on any NaN or misplaced inf.

  `floor` puts a gradient that vanishes exactly (one visible key: softmax is
  constant) on the scale of its cotangent instead of dividing by ~0.
  """
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float64), np.float64)
  if not np.all(np.isfinite(x) | ~np.isfinite(ref)):
    return float("inf")
  finite = np.isfinite(ref)
  if not np.array_equal(np.isfinite(x), finite) or not np.array_equal(x[~finite], ref[~finite]):
    return float("inf")
  diff = np.linalg.norm(x[finite] - ref[finite])
  return float(diff / max(np.linalg.norm(ref[finite]), floor, 1e-30))


def reference_with_grads(
    q, k, v, dout, dlse=None, *, mask=None, causal=False, window=(None, None), softcap=None,
    alibi_slopes=None, segment_ids=None, softmax_scale=None, dropout=None, dtype=jnp.float64,
):
  """(out, lse, dq, dk, dv) of the plain-jnp reference, all arithmetic in `dtype`.

  dropout: None, or (rate, int32 [2] seed, broadcast)."""
  if dlse is None:
    dlse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
  rate, seed, broadcast = dropout if dropout is not None else (0.0, None, False)
  return _reference_with_grads(
      q, k, v, dout, dlse, mask, alibi_slopes, segment_ids, seed, causal, tuple(window), softcap, softmax_scale,
      jnp.dtype(dtype), rate, broadcast,
  )


@functools.partial(jax.jit, static_argnums=tuple(range(9, 16)))
def _reference_with_grads(
    q, k, v, dout, dlse, mask, alibi_slopes, segment_ids, seed, causal, window, softcap, softmax_scale, dtype,
    rate, broadcast,
):
  q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
  # Jitted: op-by-op dispatch of the reference at GPU test sizes compiled every
  # op for every shape, which dominated the GPU suite's time.
  args = [x.astype(dtype) for x in (q, k, v)]
  (out, lse), vjp = jax.vjp(
      lambda q, k, v: reference.attention(
          q, k, v, mask=mask, causal=causal, window_size=window, softcap=softcap,
          alibi_slopes=alibi_slopes, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
          softmax_scale=softmax_scale, dropout_rate=rate, dropout_seed=seed, dropout_broadcast=broadcast,
          compute_dtype=dtype,
      ),
      *args,
  )
  dq, dk, dv = vjp((dout.astype(dtype), dlse.astype(lse.dtype)))
  return out, lse, dq, dk, dv


def assert_matches_reference(got, want, dout, tol: float = 1e-5) -> None:
  """(out, lse, dq, dk, dv) against the reference: relative error under tol,
  gradients with a floor of 0.1 * ||dout|| (see rel_err)."""
  floor = 0.1 * float(jnp.linalg.norm(dout))
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    assert x.shape == ref.shape, name
    err = rel_err(x, ref, floor=floor if name.startswith("d") else 0.0)
    assert err < tol, f"{name}: relative error {err:.3g}"
