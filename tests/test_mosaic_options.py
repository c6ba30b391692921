"""The Mosaic GPU kernels with sliding windows, softcap and ALiBi (issue 27).

On CPU: the per-block ranges the kernels take (a tile's inner blocks are
exactly those its band touches), lowering for CUDA through flash_attention
on a pretend H200 (every default tiling, each option: the whole Python side
of Mosaic GPU for sm_90a), and Mosaic's interpreter on small shapes against
the float64 reference: the forward and the backward each option alone and
together, GQA, ragged lengths, head_dim 64, 128 and 256, rows that see no
key, random cotangents on out and lse, the race detector, and outputs the
kernels never write read NaN (the interpreter's poisoned memory).

On a Hopper GPU the compiled kernels are held to the 2x/3x bar in
tests/test_gpu.py (test_mosaic_options_*).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads
from jax_flash2 import backends, defaults, flash_attention, plan
from jax_flash2.config import MosaicBackwardConfig as B
from jax_flash2.config import MosaicForwardConfig as F
from jax_flash2.mask import NUMPY, Mask
from jax_flash2.mosaic import backward as mosaic_bwd
from jax_flash2.mosaic import backward_wide, common
from jax_flash2.mosaic import forward as mosaic_fwd
from test_mosaic import _races_found

# ---------------------------------------------------------------- block ranges


@pytest.mark.parametrize("window, causal", [((70, 30), False), ((70, None), False), ((None, 30), False),
                                            ((100, 0), True), ((0, 0), False), ((None, None), True)])
@pytest.mark.parametrize("seq_q, seq_k", [(640, 640), (500, 900), (900, 300)])
def test_q_tiles_load_exactly_the_blocks_their_band_touches(window, causal, seq_q, seq_k):
  """A Q tile's producer loads K/V blocks [lo, hi) (common.q_tile_blocks):
  its first and last block hold a pair some row of the tile sees, none
  outside does; each consumer's stretches (common.kv_range) lie inside it,
  with the blocks of [full_lo, full_hi) visible whole to its rows."""
  mask = Mask(seq_q, seq_k, causal=causal, window_left=window[0], window_right=window[1])
  block_q, block_kv, consumers = 128, 64, 2
  rows = block_q // consumers
  seen = np.asarray(mask.visible(jnp.arange(-(-seq_q // block_q) * block_q)[:, None], jnp.arange(seq_k)[None, :],
                                 check_queries=False))
  pad = -seq_k % block_kv
  blocks = np.pad(seen, ((0, 0), (0, pad))).reshape(seen.shape[0], -1, block_kv)  # [query, block, key]
  for q_start in range(0, seen.shape[0], block_q):
    lo, hi = (int(x) for x in common.q_tile_blocks(q_start, block_q=block_q, block_kv=block_kv, mask=mask,
                                                   consumers=consumers, ints=NUMPY))
    touched = np.flatnonzero(blocks[q_start:q_start + block_q].any(axis=(0, 2)))
    if touched.size:
      assert (lo, hi) == (touched[0], touched[-1] + 1), q_start
    else:
      assert lo == hi, q_start
    for wg in range(consumers):
      start = q_start + wg * rows
      c_lo, c_full_lo, c_full_hi, c_hi = (int(np.asarray(x)) for x in common.kv_range(mask, start, rows, block_kv))
      assert lo <= c_lo <= c_full_lo <= c_full_hi <= c_hi <= max(hi, c_lo), (start, lo, hi)
      mine = blocks[start:start + rows]
      assert not mine[:, :c_lo].any() and not mine[:, c_hi:].any(), start
      assert mine[:, c_full_lo:c_full_hi].all(), start
      real_keys = np.arange(blocks.shape[1] * block_kv).reshape(-1, block_kv) < seq_k
      assert real_keys[c_full_lo:c_full_hi].all(), start  # the full stretch holds no padding


def test_schedules_follow_the_bands_work():
  """Work that grows with the Q block (causal, a right edge alone) runs
  heaviest first, in pairs on persistent CTAs; under a window's left edge
  the tiles go in order, round-robin (common.triangular)."""
  assert common.triangular(Mask(8, 8, causal=True)) and common.triangular(Mask(8, 8, window_right=3))
  assert common.triangular(Mask(8, 8, causal=True, window_right=5))
  for mask in (Mask(8, 8), Mask(8, 8, window_left=3), Mask(8, 8, causal=True, window_left=3),
               Mask(8, 8, window_left=3, window_right=3)):
    assert not common.triangular(mask)
  work = common.q_tile_work(8, block_q=128, block_kv=128, mask=Mask(1024, 1024, window_right=256))
  assert work == tuple(sorted(work, reverse=True)) and work[0] > work[-1]


# ---------------------------------------------------------------- lowering for CUDA

# The options the Mosaic kernels serve, each with every default tiling: a
# window's sides alone and together (causal and not), softcap and ALiBi
# (slopes [heads], the batch broadcast, and [batch, heads]) and sinks with them.
LOWER_OPTIONS = {
    "sliding_causal_sinks": dict(causal=True, window_size=(256, 0), sinks=True),
    "both_sides_softcap": dict(window_size=(128, 192), softcap=30.0),
    "left_only_alibi": dict(window_size=(256, None), alibi="heads"),
    "right_only_softcap_alibi_sinks": dict(window_size=(None, 64), softcap=20.0, alibi="batch", sinks=True),
}
# head_dim 64 takes three consumer warpgroups from seq_q 2048 without a
# diagonal: the forward of the options without one, at 2048.
THREE_CONSUMERS = ("both_sides_softcap", "left_only_alibi", "right_only_softcap_alibi_sinks")


@pytest.mark.parametrize("head_dim, seq, option", [
    *((head_dim, 1024, option) for head_dim in (64, 128, 256) for option in LOWER_OPTIONS),
    *((64, 2048, option) for option in THREE_CONSUMERS),
], ids=lambda x: str(x))
def test_default_kernels_lower_for_cuda_with_options(monkeypatch, head_dim, seq, option):
  """flash_attention's forward and backward (at seq 2048 with three
  consumers: the forward) on a pretend H200, auto picking the Mosaic
  kernels at their measured tilings: every kernel lowers for sm_90a (the
  whole Python side of Mosaic GPU), and no Triton kernel but the small
  delta one runs."""
  from jax._src.pallas.triton import pallas_call_registration as triton_registration

  # The Triton lowering of the delta kernel asks the GPU for its compute capability.
  monkeypatch.setattr(triton_registration.gpu_info_lib, "get_gpu_info",
                      lambda: type("Hopper", (), {"compute_capability": 90})())
  monkeypatch.setattr(backends, "default_compute_capability", lambda: (9, 0))
  options = dict(LOWER_OPTIONS[option])
  batch, heads, kv_heads = 2, 4, 2
  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16)
  alibi = options.pop("alibi", None)
  slopes = jax.ShapeDtypeStruct((heads,) if alibi == "heads" else (batch, heads), jnp.float32)
  sinks = jax.ShapeDtypeStruct((heads,), jnp.float32) if options.pop("sinks", False) else None

  three = seq == 2048

  def step(q, k, v, slopes, sinks):
    kwargs = dict(options, alibi_slopes=slopes if alibi else None, sinks=sinks)
    if three:
      return flash_attention(q, k, v, **kwargs)
    (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True, **kwargs), q, k, v)
    return vjp((out, lse))

  got = plan(q, kv, kv, **options, alibi_slopes=slopes if alibi else None, compute_capability=(9, 0))
  assert (got.forward.backend, got.backward.backend) == ("mosaic", "mosaic")
  assert got.forward.config.consumers == (3 if three else 2)
  text = jax.jit(step).trace(q, kv, kv, slopes, sinks).lower(lowering_platforms=("cuda",)).as_text()
  wide = "_wide" if head_dim == 256 else ""
  backward = () if three else (f"flash2_bwd_dkv{wide}_mosaic", f"flash2_bwd_dq{wide}_mosaic")
  for kernel in ("flash2_fwd_mosaic", *backward):
    assert kernel in text, kernel
  assert "mosaic_gpu_v2" in text and '"flash2_fwd"' not in text and "flash2_bwd_dkv\"" not in text


def test_options_change_the_kernels():
  """A window, a softcap and ALiBi each give kernels of their own, and the
  same problem without them the plain ones (the static specialisation)."""
  from test_mosaic import _kernels_text

  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  slopes = jnp.zeros((1, 2), jnp.float32)
  config = F(block_q=128, block_kv=64, stages=2)
  text = lambda **kw: _kernels_text(lambda q, k, v: mosaic_fwd.forward(q, k, v, causal=True, config=config, **kw),
                                    q, q, q)
  plain = text()
  assert text(window_size=(None, None), softcap=None, alibi_slopes=None) == plain
  variants = [text(window_size=(64, None)), text(softcap=5.0), text(alibi_slopes=slopes)]
  assert len({plain, *variants}) == 4


# ---------------------------------------------------------------- interpreter

# (shape (batch, seq_q, seq_k, heads, head_dim), kv_heads, dtype, options,
# forward config, backward config, race detector). Small tiles, so that
# short sequences span several blocks and the band's edges cross them.
INTERPRETER = {
    # A causal sliding window, ragged, GQA: consumers drain the blocks
    # before their left edge and past their diagonal; the overlapped
    # forward and dQ; three ring slots wrap mid-tile.
    "d64_sliding_causal_ragged_gqa": ((1, 200, 300, 2, 64), 1, jnp.bfloat16, dict(causal=True, window_size=(70, 0)),
                                      F(128, 64, 3, softmax_overlap=True), B(64, 64, 3, dq_softmax_overlap=True), True),
    # Two sides with a softcap, persistent CTAs (round-robin: the window's
    # tiles), early vectors in dK/dV.
    "d64_both_sides_softcap_persistent": (
        (2, 256, 256, 2, 64), None, jnp.float16, dict(window_size=(50, 30), softcap=5.0),
        F(128, 64, 2, softmax_overlap=True, persistent=True),
        B(64, 64, 2, dq_persistent=True, dkv_persistent=True, early_vectors=True), True),
    # A left side alone with ALiBi (per-batch slopes): the masked stretch
    # comes first (rows whose first blocks hold none of their keys).
    "d64_left_only_alibi": ((2, 256, 192, 2, 64), None, jnp.bfloat16, dict(window_size=(90, None), alibi="batch"),
                            F(128, 64, 2), B(64, 64, 2), False),
    # A right side alone, seq_q > seq_k + right: the first 180 rows see no
    # key (zeros, lse = -inf, dQ 0); everything at once.
    "d64_right_only_unseen_rows_all": (
        (1, 320, 130, 2, 64), 1, jnp.bfloat16, dict(window_size=(None, 10), softcap=4.0, alibi="heads"),
        F(128, 64, 2, softmax_overlap=True), B(128, 64, 2, dq_softmax_overlap=True), True),
    # Three consumer warpgroups (192-row tiles) under a causal window.
    "d64_three_consumers_window": ((1, 384, 320, 3, 64), 1, jnp.bfloat16, dict(causal=True, window_size=(100, 0)),
                                   F(192, 64, 2, softmax_overlap=True, persistent=True, consumers=3), None, True),
    # The d128 defaults (128-row K/V blocks, persistent CTAs, overlap) with
    # two sides and a softcap, ragged and GQA.
    "d128_both_sides_softcap_ragged_gqa": ((1, 200, 136, 2, 128), 1, jnp.bfloat16,
                                           dict(window_size=(40, 40), softcap=10.0), None, None, False),
    # A right side alone, causal-like: the balanced persistent table, with ALiBi.
    "d128_right_only_balanced_alibi": (
        (1, 384, 384, 2, 128), None, jnp.float16, dict(window_size=(None, 50), alibi="heads"),
        F(128, 64, 2, softmax_overlap=True, persistent=True, balanced=True), B(64, 64, 2, dq_persistent=True), False),
    # head_dim 256 (backward_wide): a causal window with softcap and ALiBi, ragged, GQA.
    "d256_causal_window_all_ragged_gqa": ((1, 72, 136, 2, 256), 1, jnp.bfloat16,
                                          dict(causal=True, window_size=(60, 0), softcap=4.0, alibi="batch"),
                                          None, None, True),
    # head_dim 256, a right side alone with rows that see no key, persistent.
    "d256_right_only_unseen_rows": ((1, 256, 128, 1, 256), None, jnp.float16, dict(window_size=(None, 20)), None,
                                    B(64, 64, 2, dq_persistent=True, dkv_persistent=True), False),
    # head_dim 256, a left side alone.
    "d256_left_only_softcap": ((1, 192, 256, 1, 256), None, jnp.bfloat16, dict(window_size=(64, None), softcap=6.0),
                               None, None, False),
}


def _arrays(shape, kv_heads, dtype, options, seed=0):
  """q, k, v, dout, dlse (random cotangents) and the options with ALiBi's
  slopes drawn ([1, heads] for "heads", [batch, heads] for "batch")."""
  batch, seq_q, seq_k, heads, head_dim = shape
  q, k, v, do = (x.astype(dtype) for x in random_inputs(seed, batch, seq_q, seq_k, heads, head_dim))
  if kv_heads is not None:
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  rng = np.random.default_rng(seed + 1)
  dlse = jnp.asarray(rng.standard_normal((batch, heads, seq_q)), jnp.float32)
  options = dict(options)
  alibi = options.pop("alibi", None)
  if alibi is not None:
    options["alibi_slopes"] = jnp.asarray(rng.uniform(0.02, 0.5, (1 if alibi == "heads" else batch, heads)),
                                          jnp.float32)
  return (q, k, v, do, dlse), options


def _reference(q, k, v, do, dlse, options):
  return reference_with_grads(q, k, v, do, dlse, causal=options.get("causal", False),
                              window=options.get("window_size", (None, None)), softcap=options.get("softcap"),
                              alibi_slopes=options.get("alibi_slopes"))


def _check_rows_that_see_nothing(got, q, k, options):
  """Rows before the band's first key: zeros, lse = -inf, dQ 0."""
  out, lse, dq = got[0], got[1], got[2]
  right = 0 if options.get("causal") else options.get("window_size", (None, None))[1]
  if right is None or q.shape[1] <= k.shape[1] + right:
    return
  blind = q.shape[1] - k.shape[1] - right
  assert np.all(np.isneginf(np.asarray(lse[..., :blind]))) and np.all(np.isfinite(np.asarray(lse[..., blind:])))
  for x in (out, dq):
    np.testing.assert_array_equal(np.asarray(x[:, :blind], np.float32), 0.0)


