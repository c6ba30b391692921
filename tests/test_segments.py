"""Packed sequences (`q_segment_ids`, `kv_segment_ids`), interpret mode, float32."""

from __future__ import annotations

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention
from jax_flash2.triton import backward as triton_backward
from jax_flash2.triton import forward as triton_forward
from jax_flash2 import mask as mask_lib
from jax_flash2.mask import Mask
from jax_flash2.problem import Operands, Problem

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
MIXED = BlockSizes(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


def _packed(lengths_per_row: list[list[int]]) -> jax.Array:
  """int32 [batch, sum(lengths)]: segment i of a row repeated lengths[i] times."""
  return jnp.array([np.repeat(np.arange(len(row)), row) for row in lengths_per_row], jnp.int32)


def _run(q, k, v, dout, ids, block_sizes, **kwargs):
  return flash_with_grads(q, k, v, dout, q_segment_ids=ids[0], kv_segment_ids=ids[1], block_sizes=block_sizes,
                          **kwargs)


@pytest.mark.parametrize("causal, kv_heads, block_sizes", [
    (False, 3, SMALL),
    (True, 3, MIXED),
    (True, 1, SMALL),  # MQA
], ids=str)
def test_matches_reference(causal, kv_heads, block_sizes):
  ids = _packed([[10, 25, 13], [48]])
  q, k, v, dout = random_inputs(5, 2, 48, 48, 3, 16)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  got = _run(q, k, v, dout, (ids, ids), block_sizes, causal=causal)
  want = reference_with_grads(q, k, v, dout, causal=causal, segment_ids=(ids, ids))
  assert_matches_reference(got, want, dout)


def test_unsorted_ids_and_unequal_lengths_with_a_mask():
  # Ids need not be sorted or contiguous; the tile skip must stay safe.
  q_ids = jax.random.randint(jax.random.PRNGKey(0), (2, 37), 0, 3)
  kv_ids = jax.random.randint(jax.random.PRNGKey(1), (2, 45), 0, 3)
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.8, (2, 1, 37, 45))
  q, k, v, dout = random_inputs(6, 2, 37, 45, 2, 16)
  got = _run(q, k, v, dout, (q_ids, kv_ids), MIXED, mask=mask, window_size=(20, 5))
  want = reference_with_grads(q, k, v, dout, mask=mask, window=(20, 5), segment_ids=(q_ids, kv_ids))
  assert_matches_reference(got, want, dout)


def test_tiles_between_segments_are_never_read():
  """Segments [0, 16) and [16, 48): with tiles of 16 the tiles pairing them are
  skipped, so NaN in the K/V of one segment cannot reach the other."""
  ids = _packed([[16, 32]])
  q, k, v, dout = random_inputs(7, 1, 48, 48, 2, 16)
  poisoned = lambda x: x.at[:, :16].set(jnp.nan)
  out, lse, dq, dk, dv = _run(q, poisoned(k), poisoned(v), dout, (ids, ids), SMALL)
  want = reference_with_grads(q, k, v, dout, segment_ids=(ids, ids))
  for name, x, ref in zip(("out", "lse", "dq"), (out, lse, dq), want):
    assert rel_err(x[:, 16:] if name != "lse" else x[:, :, 16:], ref[:, 16:] if name != "lse" else ref[:, :, 16:]) < 1e-5
  assert np.all(np.isfinite(np.asarray(dk[:, 16:]))) and np.all(np.isfinite(np.asarray(dv[:, 16:])))


def test_bad_segment_ids():
  q, k, v, _ = random_inputs(0, 2, 8, 8, 1, 8)
  ids = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match="together"):
    flash_attention(q, k, v, q_segment_ids=ids, backend="xla")
  with pytest.raises(ValueError, match="q_segment_ids must have shape"):
    flash_attention(q, k, v, q_segment_ids=ids[:, :5], kv_segment_ids=ids, backend="xla")
  with pytest.raises(TypeError, match="kv_segment_ids must be integers"):
    flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids.astype(jnp.float32), backend="xla")


