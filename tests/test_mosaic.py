"""The Mosaic GPU kernels (jax_flash2.mosaic: common, forward, backward,
backward_fused; backward_wide in test_mosaic_wide.py).

On CPU: shared-memory accounting, config validation, the rejections,
lowering for CUDA (Pallas -> Mosaic GPU dialect -> layout inference, all in
Python: API misuse fails here without a GPU), the persistent schedules and
the fused kernel's order of additions, and Mosaic's interpreter on small
shapes with its race detector (its wgmma takes a shared-memory detour; see
the kernels), whole-block and ragged lengths (padded inside; only the
ragged ones pay for a copy).

On a Hopper GPU (`pytest -m gpu tests/test_mosaic.py`): each kernel alone
against the float32 reference, relative error under 1e-2; tests/test_gpu.py
holds the API-level GPU tests at the Triton path's bar. Skipped unless the
device's compute capability is 9.x (wgmma, TMA and setmaxnreg are sm_90a).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import defaults, reference
from jax_flash2.config import MosaicBackwardConfig, MosaicForwardConfig
from jax_flash2.mask import NUMPY, Mask
from jax_flash2.mosaic import backward as mosaic_bwd
from jax_flash2.mosaic import backward_fused, backward_wide, common
from jax_flash2.mosaic import forward as mosaic


def _structs(batch, seq_q, seq_k, heads, head_dim, dtype=jnp.bfloat16, kv_heads=None):
  kv_heads = kv_heads or heads
  q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
  return q, kv, kv


def _forward_default(head_dim, seq_q=1024, causal=False):
  return defaults.mosaic_forward(head_dim, seq_q=seq_q, causal=causal)


# ---------------------------------------------------------------- config


def test_forward_defaults_fit_shared_memory():
  for head_dim in common.SUPPORTED_HEAD_DIMS:
    for seq_q, causal in ((1024, False), (8192, True)):
      config = _forward_default(head_dim, seq_q, causal)
      assert mosaic.smem_bytes(config, head_dim, jnp.bfloat16) <= common.SMEM_LIMIT, head_dim
  # head_dim 128: Q tiles (32 KiB) and three slots of K and V (192 KiB) fit;
  # beside a persistent CTA's second Q tiles they do not.
  assert mosaic.smem_bytes(MosaicForwardConfig(stages=3), 128, jnp.float16) <= common.SMEM_LIMIT
  assert mosaic.smem_bytes(MosaicForwardConfig(stages=3, persistent=True), 128, jnp.float16) > common.SMEM_LIMIT
  # A persistent CTA keeps a second set of Q tiles (32 KiB more at head_dim
  # 128): it fits beside two slots at 128, not at 256 (64 KiB more).
  persistent = MosaicForwardConfig(persistent=True)
  assert mosaic.smem_bytes(persistent, 128, jnp.bfloat16) == (
      mosaic.smem_bytes(MosaicForwardConfig(), 128, jnp.bfloat16) + 32 * 1024)
  assert mosaic.smem_bytes(persistent, 128, jnp.bfloat16) <= common.SMEM_LIMIT
  assert mosaic.smem_bytes(MosaicForwardConfig(block_kv=64, persistent=True), 256, jnp.bfloat16) > common.SMEM_LIMIT


def test_default_forward_three_consumers_from_measured_lengths():
  """head_dim 64 takes three consumers from 2k without a mask, 8k causal
  (the measured thresholds); other head_dims never."""
  assert _forward_default(64, seq_q=1024).consumers == 2
  assert _forward_default(64, seq_q=2048).consumers == 3
  assert _forward_default(64, seq_q=4096, causal=True).consumers == 2
  three = _forward_default(64, seq_q=8192, causal=True)
  assert (three.consumers, three.block_q) == (3, 192)
  assert mosaic.smem_bytes(three, 64, jnp.bfloat16) <= common.SMEM_LIMIT
  assert _forward_default(128, seq_q=16384).consumers == 2


def test_three_consumers_skip_the_padding_copy_on_the_gpu():
  """seq_q 512 in 192-row Q blocks: whole 64-row consumer tiles, so the
  kernel compiled for the GPU reads q as it is (the TMA engine zero-fills
  the last block's rows past 512, which store nothing), and 500 (a partial
  consumer tile) is padded."""
  config = MosaicForwardConfig(block_q=192, block_kv=128, stages=4, softmax_overlap=True, persistent=True,
                               consumers=3)
  for seq_q, padded in ((512, False), (500, True)):
    q = jax.ShapeDtypeStruct((1, seq_q, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    text = _lower_for_cuda(q, k, k, False, config)
    assert ("stablehlo.pad" in text) == padded, seq_q
    assert f"tensor<1x{seq_q}x2x64xbf16>" in text


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_q=64), ValueError, "block_q must be 128 or 256"),
        (dict(block_q=192), ValueError, "block_q must be 128 or 256"),
        (dict(block_kv=32), ValueError, "block_kv must be 64, 128 or 256"),
        (dict(block_kv=512), ValueError, "block_kv must be 64, 128 or 256"),
        (dict(stages=1), ValueError, "stages must be between 2 and 8"),
        (dict(stages=9), ValueError, "stages must be between 2 and 8"),
        (dict(stages=2.0), TypeError, "stages must be an int"),
        (dict(block_q=True), TypeError, "block_q must be an int"),
        (dict(softmax_overlap=1), TypeError, "softmax_overlap must be a bool"),
        (dict(persistent=None), TypeError, "persistent must be a bool"),
        (dict(persistent=True, balanced=1), TypeError, "balanced must be a bool"),
        (dict(balanced=True), ValueError, "balanced needs persistent"),
        (dict(consumers=4), ValueError, "consumers must be 2 or 3"),
        (dict(consumers=3.0), TypeError, "consumers must be an int"),
        (dict(consumers=3), ValueError, "block_q must be 192 or 384"),
    ],
)
def test_forward_config_rejects(kwargs, error, match):
  with pytest.raises(error, match=match):
    MosaicForwardConfig(**kwargs)


def test_config_is_frozen_and_hashable():
  config = MosaicForwardConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.stages = 3  # type: ignore[misc]
  assert hash(config) == hash(MosaicForwardConfig())
  assert config.rows_per_consumer == 64


def _tiles_of(schedule, table=None) -> list[list[tuple[int, int, int]]]:
  """Each CTA's tiles, (block, head, batch) in the order it runs them, from
  the schedule's own int32 arithmetic (evaluated for every CTA and tile at
  once)."""
  counts = np.asarray(schedule.tile_count(jnp.arange(schedule.num_ctas, dtype=jnp.int32), table))
  cta, i = np.meshgrid(np.arange(schedule.num_ctas), np.arange(counts.max()), indexing="ij")
  block, head, batch = (np.asarray(x) for x in schedule.tile(jnp.asarray(cta, jnp.int32), jnp.asarray(i, jnp.int32),
                                                             table))
  return [[(int(block[c, t]), int(head[c, t]), int(batch[c, t])) for t in range(counts[c])]
          for c in range(schedule.num_ctas)]


@pytest.mark.parametrize("num_q_blocks, heads, batch, causal", [
    (16, 16, 8, False), (16, 16, 8, True), (128, 16, 1, True), (13, 3, 2, True), (7, 1, 1, True), (3, 1, 1, False),
])
def test_persistent_schedule_covers_every_tile_once(num_q_blocks, heads, batch, causal):
  schedule = common.PersistentSchedule.create(num_q_blocks, heads, batch, causal=causal, interpret=False)
  tiles = _tiles_of(schedule)
  assert min(len(t) for t in tiles) >= 1
  every = [(q, h, b) for q in range(num_q_blocks) for h in range(heads) for b in range(batch)]
  assert sorted(tile for cta in tiles for tile in cta) == every
  if causal and schedule.num_tiles >= 4 * schedule.num_ctas and num_q_blocks % 2 == 0:
    # Pairs of equal work: every CTA within one pair's work of the others (a
    # causal kernel reverses q_index: its work grows with the index).
    work = [sum(num_q_blocks - q_index for q_index, _, _ in cta) for cta in tiles]
    assert max(work) - min(work) <= num_q_blocks + 1


@pytest.mark.parametrize("num_q_blocks, heads, batch, consumers, seq", [
    (32, 32, 4, 2, 4096), (43, 32, 2, 3, 8192), (86, 32, 1, 3, 16384), (128, 16, 1, 2, 16384), (16, 16, 8, 2, 2048),
    (13, 3, 2, 2, 1600), (7, 1, 1, 2, 896),
], ids=["d64_4k", "d64_8k_three", "d64_16k_three", "d128_16k", "d128_2k", "small", "fewer_tiles_than_ctas"])
def test_balanced_schedule(num_q_blocks, heads, batch, consumers, seq):
  """The balanced table (MosaicForwardConfig.balanced) runs every tile once,
  and no CTA's work (ring steps and a step a tile) exceeds the mean by more
  than one tile's, nor the paired schedule's busiest CTA: at the bench
  shapes within 1% of the mean."""
  block_q = 64 * consumers
  work = common.q_tile_work(num_q_blocks, block_q=block_q, block_kv=128, mask=Mask(seq, seq, causal=True),
                            consumers=consumers)
  assert work[0] == max(work) and work[-1] == min(work)  # block 0 the heaviest
  balanced = common.PersistentSchedule.create(num_q_blocks, heads, batch, causal=True, interpret=False, work=work)
  paired = common.PersistentSchedule.create(num_q_blocks, heads, batch, causal=True, interpret=False)
  table = jnp.asarray(balanced.table())
  cost = lambda tiles: sum(work[block] + common.TILE_OVERHEAD_STEPS for block, _, _ in tiles)
  tiles = _tiles_of(balanced, table)
  every = [(q, h, b) for q in range(num_q_blocks) for h in range(heads) for b in range(batch)]
  assert sorted(tile for cta in tiles for tile in cta) == every
  loads = [cost(cta) for cta in tiles]
  busiest, mean = max(loads), np.mean(loads)
  assert busiest <= mean + max(work) + 1 and busiest <= max(cost(cta) for cta in _tiles_of(paired))
  if num_q_blocks * heads * batch >= 2048:
    assert busiest <= 1.01 * mean
  # One column past each CTA's last tile, read ahead by run_tiles, is in bounds.
  assert table.shape[1] >= 2 + max(len(cta) for cta in tiles)


# ---------------------------------------------------------------- errors


def _bad_inputs():
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _structs(1, 256, 256, 2, 64))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  yield "float32", f32, {}, NotImplementedError, "bfloat16 and float16"
  d96 = [jnp.zeros((1, 256, 2, 96), jnp.bfloat16)] * 3
  yield "head_dim", d96, {}, NotImplementedError, r"head_dim in \(64, 128, 256\), got 96"
  yield "rank", (q[0], k, v), {}, ValueError, r"\[batch, seq, heads, head_dim\]"
  yield "kv_shape", (q, k, v[:, :128]), {}, ValueError, "k and v must have one shape"
  yield "heads", (q[:, :, :1], k, v), {}, ValueError, r"multiple of k's \(2\)"
  yield "mixed", (q, k.astype(jnp.float16), v), {}, ValueError, "share a dtype"
  deep = MosaicForwardConfig(block_kv=256, stages=4)
  yield "smem", (q, k, v), dict(config=deep), ValueError, "bytes of shared memory"
  yield "smem_ragged", (q[:, :200], k[:, :100], v[:, :100]), dict(config=deep), ValueError, "bytes of shared memory"


@pytest.mark.parametrize("args, kwargs, error, match", [c[1:] for c in _bad_inputs()], ids=[c[0] for c in _bad_inputs()])
def test_rejects(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    mosaic.forward(*args, **kwargs)


# ---------------------------------------------------------------- lowering


def _lower_for_cuda(q, k, v, causal, config=None) -> str:
  f = jax.jit(lambda q, k, v: mosaic.forward(q, k, v, causal=causal, config=config))
  return f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


def _kernels_text(f, *args) -> str:
  """The Mosaic GPU kernels of f, lowered for CUDA (the whole Python side of
  Mosaic GPU), as MLIR text without what differs between two lowerings of
  one kernel (a per-process counter in the dump name, hence the kernel hash;
  debug locations): two texts differ only where the kernels do. (The
  lowered HLO text differs from one lowering to the next.)"""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import dialect

  module = jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  context = jax_mlir.make_ir_context()
  dialect.register_dialect(context)
  context.allow_unregistered_dialects = True  # the serialized kernels' stable dialect
  kernels = []

  def visit(op):
    if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
      config = ir.DictAttr(op.attributes["mhlo.backend_config"])
      if "module" in config:
        kernel = ir.Module.parse(ir.StringAttr(config["module"]).value_bytes, context=context)
        kernels.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "",
                              kernel.operation.get_asm(enable_debug_info=False)))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner.operation)

  visit(module.operation)
  assert kernels, "no Mosaic GPU kernel"
  return "\n".join(kernels)


def test_kernels_text_is_the_same_for_the_same_kernel():
  """What the "changes the kernel" tests compare: equal for equal kernels
  (the lowered HLO text is not), different for different ones."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  f = lambda config: (lambda q, k, v: mosaic.forward(q, k, v, config=config))
  plain = _forward_default(64, seq_q=256)
  assert _kernels_text(f(plain), q, q, q) == _kernels_text(f(plain), q, q, q)
  assert _kernels_text(f(plain), q, q, q) != _kernels_text(f(dataclasses.replace(plain, stages=3)), q, q, q)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lowers_for_cuda(head_dim, dtype, causal):
  # Runs the whole Python side of Mosaic GPU for an sm_90 target (layout
  # inference, wgmma shapes, TMA transforms, barriers); the remaining passes
  # (to PTX and SASS) run where the custom call is compiled, on the GPU host.
  text = _lower_for_cuda(*_structs(2, 512, 512, 2, head_dim, dtype), causal)
  assert "mosaic_gpu_v2" in text
  out_type = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
  assert f"tensor<2x512x2x{head_dim}x{out_type}>" in text
  assert "tensor<2x2x512xf32>" in text  # lse


