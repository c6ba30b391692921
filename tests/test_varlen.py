"""flash_attention_varlen against the float64 reference run on each sequence
on its own (so the slot layout and the segment ids are checked, not
assumed), on the XLA path and the Triton kernels (interpret mode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_matches_reference, cu_seqlens as _cu, rel_err, varlen_reference_with_grads as _reference
from jax_flash2 import flash_attention_varlen

HEADS, HEAD_DIM = 4, 16
# Ragged, with an empty sequence, one with no keys, and both len_q < len_k and len_q > len_k.
LENS_Q, LENS_K = (5, 0, 17, 3, 9), (7, 0, 4, 0, 20)


def _inputs(seed, lens_q, lens_k, kv_heads, extra_q_rows=0):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  tq, tk = sum(lens_q) + extra_q_rows, sum(lens_k)
  q, k, v, dout = draw(tq, HEADS, HEAD_DIM), draw(tk, kv_heads, HEAD_DIM), draw(tk, kv_heads, HEAD_DIM), draw(
      tq, HEADS, HEAD_DIM)
  dlse = draw(HEADS, tq)
  sinks = jnp.asarray(np.log(8.0) + rng.standard_normal(HEADS), jnp.float32)
  return q, k, v, dout, dlse, sinks


@functools.partial(jax.jit, static_argnames=("static",))
def _varlen_with_grads(q, k, v, dout, dlse, cu_q, cu_k, sinks, alibi_slopes, *, static):
  options = dict(static)
  same = options.pop("same")
  wrt = (q, k, v) + (() if sinks is None else (sinks,))

  def f(q, k, v, *maybe_sinks):
    return flash_attention_varlen(q, k, v, cu_q, cu_q if same else cu_k, return_lse=True,
                                  sinks=maybe_sinks[0] if maybe_sinks else None, alibi_slopes=alibi_slopes,
                                  **options)

  (out, lse), vjp = jax.vjp(f, *wrt)
  return (out, lse, *vjp((dout, dlse)))


def _varlen(q, k, v, dout, dlse, lens_q, lens_k, *, sinks=None, alibi_slopes=None, same=False, **options):
  static = tuple(sorted(dict(options, same=same).items()))
  return _varlen_with_grads(q, k, v, dout, dlse, _cu(lens_q), _cu(lens_k), sinks, alibi_slopes, static=static)


CASES = {
    "causal_gqa": dict(kv_heads=2, causal=True),
    "window_softcap": dict(kv_heads=4, window_size=(3, 2), softcap=4.0),
    "alibi_sinks_causal_mqa": dict(kv_heads=1, causal=True, alibi=True, sinks=True),
    "full_sinks": dict(kv_heads=4, sinks=True),
}


@pytest.mark.parametrize("backend", ["xla", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_each_sequence_alone(case, backend):
  options = dict(CASES[case])
  kv_heads = options.pop("kv_heads")
  q, k, v, dout, dlse, sinks = _inputs(7, LENS_Q, LENS_K, kv_heads)
  extra = {}
  if options.pop("sinks", False):
    extra["sinks"] = sinks
  if options.pop("alibi", False):
    extra["alibi_slopes"] = 2.0 ** -jnp.arange(1, HEADS + 1, dtype=jnp.float32)
  ref_options = dict(options)
  if "window_size" in ref_options:
    ref_options["window"] = ref_options.pop("window_size")
  want = _reference(q, k, v, dout, dlse, LENS_Q, LENS_K, **extra, **ref_options)
  got = _varlen(q, k, v, dout, dlse, LENS_Q, LENS_K, backend=backend, interpret=backend == "triton", **extra,
                **options)
  assert_matches_reference(got, want, dout)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_self_attention_keeps_rows_in_place(backend):
  # The same cu_seqlens array for both sides takes the in-place path; a copy
  # of it the slot layout: both must give each sequence alone.
  lens = (6, 0, 11, 3)
  q, k, v, dout, dlse, sinks = _inputs(3, lens, lens, 2)
  options = dict(causal=True, window_size=(4, None), backend=backend, interpret=backend == "triton")
  want = _reference(q, k, v, dout, dlse, lens, lens, sinks=sinks, causal=True, window=(4, None))
  in_place = _varlen(q, k, v, dout, dlse, lens, lens, sinks=sinks, same=True, **options)
  slots = _varlen(q, k, v, dout, dlse, lens, lens, sinks=sinks, same=False, **options)
  assert_matches_reference(in_place, want, dout)
  assert_matches_reference(slots, want, dout)


@pytest.mark.parametrize("same", [True, False])
def test_rows_past_the_last_sequence_see_nothing(same):
  lens = (4, 5)
  q, k, v, dout, dlse, sinks = _inputs(5, lens, lens, 4, extra_q_rows=3 if not same else 0)
  if same:  # cu_seqlens ending short of the rows given, for both sides
    k, v = q[:, :4], dout[:, :4]
    cu = jnp.asarray([0, 4, 6], jnp.int32)
    out, lse = flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks, return_lse=True, backend="xla")
    tail = slice(6, None)
  else:
    out, lse = flash_attention_varlen(q, k, v, _cu(lens), _cu(lens), causal=True, sinks=sinks, return_lse=True,
                                      backend="xla")
    tail = slice(sum(lens), None)
  assert np.all(np.asarray(out[tail]) == 0)
  np.testing.assert_array_equal(np.asarray(lse[:, tail]), np.broadcast_to(np.asarray(sinks)[:, None],
                                                                          lse[:, tail].shape))


def test_jit_matches_eager_and_max_seqlen_shrinks_nothing_visible():
  q, k, v, dout, dlse, sinks = _inputs(11, LENS_Q, LENS_K, 2)
  cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
  f = lambda q, k, v, cu_q, cu_k, **kw: flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                                               backend="xla", **kw)
  eager = f(q, k, v, cu_q, cu_k)
  jitted = jax.jit(f)(q, k, v, cu_q, cu_k)
  bounded = f(q, k, v, cu_q, cu_k, max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K))
  for a, b, c in zip(eager, jitted, bounded):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("same", [True, False], ids=["in_place", "slots"])
def test_packing_runs_no_loop(same):
  """The row ids and slots come from loop-free programs: a while loop's every
  step is a host round trip on a GPU (jnp.searchsorted's default method)."""
  q, k, v, *_ = _inputs(12, LENS_Q, LENS_Q if same else LENS_K, 2)
  cu_q = _cu(LENS_Q)
  cu_k = cu_q if same else _cu(LENS_K)
  text = jax.jit(lambda q, k, v, cu_q, cu_k: flash_attention_varlen(
      q, k, v, cu_q, cu_q if same else cu_k, causal=True, backend="xla")).lower(q, k, v, cu_q, cu_k).as_text()
  assert "stablehlo.while" not in text


def test_no_sequences():
  q, k, v, _, _, sinks = _inputs(1, (3,), (2,), 4)
  cu = jnp.zeros((1,), jnp.int32)
  out, lse = flash_attention_varlen(q, k, v, cu, cu, sinks=sinks, return_lse=True, backend="xla")
  assert np.all(np.asarray(out) == 0) and rel_err(lse, jnp.broadcast_to(sinks[:, None], lse.shape)) == 0


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q_shape=(1, 9, 4, 16)), ValueError, r"q \[total_q, heads, head_dim\]"),
        (dict(cu_q=[1, 4, 9]), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_q=[0, 5, 4]), ValueError, "cu_seqlens_q must start at 0, never decrease"),
        (dict(cu_k=[0, 4, 99]), ValueError, "cu_seqlens_k .* end at most at 9"),
        (dict(cu_k=[0.0, 4.0, 9.0]), TypeError, "cu_seqlens_k must hold integers"),
        (dict(cu_k=[0, 9]), ValueError, "as many sequences"),
        (dict(cu_q=[[0, 4, 9]]), ValueError, r"cu_seqlens_q must be an int32 \[num_seqs \+ 1\]"),
        (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is less than the longest sequence \(5\)"),
        (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be a non-negative int"),
        (dict(alibi_slopes=jnp.ones((2, 4))), ValueError, r"alibi_slopes must have shape \[heads\]"),
        (dict(return_lse="no"), TypeError, "return_lse must be a bool"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int or None, got -1"),
        (dict(v_shape=(7, 2, 16)), ValueError, r"k, v \[total_k, kv_heads, head_dim\].*\(7, 2, 16\)"),  # silent before
        (dict(k_shape=(9, 3, 16), v_shape=(9, 3, 16)), ValueError, r"heads a multiple of kv_heads.*\(9, 3, 16\)"),
        (dict(k_shape=(5, 2, 16), v_shape=(5, 2, 16), cu_k="same"), ValueError, "cu_seqlens_k .* end at most at 5"),
        # With no sequence nothing reaches flash_attention: the options are checked all the same.
        (dict(cu_q=[0], cu_k=[0], sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \[heads\] = \(4,\)"),
        (dict(cu_q=[0], cu_k=[0], window_size=(-1, 0)), ValueError, "window_size sides must be ints >= 0"),
        (dict(cu_q=[0], cu_k=[0], softcap=0.0), ValueError, "softcap must be a finite positive number"),
        (dict(cu_q=[0], cu_k=[0], backend="gpu"), ValueError, "backend must be one of"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
  q = jnp.ones(change.pop("q_shape", (9, 4, 16)), jnp.float32)
  k = jnp.ones(change.pop("k_shape", (9, 2, 16)), jnp.float32)
  v = jnp.ones(change.pop("v_shape", k.shape), jnp.float32)
  cu_q = jnp.asarray(change.pop("cu_q", [0, 4, 9]))
  cu_k = change.pop("cu_k", [0, 3, 9])
  cu_k = cu_q if cu_k == "same" else jnp.asarray(cu_k)
  change.setdefault("backend", "xla")
  with pytest.raises(error, match=match):
    flash_attention_varlen(q, k, v, cu_q, cu_k, **change)


def test_no_keys_at_all():
  q, *_, sinks = _inputs(3, (3, 2), (0, 0), 2)
  k = v = jnp.zeros((0, 2, HEAD_DIM), jnp.float32)
  out, lse = flash_attention_varlen(q, k, v, _cu((3, 2)), _cu((0, 0)), sinks=sinks, return_lse=True, backend="xla")
  assert np.all(np.asarray(out) == 0) and rel_err(lse, jnp.broadcast_to(sinks[:, None], lse.shape)) == 0


def test_traced_cu_seqlens_check_shapes_and_dtypes():
  q = jnp.ones((9, 4, 16), jnp.float32)
  k = v = jnp.ones((9, 2, 16), jnp.float32)
  f = jax.jit(lambda cu_q, cu_k: flash_attention_varlen(q, k, v, cu_q, cu_k, backend="xla"))
  assert f(jnp.asarray([0, 4, 9], jnp.int64), jnp.asarray([0, 3, 9], jnp.int32)).shape == q.shape
  with pytest.raises(TypeError, match="cu_seqlens_k must hold integers, got float32"):
    f(jnp.asarray([0, 4, 9]), jnp.asarray([0.0, 3.0, 9.0], jnp.float32))
  with pytest.raises(ValueError, match="as many sequences"):
    f(jnp.asarray([0, 4, 9]), jnp.asarray([0, 9]))