def test_vmap_folds_segment_ids_and_alibi_slopes():
  ids = jnp.stack([_packed([[10, 22]]), _packed([[32]])])  # [2 (vmapped), 1, 32]
  q, k, v, _ = random_inputs(8, 2, 32, 32, 2, 16)
  q, k, v = (x[:, None] for x in (q, k, v))  # [2 (vmapped), 1, 32, 2, 16]
  slopes = jnp.array([0.3, 0.1], jnp.float32)  # shared by the vmapped instances

  def attend(q, k, v, ids):
    return flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, alibi_slopes=slopes,
                           causal=True, interpret=True, block_sizes=SMALL)

  got = jax.vmap(attend)(q, k, v, ids)
  for i in range(2):
    want = reference_with_grads(q[i], k[i], v[i], q[i], causal=True, alibi_slopes=slopes,
                                segment_ids=(ids[i], ids[i]))[0]
    assert rel_err(got[i], want) < 1e-5, i


# ------------------------------------------- loop bounds from the segment ids
#
# Without a dense mask the kernels walk only the blocks whose segment ids can
# meet (mask.segment_block_ranges) and run the blocks inside one segment
# without the element mask. The tests below take blocks of 16 on sequences of
# several blocks per segment, so that every stretch of the split loop runs.


def _bounds(outer_ids, inner_ids, outer_block: int, inner_block: int) -> np.ndarray:
  """[batch, outer blocks, 4] (lo, full_lo, full_hi, hi), as the kernels get them."""
  ranges = mask_lib.SegmentRanges(jnp.asarray(outer_ids, jnp.int32), jnp.asarray(inner_ids, jnp.int32))
  return np.asarray(mask_lib.segment_block_ranges(ranges.queries(outer_block), ranges.keys(inner_block)))


def test_segment_block_bounds_by_hand():
  ids = [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]]
  # Blocks of 4 hold ids {0}, {1}, {1, 2}: the last block is never full.
  np.testing.assert_array_equal(_bounds(ids, ids, 4, 4)[0], [[0, 0, 1, 1], [1, 1, 2, 3], [1, 3, 3, 3]])
  # Inner blocks of 2: {0} {0} {1} {1} {1, 2} {2}.
  np.testing.assert_array_equal(_bounds(ids, ids, 4, 2)[0], [[0, 0, 2, 2], [2, 2, 4, 5], [2, 6, 6, 6]])
  # Unsorted: inner blocks {0} {1} {0} {0, 1} all meet the outer block's 0,
  # but the full stretch must stop at the first block that is not full; an
  # outer id no inner block holds gets an empty range.
  outer, inner = [[0, 0, 0, 0, 7, 7, 7, 7]], [[0, 0, 1, 1, 0, 0, 0, 1]]
  np.testing.assert_array_equal(_bounds(outer, inner, 4, 2)[0], [[0, 0, 1, 4], [4, 4, 4, 4]])


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("blocks", [(4, 4), (8, 4), (4, 8)], ids=str)
def test_segment_block_bounds_against_brute_force(sort, blocks):
  """Every inner block sharing an id with the outer block lies in [lo, hi),
  and every block in [full_lo, full_hi) pairs one id with itself only. For
  sorted ids (the same array on both sides) the bounds are also tight."""
  outer_block, inner_block = blocks
  rng = np.random.default_rng(sum(blocks) + sort)
  ids = rng.integers(0, 6, (3, 45))
  ids = np.sort(ids, axis=1) if sort else ids
  bounds = _bounds(ids, ids, outer_block, inner_block)
  pad = lambda x, block: np.pad(x, (0, -len(x) % block), constant_values=-1).reshape(-1, block)
  for row, row_bounds in zip(ids, bounds):
    for o_ids, (lo, full_lo, full_hi, hi) in zip(pad(row, outer_block), row_bounds):
      assert lo <= full_lo <= full_hi <= hi
      o_ids = o_ids[o_ids >= 0]
      same = [(o_ids[:, None] == i_ids[i_ids >= 0][None, :]) for i_ids in pad(row, inner_block)]
      meets = [i for i, s in enumerate(same) if s.any()]
      full = [i for i, s in enumerate(same) if s.all()]
      assert all(lo <= i < hi for i in meets)
      assert all(i in full for i in range(full_lo, full_hi))
      if sort:
        assert (lo, hi) == (meets[0], meets[-1] + 1)
        assert full_hi - full_lo == len(full)