@pytest.mark.parametrize(
    "shape, kv_heads, config",
    [
        ((1, 1024, 2048, 8, 128), 2, None),  # grouped-query, seq_q < seq_k
        ((1, 2048, 1024, 4, 128), None, None),  # seq_q > seq_k: rows that see no key
        ((1, 1024, 1024, 2, 128), None, MosaicForwardConfig(block_q=128, block_kv=64, stages=4)),
        ((1, 1024, 1024, 2, 64), None, MosaicForwardConfig(block_q=256, block_kv=64, stages=3)),
        ((1, 1000, 1537, 2, 128), None, MosaicForwardConfig(softmax_overlap=True)),
        ((2, 1000, 1537, 4, 128), 2, MosaicForwardConfig(softmax_overlap=True, persistent=True)),
        ((1, 2048, 1024, 4, 64), None, MosaicForwardConfig(stages=4, persistent=True)),
        ((2, 1000, 1537, 4, 64), 2, MosaicForwardConfig(block_q=192, stages=4, softmax_overlap=True, persistent=True,
                                                        balanced=True, consumers=3)),
    ],
)
def test_lowers_for_cuda_variants(shape, kv_heads, config):
  text = _lower_for_cuda(*_structs(*shape, kv_heads=kv_heads), True, config)
  assert "mosaic_gpu_v2" in text


@pytest.mark.parametrize(
    "shape, kv_heads, causal, config, padded",
    [
        ((2, 200, 200, 2, 64), None, False, None, (256, 256)),
        ((1, 1000, 1537, 8, 128), 2, True, None, (1024, 1664)),  # grouped-query, seq_q < seq_k
        ((1, 1537, 1000, 4, 128), None, True, None, (1664, 1024)),  # rows that see no key
        ((1, 1, 257, 2, 256), None, False, None, (128, 320)),
        ((1, 257, 1, 2, 64), None, True, MosaicForwardConfig(block_q=256, block_kv=64, stages=3), (512, 64)),
    ],
    ids=["200", "gqa_1000x1537", "1537x1000", "1x257_d256", "257x1"],
)
def test_lowers_for_cuda_ragged(shape, kv_heads, causal, config, padded):
  batch, seq_q, seq_k, heads, head_dim = shape
  text = _lower_for_cuda(*_structs(*shape, kv_heads=kv_heads), causal, config)
  assert "mosaic_gpu_v2" in text
  # The kernel runs on whole blocks; the caller gets the real lengths back.
  assert f"tensor<{batch}x{padded[0]}x{heads}x{head_dim}xbf16>" in text
  assert f"tensor<{batch}x{padded[1]}x{kv_heads or heads}x{head_dim}xbf16>" in text
  assert f"tensor<{batch}x{seq_q}x{heads}x{head_dim}xbf16>" in text
  assert f"tensor<{batch}x{heads}x{seq_q}xf32>" in text


