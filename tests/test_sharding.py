"""The kernels under SPMD: jit with batch/head-sharded operands (custom
partitioning: per-shard kernels, no all-gather), shard_map and pmap; then
flash_decode under sharded jit.

On CPU the mesh is made of host devices (conftest sets
--xla_force_host_platform_device_count=8 before jax is imported) and the
kernels run in interpret mode. Each test also has a `gpu`-marked variant that
runs the compiled kernels on the GPUs (skipped without an NVIDIA GPU of compute
capability >= 8.0, and without enough GPUs for the mesh).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import decode_inputs, decode_reference, random_inputs, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention, flash_decode
from jax_flash2 import sharding as flash_sharding
from jax_flash2.api import check_problem
from jax_flash2.backends import DecodeCall, PassPlan
from jax_flash2.problem import DecodeProblem

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
MODES = [
    pytest.param(dict(interpret=True, block_sizes=SMALL), id="interpret"),
    pytest.param(dict(backend="triton"), id="gpu", marks=pytest.mark.gpu),
]
COLLECTIVES = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute")
QKV = P("data", None, "model", None)  # batch over "data", heads over "model"


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
  """A ("data", "model") mesh of this shape, halved along its larger axis
  until the devices suffice (a GPU host may have fewer than the CPU suite's
  eight; batch and heads are 4 so that every such mesh divides them). On a
  one-GPU host that is a 1x1 mesh: it still compiles the partitioned path."""
  devices = jax.devices()
  while math.prod(shape) > len(devices):
    shape = (shape[0] // 2, shape[1]) if shape[0] >= shape[1] else (shape[0], shape[1] // 2)
  # Auto axes: shardings come from in_shardings and propagation (the default
  # jax.make_mesh axes are Explicit, which shard_map below cannot take).
  return jax.make_mesh(shape, ("data", "model"), (AxisType.Auto,) * 2, devices=devices[: math.prod(shape)])


def _inputs(batch=4, heads=4, kv_heads=None, seq=16, seed=0):
  q, _, _, dout = random_inputs(seed, batch, seq, seq, heads, 16)
  _, k, v, _ = random_inputs(seed + 1, batch, seq, seq, kv_heads or heads, 16)
  return q, k, v, dout


def _out_and_grads(kernel: dict, causal=True):
  """f(q, k, v, dout, mask) -> (out, dq, dk, dv) through flash_attention."""

  def f(q, k, v, dout, mask):
    attend = lambda q, k, v: flash_attention(q, k, v, mask=mask, causal=causal, **kernel)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))

  return f


def _compile(f, args, shardings):
  """(outputs, optimized HLO text) of f jitted with in_shardings."""
  compiled = jax.jit(f, in_shardings=shardings).lower(*args).compile()
  return compiled(*jax.device_put(args, shardings)), compiled.as_text()


def _mask(shape, seed=2):
  return jax.random.bernoulli(jax.random.PRNGKey(seed), 0.7, shape)


# mesh, batch, heads, kv_heads, mask shape (None: no mask)
CASES = {
    "mha": ((2, 4), 4, 4, None, None),
    "mask_per_head": ((2, 4), 4, 4, None, (4, 4, 16, 16)),
    "mask_broadcast": ((4, 2), 4, 4, None, (1, 1, 16, 16)),
    "mask_batch_only": ((2, 4), 4, 4, None, (4, 1, 16, 16)),
    "gqa": ((4, 2), 4, 4, 2, None),
}


@pytest.mark.parametrize("kernel", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_jit_sharded_runs_per_shard_without_all_gather(case, kernel):
  mesh_shape, batch, heads, kv_heads, mask_shape = CASES[case]
  mesh = _mesh(mesh_shape)
  q, k, v, dout = _inputs(batch, heads, kv_heads)
  mask = None if mask_shape is None else _mask(mask_shape)
  qkv = NamedSharding(mesh, QKV)
  mask_sharding = None
  if mask is not None:
    mask_sharding = NamedSharding(mesh, P(*(a if n > 1 else None for a, n in zip(("data", "model"), mask_shape))))
  f = _out_and_grads(kernel)

  got, hlo = _compile(f, (q, k, v, dout, mask), (qkv, qkv, qkv, qkv, mask_sharding))

  if mesh.size > 1:  # a 1x1 mesh (one GPU) checks the values only
    assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
    # Nothing of the global q shape is left: the kernels ran on shards.
    assert f"f32[{','.join(map(str, q.shape))}]" not in hlo
  want = jax.jit(f)(q, k, v, dout, mask)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, w) < 1e-5, name
    assert x.sharding.is_equivalent_to(qkv, 4), (name, x.sharding)


@pytest.mark.parametrize("kernel", MODES)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_per_head", "slopes_per_batch"])
def test_alibi_slopes_shard_with_the_heads(per_batch, kernel):
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  slopes = jax.random.uniform(jax.random.PRNGKey(3), (4, 4) if per_batch else (4,), jnp.float32, 0.1, 0.5)

  def f(q, k, v, dout, slopes):
    attend = lambda q, k, v: flash_attention(q, k, v, alibi_slopes=slopes, causal=True, **kernel)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))

  qkv = NamedSharding(mesh, QKV)
  slopes_sharding = NamedSharding(mesh, P("data", "model") if per_batch else P("model"))
  got, hlo = _compile(f, (q, k, v, dout, slopes), (qkv,) * 4 + (slopes_sharding,))
  assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
  want = jax.jit(f)(q, k, v, dout, slopes)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, w) < 1e-5, name


@pytest.mark.parametrize("kernel", MODES)
def test_segment_ids_shard_with_the_batch(kernel):
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  ids = jnp.repeat(jnp.array([[0, 1], [0, 0], [2, 3], [1, 1]], jnp.int32), 8, axis=1)  # [4, 16]

  def f(q, k, v, dout, ids):
    attend = lambda q, k, v: flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, causal=True, **kernel)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))

  qkv = NamedSharding(mesh, QKV)
  got, hlo = _compile(f, (q, k, v, dout, ids), (qkv,) * 4 + (NamedSharding(mesh, P("data", None)),))
  assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
  want = jax.jit(f)(q, k, v, dout, ids)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, w) < 1e-5, name


@pytest.mark.parametrize("kernel", MODES)
def test_mqa_sums_dkv_over_head_shards(kernel):
  """One K/V head shared by query heads split over "model": the forward stays
  local, and dK/dV are all-reduced over "model" (the one collective)."""
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs(kv_heads=1)
  qkv, kv = NamedSharding(mesh, QKV), NamedSharding(mesh, P("data"))
  f = _out_and_grads(kernel)
  got, hlo = _compile(f, (q, k, v, dout, None), (qkv, kv, kv, qkv, None))
  if mesh.size > 1:  # a 1x1 mesh (one GPU) has nothing to reduce over
    assert set(COLLECTIVES.findall(hlo)) == {"all-reduce"}
  want = jax.jit(f)(q, k, v, dout, None)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, w) < 1e-5, name


def test_without_custom_partitioning_an_all_gather_appears(monkeypatch):
  """The check above can fail: with the forward kernel called bare (its
  custom_partitioning taken out), the same jit gathers the operands."""
  mesh = _mesh((2, 4))
  q, k, v, _ = _inputs()
  monkeypatch.setattr(flash_sharding, "_forward_partitioned", lambda *args: flash_sharding._forward_kernels(*args))
  f = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True, block_sizes=SMALL)
  qkv = NamedSharding(mesh, QKV)
  _, hlo = _compile(f, (q, k, v), (qkv,) * 3)
  assert "all-gather" in hlo


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_sharded_sequence_rides_the_ring(sinks):
  """A sequence split over a mesh axis stays split: the kernels run ring
  attention round that axis (jax_flash2.ring, contiguous layout), forward
  and backward, with collective-permutes and no all-gather, and give the
  unsharded answer; batch stays split over the other axis. (A ring of 2:
  test_ring.py has rings of 4 under shard_map.) With sinks the ring joins
  them to its merged output, and dsinks is summed over the shards (an
  all-reduce)."""
  mesh = _mesh((4, 2))
  q, k, v, dout = _inputs()
  sink = jax.random.normal(jax.random.PRNGKey(5), (4,), jnp.float32) + 1.0 if sinks else None

  def out_and_grads(kernel):
    def f(q, k, v, dout, sink):
      attend = lambda q, k, v, *sink: flash_attention(q, k, v, causal=True, sinks=sink[0] if sink else None, **kernel)
      out, vjp = jax.vjp(attend, q, k, v, *(() if sink is None else (sink,)))
      return (out, *vjp(dout))

    return f

  seq = NamedSharding(mesh, P("data", "model"))
  got, hlo = _compile(lambda q, k, v, dout, sink: out_and_grads(dict(interpret=True, block_sizes=SMALL))(
      q, k, v, dout, sink), (q, k, v, dout, sink), (seq,) * 4 + (None if sink is None else NamedSharding(mesh, P()),))
  assert "collective-permute" in hlo
  assert set(COLLECTIVES.findall(hlo)) == ({"collective-permute", "all-reduce"} if sinks else {"collective-permute"})
  want = out_and_grads(dict(backend="xla"))(q, k, v, dout, sink)
  for name, x, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    assert rel_err(x, w) < 1e-5, name


def test_only_problems_the_ring_serves_leave_the_sequence_split():
  """The rule lets seq_q and seq_k be split (one factor) only where the ring
  serves the problem; with a dense mask, a bias, ALiBi, dropout or seq_q !=
  seq_k they must be replicated: gathered, as test_sharded_sequence_outside_jit_is_gathered
  and the pre-ring suite checked. (Read off the rule, without compiling.)"""
  q = jax.ShapeDtypeStruct((2, 16, 4, 16), jnp.float32)
  rides = lambda **options: flash_sharding.rides_ring(check_problem(q, q, q, **options))
  assert rides(causal=True) and rides(window_size=(3, 0), softcap=5.0)
  assert not rides(mask=jnp.ones((16, 16), bool)) and not rides(bias=jnp.zeros((16, 16), jnp.float32))
  assert not rides(alibi_slopes=jnp.ones(4, jnp.float32)) and not rides(dropout_rate=0.1, dropout_rng=jax.random.key(0))
  assert not flash_sharding.rides_ring(check_problem(q, jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32),
                                                     jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32)))
  ring = flash_sharding._rule(["b i h d", "b i h d"], ["b i h d"], ring=True)[1]["need_replication_factors"]
  gathered = flash_sharding._rule(["b i h d", "b j h d"], ["b i h d"])[1]["need_replication_factors"]
  assert "i" not in ring and {"i", "j"} <= set(gathered)


@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic"])
def test_sharded_sequence_outside_jit_is_gathered(backend):
  """Outside jit too, on every backend: inputs whose sequence axis is
  sharded give the unsharded answer (the Triton kernels round the ring, the
  Mosaic interpreter, which is not partitioned, and XLA on gathered operands)."""
  mesh = _mesh((2, 4))
  dtype = jnp.bfloat16 if backend == "mosaic" else jnp.float32
  q, k, v = (x.astype(dtype) for x in _inputs(seq=128 if backend == "mosaic" else 32, heads=4)[:3])
  kwargs = dict(backend=backend) if backend == "xla" else dict(backend=backend, interpret=True)
  if backend == "triton":
    kwargs["block_sizes"] = SMALL
  seq = NamedSharding(mesh, P("data", "model"))
  got = flash_attention(*(jax.device_put(x, seq) for x in (q, k, v)), causal=True, **kwargs)
  want = flash_attention(q, k, v, causal=True, backend="xla")
  assert rel_err(got, want) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)


def test_explicit_mesh_axes_are_refused_with_advice():
  devices = jax.devices()[:2]
  mesh = jax.make_mesh((2,), ("x",), (AxisType.Explicit,), devices=devices)
  q, k, v = _inputs(batch=2)[:3]
  sharded = [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in (q, k, v)]
  with pytest.raises(NotImplementedError, match=r"explicit mesh axes \['x'\].*AxisType.Auto"):
    flash_attention(*sharded, interpret=True, block_sizes=SMALL)


@pytest.mark.parametrize("kernel", MODES)
def test_vmap_inside_sharded_jit(kernel):
  """A vmapped axis is folded into the kernels' batch: still no all-gather."""
  mesh = _mesh((2, 4))
  q, k, v, _ = _inputs(batch=2)
  q, k, v = (x[:, None] for x in (q, k, v))  # [2, 1, seq, heads, d]
  spec = NamedSharding(mesh, P("data", None, None, "model", None))
  f = jax.vmap(lambda q, k, v: flash_attention(q, k, v, causal=True, **kernel))
  got, hlo = _compile(f, (q, k, v), (spec,) * 3)
  assert not COLLECTIVES.findall(hlo)
  assert got.sharding.is_equivalent_to(spec, 5)
  assert rel_err(got, jax.jit(f)(q, k, v)) < 1e-5