@pytest.mark.parametrize("case", list(INTERPRETER))
def test_interpreter_matches_reference(case):
  """The forward and the backward kernels (two-kernel at head_dim 64 and 128,
  backward_wide at 256) in Mosaic's interpreter against the float64
  reference: out, lse, dQ, dK, dV with random cotangents on out and lse
  (dlse folds into delta, as the custom_vjp's backward does it)."""
  shape, kv_heads, dtype, options, forward_config, backward_config, races = INTERPRETER[case]
  (q, k, v, do, dlse), options = _arrays(shape, kv_heads, dtype, options)
  params = plgpu.InterpretGPUParams(detect_races=races, uninitialized_memory="nan")
  out, lse = mosaic_fwd.forward(q, k, v, **options, config=forward_config, interpret=params)
  delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  kernels = backward_wide if shape[-1] == 256 else mosaic_bwd
  dq, dk, dv = kernels.backward(q, k, v, do, lse, delta, **options, config=backward_config, interpret=params)
  got = (out, lse, dq, dk, dv)
  for x, like in zip(got, (q, None, q, k, v)):
    if like is not None:
      assert x.shape == like.shape and x.dtype == like.dtype
  assert_matches_reference(got, _reference(q, k, v, do, dlse, options), do, tol=1e-2)
  _check_rows_that_see_nothing(got, q, k, options)
  if races:
    assert not _races_found()


