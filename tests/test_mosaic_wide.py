"""The head_dim-256 Mosaic GPU backward (jax_flash2.mosaic.backward_wide).

On CPU: its shared-memory accounting, rejections, lowering for CUDA, and
the kernels in Mosaic's interpreter with its race detector (small shapes:
the interpreter is slow) against the float32 reference's gradients;
unwritten output blocks read NaN there (uninitialized_memory="nan", the
interpreter's default), so they fail. The race detector does not see
wgmma's shared-memory reads (jax 0.11.2: no vector clocks in its wgmma), so
the protection of the consumers' shared P^T / dS^T tile is not checked by
it: a write moved before the wait for `free` went unflagged. On a Hopper GPU
(`pytest -m gpu`): the compiled kernels at 1k-4k, and
flash_attention(backend="mosaic") at the Triton path's bar
(tests/test_gpu.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import reference_with_grads, rel_err
from jax_flash2 import defaults
from jax_flash2.config import MosaicBackwardConfig
from jax_flash2.mosaic import backward_wide as wide
from jax_flash2.mosaic import common
from test_mosaic import _bwd_problem, _bwd_structs, _is_hopper, _races_found

D = 256
hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU (compute capability 9.x)")


# ---------------------------------------------------------------- config


def test_wide_config_fits_shared_memory():
  config = defaults.mosaic_backward(D)
  assert config == MosaicBackwardConfig(64, 64, 2, dq_persistent=True)
  for dtype in (jnp.bfloat16, jnp.float16):
    # K, V; two slots of Q, dO, lse, delta; P^T and dS^T (dkv). Q, dO, lse,
    # delta; two slots of K, V; dS (dq).
    tile = 64 * D * 2
    reserve = common.BWD_SMEM_RESERVE
    assert wide.dkv_smem_bytes(config, D, dtype) == 2 * tile + 2 * (2 * tile + 2 * 64 * 4) + 2 * 64 * 64 * 2 + reserve
    assert wide.dq_smem_bytes(config, D, dtype) == 2 * tile + 2 * 64 * 4 + 2 * 2 * tile + 64 * 64 * 2 + reserve
    assert max(wide.dkv_smem_bytes(config, D, dtype), wide.dq_smem_bytes(config, D, dtype)) <= common.SMEM_LIMIT
  # A third ring slot does not fit.
  assert wide.dq_smem_bytes(dataclasses.replace(config, stages=3), D, jnp.bfloat16) > common.SMEM_LIMIT


@pytest.mark.parametrize("kernel", ["dkv", "dq", "backward"])
def test_wide_rejects(kernel):
  fn = getattr(wide, kernel)
  q, k, v, do, lse, delta = (jnp.zeros(s.shape, s.dtype) for s in _bwd_structs(1, 128, 128, 1, D))
  for config, match in (
      (MosaicBackwardConfig(128, 64, 2), "block_q = block_kv = 64"),
      (MosaicBackwardConfig(64, 64, 2, fused_dq=True), "takes none of"),
      (MosaicBackwardConfig(64, 64, 2, dq_softmax_overlap=True), "takes none of"),
      (MosaicBackwardConfig(64, 64, 2, early_vectors=True), "takes none of"),
      (MosaicBackwardConfig(64, 64, 3), "shared memory"),
  ):
    with pytest.raises(ValueError, match=match):
      fn(q, k, v, do, lse, delta, config=config)
  with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
    fn(*(x.astype(jnp.float32) for x in (q, k, v, do)), lse, delta)
  d128 = [jnp.zeros(s.shape, s.dtype) for s in _bwd_structs(1, 128, 128, 1, 128)]
  with pytest.raises(NotImplementedError, match=r"head_dim in \(256,\), got 128"):
    fn(*d128)
  with pytest.raises(ValueError, match="lse must be float32"):
    fn(q, k, v, do, lse[:, :, :64], delta)


# ---------------------------------------------------------------- lowering


@pytest.mark.parametrize("kernel", ["dkv", "dq", "backward"])
@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads",
    [
        ((2, 1024, 1024, 4, D), jnp.bfloat16, False, None),
        ((1, 1000, 1537, 8, D), jnp.float16, True, 2),  # ragged, grouped-query, seq_q < seq_k
    ],
    ids=["full", "ragged_causal_gqa"],
)
def test_wide_lowers_for_cuda(kernel, shape, dtype, causal, kv_heads):
  structs = _bwd_structs(*shape, dtype, kv_heads)
  f = jax.jit(lambda *a: getattr(wide, kernel)(*a, causal=causal))
  text = f.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("dkv", "dq"):
    assert (f"flash2_bwd_{name}_wide_mosaic" in text) == (kernel in (name, "backward")), name
  assert "flash2_bwd_dkv_mosaic" not in text and "flash2_bwd_dq_mosaic" not in text


# ---------------------------------------------------------------- interpreter

# Both kernels as persistent CTAs (the default has only dQ's).
PERSISTENT = MosaicBackwardConfig(64, 64, 2, dq_persistent=True, dkv_persistent=True)

INTERPRET = [
    # (shape, dtype, causal, kv_heads, entry): entry "kernels" runs dkv and dq
    # apart, "backward" both on one padding.
    ((1, 128, 128, 1, D), jnp.bfloat16, False, None, "kernels"),
    ((1, 128, 256, 2, D), jnp.float16, True, None, "kernels"),  # seq_q < seq_k: skipped and masked blocks
    ((1, 256, 128, 1, D), jnp.bfloat16, True, None, "backward"),  # seq_q > seq_k: rows that see no key give 0
    ((1, 72, 136, 2, D), jnp.bfloat16, True, 1, "backward"),  # ragged, grouped-query (dK, dV over 2 heads)
    ((1, 72, 136, 1, D), jnp.float16, False, None, "backward"),  # ragged: padded keys unmasked, zeroed
]


@pytest.mark.parametrize("shape, dtype, causal, kv_heads, entry", INTERPRET,
                         ids=["full", "causal_seq_q_lt_seq_k", "causal_seq_q_gt_seq_k", "ragged_causal_gqa",
                              "ragged_full_fp16"])
def test_wide_interpreter_matches_reference(shape, dtype, causal, kv_heads, entry, config=None):
  (q, k, v, do, lse, delta), refs = _bwd_problem(*shape, dtype, causal, kv_heads)
  kwargs = dict(causal=causal, config=config, interpret=plgpu.InterpretGPUParams(detect_races=True))
  if entry == "backward":
    grads = wide.backward(q, k, v, do, lse, delta, **kwargs)
  else:
    grads = (wide.dq(q, k, v, do, lse, delta, **kwargs), *wide.dkv(q, k, v, do, lse, delta, **kwargs))
  for name, x, ref, like in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
    assert x.shape == like.shape and x.dtype == like.dtype, name
    assert rel_err(x, ref) < 1e-2, name
  assert not _races_found()


@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads, config",
    [
        # Both kernels persistent (the interpreter runs two CTAs, each taking
        # several tiles): the ring runs on across tiles, the outer halves
        # reload after the stores. Causal tiles in pairs; seq_q > seq_k.
        ((1, 384, 256, 1, D), jnp.bfloat16, True, None, PERSISTENT),
        ((1, 200, 300, 2, D), jnp.float16, False, 1, PERSISTENT),  # ragged, grouped-query
        ((1, 256, 256, 2, D), jnp.bfloat16, True, None, MosaicBackwardConfig(64, 64, 2)),  # one CTA per tile
    ],
    ids=["persistent_causal_pairs", "persistent_ragged_gqa", "plain_grid"],
)
def test_wide_interpreter_configs(shape, dtype, causal, kv_heads, config):
  test_wide_interpreter_matches_reference(shape, dtype, causal, kv_heads, "kernels", config=config)


# ---------------------------------------------------------------- GPU


def _check_at_the_bar(shape, dtype, causal, kv_heads=None, config=None):
  """The compiled kernels' gradients against the float32 reference: under
  1e-2 relative and at most 3x the error of the plain math in `dtype` (the
  Triton path's bar, tests/test_gpu.py)."""
  (q, k, v, do, lse, delta), refs = _bwd_problem(*shape, dtype, causal, kv_heads)
  grads = jax.jit(lambda *a: wide.backward(*a, causal=causal, config=config))(q, k, v, do, lse, delta)
  plain = reference_with_grads(q, k, v, do, causal=causal, dtype=dtype)[2:]
  for name, x, ref, base in zip(("dq", "dk", "dv"), grads, refs, plain):
    err, base_err = rel_err(x, ref), rel_err(base, ref)
    assert err < 1e-2, f"{name}: relative error {err:.3g}"
    assert err <= 3.0 * base_err, f"{name}: error {err:.3g} > 3 x plain {jnp.dtype(dtype).name} {base_err:.3g}"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("seq", [1024, 4096])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wide_gpu_matches_reference(seq, causal):
  _check_at_the_bar((1, seq, seq, 4, D), jnp.bfloat16, causal)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape, dtype, kv_heads",
    [
        ((1, 1024, 2048, 8, D), jnp.bfloat16, 2),  # grouped-query, seq_q < seq_k
        ((1, 2048, 1024, 4, D), jnp.float16, None),  # seq_q > seq_k
        ((1, 1000, 1537, 8, D), jnp.bfloat16, 2),  # ragged, grouped-query
        ((2, 1537, 1000, 2, D), jnp.float16, None),  # ragged, seq_q > seq_k
    ],
    ids=["gqa", "seq_q_gt_seq_k", "ragged_gqa", "ragged_seq_q_gt_seq_k"],
)
def test_wide_gpu_variants(shape, dtype, kv_heads, causal):
  _check_at_the_bar(shape, dtype, causal, kv_heads)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wide_gpu_backend_mosaic(causal):
  """flash_attention(backend="mosaic") at head_dim 256: the Mosaic forward and
  these kernels through the custom_vjp, at the Triton path's bar."""
  from test_gpu import _check

  _check((1, 2048, 2048, 4, D), jnp.bfloat16, causal, backend="mosaic")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads",
    [
        ((1, 4096, 4096, 4, D), jnp.bfloat16, True, None),
        ((1, 1000, 1537, 8, D), jnp.float16, False, 2),  # ragged, grouped-query
    ],
    ids=["causal_4k", "ragged_gqa"],
)
def test_wide_gpu_persistent(shape, dtype, causal, kv_heads):
  _check_at_the_bar(shape, dtype, causal, kv_heads, config=PERSISTENT)