# ---------------------------------------------------------------- shard_map, pmap


def _check_vma(kernel: dict) -> bool:
  """shard_map's check_vma for a gradient through the kernels: on in the
  compiled (GPU) mode. In interpret mode Pallas's HLO interpreter pads
  varying blocks with an invariant value, which check_vma rejects
  (test_interpret_backward_under_check_vma pins that JAX limitation)."""
  return not kernel.get("interpret", False)


@pytest.mark.parametrize("kernel", MODES)
def test_shard_map_matches_unsharded(kernel):
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  f = _out_and_grads(kernel)
  per_shard = lambda q, k, v, dout: f(q, k, v, dout, None)
  mapped = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(QKV,) * 4, out_specs=(QKV,) * 4,
                                 check_vma=_check_vma(kernel)))
  got = mapped(q, k, v, dout)
  want = jax.jit(per_shard)(q, k, v, dout)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, w) < 1e-5, name

  # And the gradient taken outside the shard_map.
  attend = jax.shard_map(
      lambda q, k, v: flash_attention(q, k, v, causal=True, **kernel),
      mesh=mesh, in_specs=(QKV,) * 3, out_specs=QKV, check_vma=_check_vma(kernel),
  )
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * dout), argnums=(0, 1, 2)))(q, k, v)
  for name, x, w in zip(("dq", "dk", "dv"), grads, want[1:]):
    assert rel_err(x, w) < 1e-5, name


