"""Shared test helpers: random inputs, the float64 reference, error metrics."""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import pkgutil
import zlib


def _cuda_plugin_installed() -> bool:
  """Whether a jax CUDA plugin is installed (found without importing jax)."""
  if importlib.util.find_spec("jax_plugins") is None:
    return False
  import jax_plugins  # a namespace package: importing it imports no plugin

  return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__))


# Eight host devices for the sharding tests' meshes on CPU. Read when jax
# creates its CPU backend, so it must come before jax is imported; a caller's
# own XLA_FLAGS win.
_XLA_FLAGS = ["--xla_force_host_platform_device_count=8"]
if not _cuda_plugin_installed():
  # CPU only: most of the suite's time is XLA compiling the interpret-mode
  # kernels (big while-loop programs, run once or twice on tiny inputs), and
  # LLVM's optimisations cost far more compile time than they save in run
  # time. The tolerances are unchanged: float32 against float64 either way.
  # Left off where a GPU plugin is installed: the flags are global and would
  # slow the GPU suite's compiled programs.
  _XLA_FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(_XLA_FLAGS))

# One OpenBLAS thread for numpy. Mosaic's interpreter does each wgmma as a
# numpy matmul of one tile (64 x 64 to 64 x 256), from several Python threads
# at once (one per warpgroup), under two xdist workers on a 2-core machine:
# OpenBLAS's own threads (one per core, spinning while they wait) then only
# fight for the cores. Measured on the CI machine: a 64x128 @ 128x64 bf16
# tile 2.8 ms with OpenBLAS's threads, 0.08 ms with one; tests/
# test_mosaic_options.py at -n 2 took 131 s beside one busy process and 76 s
# with one thread (idle machine 58 s and 53 s). Read when numpy loads
# OpenBLAS, so before numpy is imported (nothing imports it before this file).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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