def _copies(f, *args) -> list[str]:
  """The operations around the kernel that copy an array: jnp.pad (a jit
  named _pad) and slices."""
  names = [eqn.params.get("name", eqn.primitive.name).strip("_") for eqn in jax.make_jaxpr(f)(*args).eqns]
  return sorted(name for name in names if name in ("pad", "slice"))


def test_only_ragged_lengths_pay_for_padding():
  """Whole blocks reach the kernel as they are (no pad, no slice: no copy);
  a ragged length pads what it must and slices the results back."""
  forward = lambda q, k, v: mosaic.forward(q, k, v, causal=True)
  assert _copies(forward, *_structs(1, 512, 256, 2, 128)) == []
  assert _copies(forward, *_structs(1, 500, 256, 2, 128)) == ["pad", "slice", "slice"]  # q; out, lse
  assert _copies(forward, *_structs(1, 512, 250, 2, 128)) == ["pad", "pad"]  # k, v


# ---------------------------------------------------------------- interpreter


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale"))
def _reference(q, k, v, *, causal, softmax_scale):
  """(out, lse) of the plain-jnp reference in float32, one jitted program
  (op by op on CPU it cost a quarter of the interpreted kernel's time)."""
  return reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, compute_dtype=jnp.float32)


def _check_against_reference(batch, seq_q, seq_k, heads, head_dim, dtype, causal, *, kv_heads=None,
                             config=None, interpret=True, tol=1e-2, softmax_scale=None):
  q, k, v, _ = random_inputs(0, batch, seq_q, seq_k, heads, head_dim, dtype)
  if kv_heads is not None:
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  out, lse = mosaic.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, config=config, interpret=interpret)
  ref_out, ref_lse = _reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (batch, heads, seq_q) and lse.dtype == jnp.float32
  # rel_err is inf unless the -inf rows of lse (no visible key) match exactly.
  assert rel_err(out, ref_out) < tol
  assert rel_err(lse, ref_lse) < tol
  return np.asarray(lse)


@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads, config",
    [
        ((1, 256, 256, 1, 64), jnp.bfloat16, False, None, None),
        # Three ring slots over four K/V steps, with the diagonal's drain: the
        # first consumer stops a block before the second.
        ((1, 256, 256, 1, 64), jnp.float16, True, None, MosaicForwardConfig(block_q=128, block_kv=64, stages=3)),
        ((1, 128, 384, 2, 64), jnp.bfloat16, True, 1, MosaicForwardConfig(block_q=128, block_kv=64, stages=2)),
    ],
    ids=["full", "causal_drain", "gqa_seq_q_lt_seq_k"],
)
def test_interpreter_matches_reference(shape, dtype, causal, kv_heads, config):
  _check_against_reference(*shape, dtype, causal, kv_heads=kv_heads, config=config)


# softmax_overlap: P V of one block runs under the next block's softmax.
# (shape, causal, kv_heads, config): the drain (causal, 3 slots over four
# blocks), a first block that is also the diagonal (seq_q < seq_k, GQA), a
# partial last block (ragged), and one query row that sees every key.
OVERLAP = [
    ((1, 256, 256, 1, 64), True, None, MosaicForwardConfig(block_q=128, block_kv=64, stages=3, softmax_overlap=True)),
    ((1, 128, 384, 2, 64), True, 1, MosaicForwardConfig(block_q=128, block_kv=64, softmax_overlap=True)),
    ((1, 72, 136, 2, 64), False, 1, MosaicForwardConfig(block_q=128, block_kv=64, softmax_overlap=True)),
    ((1, 1, 257, 1, 64), True, None, MosaicForwardConfig(block_q=128, block_kv=64, softmax_overlap=True)),
]


def _races_found() -> bool:
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the race detector's state

  return gpu_callbacks.get_races().races_found


def _check_without_races(shape, causal, kv_heads, config):
  """The forward in Mosaic's interpreter with its race detector, against the
  reference, bf16."""
  params = plgpu.InterpretGPUParams(detect_races=True)
  _check_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=params)
  assert not _races_found()


@pytest.mark.parametrize("shape, causal, kv_heads, config", OVERLAP,
                         ids=["causal_drain", "gqa_seq_q_lt_seq_k", "ragged", "one_row"])
def test_interpreter_softmax_overlap(shape, causal, kv_heads, config):
  # The numbers, and the barrier protocol of the ring under the shifted
  # releases (V of block kb-1 is released one step later) through the race
  # detector. Mosaic's interpreter runs each wgmma when it is issued, so the
  # overlap itself (what may run while P V is in flight) is only checked on
  # the GPU (test_gpu_softmax_overlap).
  _check_without_races(shape, causal, kv_heads, config)


# persistent: (shape, causal, kv_heads, config). Two CTAs over 4-8 tiles, so
# that each runs several: the ring's slots and phases carry from one tile to
# the next (3 slots over 4 K/V blocks a tile: a tile starts mid-ring), and a
# tile's Q arrives in the buffer the previous tile's output left.
PERSISTENT = [
    ((2, 256, 256, 2, 64), False, None, MosaicForwardConfig(block_q=128, block_kv=64, stages=3, softmax_overlap=True,
                                                            persistent=True)),
    ((2, 256, 256, 1, 64), True, None, MosaicForwardConfig(block_q=128, block_kv=64, stages=3, persistent=True)),
    ((1, 384, 256, 3, 64), True, 1, MosaicForwardConfig(block_q=128, block_kv=64, softmax_overlap=True,
                                                        persistent=True)),
    ((1, 72, 136, 4, 64), False, 2, MosaicForwardConfig(block_q=128, block_kv=64, softmax_overlap=True,
                                                         persistent=True)),
    # 256-row tiles (128 rows a consumer).
    ((1, 512, 512, 2, 64), True, None, MosaicForwardConfig(block_q=256, block_kv=64, stages=3, softmax_overlap=True,
                                                           persistent=True)),
    # balanced: the tiles from the host's table (causal), with three
    # consumers and rows that see no key (tiles of no K/V block).
    ((2, 256, 256, 2, 64), True, None, MosaicForwardConfig(block_q=128, block_kv=64, stages=3, softmax_overlap=True,
                                                           persistent=True, balanced=True)),
    ((1, 576, 320, 3, 64), True, 1, MosaicForwardConfig(block_q=192, block_kv=64, softmax_overlap=True,
                                                        persistent=True, consumers=3, balanced=True)),
]


@pytest.mark.parametrize("shape, causal, kv_heads, config", PERSISTENT,
                         ids=["full_overlap", "causal_drain", "gqa_rows_that_see_nothing", "ragged_gqa", "block_q_256",
                              "balanced", "balanced_three_see_nothing"])