@pytest.mark.parametrize("kernel", MODES)
def test_shard_map_forward_under_check_vma(kernel):
  """The kernels' outputs vary over the mesh axes their inputs vary over
  (tiles.out_struct), so shard_map's default check_vma=True accepts them."""
  mesh = _mesh((2, 4))
  q, k, v, _ = _inputs()
  attend = lambda q, k, v: flash_attention(q, k, v, causal=True, **kernel)
  got = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(QKV,) * 3, out_specs=QKV))(q, k, v)
  assert rel_err(got, jax.jit(attend)(q, k, v)) < 1e-5


@pytest.mark.xfail(
    raises=ValueError, strict=True,
    reason="jax 0.11.2: Pallas's HLO interpreter pads varying blocks with an invariant value under check_vma",
)
def test_interpret_backward_under_check_vma():
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  attend = jax.shard_map(
      lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True, block_sizes=SMALL),
      mesh=mesh, in_specs=(QKV,) * 3, out_specs=QKV,
  )
  jax.jit(jax.grad(lambda q: jnp.sum(attend(q, k, v) * dout)))(q)


@pytest.mark.parametrize("kernel", MODES)
def test_pmap_over_a_leading_device_axis(kernel):
  n = min(2, jax.device_count())  # one device on a one-GPU host
  q, k, v, dout = _inputs(batch=2)
  f = _out_and_grads(kernel)
  per_device = lambda q, k, v, dout: f(q, k, v, dout, None)
  split = lambda x: x.reshape(n, 2 // n, *x.shape[1:])  # [devices, batch / devices, ...]
  got = jax.pmap(per_device)(*map(split, (q, k, v, dout)))
  want = jax.jit(per_device)(q, k, v, dout)
  for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(np.asarray(x).reshape(w.shape), w) < 1e-5, name


@pytest.mark.parametrize("kernel", MODES)
@pytest.mark.parametrize("bias_shape", [(4, 4, 16, 16), (1, 4, 16, 16)], ids=["per_problem", "shared_over_batch"])
def test_bias_and_its_gradient_shard_with_batch_and_heads(bias_shape, kernel):
  """The bias splits like q's batch and heads; dS is computed per shard and
  summed over the bias's broadcast batch axis outside the kernels (an
  all-reduce over "data" when the bias is shared over a sharded batch)."""
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  bias = jax.random.normal(jax.random.PRNGKey(4), bias_shape, jnp.float32)

  def f(q, k, v, dout, bias):
    attend = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, causal=True, **kernel)
    out, vjp = jax.vjp(attend, q, k, v, bias)
    return (out, *vjp(dout))

  qkv = NamedSharding(mesh, QKV)
  bias_spec = P("data" if bias_shape[0] > 1 else None, "model", None, None)
  got, hlo = _compile(f, (q, k, v, dout, bias), (qkv,) * 4 + (NamedSharding(mesh, bias_spec),))
  if mesh.size > 1:
    assert "all-gather" not in hlo
  want = jax.jit(f)(q, k, v, dout, bias)
  for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert rel_err(x, w) < 1e-5, name


