"""ring_attention: the sequence split over a mesh axis of host devices.

Each case runs ring_attention inside shard_map on P = 2, 4 or 8 of
conftest's 8 host devices, with its forward and backward in one jitted
program, and compares out, lse, dq, dk, dv (and dsinks) of the unpermuted
sequence with the float64 reference, under random output cotangents (dout
and dlse).
Most cases run the steps on plain XLA (the ring's logic: layouts, masks from
true positions, skipped and unmasked steps, the backward ring, allgather);
one runs the Triton kernels in interpret mode.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from conftest import assert_within_plain_error, random_inputs, reference_with_grads, rel_err
from jax_flash2 import RingLayout, RingStrategy, flash_attention, ring_attention, zigzag_order
from jax_flash2 import ring_steps as ring_lib
from jax_flash2.api import check_problem
from jax_flash2.backends import Backend, Device

AXIS = "sp"
SEQ = P(None, AXIS)  # [batch, seq, ...] split over the ring
ROWS = P(None, None, AXIS)  # lse-like [batch, heads, seq]


def _mesh(num_devices: int) -> jax.sharding.Mesh:
  return jax.make_mesh((num_devices,), (AXIS,), (AxisType.Auto,), devices=jax.devices()[:num_devices])


def _inputs(seq, heads, kv_heads, *, segments=False, sinks=False, seed=0, batch=2, head_dim=16):
  q, _, _, dout = random_inputs(seed, batch, seq, seq, heads, head_dim)
  _, k, v, _ = random_inputs(seed + 1, batch, seq, seq, kv_heads, head_dim)
  rng = np.random.default_rng(seed + 2)
  dlse = jnp.asarray(rng.standard_normal((batch, heads, seq)), jnp.float32)
  # Packed documents: sorted ids, some crossing the shards' boundaries.
  ids = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq)), axis=1), jnp.int32) if segments else None
  sink = jnp.asarray(rng.standard_normal(heads), jnp.float32) if sinks else None
  return q, k, v, dout, dlse, ids, sink


def _ring_program(num_devices, *, segments, sinks, check_vma=True, **options):
  """jit(shard_map) of (out, lse, dq, dk, dv, dsinks) of ring_attention on
  the layout-ordered sequence."""

  def local(q, k, v, dout, dlse, ids, sink):
    attend = lambda q, k, v, sink: ring_attention(q, k, v, axis_name=AXIS, q_segment_ids=ids, kv_segment_ids=ids,
                                                  sinks=sink, return_lse=True, **options)
    (out, lse), pullback = jax.vjp(attend, q, k, v, sink)
    dq, dk, dv, dsink = pullback((dout, dlse))
    if sink is not None and not check_vma:
      # Without check_vma a vjp inside the body gives each device's share of
      # an invariant input's gradient (shard_map's own transpose sums them).
      dsink = jax.lax.psum(dsink, AXIS)
    return out, lse, dq, dk, dv, dsink

  specs = (SEQ, SEQ, SEQ, SEQ, ROWS, SEQ if segments else P(), P())
  return jax.jit(jax.shard_map(local, mesh=_mesh(num_devices), in_specs=specs,
                               out_specs=(SEQ, ROWS, SEQ, SEQ, SEQ, P()), check_vma=check_vma))


@functools.cache
def _compiled_ring(num_devices, args_shapes, *, segments, sinks, check_vma, **options):
  """_ring_program compiled for arguments of these ShapeDtypeStructs, once
  per process: the P = 8 cases and the memory test share one compile."""
  program = _ring_program(num_devices, segments=segments, sinks=sinks, check_vma=check_vma, **options)
  return program.lower(*args_shapes).compile()


def _shapes(*args) -> tuple:
  return tuple(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)


def _check_ring(num_devices, *, seq=32, heads=2, kv_heads=2, batch=2, head_dim=16, segments=False, sinks=False,
                causal=False, window_size=None, layout="contiguous", dtype=jnp.float32, check_vma=True, **options):
  """The ring's results, back in sequence order, against the float64
  reference (float32 inputs: relative error under 1e-5; bf16: within 2x/3x
  of the plain bf16 math's error); returns the compiled program's HLO text."""
  q, k, v, dout, dlse, ids, sink = _inputs(seq, heads, kv_heads, segments=segments, sinks=sinks, batch=batch,
                                           head_dim=head_dim)
  q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
  mask = dict(causal=causal, window=window_size or (None, None), segment_ids=None if ids is None else (ids, ids),
              sinks=sink)
  want = reference_with_grads(q, k, v, dout, dlse, **mask)
  if RingLayout(layout) is RingLayout.ZIGZAG:
    perm, inverse = zigzag_order(seq, num_devices)
  else:
    perm = inverse = np.arange(seq)
  along = lambda x, axis=1: None if x is None else jnp.take(x, perm, axis=axis)
  args = (along(q), along(k), along(v), along(dout), along(dlse, 2), along(ids), sink)
  program = _compiled_ring(num_devices, _shapes(*args), segments=segments, sinks=sinks, check_vma=check_vma,
                           causal=causal, window_size=window_size, layout=layout, **options)
  got = program(*args)
  out, lse, dq, dk, dv, dsinks = got
  back = lambda x, axis=1: jnp.take(x, inverse, axis=axis)
  results = [back(out), back(lse, 2), back(dq), back(dk), back(dv)] + ([dsinks] if sinks else [])
  if dtype == jnp.float32:
    floor = 0.1 * float(jnp.linalg.norm(dout))
    for name, x, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), results, want):
      err = rel_err(x, w, floor=floor if name.startswith("d") else 0.0)
      assert err < 1e-5, f"{name}: relative error {err:.3g}"
  else:
    assert_within_plain_error(results, want, reference_with_grads(q, k, v, dout, dlse, dtype=dtype, **mask), dtype)
  # Deterministic: the same program gives the same bits again.
  for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, program(*args)):
    assert np.array_equal(np.asarray(x), np.asarray(y)), f"{name} differs between two runs"
  return program.as_text()


# ---------------------------------------------------------------- against the reference (steps on XLA)

CASES = {
    # P, layout, causal, window, heads, kv_heads, segments, sinks, strategy, dtype
    "p4-zigzag-causal-gqa": (4, "zigzag", True, None, 4, 2, False, False, "ring", jnp.float32),
    # Offset chunks cut by both sides of the band, the left one negative.
    "p2-zigzag-band": (2, "zigzag", False, (6, 2), 2, 2, False, False, "ring", jnp.float32),
    "p2-contiguous-causal-window-segments-bf16": (2, "contiguous", True, (20, None), 2, 2, True, False, "ring",
                                                  jnp.bfloat16),
    "p2-contiguous-allgather-mqa-segments-sinks": (2, "contiguous", True, None, 4, 1, True, True, "allgather",
                                                   jnp.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_ring_matches_reference(case):
  num_devices, layout, causal, window, heads, kv_heads, segments, sinks, strategy, dtype = CASES[case]
  _check_ring(num_devices, layout=layout, causal=causal, window_size=window, heads=heads, kv_heads=kv_heads,
              segments=segments, sinks=sinks, strategy=strategy, dtype=dtype, backend="xla")


# P = 8, one head of 8 over 1024 positions: 128 a device, so each step is
# small; the same programs give test_p8_memory_per_device its compiles.
P8 = dict(seq=1024, heads=1, kv_heads=1, batch=1, head_dim=8)
P8_CASES = {"zigzag-causal": ("zigzag", True), "contiguous-full": ("contiguous", False)}


@pytest.mark.parametrize("case", P8_CASES)
def test_p8_matches_reference(case):
  layout, causal = P8_CASES[case]
  _check_ring(8, layout=layout, causal=causal, backend="xla", **P8)


@pytest.mark.parametrize("case", P8_CASES)
def test_p8_memory_per_device(case):
  """Temp bytes per device of the P = 8 ring's forward + backward are at
  most 1/8 of the unsharded run's (the same flash_attention, forward +
  backward, on one device) plus the ring's buffers, counted as 16 local
  K/V shards in float32 (K, V and their hop in flight; dK, dV, the step's
  share and their hop; dQ and the running out; generous).

  On backend="xla" every step holds its [128, 128] scores, so the
  unsharded run's [1024, 1024] ones dominate its temp bytes (4 score-sized
  arrays, 16 MiB against 0.3 MiB of the rest): a ring that gathered the
  sequence would hold all of them on every device, 8x the bound. The ring
  holds a step's share, (S/P)^2 per step: zigzag causal measures ~1/50 of
  the unsharded bytes; contiguous full attention ~1/11, its independent
  steps' scores live together in XLA's CPU schedule."""
  layout, causal = P8_CASES[case]
  q, k, v, dout, dlse, _, _ = _inputs(P8["seq"], P8["heads"], P8["kv_heads"], batch=P8["batch"],
                                      head_dim=P8["head_dim"])
  args = _shapes(q, k, v, dout, dlse, None, None)
  ring = _compiled_ring(8, args, segments=False, sinks=False, check_vma=True, causal=causal, window_size=None,
                        layout=layout, backend="xla").memory_analysis()

  def unsharded(q, k, v, dout, dlse):
    attend = lambda q, k, v: flash_attention(q, k, v, causal=causal, return_lse=True, backend="xla")
    (out, lse), pullback = jax.vjp(attend, q, k, v)
    return out, lse, *pullback((dout, dlse))

  whole = jax.jit(unsharded).lower(*args[:5]).compile().memory_analysis()
  shard_bytes = k.size // 8 * 4
  bound = whole.temp_size_in_bytes / 8 + 16 * shard_bytes
  assert whole.temp_size_in_bytes > 8 * 16 * shard_bytes  # the quadratic term dominates the bound
  assert ring.temp_size_in_bytes <= bound, (ring.temp_size_in_bytes, whole.temp_size_in_bytes, bound)


def test_ring_interpret_kernels():
  """The Triton kernels in interpret mode as the steps: the second step's
  chunks under a causal window give a band with a negative side (keys from
  11 past each query's index); GQA and sinks (the backward reads the merged
  lse in the kernels' base 2). Contiguous: zigzag's steps between offset
  chunks compile twice the kernel copies, and its logic is the XLA cases'.
  Interpret-mode Pallas under check_vma cannot run a backward
  (test_sharding pins that)."""
  _check_ring(2, layout="contiguous", causal=True, window_size=(5, None), heads=4, kv_heads=2, sinks=True,
              backend="triton", interpret=True, check_vma=False)


def test_ring_interpret_kernels_two_masks_a_step():
  """Zigzag under a causal window with the Triton kernels (interpret mode):
  some device's step holds blocks of two different masks, so one step's
  backward calls the kernels for two blocks in turn."""
  _check_ring(2, layout="zigzag", causal=True, window_size=(5, None), backend="triton", interpret=True,
              check_vma=False)


@pytest.mark.gpu
@pytest.mark.parametrize("num_devices", [2, 4, 8])
@pytest.mark.parametrize("layout, causal, strategy", [("zigzag", True, "ring"), ("contiguous", False, "allgather"),
                                                      ("contiguous", True, "ring")])
def test_ring_on_gpus(num_devices, layout, causal, strategy):
  """The compiled kernels ("auto") as the steps on a real mesh of GPUs, bf16, GQA, 256 tokens per device:
  values and gradients within FlashAttention's rule of the plain bf16 math's error, bits repeated."""
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} GPUs, {jax.device_count()} here")
  _check_ring(num_devices, seq=256 * num_devices, heads=4, kv_heads=2, head_dim=64, layout=layout, causal=causal,
              strategy=strategy, dtype=jnp.bfloat16, backend="auto")


def test_auto_warns_without_a_gpu_and_permutes_ahead_of_attention():
  """Under "auto" on CPU the steps run XLA, with a warning. In the compiled
  forward each step's K/V collective-permute comes before the attention of
  the step that issues it. (The CPU backend's collective-permute is
  synchronous, with no start/done pair: the order of the schedule is what
  it shows; test_jaxpr_issues_each_hop_before_the_step checks the order the
  ring emits, forward and backward.)"""
  if jax.devices()[0].platform == "gpu":
    pytest.skip("the CPU schedule")
  q, k, v, _, _, _, _ = _inputs(32, 2, 2)
  attend = lambda q, k, v: ring_attention(q, k, v, axis_name=AXIS, causal=True, layout="contiguous")
  with pytest.warns(RuntimeWarning, match="ring_attention's steps run the plain XLA attention"):
    f = jax.jit(jax.shard_map(attend, mesh=_mesh(4), in_specs=(SEQ,) * 3, out_specs=SEQ))
    hlo = f.lower(q, k, v).compile().as_text()
  # The entry computation's instructions in schedule order: (name, op, first operand).
  entry = hlo[hlo.index("ENTRY"):]
  order = [m.groups() for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = .+? ([a-z][a-z-]*)\(%?([\w.-]*)", entry, re.M)]
  position = {name: i for i, (name, _, _) in enumerate(order)}
  permutes = {name: operand for name, op, operand in order if op == "collective-permute"}
  # The forward's K hops: the chain of permutes from the first one issued
  # (of a parameter); link t carries step t + 1's K.
  chain = [next(name for name, _, _ in order if name in permutes)]
  while nxt := [name for name, operand in permutes.items() if operand == chain[-1]]:
    chain += nxt[:1]
  conditionals = [name for name, op, _ in order if op == "conditional"]
  # Steps 1-3 are conditionals (skipped on devices before the diagonal).
  assert len(chain) == 3 and len(conditionals) == 3, order
  for t in (1, 2):  # step t's attention comes after the hop of step t + 1's K
    assert position[chain[t]] < position[conditionals[t - 1]], (t, chain, conditionals)


def _flat_eqns(jaxpr):
  """The equations of a jaxpr in program order, sub-jaxprs (custom_vjp,
  pjit, shard_map) inlined; a cond is one equation."""
  for eqn in jaxpr.eqns:
    subs = [] if eqn.primitive.name == "cond" else [
        getattr(p, "jaxpr", p) for p in eqn.params.values() if hasattr(getattr(p, "jaxpr", p), "eqns")]
    if subs:
      for sub in subs:
        yield from _flat_eqns(sub)
    else:
      yield eqn


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_jaxpr_issues_each_hop_before_the_step(layout):
  """In the forward and the backward, the ppermute of step t+1's K/V is
  emitted before step t's attention (a dot_general or a switch of them)."""
  q, k, v, dout, dlse, _, _ = _inputs(16, 2, 2)

  def local(q, k, v, dout):
    attend = lambda q, k, v: ring_attention(q, k, v, axis_name=AXIS, causal=True, layout=layout, backend="xla")
    out, pullback = jax.vjp(attend, q, k, v)
    return pullback(dout)

  f = jax.shard_map(local, mesh=_mesh(4), in_specs=(SEQ,) * 4, out_specs=(SEQ,) * 3)
  ops = [e.primitive.name for e in _flat_eqns(jax.make_jaxpr(f)(q, k, v, dout).jaxpr)]
  # p: hops (K and V go together), a: attention (a step's dots, or the switch of them).
  runs = re.sub(r"p+", "p", "".join({"ppermute": "p", "dot_general": "a", "cond": "a"}.get(op, "") for op in ops))
  # The forward's 4 steps: hop 1 issued before step 0's attention, hop 2
  # before step 1's, hop 3 before step 2's; then the backward, whose K/V
  # hops and dK/dV hops alternate with its steps alike.
  assert re.match(r"pa+pa+pa+p(a+p){4}", runs), runs


# ---------------------------------------------------------------- the schedule


def _ring(num_devices, layout, *, causal=True, window_size=None, seq=16) -> ring_lib.Ring:
  q = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
  problem = check_problem(q, q, q, causal=causal, window_size=window_size)
  return ring_lib.Ring(AXIS, num_devices, RingLayout(layout), RingStrategy.RING, problem, Device(None),
                       Backend.XLA, ring_lib.Parts(None, None))  # XLA steps: no kernel parts


def _runs(ring: ring_lib.Ring, t: int, device: int) -> list:
  """The blocks a device runs at step t."""
  step = ring_lib.schedule(ring)[t]
  return list(step.kinds[step.table[device]])


def test_causal_steps_skip_hidden_and_unmask_full_pairs():
  # Contiguous: step t runs unmasked on devices r >= t, is skipped before.
  ring = _ring(4, "contiguous")
  for t, r in itertools.product(range(4), range(4)):
    masks = [block.call.problem.mask for block in _runs(ring, t, r) for _ in block.parts]
    if t == 0:
      assert [m.is_causal for m in masks] == [True]
    else:
      assert [m.is_full for m in masks] == ([True] if r >= t else [])
  # Zigzag: every device runs the same work at every step: its whole shard
  # causally at the diagonal step, then one unmasked attention of one chunk
  # against the other shard's two, or of its two against one.
  ring = _ring(4, "zigzag")
  for t, r in itertools.product(range(4), range(4)):
    blocks = _runs(ring, t, r)
    assert len(blocks) == 1
    (block,) = blocks
    ((rows, cols),) = block.parts
    mask = block.call.problem.mask
    if t == 0:
      assert mask.is_causal and rows == cols == (0, 1)
    else:
      assert mask.is_full and len(rows) * len(cols) == 2
      # From an earlier shard (s < r) both query chunks see its chunk 0.
      assert (cols == (0,)) == ((r - t) % 4 < r)


def test_pair_mask_is_the_band_over_true_positions():
  for chunk, distance, left, right in itertools.product((1, 3, 4), range(-9, 10), (None, 0, 2, 5), (None, 0, 1, 4)):
    i, j = np.meshgrid(np.arange(chunk), np.arange(chunk), indexing="ij")
    true_q, true_k = i + distance, j
    want = np.ones((chunk, chunk), bool)
    if left is not None:
      want &= true_k >= true_q - left
    if right is not None:
      want &= true_k <= true_q + right
    mask = ring_lib.pair_mask(distance, chunk, left, right, segments=False)
    got = np.zeros_like(want) if mask is None else np.broadcast_to(
        True if mask.visible(i, j, check_queries=False, check_keys=False) is None else
        mask.visible(i, j, check_queries=False, check_keys=False), want.shape)
    assert np.array_equal(got, want), (chunk, distance, left, right, mask)
    if mask is not None:
      assert want.any()
      assert mask.has_band or want.all()  # a pair seen whole runs unmasked


# ---------------------------------------------------------------- zigzag_order and errors


def test_zigzag_order_round_trip():
  perm, inverse = zigzag_order(16, 4)
  x = np.arange(16) * 10
  assert np.array_equal(x[perm][inverse], x)
  shards = perm.reshape(4, 4)  # device r's shard: chunks r and 7 - r of 2 positions
  for r in range(4):
    assert list(shards[r]) == [2 * r, 2 * r + 1, 2 * (7 - r), 2 * (7 - r) + 1]
  with pytest.raises(ValueError, match=r"seq_len must be divisible by 2 \* num_devices = 8"):
    zigzag_order(12, 4)
  with pytest.raises(ValueError, match="num_devices must be a positive int"):
    zigzag_order(12, 0)


def _trace(seq=16, num_devices=2, **options):
  q = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32)
  f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, backend="xla", **options), mesh=_mesh(num_devices),
                    in_specs=(SEQ,) * 3, out_specs=SEQ)
  return jax.eval_shape(f, q, q, q)