def test_flash_attention_backend_mosaic():
  """flash_attention(backend="mosaic") with a right-side window, softcap and
  per-batch ALiBi, grouped-query, rows that see no key (their out 0, lse
  -inf), a cotangent on lse, through the custom_vjp and the backends layer
  (head_dim 64: the two-kernel backward at the measured tilings) in
  Mosaic's interpreter, against the reference."""
  options = dict(window_size=(None, 16), softcap=8.0, alibi="batch")
  (q, k, v, do, dlse), options = _arrays((2, 256, 128, 2, 64), 1, jnp.float16, options, seed=3)
  got = plan(q, k, v, **options, interpret=True, backend="mosaic")
  assert (got.forward.backend, got.backward.backend) == ("mosaic", "mosaic")
  assert not got.backward.config.fused_dq
  got = flash_with_grads(q, k, v, do, dlse, backend="mosaic", **options)
  assert_matches_reference(got, _reference(q, k, v, do, dlse, options), do, tol=1e-2)
  _check_rows_that_see_nothing(got, q, k, options)


def test_entry_points_check_the_options():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="window_size must be a pair"):
    mosaic_fwd.forward(q, q, q, window_size=(-1, 0))
  with pytest.raises(ValueError, match="softcap must be > 0"):
    mosaic_fwd.forward(q, q, q, softcap=0.0)
  with pytest.raises(ValueError, match=r"alibi_slopes must be float32 \[batch or 1, heads\]"):
    mosaic_bwd.dq(q, q, q, q, jnp.zeros((1, 2, 128), jnp.float32), jnp.zeros((1, 2, 128), jnp.float32),
                  alibi_slopes=jnp.zeros((2,), jnp.float32))