@pytest.mark.parametrize("kernel", MODES)
def test_sinks_shard_with_the_heads(kernel):
  """The sinks enter the forward kernels' partitioned call split like the
  heads: no all-gather, and dsinks is summed over the batch shards (an
  all-reduce over "data")."""
  mesh = _mesh((2, 4))
  q, k, v, dout = _inputs()
  sinks = jax.random.normal(jax.random.PRNGKey(5), (4,), jnp.float32) + 2.0

  def f(q, k, v, dout, sinks):
    attend = lambda q, k, v, sinks: flash_attention(q, k, v, sinks=sinks, causal=True, **kernel)
    out, vjp = jax.vjp(attend, q, k, v, sinks)
    return (out, *vjp(dout))

  qkv = NamedSharding(mesh, QKV)
  got, hlo = _compile(f, (q, k, v, dout, sinks), (qkv,) * 4 + (NamedSharding(mesh, P("model")),))
  if mesh.size > 1:
    assert "all-gather" not in hlo
    assert f"f32[{','.join(map(str, q.shape))}]" not in hlo
  want = jax.jit(f)(q, k, v, dout, sinks)
  for name, x, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    assert rel_err(x, w) < 1e-5, name


# ---------------------------------------------------------------- flash_decode

DECODE_MODES = [
    pytest.param(dict(interpret=True), id="interpret"),
    pytest.param(dict(backend="triton"), id="gpu", marks=pytest.mark.gpu),
]
# batch, heads, kv_heads, page_size (None: contiguous), the caches' spec (q's is QKV)
DECODE_CASES = {
    # GQA 2:1: the K/V heads split with the query heads' groups.
    "gqa_contiguous": (4, 8, 4, None, QKV),
    # MQA, paged: the page pool is indexed by the block table, so it stays
    # whole on every batch shard, and its one K/V head serves each head shard.
    "mqa_paged_sinks": (4, 8, 1, 16, P()),
}


