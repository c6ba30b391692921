"""flash_decode and write_kv_cache: the split-KV Triton kernel in interpret
mode against the float64 reference over the gathered cache (contiguous and
paged caches, ragged lengths, GQA/MQA, every option), the XLA path, split
counts, jit, vmap, the cache writes, no gradient, and the argument checks;
then the compiled kernel at realistic sizes (marker gpu). Sharded calls:
test_sharding.py.

Interpret mode poisons outputs (unwritten blocks read NaN, see
test_kernels.py); the caches are poisoned with NaN past each sequence's
length and in the pages no sequence owns, so a kernel that reads a key it
should skip comes out NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from conftest import assert_within_plain_error, decode_inputs, decode_reference, rel_err
from jax_flash2 import DecodeConfig, defaults, decode_plan, flash_decode, reference, write_kv_cache
from jax_flash2.problem import DecodeProblem
from jax_flash2.triton import decode as triton_decode


_reference = decode_reference


def _check(got, want, tol=1e-5):
  for name, x, ref in zip(("out", "lse"), got, want):
    assert x.shape == ref.shape, name
    err = rel_err(x, ref)
    assert err < tol, f"{name}: relative error {err:.3g}"


def _f64(x):
  return None if x is None else jnp.asarray(x, jnp.float64)


# (seq_q, heads, kv_heads, head_dim, max_seq, lens, page_size)
CASES = [
    (1, 16, 2, 64, 200, [0, 200, 37], None),  # GQA 8:1, one new token
    (4, 4, 1, 128, 96, [96, 5, 0, 64], None),  # MQA, speculative
    (4, 16, 2, 64, 128, [128, 0, 77], 16),  # paged, GQA 8:1
    (1, 4, 1, 128, 128, [65, 128], 32),  # paged, MQA
    (2, 6, 2, 80, 100, [100, 1, 50], None),  # group 3 and head_dim 80: padded rows and columns
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"sq{c[0]}-h{c[1]}:{c[2]}-d{c[3]}-page{c[6]}")
def test_matches_reference(case):
  seq_q, heads, kv_heads, head_dim, max_seq, lens, page_size = case
  q, kc, vc, table, seqlens, k, v = decode_inputs(len(lens), len(lens), seq_q, heads, kv_heads, head_dim, max_seq,
                                                  lens, page_size)
  got = flash_decode(q, kc, vc, seqlens, block_table=table, return_lse=True, interpret=True)
  _check(got, _reference(q, k, v, seqlens))


@pytest.mark.parametrize("paged", [False, True])
def test_window_softcap_alibi_sinks(paged):
  """Every option at once, seq_q 4, GQA 4:1: causal with a left window and
  sinks; softcap and ALiBi (per batch element) too."""
  lens = [0, 128, 50]
  q, kc, vc, table, seqlens, k, v = decode_inputs(7, 3, 4, 8, 2, 64, 128, lens, 16 if paged else None)
  rng = np.random.default_rng(1)
  slopes = jnp.asarray(rng.uniform(0.01, 0.3, (3, 8)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)
  options = dict(window_size=(20, None), softcap=3.0)
  got = flash_decode(q, kc, vc, seqlens, block_table=table, alibi_slopes=slopes, sinks=sinks, return_lse=True,
                     interpret=True, **options)
  want = _reference(q, k, v, seqlens, alibi_slopes=_f64(slopes), sinks=_f64(sinks), **options)
  _check(got, want)
  # The empty sequence: zeros, lse = the sink.
  np.testing.assert_array_equal(np.asarray(got[0][0]), 0.0)
  np.testing.assert_allclose(np.asarray(got[1][0]), np.broadcast_to(np.asarray(sinks)[:, None], (8, 4)))


def test_non_causal_window():
  """Without causal the new queries see the keys after their level one,
  up to a right window of 2 (and a left one of 9); head_dim 80, padded to
  128 inside."""
  q, kc, vc, table, seqlens, k, v = decode_inputs(3, 2, 4, 4, 4, 80, 64, [64, 30])
  options = dict(causal=False, window_size=(9, 2))
  _check(flash_decode(q, kc, vc, seqlens, return_lse=True, interpret=True, **options),
         _reference(q, k, v, seqlens, **options))


def test_splits_agree():
  """One split, several (37: the combine's chunks of 16 splits, the last
  one partial, and splits that see no key), and the default give the same
  result to rounding."""
  q, kc, vc, table, seqlens, k, v = decode_inputs(5, 2, 1, 8, 2, 64, 256, [256, 130], 32)
  runs = [flash_decode(q, kc, vc, seqlens, block_table=table, return_lse=True, interpret=True, num_splits=n)
          for n in (1, 5, 37, None)]
  want = _reference(q, k, v, seqlens)
  for got in runs:
    _check(got, want)
  for got in runs[1:]:
    for x, y in zip(got, runs[0]):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=2e-6)


def test_jit_matches_eager_and_xla():
  q, kc, vc, table, seqlens, k, v = decode_inputs(11, 2, 1, 4, 2, 64, 64, [3, 64], 16)
  eager = flash_decode(q, kc, vc, seqlens, block_table=table, return_lse=True, interpret=True)
  jitted = jax.jit(functools.partial(flash_decode, return_lse=True, interpret=True))(q, kc, vc, seqlens,
                                                                                        block_table=table)
  for x, y in zip(eager, jitted):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  # The XLA path, on the same poisoned paged cache.
  xla = flash_decode(q, kc, vc, seqlens, block_table=table, return_lse=True, backend="xla")
  _check(xla, _reference(q, k, v, seqlens))


def test_vmap_folds_into_batch():
  """jax.vmap over 2 independent problems, each with its own paged cache
  (the pools' pages renumbered into one), its own sinks and shared per-batch
  ALiBi slopes, equals each problem against the float64 reference (so the
  unbatched call, which test_matches_reference holds to the same)."""
  problems = [decode_inputs(20 + i, 2, 4, 4, 2, 16, 32, lens, 16) for i, lens in enumerate(([32, 0], [7, 20]))]
  q, kc, vc, table, seqlens, k, v = (jnp.stack(xs) for xs in zip(*problems))
  rng = np.random.default_rng(8)
  sinks = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0.1, 0.5, (2, 4)), jnp.float32)
  decode = lambda q, kc, vc, lens, table, sinks: flash_decode(q, kc, vc, lens, block_table=table, sinks=sinks,
                                                              alibi_slopes=slopes, return_lse=True, interpret=True)
  got = jax.jit(jax.vmap(decode))(q, kc, vc, seqlens, table, sinks)
  for i in range(2):
    want = _reference(q[i], k[i], v[i], seqlens[i], sinks=_f64(sinks[i]), alibi_slopes=_f64(slopes))
    _check([x[i] for x in got], want)


@pytest.mark.parametrize("paged", [False, True])
def test_write_kv_cache_round_trip(paged):
  """A prefill of ragged lengths, then two decode steps of 1 and 3 tokens,
  written by write_kv_cache (jitted, caches donated) and read back by
  flash_decode, equal the reference over the tokens laid end to end."""
  batch, kv_heads, heads, d, max_seq, page = 2, 1, 4, 64, 64, 16
  rng = np.random.default_rng(4)
  tokens = lambda n: [jnp.asarray(rng.standard_normal((batch, n, kv_heads, d)), jnp.float32) for _ in range(2)]
  if paged:
    pages = batch * max_seq // page + 2
    table = jnp.asarray(rng.permutation(pages)[:batch * max_seq // page].reshape(batch, -1), jnp.int32)
    shape = (pages, page, kv_heads, d)
  else:
    table, shape = None, (batch, max_seq, kv_heads, d)
  kc, vc = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)  # two buffers: both are donated
  write = jax.jit(write_kv_cache, donate_argnums=(0, 1))
  lens = jnp.asarray([0, 0], jnp.int32)
  k_all, v_all = np.zeros((batch, max_seq, kv_heads, d), np.float32), np.zeros((batch, max_seq, kv_heads, d),
                                                                                np.float32)
  for step, n in enumerate((8, 1, 3)):
    k_new, v_new = tokens(n)
    for b in range(batch):
      start = int(lens[b])
      k_all[b, start:start + n], v_all[b, start:start + n] = k_new[b], v_new[b]
    kc, vc, lens = write(kc, vc, k_new, v_new, lens, block_table=table)
    if step == 0:  # a ragged prefill: sequence 1 is 5 tokens longer
      extra_k, extra_v = tokens(5)
      k_all[1, 8:13], v_all[1, 8:13] = extra_k[1], extra_v[1]
      kc, vc, _ = write(kc, vc, extra_k, extra_v, lens, block_table=table)
      lens = lens.at[1].add(5)
  np.testing.assert_array_equal(np.asarray(lens), [12, 17])
  np.testing.assert_array_equal(np.asarray(reference.gather_cache(kc, table))[0, :12], k_all[0, :12])
  np.testing.assert_array_equal(np.asarray(reference.gather_cache(vc, table))[1, :17], v_all[1, :17])
  q = jnp.asarray(rng.standard_normal((batch, 3, heads, d)), jnp.float32)
  got = flash_decode(q, kc, vc, lens, block_table=table, return_lse=True, interpret=True)
  _check(got, _reference(q, jnp.asarray(k_all), jnp.asarray(v_all), lens))


def test_write_kv_cache_drops_past_capacity():
  kc = vc = jnp.zeros((1, 4, 1, 8), jnp.float32)
  new = jnp.ones((1, 3, 1, 8), jnp.float32)
  kc, vc, lens = write_kv_cache(kc, vc, new, new, jnp.asarray([2], jnp.int32))
  np.testing.assert_array_equal(np.asarray(kc[0, :, 0, 0]), [0, 0, 1, 1])
  assert int(lens[0]) == 5
  # flash_decode reads a length past the capacity as the capacity.
  q = jnp.ones((1, 1, 2, 8), jnp.float32)
  np.testing.assert_array_equal(np.asarray(flash_decode(q, kc, vc, lens, backend="xla")),
                                np.asarray(flash_decode(q, kc, vc, jnp.asarray([4], jnp.int32), backend="xla")))


def test_grad_raises():
  q, kc, vc, table, seqlens, k, v = decode_inputs(2, 1, 1, 2, 1, 16, 32, [20])
  f = lambda q: flash_decode(q, kc, vc, seqlens, backend="xla").sum()
  with pytest.raises(TypeError, match="no gradient.*flash_attention"):
    jax.grad(f)(q)


def test_auto_backend_and_plan():
  q, kc, vc, table, seqlens, _, _ = decode_inputs(2, 8, 1, 8, 1, 64, 8192, [1] * 8)
  if jax.devices()[0].platform != "gpu":
    with pytest.warns(RuntimeWarning, match="flash_decode runs the plain XLA"):
      flash_decode(q[:1, :, :, :], kc[:1, :64], vc[:1, :64], seqlens[:1])
    assert decode_plan(q, kc, vc, seqlens).backend == "xla"
    with pytest.raises(ValueError, match="backend='triton'.*interpret=True"):
      flash_decode(q, kc, vc, seqlens, backend="triton")
  # An H200: two waves of 132 SMs over 8 sequences of one K/V head: 33 splits.
  plan = decode_plan(q, kc, vc, seqlens, compute_capability=(9, 0), sm_count=132)
  assert (plan.backend, plan.config.num_splits, plan.config.block_k) == ("triton", 33, 64)
  assert plan.config.num_stages == defaults.DECODE_STAGES
  assert decode_plan(q, kc, vc, seqlens, compute_capability=(9, 0), num_splits=2).config.num_splits == 2
  assert defaults.decode_splits(132, 64, 8, 128) == 1
  assert defaults.decode_splits(132, 8, 4, 128) == 9
  assert defaults.decode_splits(132, 1, 1, 4) == 4
  assert defaults.decode_block_k(48) == 16
  with pytest.raises(ValueError, match="DecodeConfig.block_k"):
    DecodeConfig(block_k=24, num_splits=1)
  with pytest.raises(ValueError, match="no Mosaic kernel"):
    decode_plan(q, kc, vc, seqlens, backend="mosaic")


def test_bad_inputs_name_the_argument():
  q, kc, vc, table, seqlens, _, _ = decode_inputs(2, 2, 1, 4, 2, 64, 64, [3, 5], 16)
  call = functools.partial(flash_decode, interpret=True)
  cases = [
      (dict(q=q[0]), ValueError, "q must have shape"),
      (dict(k_cache=kc[..., :32]), ValueError, "k_cache and v_cache"),
      (dict(k_cache=kc[..., :32], v_cache=vc[..., :32]), ValueError, "head_dim"),
      (dict(q=q[:, :, :3]), ValueError, "multiple of the cache's kv_heads"),
      (dict(q=q.astype(jnp.bfloat16)), TypeError, "share one dtype"),
      (dict(cache_seqlens=seqlens[:1]), ValueError, r"cache_seqlens must have shape \[batch\] = \(2,\)"),
      (dict(cache_seqlens=seqlens.astype(jnp.float32)), TypeError, "cache_seqlens must hold integers"),
      (dict(block_table=table[:1]), ValueError, "block_table must have shape"),
      (dict(block_table=table.astype(jnp.float32)), TypeError, "block_table must hold integers"),
      (dict(k_cache=kc[:, :8], v_cache=vc[:, :8]), ValueError, "page_size .* multiple of 16"),
      (dict(block_table=None), ValueError, "k_cache's batch"),
      (dict(num_splits=0), ValueError, "num_splits must be a positive int"),
      (dict(num_splits=2.0), ValueError, "num_splits"),
      (dict(window_size=(-1, None)), ValueError, "window_size"),
      (dict(softcap=-1.0), ValueError, "softcap"),
      (dict(alibi_slopes=jnp.ones(3)), ValueError, "alibi_slopes"),
      (dict(sinks=jnp.ones(2)), ValueError, "sinks"),
      (dict(backend="cudnn"), ValueError, "backend must be one of"),
      (dict(causal=1), TypeError, "causal must be a bool"),
      (dict(return_lse="no"), TypeError, "return_lse must be a bool"),
  ]
  for change, error, match in cases:
    args = {**dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, block_table=table), **change}
    with pytest.raises(error, match=match):
      call(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args)
  new = jnp.ones((2, 1, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="k_new"):
    write_kv_cache(kc, vc, new[..., :32], new, seqlens, block_table=table)
  with pytest.raises(ValueError, match="cache_seqlens"):
    write_kv_cache(kc, vc, new, new, seqlens[:1], block_table=table)


@pytest.mark.parametrize("paged", [False, True])
def test_kernel_lowers_for_an_h200(paged):
  """The split and combine kernels through the Pallas Triton lowering for an
  H200 target, on any host: the block-table and length loads, the gathers
  of q and the per-head values, the bounds' integer arithmetic and every
  option must lower (interpret mode checks none of that)."""
  batch, seq_q, heads, kv_heads, d = 3, 4, 16, 2, 128
  p = DecodeProblem(seq_q=seq_q, head_dim=d, softmax_scale=0.1, dtype="bfloat16", group=heads // kv_heads,
                    window_left=100, window_right=0, softcap=20.0, has_alibi=True,
                    page_size=32 if paged else None, num_pages=40 if paged else None)
  cache = (40, 32, kv_heads, d) if paged else (batch, 1000, kv_heads, d)
  args = (jax.ShapeDtypeStruct((batch, seq_q, heads, d), jnp.bfloat16),
          *(jax.ShapeDtypeStruct(cache, jnp.bfloat16),) * 2, jax.ShapeDtypeStruct((batch,), jnp.int32),
          jax.ShapeDtypeStruct((batch, 12), jnp.int32) if paged else None,
          jax.ShapeDtypeStruct((1, heads), jnp.float32))
  config = defaults.decode_config(p.page_size, 132, batch=batch, kv_heads=kv_heads, max_seq=1000)

  def run(q, k, v, lens, table, slopes):
    parts, lse = triton_decode.decode(q, k, v, lens, table, slopes, p, config)
    return triton_decode.combine(parts, lse, slopes[0], p, heads=heads, dtype=q.dtype)

  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
    lowered = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))
  assert "flash2_decode" in lowered.as_text() and "flash2_decode_combine" in lowered.as_text()


# ---------------------------------------------------------------- on a GPU: the 2x rule


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [
    # (batch, seq_q, heads, kv_heads, head_dim, max_seq, page_size)
    (8, 1, 32, 4, 128, 8192, None),
    (8, 4, 32, 4, 128, 8192, 256),
    (1, 1, 64, 8, 64, 32768, 64),
])
def test_gpu_matches_reference(shape, dtype):
  """The compiled kernel's error, against float32, at most 2x that of the
  same math done plainly in the input dtype, and under 1e-2; ragged lengths
  (one full, one empty), sinks, and with seq_q 4 a causal window; the
  default num_splits (the GPU's SM count)."""
  batch, seq_q, heads, kv_heads, head_dim, max_seq, page = shape
  lens = np.random.default_rng(batch).integers(1, max_seq, batch)
  lens[0] = max_seq
  if batch > 1:
    lens[1] = 0
  q, kc, vc, table, seqlens, k, v = decode_inputs(batch + max_seq, batch, seq_q, heads, kv_heads, head_dim, max_seq,
                                            lens, page, dtype)
  # Around log(length): the sink takes a sizeable share of each row.
  sinks = jnp.asarray(np.log(max_seq) + np.random.default_rng(0).standard_normal(heads), jnp.float32)
  options = dict(window_size=(4000, None)) if seq_q > 1 else {}
  _poison().block_until_ready()
  got = jax.jit(functools.partial(flash_decode, return_lse=True, backend="triton", **options))(
      q, kc, vc, seqlens, block_table=table, sinks=sinks)
  want = reference.decode_attention(*(x.astype(jnp.float32) for x in (q, k, v)), seqlens, sinks=sinks,
                                    compute_dtype=jnp.float32, **options)
  plain = reference.decode_attention(q, k, v, seqlens, sinks=sinks.astype(dtype), compute_dtype=dtype, **options)
  assert_within_plain_error(got, want, plain, dtype)


@jax.jit
def _poison():
  # Fill and free a large buffer with NaN first, so that an output block the
  # kernel never writes is likely to read NaN rather than stale zeros.
  return jnp.full((1 << 28,), jnp.nan, jnp.float32)