def test_interpreter_persistent(shape, causal, kv_heads, config):
  batch, seq_q, _, heads, _ = shape
  assert batch * heads * -(-seq_q // config.block_q) >= 2 * common._PERSISTENT_INTERPRET_CTAS
  _check_without_races(shape, causal, kv_heads, config)


# consumers=3: (shape, causal, kv_heads, config), 64 rows for each of three
# consumers. The drain (the first two consumers stop one and two blocks
# before the third), the overlap on a ragged grouped-query problem, and
# persistent CTAs over several tiles each.
THREE_CONSUMERS = [
    ((1, 192, 192, 1, 64), True, None, MosaicForwardConfig(block_q=192, block_kv=64, stages=3, consumers=3)),
    ((1, 72, 136, 2, 64), False, 1, MosaicForwardConfig(block_q=192, block_kv=64, softmax_overlap=True,
                                                         consumers=3)),
    ((1, 384, 320, 3, 64), True, 1, MosaicForwardConfig(block_q=192, block_kv=64, softmax_overlap=True,
                                                        persistent=True, consumers=3)),
]


@pytest.mark.parametrize("shape, causal, kv_heads, config", THREE_CONSUMERS,
                         ids=["causal_drain", "overlap_ragged_gqa", "persistent_causal_gqa"])
def test_interpreter_three_consumers(shape, causal, kv_heads, config):
  _check_without_races(shape, causal, kv_heads, config)


def test_interpreter_rows_that_see_no_key():
  # Causal with seq_q > seq_k: the first seq_q - seq_k rows see nothing and
  # get zeros and lse = -inf, not NaN.
  lse = _check_against_reference(1, 256, 128, 1, 64, jnp.bfloat16, True,
                                 config=MosaicForwardConfig(block_q=128, block_kv=64, stages=2), softmax_scale=0.3)
  assert np.all(np.isneginf(lse[..., :128])) and np.all(np.isfinite(lse[..., 128:]))


# Ragged lengths (padded to whole blocks inside), for the forward and the
# backward kernels alike: (batch, seq_q, seq_k, heads, head_dim), dtype,
# causal, kv_heads. The block sizes are the smallest, so that a short
# sequence still spans several blocks.
RAGGED = [
    # Non-causal, grouped-query: keys past seq_k masked in the last, partial
    # K/V block (forward, dq); dkv's last CTA has a warpgroup with 8 real keys
    # and one with none.
    ((1, 72, 136, 2, 64), jnp.bfloat16, False, 1),
    # seq_q > seq_k: the first 170 rows see no key (zeros, lse = -inf); the
    # diagonal, with the real offset, also hides the padded keys.
    ((1, 300, 130, 1, 64), jnp.bfloat16, True, None),
    # One query (and its padding) sees all 257 keys: the diagonal, at offset
    # 256, stops right before the padding of the last K/V block.
    ((1, 1, 257, 1, 64), jnp.float16, True, None),
]
RAGGED_IDS = ["72x136_full_gqa", "300x130_causal", "1x257_causal"]


@pytest.mark.parametrize("shape, dtype, causal, kv_heads", RAGGED, ids=RAGGED_IDS)
def test_interpreter_ragged_matches_reference(shape, dtype, causal, kv_heads):
  config = MosaicForwardConfig(block_q=128, block_kv=64, stages=2)
  lse = _check_against_reference(*shape, dtype, causal, kv_heads=kv_heads, config=config)
  seq_q, seq_k = shape[1:3]
  if causal and seq_q > seq_k:
    blind = seq_q - seq_k
    assert np.all(np.isneginf(lse[..., :blind])) and np.all(np.isfinite(lse[..., blind:]))


# ---------------------------------------------------------------- GPU


def _is_hopper() -> bool:
  try:
    device = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return str(getattr(device, "compute_capability", "")).startswith("9")


hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU (compute capability 9.x)")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("seq", [1024, 4096])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_matches_reference(seq, head_dim, dtype, causal):
  _check_against_reference(2, seq, seq, 4, head_dim, dtype, causal, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "shape, kv_heads, config",
    [
        ((1, 1024, 2048, 8, 128), 2, None),  # grouped-query, seq_q < seq_k
        ((1, 2048, 1024, 4, 128), None, None),  # seq_q > seq_k: rows that see no key
        ((1, 2048, 2048, 2, 128), None, MosaicForwardConfig(block_q=128, block_kv=64, stages=4)),  # drain
        ((1, 2048, 2048, 2, 256), None, None),
        ((1, 1000, 1537, 8, 128), 2, None),  # ragged: padded to whole blocks
        ((1, 1537, 1000, 4, 64), None, MosaicForwardConfig(block_q=256, block_kv=64, stages=3)),
        ((1, 777, 777, 2, 256), None, None),
        # Whole 64-row tiles, half a Q block: not padded (the TMA engine
        # zero-fills the second consumer's rows, which store nothing).
        ((2, 1088, 1024, 4, 128), None, None),
    ],
    ids=["gqa", "seq_q_gt_seq_k", "block_kv_64", "d256", "ragged_gqa", "ragged_seq_q_gt_seq_k", "ragged_d256",
         "half_block_unpadded"],
)
def test_gpu_variants(shape, kv_heads, config):
  for dtype in (jnp.bfloat16, jnp.float16):
    _check_against_reference(*shape, dtype, True, kv_heads=kv_heads, config=config, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape, kv_heads", [((4, 2048, 2048, 8, 64), None), ((2, 2100, 1537, 8, 64), 2)],
                         ids=["2k", "ragged_gqa"])
def test_gpu_three_consumers_from_2k(shape, kv_heads):
  """The d64 default without a mask takes three consumers from 2k: 2048 rows
  in 192-row Q blocks leave the last tile's third consumer past seq_q (it
  stores nothing); ragged grouped-query with seq_q > seq_k."""
  assert _forward_default(64, seq_q=shape[1]).consumers == 3
  for dtype in (jnp.bfloat16, jnp.float16):
    _check_against_reference(*shape, dtype, False, kv_heads=kv_heads, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape, kv_heads",
    [((2, 4096, 4096, 4, 64), None), ((1, 4096, 4096, 4, 128), None), ((1, 2048, 2048, 2, 256), None),
     ((1, 1000, 1537, 8, 128), 2)],
    ids=["d64", "d128", "d256", "ragged_gqa"],
)
def test_gpu_softmax_overlap(shape, kv_heads, causal):
  """The defaults (each overlaps its softmax with P V) over longer sequences."""
  config = _forward_default(shape[-1], seq_q=shape[1], causal=causal)
  assert config.softmax_overlap
  _check_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=False)


# Persistent kernels on the GPU: more tiles than SMs (132 on an H200), so
# that each CTA takes several; ragged lengths with GQA; causal seq_q > seq_k
# (rows that see no key) with an odd number of Q blocks.
PERSISTENT_GPU_SHAPES = dict(
    argnames="shape, kv_heads",
    argvalues=[((8, 2048, 2048, 16, 128), None), ((4, 2048, 2048, 32, 64), None), ((3, 1000, 1537, 16, 128), 4),
               ((2, 1537, 1000, 16, 64), None)],
    ids=["d128", "d64", "ragged_gqa", "seq_q_gt_seq_k"],
)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(**PERSISTENT_GPU_SHAPES)
def test_gpu_persistent(shape, kv_heads, causal):
  config = dataclasses.replace(_forward_default(shape[-1], seq_q=shape[1], causal=causal), persistent=True)
  _check_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "shape, kv_heads",
    PERSISTENT_GPU_SHAPES["argvalues"] + [((2, 4096, 4096, 8, 64), None), ((1, 5000, 4999, 8, 64), 2)],
    ids=PERSISTENT_GPU_SHAPES["ids"] + ["d64_4k_three", "d64_three_ragged_gqa"],
)
def test_gpu_balanced(shape, kv_heads):
  """The causal persistent forward with its tiles from the balanced table,
  with two consumers and three (at head_dim 64 they are the default from 8k
  causal)."""
  config = dataclasses.replace(_forward_default(shape[-1], seq_q=shape[1], causal=True), persistent=True,
                               balanced=True)
  if shape[-1] == 64 and shape[1] >= 4096:
    config = dataclasses.replace(config, block_q=3 * common.WGMMA_M, consumers=3)
  _check_against_reference(*shape, jnp.bfloat16, True, kv_heads=kv_heads, config=config, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape, kv_heads, persistent",
    [((4, 4096, 4096, 16, 64), None, True), ((2, 1537, 1000, 8, 64), None, True), ((3, 1000, 1537, 16, 64), 4, False)],
    ids=["d64_persistent", "seq_q_gt_seq_k_persistent", "ragged_gqa_grid"],
)
def test_gpu_three_consumers(shape, kv_heads, persistent, causal):
  config = MosaicForwardConfig(block_q=192, block_kv=128, stages=4, softmax_overlap=True, persistent=persistent,
                               consumers=3)
  _check_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=False)


# ================================================================ backward
# jax_flash2.mosaic.backward (the dK/dV and dQ kernels) and backward_fused
# (dQ folded into dK/dV), fed the reference's lse and delta = rowsum(dO * O).

# The fused kernel's tilings: at head_dim 64 the default's (without
# early_vectors, which test_bwd_interpreter_fused_dq_early_vectors adds); at
# 128 64-row blocks and two slots (a second set of K and V tiles does not
# fit beside its dS^T and dQ staging).
FUSED = {
    64: MosaicBackwardConfig(block_q=64, block_kv=128, stages=4, dkv_persistent=True, fused_dq=True),
    128: MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, fused_dq=True),
}


def _bwd_structs(batch, seq_q, seq_k, heads, head_dim, dtype=jnp.bfloat16, kv_heads=None):
  q, k, v = _structs(batch, seq_q, seq_k, heads, head_dim, dtype, kv_heads)
  vec = jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)
  return q, k, v, q, vec, vec


def _mosaic_smem_counts(fn, *structs) -> list[int]:
  """The shared memory Mosaic GPU counts for each kernel `fn` lowers for
  CUDA (the sum it refuses a kernel over 227 KiB by), in order."""
  from jax.experimental.mosaic.gpu import core

  counts, count = [], core._smem_tree_size

  def recorded(buffers):
    counts.append(count(buffers))
    return counts[-1]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(core, "_smem_tree_size", recorded)
    jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",))
  return counts