@pytest.mark.parametrize("kernel", DECODE_MODES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_sharded_runs_per_shard_without_all_gather(case, kernel):
  """flash_decode under jit with q, the caches, cache_seqlens (and the block
  table, the sinks) sharded over batch and heads: the kernel runs on shards
  of batch and heads, no collective, and equals the float64 reference to
  float32 rounding (as the unsharded call does, test_decode.py)."""
  batch, heads, kv_heads, page, cache_spec = DECODE_CASES[case]
  mesh = _mesh((2, 4))
  lens = [32, 0, 17, 5]
  q, kc, vc, table, seqlens, k, v = decode_inputs(9, batch, 1, heads, kv_heads, 16, 32, lens, page)
  sinks = jnp.asarray(np.random.default_rng(3).standard_normal(heads), jnp.float32) if page else None
  sharded = lambda spec: None if spec is None else NamedSharding(mesh, spec)
  shardings = (sharded(QKV), sharded(cache_spec), sharded(cache_spec),
               sharded(P("data")), sharded(P("data", None) if page else None), sharded(P("model") if page else None))
  f = lambda q, kc, vc, lens, table, sinks: flash_decode(q, kc, vc, lens, block_table=table, sinks=sinks,
                                                         return_lse=True, **kernel)
  (out, lse), hlo = _compile(f, (q, kc, vc, seqlens, table, sinks), shardings)
  if mesh.size > 1:
    assert not COLLECTIVES.findall(hlo), COLLECTIVES.findall(hlo)
    assert f"f32[{','.join(map(str, q.shape))}]" not in hlo
  want = decode_reference(q, k, v, seqlens, sinks=None if sinks is None else jnp.asarray(sinks, jnp.float64))
  for name, x, w in zip(("out", "lse"), (out, lse), want):
    assert rel_err(x, w) < 1e-5, name
  assert out.sharding.is_equivalent_to(shardings[0], 4)


def test_decode_shards_follow_the_cache():
  """The partition callback's choice, without compiling: q split over batch
  alone takes the cache's head split (moving q, not gathering the cache);
  a paged pool stays whole over batch; heads that would split a K/V group
  across shards are gathered; one mesh axis never splits both. (The host's
  CPU devices: a GPU host may have fewer GPUs than the mesh.)"""
  mesh = jax.make_mesh((2, 4), ("data", "model"), (AxisType.Auto,) * 2, devices=jax.devices("cpu")[:8])
  p = DecodeProblem(seq_q=1, head_dim=16, softmax_scale=0.25, dtype="float32", group=2)
  call = DecodeCall(p, PassPlan("triton"), interpret=True)
  arg = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
  lens = arg((4,), P("data"))

  def chosen(q_spec, cache_spec, kv_heads=4, paged=False):
    call_here = dataclasses.replace(call, problem=dataclasses.replace(
        p, group=8 // kv_heads, page_size=16 if paged else None, num_pages=8 if paged else None))
    cache = arg((8, 16, kv_heads, 16) if paged else (4, 32, kv_heads, 16), cache_spec)
    table = arg((4, 2), P("data")) if paged else None
    args = (arg((4, 1, 8, 16), q_spec), cache, cache, lens, table, None, None)
    _, _, _, shardings = flash_sharding._decode_partition(call_here, mesh, args, None)
    return tuple(tuple(s.spec) + (None,) * (4 - len(s.spec)) for s in shardings[:2])

  assert chosen(P("data"), P("data", None, "model")) == (tuple(QKV), tuple(QKV))
  assert chosen(QKV, P(), paged=True) == (tuple(QKV), (None, None, "model", None))
  assert chosen(QKV, P("data"), kv_heads=2) == (("data", None, None, None),) * 2  # 2 K/V heads over 4 shards
  assert chosen(P(None, None, "data"), P("data")) == (("data", None, None, None),) * 2


def test_decode_explicit_mesh_axes_are_refused():
  devices = jax.devices("cpu")[:2]
  mesh = jax.make_mesh((2,), ("x",), (AxisType.Explicit,), devices=devices)
  q, kc, vc, _, seqlens, _, _ = decode_inputs(1, 2, 1, 2, 1, 16, 16, [3, 16])
  with pytest.raises(NotImplementedError, match=r"k_cache is sharded over explicit mesh axes \['x'\]"):
    flash_decode(q, jax.device_put(kc, NamedSharding(mesh, P("x"))), vc, seqlens, interpret=True)