# Tests that share one expensive module-scoped fixture (or cached compile),
# by node id prefix: under pytest-xdist each group goes to one worker, so its
# fixture runs once rather than once per worker that gets one of its tests.
ONE_WORKER_GROUPS = {
    "tests/test_example.py::": "train_gpt runs",
    "tests/test_ring.py::test_p8_": "ring P = 8 programs",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """--dist load (what -n picks by default), except for ONE_WORKER_GROUPS:
  every other test is a scheduling unit of its own, handed out as workers
  free up. (xdist's own --dist loadgroup would do this with marks, but does
  not group anything under pytest 9.)"""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class OneWorkerGroups(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      for prefix, group in ONE_WORKER_GROUPS.items():
        if nodeid.startswith(prefix):
          return group
      return nodeid

  return OneWorkerGroups(config, log)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """A pytest-xdist worker's full garbage collection, before it reports
  that it has finished, and the heap frozen after it. Once the last worker
  has reported, the controller tears the workers down and execnet SIGINTs
  one still running 5 s later; pytest's unconfigure then ran full
  collections over the heap of a whole run (jax's caches: 0.6 s each after
  41 interpreter tests, growing with the run), the SIGINT landed in jax's gc
  callback, and the run printed a PytestUnraisableExceptionWarning with a
  KeyboardInterrupt. Frozen objects are skipped by those collections."""
  if hasattr(session.config, "workerinput"):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
  if has_supported_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU of compute capability >= 8.0")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def seed_of(name: str) -> int:
  """A test case's input seed from its name, the same in every process
  (Python's hash of a str is salted per process)."""
  return zlib.crc32(name.encode())


def random_inputs(seed: int, batch, seq_q, seq_k, heads, head_dim, dtype=jnp.float32):
  """Fresh standard normal q, k, v and a random output cotangent dout.

  Drawn by numpy: jax.random compiles its sampler anew for every shape, which
  cost about half a second per test on CPU."""
  rng = np.random.default_rng(seed)
  q_shape, kv_shape = (batch, seq_q, heads, head_dim), (batch, seq_k, heads, head_dim)
  return tuple(
      jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
      for shape in (q_shape, kv_shape, kv_shape, q_shape)
  )


def decode_inputs(seed, batch, seq_q, heads, kv_heads, head_dim, max_seq, lens, page_size=None, dtype=jnp.float32):
  """flash_decode's inputs on fresh random numbers: q, the kernel's k/v
  caches (poisoned with NaN where no key is valid: a kernel that reads one
  comes out NaN), the block table (None when contiguous), cache_seqlens, and
  the clean contiguous k/v caches for the reference. Paged: each sequence
  owns max_seq // page_size pages, shuffled over a pool with spare pages."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seq_q, heads, head_dim), np.float32)
  k, v = (rng.standard_normal((batch, max_seq, kv_heads, head_dim), np.float32) for _ in range(2))
  valid = np.arange(max_seq)[None, :] < np.asarray(lens)[:, None]
  k, v = (np.where(valid[:, :, None, None], x, 0.0).astype(np.float32) for x in (k, v))
  poisoned = [np.where(valid[:, :, None, None], x, np.nan).astype(np.float32) for x in (k, v)]
  table = None
  if page_size is not None:
    per_seq = max_seq // page_size
    pages = batch * per_seq + 3
    order = rng.permutation(pages)[:batch * per_seq].reshape(batch, per_seq)
    paged = []
    for x in poisoned:
      pool = np.full((pages, page_size, kv_heads, head_dim), np.nan, np.float32)
      pool[order.reshape(-1)] = x.reshape(batch * per_seq, page_size, kv_heads, head_dim)
      paged.append(pool)
    poisoned, table = paged, jnp.asarray(order, jnp.int32)
  as_jnp = lambda x: jnp.asarray(x).astype(dtype)
  return (as_jnp(q), *(as_jnp(x) for x in poisoned), table, jnp.asarray(lens, jnp.int32), as_jnp(k), as_jnp(v))


def decode_reference(q, k, v, lens, **options):
  """(out, lse) of reference.decode_attention in float64 over the clean
  caches (q, k, v are cast); array options (slopes, sinks, block_table) are
  operands of one jitted program, the rest static: op by op, the reference
  cost more than the interpret-mode kernel it checks."""
  arrays = {name: x for name, x in options.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((name, x) for name, x in options.items() if name not in arrays))
  return _decode_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), lens, arrays, static)


@functools.partial(jax.jit, static_argnums=(5,))
def _decode_reference(q, k, v, lens, arrays, static):
  return reference.decode_attention(q, k, v, lens, **arrays, **dict(static))


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
    alibi_slopes=None, segment_ids=None, bias=None, sinks=None, softmax_scale=None, dropout=None, dtype=jnp.float64,
):
  """(out, lse, dq, dk, dv) of the plain-jnp reference, all arithmetic in
  `dtype`, and dsinks after them when sinks are given (the bias takes no
  gradient here: test_bias.py checks dbias).

  dropout: None, or (rate, int32 [2] seed, broadcast)."""
  if dlse is None:
    dlse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
  rate, seed, broadcast = dropout if dropout is not None else (0.0, None, False)
  return _reference_with_grads(
      q, k, v, dout, dlse, mask, alibi_slopes, segment_ids, seed, bias, sinks, causal, tuple(window), softcap,
      softmax_scale, jnp.dtype(dtype), rate, broadcast,
  )


@functools.partial(jax.jit, static_argnums=tuple(range(11, 18)))
def _reference_with_grads(
    q, k, v, dout, dlse, mask, alibi_slopes, segment_ids, seed, bias, sinks, causal, window, softcap,
    softmax_scale, dtype, rate, broadcast,
):
  q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
  # Jitted: op-by-op dispatch of the reference at GPU test sizes compiled every
  # op for every shape, which dominated the GPU suite's time.
  args = [x.astype(dtype) for x in (q, k, v) + (() if sinks is None else (sinks,))]
  (out, lse), vjp = jax.vjp(
      lambda q, k, v, *sinks: reference.attention(
          q, k, v, mask=mask, causal=causal, window_size=window, softcap=softcap,
          alibi_slopes=alibi_slopes, q_segment_ids=q_ids, kv_segment_ids=kv_ids, bias=bias,
          sinks=sinks[0] if sinks else None,
          softmax_scale=softmax_scale, dropout_rate=rate, dropout_seed=seed, dropout_broadcast=broadcast,
          compute_dtype=dtype,
      ),
      *args,
  )
  return (out, lse, *vjp((dout.astype(dtype), dlse.astype(lse.dtype))))


def cu_seqlens(lens) -> jax.Array:
  """int32 [len(lens) + 1]: the offsets of sequences of these lengths packed end to end."""
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def varlen_reference_with_grads(q, k, v, dout, dlse, lens_q, lens_k, *, sinks=None, alibi_slopes=None,
                                dtype=jnp.float64, **options):
  """(out, lse, dq, dk, dv[, dsinks]) of flash_attention_varlen's inputs
  ([total, heads, head_dim]), each sequence through the plain reference on
  its own in `dtype`; rows of no sequence, and sequences with no key, see
  nothing.

  One reference call for all the sequences (one compile, not one per
  length): sequence s is batch row s, its queries and keys right-aligned in
  rows of the longest lengths, which keeps its band's bottom-right
  alignment and its ALiBi distances; kv segment ids hide the keys before it
  (its padded queries, whose cotangents are zero, may see them)."""
  heads = q.shape[1]
  max_q, max_k = max(max(lens_q), 1), max(max(lens_k), 1)
  cq, ck = np.asarray(cu_seqlens(lens_q)), np.asarray(cu_seqlens(lens_k))

  def slots(lens, starts, longest):
    """[n, longest] source rows of the padded layout and where they are real."""
    at = np.arange(longest)[None, :] - (longest - np.asarray(lens))[:, None]
    real = at >= 0
    return np.where(real, starts[:-1, None] + at, 0), real

  rows, real_q = slots(lens_q, cq, max_q)
  keys, real_k = slots(lens_k, ck, max_k)
  padded = lambda x, at, real: jnp.where(real[..., None, None], jnp.asarray(x)[at], 0)
  ids = (jnp.asarray(real_q, jnp.int32), jnp.asarray(real_k, jnp.int32))
  dlse_padded = jnp.where(real_q[:, None, :], jnp.asarray(dlse)[:, rows].transpose(1, 0, 2), 0)
  got = reference_with_grads(padded(q, rows, real_q), padded(k, keys, real_k), padded(v, keys, real_k),
                             padded(dout, rows, real_q), dlse_padded, segment_ids=ids, sinks=sinks,
                             alibi_slopes=alibi_slopes, dtype=dtype, **options)
  got = [np.asarray(x) for x in got]
  out, lse = np.zeros(q.shape), np.full((heads, q.shape[0]), -np.inf)
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  if sinks is not None:
    lse[:] = np.asarray(sinks, np.float64)[:, None]  # rows of no sequence
  out[rows[real_q]], dq[rows[real_q]] = got[0][real_q], got[2][real_q]
  lse[:, rows[real_q]] = got[1].transpose(1, 0, 2)[:, real_q]
  dk[keys[real_k]], dv[keys[real_k]] = got[3][real_k], got[4][real_k]
  return (out, lse, dq, dk, dv) + ((got[5],) if sinks is not None else ())


def flash_with_grads(q, k, v, dout, dlse=None, *, wrt=(), **kwargs):
  """(out, lse, dq, dk, dv) of flash_attention(q, k, v, return_lse=True,
  interpret=True, **kwargs) (interpret=False may override) with output cotangents (dout, dlse), then the
  gradients of the array arguments named in `wrt` (e.g. ("bias",)), in
  order. One jitted program: array arguments (mask, bias, slopes, segment
  ids, sinks, dropout key) are its operands, the rest static. Much cheaper
  to compile than the same calls op by op (the eager path keeps its own
  tests: test_api.test_jit_matches_eager, test_kernels.test_gradients_are_deterministic).

  dlse None means zeros."""
  if dlse is None:
    dlse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
  arrays = {name: x for name, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((name, x) for name, x in kwargs.items() if name not in arrays))
  return _flash_with_grads(q, k, v, dout, dlse, arrays, static, tuple(wrt))


@functools.partial(jax.jit, static_argnums=(6, 7))
def _flash_with_grads(q, k, v, dout, dlse, arrays, static, wrt):
  from jax_flash2 import flash_attention

  arrays = dict(arrays)
  differentiated = [arrays.pop(name) for name in wrt]

  def f(q, k, v, *differentiated):
    # interpret=True unless the static options say otherwise (backend="xla").
    options = {"interpret": True, **dict(static)}
    return flash_attention(q, k, v, return_lse=True, **arrays, **dict(zip(wrt, differentiated)), **options)

  (out, lse), vjp = jax.vjp(f, q, k, v, *differentiated)
  return (out, lse, *vjp((dout, dlse)))


def assert_within_plain_error(got, want, plain, dtype, *, limit: float | None = 1e-2,
                              names=("out", "lse", "dq", "dk", "dv", "dsinks"), out_factor: float = 2.0) -> None:
  """FlashAttention's test rule: against the higher-precision `want`, each of
  got's arrays errs at most 2x (outputs; `out_factor`) or 3x (gradients) as
  much as `plain`, the same math done plainly in `dtype`; and, with `limit`,
  under it relative."""
  for name, x, w, p in zip(names, got, want, plain):
    factor = out_factor if name in ("out", "lse") else 3.0
    err, plain_err = rel_err(x, w), rel_err(p, w)
    if limit is not None:
      assert err < limit, f"{name}: relative error {err:.3g}"
    assert err <= factor * plain_err, (
        f"{name}: error {err:.3g} > {factor} x plain {jnp.dtype(dtype).name} {plain_err:.3g}")


def assert_matches_reference(got, want, dout, tol: float = 1e-5) -> None:
  """(out, lse, dq, dk, dv) (and dsinks where given) against the reference:
  relative error under tol, gradients with a floor of 0.1 * ||dout|| (see
  rel_err)."""
  assert len(got) == len(want)
  floor = 0.1 * float(jnp.linalg.norm(dout))
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
    assert x.shape == ref.shape, name
    err = rel_err(x, ref, floor=floor if name.startswith("d") else 0.0)
    assert err < tol, f"{name}: relative error {err:.3g}"