def _smem_cases(head_dim):
  """(kernel, fn of the backward's operands, its estimate) at the default
  tilings, persistent and one CTA a tile."""
  forward = _forward_default(head_dim, seq_q=4096, causal=True)
  yield "forward", lambda q, k, v, *_: mosaic.forward(q, k, v, causal=True, config=forward), \
      mosaic.smem_bytes(forward, head_dim, jnp.bfloat16)
  if head_dim in common.WIDE_HEAD_DIMS:
    config = defaults.mosaic_backward(head_dim)
    for name in ("dkv", "dq"):
      yield f"wide {name}", lambda *a, name=name: getattr(backward_wide, name)(*a, causal=True, config=config), \
          getattr(backward_wide, f"{name}_smem_bytes")(config, head_dim, jnp.bfloat16)
    return
  for tiles, segments in (("persistent", False), ("one CTA a tile", True)):
    config = defaults.mosaic_backward(head_dim, fused=False, segments=segments)
    for name in ("dkv", "dq"):
      yield f"{name} {tiles}", \
          lambda *a, name=name, config=config: getattr(mosaic_bwd, name)(*a, causal=True, config=config), \
          getattr(mosaic_bwd, f"{name}_smem_bytes")(config, head_dim, jnp.bfloat16)
  if head_dim in FUSED:
    config = FUSED[head_dim]
    yield "fused", lambda *a: backward_fused.backward(*a, causal=True, config=config), \
        backward_fused.smem_bytes(config, head_dim, jnp.bfloat16)


@pytest.mark.parametrize("head_dim", common.SUPPORTED_HEAD_DIMS)
def test_smem_estimates_hold_mosaics_count(head_dim):
  """Each kernel's shared-memory estimate (what check_smem refuses a tiling
  by) is at least what Mosaic GPU counts when it lowers the kernel, so that
  no tiling passes our check to meet Mosaic's refusal, and within 4 KiB of
  it, so that the check refuses no tiling that fits by much."""
  structs = _bwd_structs(1, 1024, 1024, 2, head_dim)
  for kernel, fn, estimate in _smem_cases(head_dim):
    [count] = _mosaic_smem_counts(fn, *structs)
    assert count <= estimate <= count + 4096, (kernel, count, estimate)


def test_bwd_smem_bytes():
  for head_dim in (64, 128):
    config = defaults.mosaic_backward(head_dim)
    two = dataclasses.replace(config, fused_dq=False)
    assert mosaic_bwd.dkv_smem_bytes(two, head_dim, jnp.bfloat16) <= common.SMEM_LIMIT
    assert mosaic_bwd.dq_smem_bytes(two, head_dim, jnp.bfloat16) <= common.SMEM_LIMIT
    assert backward_fused.smem_bytes(FUSED[head_dim], head_dim, jnp.bfloat16) <= common.SMEM_LIMIT
  # A persistent dQ kernel keeps two sets of Q, dO, lse and delta rows.
  plain, persistent = MosaicBackwardConfig(64, 64, 2), MosaicBackwardConfig(64, 64, 2, dq_persistent=True)
  rows = 2 * common.OUTER_ROWS * 128 * 2 + 2 * common.OUTER_ROWS * 4
  assert mosaic_bwd.dq_smem_bytes(persistent, 128, jnp.bfloat16) == (
      mosaic_bwd.dq_smem_bytes(plain, 128, jnp.bfloat16) + rows)
  assert mosaic_bwd.dq_smem_bytes(persistent, 128, jnp.bfloat16) <= common.SMEM_LIMIT
  # A persistent dK/dV kernel keeps two sets of K and V tiles.
  persistent_dkv = MosaicBackwardConfig(64, 64, 2, dkv_persistent=True)
  tiles = 2 * common.OUTER_ROWS * 128 * 2
  assert mosaic_bwd.dkv_smem_bytes(persistent_dkv, 128, jnp.bfloat16) == (
      mosaic_bwd.dkv_smem_bytes(plain, 128, jnp.bfloat16) + tiles)
  assert mosaic_bwd.dkv_smem_bytes(persistent_dkv, 128, jnp.bfloat16) <= common.SMEM_LIMIT
  # The fused kernel adds dS^T (double-buffered) and each consumer's staged
  # float32 piece of dQ: 64 x 64, half the columns at head_dim 128, all of
  # them at 64.
  ds_t = 2 * common.OUTER_ROWS * 64 * 2
  for head_dim, config in FUSED.items():
    unfused = dataclasses.replace(config, fused_dq=False)
    assert backward_fused.smem_bytes(config, head_dim, jnp.bfloat16) == (
        mosaic_bwd.dkv_smem_bytes(unfused, head_dim, jnp.bfloat16) + ds_t + 2 * 64 * 64 * 4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_q=32), ValueError, "block_q must be 64 or 128"),
        (dict(block_kv=256), ValueError, "block_kv must be 64 or 128"),
        (dict(stages=1), ValueError, "stages must be between 2 and 8"),
        (dict(stages=True), TypeError, "stages must be an int"),
        (dict(dq_persistent=0), TypeError, "dq_persistent must be a bool"),
        (dict(dkv_persistent="no"), TypeError, "dkv_persistent must be a bool"),
        (dict(dq_softmax_overlap=1), TypeError, "dq_softmax_overlap must be a bool"),
        (dict(early_vectors=1), TypeError, "early_vectors must be a bool"),
        (dict(fused_dq=True, block_q=128), ValueError, "fused_dq needs block_q 64"),
    ],
)
def test_bwd_config_rejects(kwargs, error, match):
  with pytest.raises(error, match=match):
    MosaicBackwardConfig(**kwargs)


BACKWARDS = {"dkv": mosaic_bwd.dkv, "dq": mosaic_bwd.dq, "backward": mosaic_bwd.backward,
             "fused": backward_fused.backward}


@pytest.mark.parametrize("name", BACKWARDS)
def test_bwd_rejects(name):
  fn = BACKWARDS[name]
  q, k, v, do, lse, delta = (jnp.zeros(s.shape, s.dtype) for s in _bwd_structs(1, 256, 256, 2, 64))
  with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
    fn(*(x.astype(jnp.float32) for x in (q, k, v, do)), lse, delta)
  for head_dim in (96, 256):  # 256: backward_wide's
    d = jnp.zeros((1, 256, 2, head_dim), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"head_dim in \(64, 128\), got {head_dim}"):
      fn(d, d, d, d, lse, delta)
  with pytest.raises(ValueError, match="lse must be float32"):
    fn(q, k, v, do, lse[:, :1], delta)
  with pytest.raises(ValueError, match="do must have q's shape"):
    fn(q, k, v, do[:, :128], lse, delta)
  fused = name == "fused"
  with pytest.raises(ValueError, match="shared memory"):
    fn(q, k, v, do, lse, delta, config=MosaicBackwardConfig(64 if fused else 128, 128, 8, fused_dq=fused))
  # Each module runs its own kernels: fused_dq says which.
  with pytest.raises(ValueError, match="fused kernel needs fused_dq=True" if fused else "here need fused_dq=False"):
    fn(q, k, v, do, lse, delta, config=MosaicBackwardConfig(64, 64, 2, fused_dq=not fused))


def test_bwd_fused_default_is_head_dim_64s():
  """The fused kernel's default is the measured one, which fuses at head_dim
  64 only: at 128 it asks for a config."""
  d128 = [jnp.zeros(s.shape, s.dtype) for s in _bwd_structs(1, 256, 256, 2, 128)]
  with pytest.raises(ValueError, match="fused kernel needs fused_dq=True"):
    backward_fused.backward(*d128)


@pytest.mark.parametrize("kernel", ["dkv", "dq"])
@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads, config",
    [
        ((2, 512, 512, 2, 64), jnp.bfloat16, False, None, None),
        ((2, 512, 512, 2, 128), jnp.float16, True, None, None),
        ((1, 512, 1024, 8, 128), jnp.bfloat16, True, 2, None),  # grouped-query, seq_q < seq_k
        ((1, 1024, 512, 2, 128), jnp.bfloat16, True, None, MosaicBackwardConfig(128, 128, 2)),  # seq_q > seq_k
    ],
    ids=["d64_full", "d128_causal", "gqa", "seq_q_gt_seq_k"],
)
def test_bwd_lowers_for_cuda(kernel, shape, dtype, causal, kv_heads, config):
  structs = _bwd_structs(*shape, dtype, kv_heads)
  f = jax.jit(lambda *a: getattr(mosaic_bwd, kernel)(*a, causal=causal, config=config))
  text = f.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu_v2" in text
  assert f"flash2_bwd_{kernel}_mosaic" in text