# ---------------------------------------------------------------- segment ids


def _packed_ids(rng, batch: int, seq: int, pieces: int) -> jax.Array:
  """int32 [batch, seq]: each row cut at random into `pieces` runs of ids 0, 1, ..."""
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq), pieces - 1, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
  return jnp.asarray(np.stack(rows), jnp.int32)


def _segment_ids(kind: str, batch: int, seq_q: int, seq_k: int, seed: int = 0):
  """("packed": the same runs for queries and keys; "cross": runs of their
  own, the queries' last id absent from the keys, so its rows see no key;
  "unsorted": ids drawn at random from {0, 1, 2})."""
  rng = np.random.default_rng(seed)
  if kind == "unsorted":
    return (jnp.asarray(rng.integers(0, 3, (batch, seq_q)), jnp.int32),
            jnp.asarray(rng.integers(0, 3, (batch, seq_k)), jnp.int32))
  q_ids = _packed_ids(rng, batch, seq_q, 4)
  if kind == "packed":
    return q_ids, q_ids
  return q_ids, jnp.minimum(_packed_ids(rng, batch, seq_k, 3), 2)  # q's id 3 never among the keys


# (shape (batch, seq_q, seq_k, heads, head_dim), kv_heads, options, ids
# (`_segment_ids`), forward config, backward config (None: the forward
# alone), race detector).
SEGMENT_CASES = {
    # Queries and keys of their own lengths and runs (rows that see no key),
    # a window and a softcap, persistent CTAs in every kernel (the tile after
    # a CTA's last is read, clamped), three ring slots in dK/dV.
    "d64_cross_window_softcap_persistent": (
        (1, 192, 136, 1, 64), None, dict(window_size=(60, 40), softcap=5.0), "cross",
        F(128, 64, 2, softmax_overlap=True, persistent=True), B(64, 64, 3, dq_persistent=True, dkv_persistent=True),
        False),
    # Ids in no order with ALiBi, ragged, the d128 defaults: the hull of
    # blocks whose id ranges meet, masked.
    "d128_unsorted_alibi_ragged": ((1, 72, 136, 1, 128), None, dict(alibi="heads"), "unsorted", None, None, True),
    # head_dim 256 (backward_wide), ragged, rows that see no key.
    "d256_cross_causal_ragged": ((1, 100, 72, 1, 256), None, dict(causal=True), "cross", None, None, False),
    # The d64 defaults under segment ids at a long sequence (three consumers
    # of 64 rows, one CTA a tile; the two-kernel backward), a window, GQA.
    "d64_packed_window_long_defaults": (
        (1, 384, 384, 2, 64), 1, dict(window_size=(100, 50)), "packed",
        defaults.mosaic_forward(64, seq_q=16384, causal=False, segments=True),
        defaults.mosaic_backward(64, fused=False, segments=True), False),
}


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
def test_interpreter_with_segment_ids(case):
  """The Mosaic forward and backward (two-kernel at head_dim 64 and 128,
  backward_wide at 256) with segment ids in Mosaic's interpreter against the
  float64 reference (out, lse and every gradient), rows whose id no key
  holds giving zeros, lse -inf and dQ 0, poisoned memory, the race detector
  where asked."""
  shape, kv_heads, options, kind, forward_config, backward_config, races = SEGMENT_CASES[case]
  (q, k, v, do, dlse), options = _arrays(shape, kv_heads, jnp.bfloat16, options)
  ids = dict(zip(("q_segment_ids", "kv_segment_ids"), _segment_ids(kind, shape[0], shape[1], shape[2])))
  params = plgpu.InterpretGPUParams(detect_races=races, uninitialized_memory="nan")
  out, lse = mosaic_fwd.forward(q, k, v, **options, **ids, config=forward_config, interpret=params)
  delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  kernels = backward_wide if shape[-1] == 256 else mosaic_bwd
  got = (out, lse, *kernels.backward(q, k, v, do, lse, delta, **options, **ids, config=backward_config,
                                     interpret=params))
  want = reference_with_grads(q, k, v, do, dlse, causal=options.get("causal", False),
                              window=options.get("window_size", (None, None)), softcap=options.get("softcap"),
                              alibi_slopes=options.get("alibi_slopes"),
                              segment_ids=(ids["q_segment_ids"], ids["kv_segment_ids"]))
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_matches_reference(got, want, do, tol=1e-2)
  if kind == "cross":
    blind = np.asarray(ids["q_segment_ids"] == 3)
    assert blind.any() and np.all(np.isneginf(np.asarray(lse)[np.broadcast_to(blind[:, None], lse.shape)]))
    for x in (out, got[2]):
      np.testing.assert_array_equal(np.asarray(x, np.float32)[blind], 0.0)
  if races:
    assert not _races_found()