LONG = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(32, 16))


@pytest.mark.parametrize("lengths, causal, block_sizes", [
    ([64, 32, 32], True, SMALL),  # aligned to the blocks: interior blocks run unmasked
    ([64, 32, 32], False, LONG),
    ([37, 50, 9, 32], True, LONG),  # boundaries inside blocks
    ([21, 70, 37], False, SMALL),
], ids=str)
def test_packed_segments_of_several_blocks(lengths, causal, block_sizes):
  ids = _packed([lengths, lengths[::-1]])
  seq = sum(lengths)
  q, k, v, dout = random_inputs(11, 2, seq, seq, 2, 16)
  got = _run(q, k, v, dout, (ids, ids), block_sizes, causal=causal)
  want = reference_with_grads(q, k, v, dout, causal=causal, segment_ids=(ids, ids))
  assert_matches_reference(got, want, dout)


def test_unsorted_ids_without_a_mask():
  """The hull path: blocks between two runs of one id meet it by range only.
  Here the ids of rows 0..15 come back at 32..47 with other ids between (a
  block of id 0 sees full blocks at 0 and 2 but not 1), and the second batch
  row is random."""
  q_ids = jnp.array([[0] * 16 + [1] * 16 + [0] * 16 + [2] * 8, list(np.random.default_rng(0).integers(0, 3, 56))],
                    jnp.int32)
  kv_ids = q_ids[:, ::-1]
  q, k, v, dout = random_inputs(12, 2, 56, 56, 2, 16)
  for ids, causal in (((q_ids, q_ids), True), ((q_ids, kv_ids), False)):
    got = _run(q, k, v, dout, ids, SMALL, causal=causal)
    want = reference_with_grads(q, k, v, dout, causal=causal, segment_ids=ids)
    assert_matches_reference(got, want, dout)