@pytest.mark.parametrize("options, error, match", [
    (dict(axis_name=None), ValueError, "ring_attention needs axis_name"),
    (dict(axis_name="nope"), ValueError, "axis_name 'nope' is not a mesh axis bound here"),
    (dict(axis_name=AXIS, layout="spiral"), ValueError, r"layout must be one of \['contiguous', 'zigzag'\]"),
    (dict(axis_name=AXIS, strategy="tree"), ValueError, r"strategy must be one of \['ring', 'allgather'\]"),
    (dict(axis_name=AXIS, seq=6), ValueError, r"layout='zigzag' .* local length \(q axis 1\) must be even, got 3"),
    (dict(axis_name=AXIS, return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(axis_name=AXIS, window_size=(-1, 0)), ValueError, "window_size sides must be ints >= 0"),
])
def test_errors_name_the_argument(options, error, match):
  with pytest.raises(error, match=match):
    _trace(**options)


def test_errors_outside_shard_map_and_unequal_lengths():
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="axis_name 'sp' is not a mesh axis bound here"):
    ring_attention(q, q, q, axis_name=AXIS, backend="xla")
  with pytest.raises(ValueError, match="local lengths .* must be equal"):
    ring_attention(q, q[:, :4], q[:, :4], axis_name=AXIS, backend="xla")