@pytest.mark.parametrize(
    "shape, causal, kv_heads, config",
    [
        ((1, 1000, 1537, 8, 128), True, 2, None),  # grouped-query, seq_q < seq_k
        ((2, 257, 1, 2, 64), False, None, MosaicBackwardConfig(128, 64, 2)),
    ],
    ids=["gqa_1000x1537", "257x1"],
)
def test_bwd_lowers_for_cuda_ragged(shape, causal, kv_heads, config):
  """Both kernels through `backward`, on one padding to whole 128-row blocks."""
  batch, seq_q, seq_k, heads, head_dim = shape
  structs = _bwd_structs(*shape, kv_heads=kv_heads)
  f = jax.jit(lambda *a: mosaic_bwd.backward(*a, causal=causal, config=config))
  text = f.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash2_bwd_dkv_mosaic" in text and "flash2_bwd_dq_mosaic" in text
  round_up = lambda n: -(-n // common.OUTER_ROWS) * common.OUTER_ROWS
  assert f"tensor<{batch}x{round_up(seq_q)}x{heads}x{head_dim}xbf16>" in text
  assert f"tensor<{batch}x{round_up(seq_k)}x{kv_heads or heads}x{head_dim}xbf16>" in text
  assert f"tensor<{batch}x{heads}x{round_up(seq_q)}xf32>" in text  # lse and delta


@pytest.mark.parametrize("module", [mosaic_bwd, backward_fused], ids=["two_kernels", "fused"])
def test_bwd_only_ragged_lengths_pay_for_padding(module):
  """As in the forward: whole blocks reach the kernels without a copy; ragged
  lengths are padded once for both kernels."""
  f = lambda *a: module.backward(*a, causal=True)
  assert _copies(f, *_bwd_structs(1, 256, 512, 2, 64)) == []
  # q, do, lse, delta padded once each, though both kernels read them; dq sliced.
  assert _copies(f, *_bwd_structs(1, 250, 512, 2, 64)) == ["pad"] * 4 + ["slice"]
  assert _copies(f, *_bwd_structs(1, 256, 500, 2, 64)) == ["pad"] * 2 + ["slice"] * 2  # k, v; dk, dv


def _bwd_problem(batch, seq_q, seq_k, heads, head_dim, dtype, causal, kv_heads=None):
  """The backward kernels' operands (q, k, v, do, lse, delta) and the
  reference's (dq, dk, dv)."""
  q, k, v, do = (x.astype(dtype) for x in random_inputs(5, batch, seq_q, seq_k, heads, head_dim))
  if kv_heads is not None:
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  out, lse, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, do, causal=causal, dtype=jnp.float32)
  # delta from the output as the kernel's caller would have it (rounded to dtype).
  delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(dtype).astype(jnp.float32))
  return (q, k, v, do, lse.astype(jnp.float32), delta), (ref_dq, ref_dk, ref_dv)


def _check_bwd_against_reference(batch, seq_q, seq_k, heads, head_dim, dtype, causal, *, kv_heads=None,
                                 config=None, interpret=True, tol=1e-2):
  """config's kernels (the measured default's where None) against the
  reference: the fused one, or dkv and dq each called alone."""
  (q, k, v, do, lse, delta), (ref_dq, ref_dk, ref_dv) = _bwd_problem(
      batch, seq_q, seq_k, heads, head_dim, dtype, causal, kv_heads)
  config = defaults.mosaic_backward(head_dim) if config is None else config
  kwargs = dict(causal=causal, config=config, interpret=interpret)
  if config.fused_dq:
    dq, dk, dv = backward_fused.backward(q, k, v, do, lse, delta, **kwargs)
  else:
    dk, dv = mosaic_bwd.dkv(q, k, v, do, lse, delta, **kwargs)
    dq = mosaic_bwd.dq(q, k, v, do, lse, delta, **kwargs)
  for name, x, ref, like in (("dq", dq, ref_dq, q), ("dk", dk, ref_dk, k), ("dv", dv, ref_dv, v)):
    assert x.shape == like.shape and x.dtype == like.dtype, name
    assert rel_err(x, ref) < tol, name
  return dq, dk, dv


@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads, config",
    [
        ((1, 128, 256, 1, 64), jnp.float16, False, None, MosaicBackwardConfig(64, 64, 2)),
        # Grouped-query (dkv sums two query heads) with three ring slots;
        # dkv's second consumer drains the first Q block, dq's first consumer
        # drains the last K/V block.
        ((1, 256, 256, 2, 64), jnp.bfloat16, True, 1, MosaicBackwardConfig(64, 64, 3)),
        ((1, 128, 384, 1, 64), jnp.float16, True, None, MosaicBackwardConfig(64, 64, 2)),
        # Rows that see no key (lse = -inf) must give 0, not NaN.
        ((1, 384, 128, 1, 64), jnp.float16, True, None, MosaicBackwardConfig(128, 64, 2)),
        # The dQ kernel's softmax under dP's product (the default at head_dim 64 and 128).
        ((1, 72, 136, 2, 64), jnp.bfloat16, True, 1, MosaicBackwardConfig(64, 64, 2, dq_softmax_overlap=True)),
        ((1, 384, 128, 1, 64), jnp.float16, True, None, MosaicBackwardConfig(64, 128, 2, dq_softmax_overlap=True)),
        # lse and delta loaded before the wait for S^T and dP^T, with rows
        # that see no key and a drain of the other consumer's blocks.
        ((1, 256, 256, 2, 64), jnp.bfloat16, True, 1, MosaicBackwardConfig(64, 64, 3, early_vectors=True)),
        ((1, 384, 128, 1, 64), jnp.float16, True, None, MosaicBackwardConfig(128, 64, 2, early_vectors=True)),
    ],
    ids=["full_seq_q_lt_seq_k", "causal_gqa_drain", "causal_seq_q_lt_seq_k", "causal_seq_q_gt_seq_k",
         "dq_overlap_ragged_gqa", "dq_overlap_causal_seq_q_gt_seq_k", "early_vectors_causal_gqa_drain",
         "early_vectors_causal_seq_q_gt_seq_k"],
)
def test_bwd_interpreter_matches_reference(shape, dtype, causal, kv_heads, config):
  _check_bwd_against_reference(*shape, dtype, causal, kv_heads=kv_heads, config=config)


@pytest.mark.parametrize("kernel", ["dq", "dkv"])
@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads, config",
    # Two CTAs over 4-9 tiles (causal: in pairs; an odd number of outer
    # blocks): the ring and the outer tiles' buffers carry across tiles.
    [
        ((2, 256, 256, 2, 64), jnp.bfloat16, True, 1, MosaicBackwardConfig(64, 64, 3)),
        ((1, 72, 136, 4, 64), jnp.bfloat16, False, 2, MosaicBackwardConfig(64, 64, 2)),
        ((1, 384, 128, 3, 64), jnp.float16, True, None, MosaicBackwardConfig(128, 64, 2, dq_softmax_overlap=True)),
        ((1, 128, 384, 3, 64), jnp.bfloat16, True, None, MosaicBackwardConfig(64, 64, 2)),
    ],
    ids=["causal_gqa", "ragged_gqa", "seq_q_gt_seq_k", "seq_q_lt_seq_k"],
)
def test_bwd_interpreter_persistent(kernel, shape, dtype, causal, kv_heads, config):
  (q, k, v, do, lse, delta), (ref_dq, ref_dk, ref_dv) = _bwd_problem(*shape, dtype, causal, kv_heads)
  config = dataclasses.replace(config, **{f"{kernel}_persistent": True})
  kwargs = dict(causal=causal, config=config, interpret=plgpu.InterpretGPUParams(detect_races=True))
  if kernel == "dq":
    assert rel_err(mosaic_bwd.dq(q, k, v, do, lse, delta, **kwargs), ref_dq) < 1e-2
  else:
    dk, dv = mosaic_bwd.dkv(q, k, v, do, lse, delta, **kwargs)
    assert rel_err(dk, ref_dk) < 1e-2 and rel_err(dv, ref_dv) < 1e-2
  assert not _races_found()