@pytest.mark.parametrize("seqs, window, causal", [
    ((80, 80), (24, 0), False),  # a window ending on the diagonal, several blocks long
    ((48, 96), (None, None), True),  # seq_q < seq_k: the band is aligned bottom-right
    ((96, 48), (20, 10), False),  # seq_q > seq_k, a window on both sides
], ids=str)
def test_segments_with_a_band_and_unequal_lengths(seqs, window, causal):
  seq_q, seq_k = seqs
  # Each side packs the same three segments into its own length.
  q_ids, kv_ids = (_packed([[s // 4, s // 2, s - s // 4 - s // 2]]) for s in seqs)
  q, k, v, dout = random_inputs(13, 1, seq_q, seq_k, 4, 16)
  k, v = k[:, :, :2], v[:, :, :2]  # GQA: the dK/dV programs loop over their query group
  got = _run(q, k, v, dout, (q_ids, kv_ids), LONG, causal=causal, window_size=window)
  want = reference_with_grads(q, k, v, dout, causal=causal, window=window, segment_ids=(q_ids, kv_ids))
  assert_matches_reference(got, want, dout)


def test_rows_whose_segment_has_no_keys():
  """Query segment 5 (rows 20..43, across Q blocks) has no key: its rows get
  zeros and lse -inf, and the Q blocks it fills walk no K/V block at all."""
  q_ids = jnp.array([[0] * 20 + [5] * 24 + [1] * 20], jnp.int32)
  kv_ids = jnp.array([[0] * 30 + [1] * 34], jnp.int32)
  q, k, v, dout = random_inputs(14, 1, 64, 64, 2, 16)
  got = _run(q, k, v, dout, (q_ids, kv_ids), SMALL)
  want = reference_with_grads(q, k, v, dout, segment_ids=(q_ids, kv_ids))
  assert_matches_reference(got, want, dout)
  out, lse, dq, dk, dv = got
  np.testing.assert_array_equal(np.asarray(out[:, 20:44]), 0.0)
  assert np.all(np.asarray(lse)[:, :, 20:44] == -np.inf)
  np.testing.assert_array_equal(np.asarray(dq[:, 20:44]), 0.0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))


def _primitive_names(jaxpr) -> set[str]:
  """Names of the primitives in a jaxpr and every jaxpr nested in it."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jex.core.ClosedJaxpr):
          names |= _primitive_names(sub.jaxpr)
        elif isinstance(sub, jex.core.Jaxpr):
          names |= _primitive_names(sub)
  return names


def _kernel_calls(with_mask: bool):
  """Traces the forward, dK/dV and dQ kernels of a causal problem with segment
  ids (and a dense mask): their closed jaxpr."""
  seq, d = 64, 16
  problem = Problem(mask=Mask(seq, seq, causal=True, dense=with_mask, segments=True), head_dim=d,
                    softmax_scale=0.25, dtype="float32")
  q = jnp.zeros((1, seq, 2, d), jnp.float32)
  rows = jnp.zeros((1, 2, seq), jnp.float32)
  ids = _packed([[40, 24]])
  mask = jnp.ones((1, 1, seq, seq), jnp.int8) if with_mask else None
  operands = Operands(mask=mask, q_segment_ids=ids, kv_segment_ids=ids)
  config = KernelConfig(16, 16)

  def kernels(q, k, v, do, lse):
    out, lse = triton_forward.forward(q, k, v, operands, problem, config, interpret=True)
    grads = triton_backward.backward(q, k, v, out, lse, do, rows, operands, problem,
                                     BlockSizes(config, config, config), interpret=True)
    return out, lse, grads

  return jax.make_jaxpr(kernels)(q, q, q, q, rows)


def test_segment_bounds_leave_no_cond_in_the_kernels():
  """With segment ids alone the loops are narrowed by bounds: no kernel
  holds a lax.cond (which would also keep Triton from pipelining the K/V
  loads). A dense mask keeps its per-tile flags, and with them the cond."""
  calls = lambda jaxpr: [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
  plain, masked = _kernel_calls(with_mask=False), _kernel_calls(with_mask=True)
  assert len(calls(plain)) == 4  # forward, delta, dK/dV, dQ
  for eqn in calls(plain):
    assert "cond" not in _primitive_names(eqn.params["jaxpr"]), eqn.params["name_and_src_info"]
  assert any("cond" in _primitive_names(eqn.params["jaxpr"]) for eqn in calls(masked))


@pytest.mark.parametrize("with_mask", [False, True], ids=["segments", "segments_and_mask"])
def test_kernels_with_segments_lower_for_cuda(with_mask):
  """Runs the Triton lowering (Pallas to Triton IR) of every kernel for an
  H200 target, on any host: scalar loads of the bounds and the min/max on
  them must lower (a jnp.where on such scalars once crashed it)."""
  seq_q, seq_k, d = 200, 136, 64  # ragged ends, seq_q > seq_k
  problem = Problem(mask=Mask(seq_q, seq_k, causal=True, window_left=48, dense=with_mask, segments=True),
                    head_dim=d, softmax_scale=0.125, dtype="bfloat16", group=2, has_bias=True)
  q = jax.ShapeDtypeStruct((2, seq_q, 4, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, seq_k, 2, d), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((2, 4, seq_q), jnp.float32)
  ids = (jax.ShapeDtypeStruct((2, seq_q), jnp.int32), jax.ShapeDtypeStruct((2, seq_k), jnp.int32))
  mask = jax.ShapeDtypeStruct((2, 1, seq_q, seq_k), jnp.int8) if with_mask else None
  bias = jax.ShapeDtypeStruct((1, 4, seq_q, seq_k), jnp.bfloat16)
  blocks = BlockSizes(fwd=KernelConfig(64, 32), dkv=KernelConfig(32, 64), dq=KernelConfig(64, 64))

  def kernels(q, k, v, do, dlse, q_ids, kv_ids, mask, bias):
    operands = Operands(mask=mask, q_segment_ids=q_ids, kv_segment_ids=kv_ids, bias=bias)
    out, lse = triton_forward.forward(q, k, v, operands, problem, blocks.fwd)
    grads = triton_backward.backward(q, k, v, out, lse, do, dlse, operands, problem, blocks)
    return out, lse, grads, triton_backward.bias_gradient(q, k, v, out, lse, do, dlse, operands, problem, blocks)

  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
    lowered = jax.jit(kernels).trace(q, kv, kv, q, rows, *ids, mask, bias).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash2_fwd", "flash2_bwd_dkv", "flash2_bwd_dq", "flash2_bwd_dbias"):
    assert name in text, name