def test_flash_attention_segment_ids_on_mosaic():
  """flash_attention(backend="mosaic") with packed segment ids, causal,
  ragged and grouped-query: both passes on the Mosaic kernels (the two-kernel
  backward at head_dim 64, its measured tiles) through the custom_vjp, in
  Mosaic's interpreter, against the reference with random cotangents on out
  and lse."""
  (q, k, v, do, dlse), options = _arrays((1, 72, 72, 2, 64), 1, jnp.bfloat16, dict(causal=True), seed=5)
  q_ids, kv_ids = _segment_ids("packed", 1, 72, 72, seed=5)
  options.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  got = plan(q, k, v, **options, interpret=True, backend="mosaic")
  assert (got.forward.backend, got.backward.backend) == ("mosaic", "mosaic")
  assert not got.backward.config.fused_dq
  got = flash_with_grads(q, k, v, do, dlse, backend="mosaic", **options)
  want = reference_with_grads(q, k, v, do, dlse, causal=True, segment_ids=(q_ids, kv_ids))
  assert_matches_reference(got, want, do, tol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kernels_with_segment_ids_lower_for_cuda(head_dim):
  """The causal forward and backward with segment ids, at their default
  tilings (one CTA a tile), lower for sm_90a; the forward also at the
  tiling a long sequence takes (three consumers at head_dim 64)."""
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  q = jax.ShapeDtypeStruct((2, 1024, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
  rows = jax.ShapeDtypeStruct((2, 4, 1024), jnp.float32)
  text = lower(lambda q, k, v, a, b: mosaic_fwd.forward(q, k, v, causal=True, q_segment_ids=a, kv_segment_ids=b),
               q, kv, kv, ids, ids)
  assert "flash2_fwd_mosaic" in text and "mosaic_gpu_v2" in text
  long = defaults.mosaic_forward(head_dim, seq_q=16384, causal=True, segments=True)
  text = lower(lambda q, k, v, a, b: mosaic_fwd.forward(q, k, v, causal=True, q_segment_ids=a, kv_segment_ids=b,
                                                        config=long), q, kv, kv, ids, ids)
  assert "flash2_fwd_mosaic" in text
  kernels, wide = (backward_wide, "_wide") if head_dim == 256 else (mosaic_bwd, "")
  text = lower(lambda q, k, v, lse, a, b: kernels.backward(q, k, v, q, lse, lse, causal=True, q_segment_ids=a,
                                                            kv_segment_ids=b), q, kv, kv, rows, ids, ids)
  assert f"flash2_bwd_dkv{wide}_mosaic" in text and f"flash2_bwd_dq{wide}_mosaic" in text