@pytest.mark.parametrize(
    "shape, dtype, causal, kv_heads",
    # One CTA takes every tile in turn (see _fused_schedule): the ring, the
    # dS^T buffers and the additions into dQ carry across tiles and heads.
    [
        ((1, 256, 256, 1, 128), jnp.bfloat16, False, None),  # each consumer adds half of dQ's columns
        ((1, 384, 384, 2, 64), jnp.bfloat16, True, None),  # the consumers take turns; climbing and descending tiles
        ((1, 256, 384, 2, 128), jnp.float16, True, 1),  # grouped-query, seq_q < seq_k
        ((1, 384, 128, 1, 64), jnp.float16, True, None),  # seq_q > seq_k: rows that see no key, dQ 0
        ((1, 72, 136, 2, 64), jnp.bfloat16, False, None),  # ragged
    ],
    ids=["d128", "d64_causal", "gqa_seq_q_lt_seq_k", "seq_q_gt_seq_k", "ragged"],
)
def test_bwd_interpreter_fused_dq(shape, dtype, causal, kv_heads):
  config = dataclasses.replace(FUSED[shape[-1]], stages=2)  # stages 2: wraps the ring more often
  _check_bwd_against_reference(*shape, dtype, causal, kv_heads=kv_heads, config=config,
                               interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert not _races_found()


@pytest.mark.parametrize(
    "shape, causal",
    [((1, 256, 256, 1, 128), False), ((1, 384, 384, 2, 64), True)],
    ids=["d128", "d64_causal"],
)
def test_bwd_interpreter_fused_dq_early_vectors(shape, causal):
  """The fused kernel (the d64 default's) with lse and delta loaded before
  the wait for S^T and dP^T: exact, and no race under the race detector."""
  config = dataclasses.replace(FUSED[shape[-1]], stages=2, early_vectors=True)
  _check_bwd_against_reference(*shape, jnp.bfloat16, causal, config=config,
                               interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert not _races_found()


def test_bwd_early_vectors_lowers_for_cuda():
  """early_vectors changes the dK/dV kernel it is given (d128, the two
  kernels' default, off; d64, the fused default, on) and lowers for CUDA."""
  for head_dim, module in ((128, mosaic_bwd), (64, backward_fused)):
    structs = _bwd_structs(1, 512, 512, 2, head_dim)
    lower = lambda config: _kernels_text(lambda *a: module.backward(*a, causal=True, config=config), *structs)
    config = defaults.mosaic_backward(head_dim)
    assert config.early_vectors == (head_dim == 64)
    assert lower(config) != lower(dataclasses.replace(config, early_vectors=not config.early_vectors))


@pytest.mark.parametrize("shape, causal", [((2, 1024, 1024, 4, 128), True), ((1, 1000, 1537, 8, 64), False)])
def test_bwd_fused_lowers_for_cuda(shape, causal):
  """One kernel, with a semaphore per Q block and piece of dQ, and no dQ kernel."""
  config = FUSED[shape[-1]]
  f = jax.jit(lambda *a: backward_fused.backward(*a, causal=causal, config=config))
  text = f.trace(*_bwd_structs(*shape)).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash2_bwd_dkv_mosaic" in text and "flash2_bwd_dq_mosaic" not in text


@pytest.mark.parametrize("shape, dtype, causal, kv_heads", RAGGED, ids=RAGGED_IDS)
def test_bwd_interpreter_ragged_matches_reference(shape, dtype, causal, kv_heads):
  """The kernels on the operands padded as `backward` pads them, so that the
  rows of padding can be checked before they are sliced away: dQ of padded
  queries (lse = +inf: P = 0) and dK, dV of padded keys (hidden by the
  diagonal, or zeroed by dkv) are exactly 0."""
  operands, refs = _bwd_problem(*shape, dtype, causal, kv_heads)
  seq_q, seq_k, head_dim = shape[1], shape[2], shape[4]
  padded = common.pad_backward(*operands)
  kwargs = dict(mask=Mask(seq_q, seq_k, causal=causal), scores=common.Scores(head_dim ** -0.5), slopes=None,
                config=MosaicBackwardConfig(64, 64, 2), interpret=True)
  dk, dv = mosaic_bwd._dkv_call(*padded, **kwargs)
  dq = mosaic_bwd._dq_call(*padded, **kwargs)
  for name, x, seq, ref in (("dq", dq, seq_q, refs[0]), ("dk", dk, seq_k, refs[1]), ("dv", dv, seq_k, refs[2])):
    assert x.shape[1] % common.OUTER_ROWS == 0 and x.shape[1] > seq, name
    np.testing.assert_array_equal(np.asarray(x[:, seq:], np.float32), 0.0, err_msg=name)
    assert rel_err(x[:, :seq], ref) < 1e-2, name


# ---------------------------------------------------------------- the fused kernel's order of additions


def _dq_order_model(seq_q, seq_k, causal, group=1, num_ctas=None, kv_heads=1):
  """(ranks, events): the fused kernel's order of additions into dQ and, per
  (kv head, query head of its group, Q block), the (time, cta, rank) of its
  additions in the schedule's model, from the kernel's own tile order
  (PersistentSchedule)."""
  num_kv = -(-seq_k // common.OUTER_ROWS)
  schedule = backward_fused._fused_schedule(num_kv, kv_heads, 1, causal=causal, interpret=False)
  if num_ctas is not None:
    schedule = dataclasses.replace(schedule, num_ctas=num_ctas)
  mask = Mask(seq_q, seq_k, causal=causal)
  ranks = backward_fused._dq_order(schedule, mask=mask, block_q=64, group=group)
  assert ranks.shape[0] == (1 if backward_fused._heads_alike(schedule) else kv_heads)
  num_q = -(-seq_q // 64)
  lo = np.broadcast_to(mask.q_blocks_right(np.arange(num_kv) * common.OUTER_ROWS, 64, 64, NUMPY)[0], (num_kv,))
  events = {}
  for cta in range(schedule.num_ctas):
    time = 0
    for i in range(int(schedule.tile_count(jnp.int32(cta)))):
      j, head, _ = (int(x) for x in schedule.tile(jnp.int32(cta), jnp.int32(i)))
      visits = num_q - int(lo[j])
      for step in range(group * visits):
        qb = int(backward_fused._visit(j, step % visits, visits, int(lo[j]), num_q=num_q, num_kv=num_kv,
                                       causal=causal, where=np.where, div=np.floor_divide, rem=np.remainder))
        rank = int(ranks[head if ranks.shape[0] > 1 else 0, j, step])
        events.setdefault((head, step // visits, qb), []).append((time + step, cta, rank))
      time += group * visits
  return ranks, events


@pytest.mark.parametrize(
    "seq_q, seq_k, causal, group, num_ctas, kv_heads",
    [(1024, 1024, False, 1, None, 1), (1024, 1024, True, 1, None, 1), (1000, 1537, True, 2, None, 1),
     (1537, 1000, True, 1, None, 1), (384, 1024, False, 1, None, 1), (2048, 2048, False, 1, 4, 1),
     (2048, 2048, True, 2, 3, 1),
     # Heads across rounds (5 CTAs over 3 heads of 16 tiles; 3 over 3 heads of 8 pairs;
     # 3 over 2 heads of 5 ragged tiles): an order per head.
     (2048, 2048, False, 1, 5, 3), (2048, 2048, True, 1, 3, 3), (1000, 600, True, 2, 3, 2),
     # Whole heads per round over several heads: one order serves them all.
     (1024, 1024, False, 1, None, 4), (1024, 1024, True, 1, 8, 4)],
)
def test_dq_order_is_deadlock_free(seq_q, seq_k, causal, group, num_ctas, kv_heads):
  """Each Q block's additions are ranked 0, 1, ... in the order of the
  schedule's model (time, then CTA), so a CTA only ever waits for additions
  that come before its own in one total order that each CTA's steps follow:
  with all CTAs resident, the earliest pending addition can always go. The
  model is replayed here from the kernel's own tile order."""
  _, events = _dq_order_model(seq_q, seq_k, causal, group, num_ctas, kv_heads)
  for key, additions in events.items():
    additions.sort()
    assert [rank for _, _, rank in additions] == list(range(len(additions))), key


@pytest.mark.parametrize("causal", [False, True])
def test_dq_order_spreads_the_adders(causal):
  """At equal lengths no two tiles add into one Q block at one time, and
  successive adders are two steps apart (non-causal; causal: at least one),
  so that an adder seldom waits for the one before it."""
  _, events = _dq_order_model(4096, 4096, causal)
  gaps = [b[0] - a[0] for additions in events.values() for a, b in zip(sorted(additions), sorted(additions)[1:])]
  assert min(gaps) == (1 if causal else 2)


@pytest.mark.parametrize(
    "num_kv, kv_heads, batch, causal, paired, num_ctas, alike",
    [
        (16, 16, 8, False, False, 128, True),  # 8 heads' tiles per round, 4 SMs idle
        (16, 16, 8, True, True, 128, True),  # pairs: 8 CTAs a head, 16 heads per round
        (64, 16, 2, False, False, 128, True),
        (128, 16, 1, False, False, 128, True),
        (256, 16, 1, False, False, 128, True),  # a head over two rounds: the largest divisor of 256 <= 132
        (264, 2, 1, False, False, 132, True),
        (33, 4, 1, True, False, 132, True),  # an odd number of K/V blocks: unpaired
        (16, 2, 1, False, False, 32, True),  # few tiles: one round
        # 6144 keys, 64 heads: whole heads would take 32 rounds of 96 CTAs; 24 split ones take 128.
        (48, 32, 2, False, False, 128, False),
        (48, 32, 2, True, True, 128, False),  # pairs: 24 a head, 13 rounds of 120 CTAs or 12 of 128
        (96, 32, 1, False, False, 128, False),  # 12288 keys: 24 rounds, not 32 of 96
        (67, 3, 1, False, False, 101, False),  # two rounds, not three of 67
    ],
)
def test_fused_schedule_fills_the_rounds_on_resident_ctas(num_kv, kv_heads, batch, causal, paired, num_ctas, alike):
  """The fused kernel's CTAs wait on each other: never more than the SMs (all
  resident), in as few rounds as the SMs allow, and where that costs no
  round a whole number of heads per round or of rounds per head, so that one
  head's order of additions (`_dq_order`) holds for every head."""
  schedule = backward_fused._fused_schedule(num_kv, kv_heads, batch, causal=causal, interpret=False)
  assert (schedule.paired, schedule.num_ctas) == (paired, num_ctas)
  assert schedule.num_ctas <= common.sm_count()
  per_head = num_kv // 2 if paired else num_kv
  units = per_head * kv_heads * batch
  assert -(-units // schedule.num_ctas) == -(-units // common.sm_count())
  assert backward_fused._heads_alike(schedule) == alike
  assert backward_fused._fused_schedule(num_kv, kv_heads, batch, causal=causal, interpret=True).num_ctas == 1


# ---------------------------------------------------------------- backward on the GPU


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("seq", [1024, 4096])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_gpu_matches_reference(seq, head_dim, causal):
  _check_bwd_against_reference(2, seq, seq, 4, head_dim, jnp.bfloat16, causal, interpret=False)


# Backward variants the GPU tests run: (shape, dtype, kv_heads, config).
BWD_GPU_VARIANTS = dict(
    argnames="shape, dtype, kv_heads, config",
    argvalues=[
        ((1, 1024, 2048, 8, 128), jnp.bfloat16, 2, None),  # grouped-query, seq_q < seq_k
        ((1, 2048, 1024, 4, 128), jnp.float16, None, None),  # seq_q > seq_k
        ((1, 2048, 2048, 2, 64), jnp.bfloat16, None, MosaicBackwardConfig(128, 128, 2)),
        ((1, 1000, 1537, 8, 128), jnp.bfloat16, 2, None),  # ragged: padded to whole blocks
        ((1, 1537, 1000, 4, 64), jnp.float16, None, None),
        ((2, 777, 777, 2, 64), jnp.bfloat16, None, MosaicBackwardConfig(128, 128, 2)),
        # Not persistent, ragged grouped-query (the defaults are persistent).
        ((1, 1000, 1537, 8, 64), jnp.float16, 2, MosaicBackwardConfig(64, 64, 2)),
        # Three ring slots at head_dim 128, one CTA a tile: beside a persistent
        # CTA's second outer tiles they do not fit.
        ((2, 4096, 4096, 4, 128), jnp.bfloat16, None, MosaicBackwardConfig(64, 64, 3)),
    ],
    ids=["gqa", "seq_q_gt_seq_k", "blocks_128", "ragged_gqa", "ragged_seq_q_gt_seq_k", "ragged_blocks_128",
         "grid_ragged_gqa", "d128_three_slots"],
)


@pytest.mark.parametrize(**BWD_GPU_VARIANTS)
def test_bwd_gpu_variants_fit(shape, dtype, kv_heads, config):
  """The GPU variants' tilings pass the kernels' own checks (check_smem
  among them, at trace time), so that a GPU run tests the kernels rather
  than meets our own refusal."""
  batch, seq_q, seq_k, heads, head_dim = shape
  q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads or heads, head_dim), dtype)
  rows = jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)
  config = defaults.mosaic_backward(head_dim) if config is None else config
  backward = backward_fused.backward if config.fused_dq else mosaic_bwd.backward
  jax.eval_shape(functools.partial(backward, causal=True, config=config), q, kv, kv, q, rows, rows)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(**BWD_GPU_VARIANTS)
def test_bwd_gpu_variants(shape, dtype, kv_heads, config):
  _check_bwd_against_reference(*shape, dtype, True, kv_heads=kv_heads, config=config, interpret=False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(**PERSISTENT_GPU_SHAPES)
def test_bwd_gpu_persistent(shape, kv_heads, causal):
  """The two kernels, both persistent, over several rounds of tiles."""
  head_dim = shape[-1]
  config = dataclasses.replace(defaults.mosaic_backward(head_dim), fused_dq=False, dq_persistent=True,
                               dkv_persistent=True)
  if max(mosaic_bwd.dq_smem_bytes(config, head_dim, jnp.bfloat16),
         mosaic_bwd.dkv_smem_bytes(config, head_dim, jnp.bfloat16)) > common.SMEM_LIMIT:
    config = dataclasses.replace(config, stages=2)  # d128: the second buffers take a ring slot's room
  _check_bwd_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=False)


def _check_fused_bwd_on_gpu(shape, kv_heads, causal, config):
  """`config`'s fused kernel against the reference, and the same bits from a second run."""
  grads = _check_bwd_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config,
                                       interpret=False)
  (q, k, v, do, lse, delta), _ = _bwd_problem(*shape, jnp.bfloat16, causal, kv_heads)
  again = backward_fused.backward(q, k, v, do, lse, delta, causal=causal, config=config)
  for name, x, y in zip(("dq", "dk", "dv"), grads, again):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=name)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(**PERSISTENT_GPU_SHAPES)
def test_bwd_gpu_fused_dq(shape, kv_heads, causal):
  """The fused kernel (the d64 default; at d128 each consumer adding half of
  dQ's columns) against the reference, over several rounds of persistent
  CTAs; and deterministic: a second run gives the same bits."""
  config = defaults.mosaic_backward(64) if shape[-1] == 64 else FUSED[128]
  _check_fused_bwd_on_gpu(shape, kv_heads, causal, config)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_gpu_fused_dq_heads_across_rounds(causal):
  """The d64 default (the fused kernel) where whole heads per round would
  waste rounds: 11 heads of 48 K/V blocks (24 causal pairs) run on 132 CTAs
  in 4 rounds (2 causal), not on 96 in 6 (120 in 3), so each head has an
  order of additions of its own (`_dq_order`)."""
  schedule = backward_fused._fused_schedule(48, 11, 1, causal=causal, interpret=False)
  assert schedule.num_ctas == 132 and not backward_fused._heads_alike(schedule)
  _check_fused_bwd_on_gpu((1, 6144, 6144, 11, 64), None, causal, defaults.mosaic_backward(64))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape, kv_heads",
    [((2, 4096, 4096, 4, 64), None), ((1, 4096, 4096, 4, 128), None), ((1, 1000, 1537, 8, 128), 2),
     ((1, 1537, 1000, 4, 64), None)],
    ids=["d64", "d128", "ragged_gqa", "ragged_seq_q_gt_seq_k"],
)
def test_bwd_gpu_early_vectors(shape, kv_heads, causal):
  """early_vectors on the defaults (d128: the two kernels; d64: the fused
  kernel, whose default has it)."""
  config = dataclasses.replace(defaults.mosaic_backward(shape[-1]), early_vectors=True)
  _check_bwd_against_reference(*shape, jnp.bfloat16, causal, kv_heads=kv_heads, config=config, interpret=False)
