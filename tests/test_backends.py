"""Which backend runs each pass: plan() for every option, and flash_attention
doing what plan() says (on a pretend GPU of the given compute capability:
the call is captured, not run), the errors of configs and backends that
cannot run, and the Mosaic kernels through the API in Mosaic's interpreter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import (
    Backend,
    BlockSizes,
    KernelConfig,
    MosaicBackwardConfig,
    MosaicConfig,
    MosaicForwardConfig,
    api,
    backends,
    defaults,
    flash_attention,
    plan,
)

HOPPER, AMPERE = (9, 0), (8, 0)


def _structs(seq_q=256, seq_k=None, heads=2, kv_heads=None, head_dim=128, dtype=jnp.bfloat16, batch=1):
  q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_k or seq_q, kv_heads or heads, head_dim), dtype)
  return q, kv, kv


def _options(name: str, q, k) -> dict:
  """flash_attention keyword arguments for an option, as ShapeDtypeStructs."""
  batch, seq_q, heads, _ = q.shape
  seq_k = k.shape[1]
  ids = (jax.ShapeDtypeStruct((batch, seq_q), jnp.int32), jax.ShapeDtypeStruct((batch, seq_k), jnp.int32))
  return {
      "none": {},
      "causal": dict(causal=True),
      "mask": dict(mask=jax.ShapeDtypeStruct((batch, 1, seq_q, seq_k), jnp.bool_)),
      "bias": dict(bias=jax.ShapeDtypeStruct((1, heads, seq_q, seq_k), jnp.float32)),
      "window": dict(window_size=(64, 0)),
      "window_as_causal": dict(window_size=(None, 0)),
      "softcap": dict(softcap=30.0),
      "alibi": dict(alibi_slopes=jax.ShapeDtypeStruct((heads,), jnp.float32)),
      "segments": dict(q_segment_ids=ids[0], kv_segment_ids=ids[1]),
      "dropout": dict(dropout_rate=0.1, dropout_rng=jax.ShapeDtypeStruct((2,), jnp.uint32)),
      "scale": dict(softmax_scale=0.3, causal=True),
      # Joined outside the kernels: the Mosaic kernels serve them too.
      "sinks": dict(sinks=jax.ShapeDtypeStruct((heads,), jnp.float32), causal=True),
  }[name]


OPTIONS = ["none", "causal", "mask", "bias", "window", "window_as_causal", "softcap", "alibi", "segments",
           "dropout", "scale", "sinks"]
PLAIN = {"none", "causal", "window_as_causal", "scale", "sinks"}
# What the Mosaic kernels serve besides plain attention (issue 27).
MOSAIC_OPTIONS = {"window", "softcap", "alibi", "segments"}
# The options they leave to the Triton kernels, as their reason names them.
TRITON_ONLY = {"mask": "a dense mask", "bias": "a bias", "dropout": "dropout"}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_auto_on_hopper(option, head_dim):
  """The Mosaic kernels for full/causal attention, windows, softcap, ALiBi
  and segment ids at head_dim 64, 128 and 256; the Triton kernels for
  everything else, with the reason naming the option."""
  q, k, v = _structs(head_dim=head_dim)
  got = plan(q, k, v, compute_capability=HOPPER, **_options(option, q, k))
  served = head_dim != 96 and option in PLAIN | MOSAIC_OPTIONS
  for pass_plan, mosaic in ((got.forward, served), (got.backward, served)):
    assert pass_plan.backend == ("mosaic" if mosaic else "triton")
    assert (pass_plan.reason is None) == mosaic
    if mosaic:
      continue
    assert pass_plan.reason.startswith("the Mosaic")
    assert isinstance(pass_plan.config, BlockSizes)
    if option in TRITON_ONLY and head_dim != 96:
      assert pass_plan.reason.endswith(f"not {TRITON_ONLY[option]}")
  if served:
    assert isinstance(got.forward.config, MosaicForwardConfig)
    assert isinstance(got.backward.config, MosaicBackwardConfig)
    # The fused backward (the d64 default) serves full and causal attention only.
    assert got.backward.config.fused_dq == (head_dim == 64 and option in PLAIN)


BENCH_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", [
    dict(window_size=(1024, 0)), dict(causal=True, window_size=(256, None)), dict(window_size=(512, 512)),
    dict(window_size=(None, 128)), dict(window_size=(2048, None)), dict(causal=True, softcap=30.0),
    dict(softcap=50.0), dict(causal=True, alibi=True), dict(alibi=True, batched_slopes=True),
    dict(causal=True, window_size=(1024, 0), softcap=30.0, alibi=True),
], ids=["sliding", "causal_left", "both", "right_only", "left_only", "causal_softcap", "softcap", "causal_alibi",
        "alibi_per_batch", "all"])
def test_options_run_mosaic_at_the_bench_shapes(head_dim, options):
  """The bench's shapes (batch x seq = 16k tokens, hidden 2048, seq 512 to
  16k, GQA by 4 among them) with each option the Mosaic kernels serve: both
  passes on them on an H200, their measured tiles (the two-kernel backward
  at head_dim 64)."""
  options = dict(options)
  alibi, batched = options.pop("alibi", False), options.pop("batched_slopes", False)
  for seq in BENCH_SEQLENS:
    batch, heads = 16384 // seq, 2048 // head_dim
    for kv_heads in (heads, heads // 4):
      q, k, v = _structs(seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch)
      if alibi:
        options["alibi_slopes"] = jax.ShapeDtypeStruct((batch, heads) if batched else (heads,), jnp.float32)
      got = plan(q, k, v, compute_capability=HOPPER, **options)
      assert (got.forward.backend, got.backward.backend) == ("mosaic", "mosaic"), (seq, kv_heads, got.forward.reason)
      causal = options.get("causal", False) or options.get("window_size", (None, None))[1] == 0
      assert got.forward.config == defaults.mosaic_forward(head_dim, seq_q=seq, causal=causal)
      assert got.backward.config == defaults.mosaic_backward(head_dim, fused=False)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_segment_ids_take_one_cta_a_tile(head_dim):
  """With segment ids plan() reports the measured tiles with every kernel on
  one CTA a tile (a tile's work follows the ids, which the persistent CTAs'
  static schedules cannot see); the same problem without ids keeps them."""
  q, k, v = _structs(16384, heads=2048 // head_dim, head_dim=head_dim)
  ids = jax.ShapeDtypeStruct((1, 16384), jnp.int32)
  got = plan(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids, compute_capability=HOPPER)
  assert (got.forward.backend, got.backward.backend) == ("mosaic", "mosaic")
  forward, backward = got.forward.config, got.backward.config
  assert not (forward.persistent or forward.balanced or backward.dq_persistent or backward.dkv_persistent)
  assert forward == dataclasses.replace(defaults.mosaic_forward(head_dim, seq_q=16384, causal=True),
                                        persistent=False, balanced=False)
  plain = plan(q, k, v, causal=True, compute_capability=HOPPER)
  assert plain.forward.config == defaults.mosaic_forward(head_dim, seq_q=16384, causal=True)
  assert plain.backward.config.dq_persistent


def test_fused_backward_config_refused_for_options():
  """An explicit fused_dq config (the d64 default for plain attention) with
  an option only the two kernels serve is an error naming it, not a switch."""
  q, k, v = _structs(head_dim=64)
  fused = MosaicConfig(backward=defaults.mosaic_backward(64))
  assert plan(q, k, v, causal=True, mosaic_config=fused, compute_capability=HOPPER).backward.config.fused_dq
  with pytest.raises(ValueError, match="fused_dq.*serves full and causal attention only, not a window"):
    plan(q, k, v, window_size=(64, 0), mosaic_config=fused, compute_capability=HOPPER)
  with pytest.raises(ValueError, match="not a softcap, ALiBi"):
    plan(q, k, v, softcap=5.0, alibi_slopes=jax.ShapeDtypeStruct((2,), jnp.float32), mosaic_config=fused,
         compute_capability=HOPPER)
  two = MosaicConfig(backward=defaults.mosaic_backward(64, fused=False))
  assert plan(q, k, v, softcap=5.0, mosaic_config=two, compute_capability=HOPPER).backward.backend == "mosaic"


@pytest.mark.parametrize("head_dim, config, match", [
    (64, MosaicConfig(forward=MosaicForwardConfig(block_kv=256, stages=4)), "for the forward at head_dim 64"),
    (128, MosaicConfig(backward=MosaicBackwardConfig(block_q=64, block_kv=128, stages=4)),
     "shared memory for the dQ kernel at head_dim 128"),
    (64, MosaicConfig(backward=MosaicBackwardConfig(block_q=64, block_kv=128, stages=8, fused_dq=True)),
     "shared memory for the fused kernel at head_dim 64"),
    (256, MosaicConfig(backward=MosaicBackwardConfig(block_q=128, block_kv=128)),
     r"head_dim 256 takes block_q = block_kv = 64"),
    (256, MosaicConfig(backward=MosaicBackwardConfig(block_q=64, block_kv=64, stages=3)),
     "shared memory for the dK/dV kernel at head_dim 256"),
])
def test_plan_refuses_configs_the_kernels_refuse(head_dim, config, match):
  """A Mosaic config that the kernels would refuse (buffers past shared
  memory, the wide kernels' tiles) is refused by plan() already, with the
  kernels' own message: plan() says what the call runs."""
  q, k, v = _structs(head_dim=head_dim)
  with pytest.raises(ValueError, match=match):
    plan(q, k, v, causal=True, mosaic_config=config, compute_capability=HOPPER)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, causal=True, backend="mosaic", mosaic_config=config,
                                                   interpret=True), q, k, v)


@pytest.mark.parametrize("dtype, backend", [(jnp.bfloat16, "mosaic"), (jnp.float16, "mosaic"), (jnp.float32, "triton")])
def test_auto_on_hopper_by_dtype(dtype, backend):
  got = plan(*_structs(dtype=dtype), compute_capability=HOPPER)
  assert got.forward.backend == got.backward.backend == backend
  if backend == "triton":
    assert "bfloat16 and float16" in got.forward.reason


@pytest.mark.parametrize("seq_q, seq_k, backend", [
    (256, 256, "mosaic"), (640, 768, "mosaic"),  # whole 128-row blocks
    (704, 704, "triton"), (1000, 1000, "triton"), (3999, 4096, "triton"),  # short ragged: padding does not pay
    (4000, 4000, "mosaic"), (4100, 4500, "mosaic"),  # long ragged: padded inside
])
def test_auto_on_hopper_by_length(seq_q, seq_k, backend):
  got = plan(*_structs(seq_q, seq_k), causal=True, compute_capability=HOPPER)
  assert got.forward.backend == got.backward.backend == backend
  if backend == "triton":
    assert "ragged lengths under 4000" in got.forward.reason
    # backend="mosaic" pads them all the same.
    assert plan(*_structs(seq_q, seq_k), causal=True, compute_capability=HOPPER, backend="mosaic").forward.backend \
        == "mosaic"


def test_measured_defaults():
  """The tilings plan() reports are the measured tables'."""
  q, k, v = _structs(seq_q=8192, head_dim=64)
  got = plan(q, k, v, causal=True, compute_capability=HOPPER)
  assert got.forward.config == defaults.mosaic_forward(64, seq_q=8192, causal=True)
  assert got.forward.config.consumers == 3
  assert got.backward.config == defaults.mosaic_backward(64) and got.backward.config.fused_dq
  assert plan(*_structs(head_dim=128), compute_capability=HOPPER).backward.config.fused_dq is False
  triton = plan(*_structs(seq_q=200, head_dim=80), causal=True, compute_capability=AMPERE).forward.config
  assert triton == defaults.block_sizes(128, True).fit(200, 200)


@pytest.mark.parametrize("option", OPTIONS)
def test_ampere_runs_triton(option):
  q, k, v = _structs()
  got = plan(q, k, v, compute_capability=AMPERE, **_options(option, q, k))
  assert got.forward.backend == got.backward.backend == "triton"
  assert "Hopper" in got.forward.reason


def test_no_gpu_runs_xla_and_interpret_runs_triton():
  q, k, v = _structs()
  got = plan(q, k, v, compute_capability=None)
  assert got.forward.backend == got.backward.backend == "xla" and not got.kernels
  assert "Hopper" in got.forward.reason and "Triton" in got.forward.reason
  got = plan(q, k, v, interpret=True)
  assert got.forward.backend == "triton" and "interpret=True" in got.forward.reason
  got = plan(q, k, v, interpret=True, backend="mosaic")
  assert got.forward.backend == got.backward.backend == "mosaic"
  assert plan(q, k, v, backend=Backend.XLA, compute_capability=HOPPER).forward.backend == "xla"


def test_explicit_backends():
  q, k, v = _structs()
  assert plan(q, k, v, backend="triton", compute_capability=HOPPER).forward.backend == "triton"
  mixed = plan(q, k, v, backend="mosaic", dropout_rate=0.1, dropout_rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
               compute_capability=HOPPER)
  assert mixed.forward.backend == "triton" and "not dropout" in mixed.forward.reason
  with pytest.raises(ValueError, match="backend='triton': the Triton kernels need an NVIDIA GPU"):
    plan(q, k, v, backend="triton", compute_capability=None)
  with pytest.raises(ValueError, match="backend='mosaic': the Mosaic kernels need a Hopper GPU"):
    plan(q, k, v, backend="mosaic", compute_capability=AMPERE)
  with pytest.raises(ValueError, match="interpret=True"):
    plan(q, k, v, backend="xla", interpret=True)


def test_explicit_configs_win_and_never_switch_family():
  q, k, v = _structs()
  tiles = BlockSizes(fwd=KernelConfig(64, 32), dkv=KernelConfig(32, 64), dq=KernelConfig(64, 64))
  forward = MosaicForwardConfig(block_q=128, block_kv=64, stages=3)
  got = plan(q, k, v, mosaic_config=MosaicConfig(forward=forward), compute_capability=HOPPER)
  assert got.forward.config == forward
  assert got.backward.config == defaults.mosaic_backward(128)
  assert plan(q, k, v, backend="triton", block_sizes=tiles, compute_capability=HOPPER).forward.config == tiles
  # A Triton config where the Mosaic kernels run both passes is an error, not a switch.
  with pytest.raises(ValueError, match="block_sizes configures the Triton kernels, but neither pass runs them"):
    plan(q, k, v, block_sizes=tiles, compute_capability=HOPPER)
  with pytest.raises(ValueError, match="mosaic_config configures the Mosaic kernels.*backend='mosaic'"):
    plan(q, k, v, mask=jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.bool_), mosaic_config=MosaicConfig(),
         compute_capability=HOPPER)
  # Where no kernel runs (XLA on a CPU), configs have nothing to tile.
  assert plan(q, k, v, block_sizes=tiles, compute_capability=None).forward.backend == "xla"
  with pytest.raises(TypeError, match="mosaic_config must be a jax_flash2.MosaicConfig"):
    plan(q, k, v, mosaic_config=forward)
  with pytest.raises(TypeError, match="MosaicConfig.forward must be a MosaicForwardConfig"):
    MosaicConfig(forward=MosaicBackwardConfig())


def _captured(monkeypatch, capability):
  """Makes flash_attention record its Call instead of running the kernels,
  on a pretend device of this compute capability."""
  calls = []

  def fake_flash(q, k, v, operands, call):
    calls.append(call)
    return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  monkeypatch.setattr(backends, "default_compute_capability", lambda: capability)
  monkeypatch.setattr(api.vjp, "flash", fake_flash)
  return calls


@pytest.mark.parametrize("capability", [HOPPER, AMPERE], ids=["hopper", "ampere"])
@pytest.mark.parametrize("option", OPTIONS)
def test_flash_attention_runs_what_plan_says(monkeypatch, capability, option):
  calls = _captured(monkeypatch, capability)
  for shape in (dict(), dict(seq_q=1000, seq_k=1537, heads=4, kv_heads=2, head_dim=64), dict(head_dim=80)):
    q, k, v = _structs(**shape)
    options = _options(option, q, k)
    arrays = {name: x for name, x in options.items() if isinstance(x, jax.ShapeDtypeStruct)}
    static = {name: x for name, x in options.items() if name not in arrays}
    jax.eval_shape(lambda q, k, v, arrays: flash_attention(q, k, v, **arrays, **static), q, k, v, arrays)
    assert calls.pop().plan == plan(q, k, v, compute_capability=capability, **options)


def test_plan_takes_arrays_and_checks_like_flash_attention():
  q, k, v, _ = random_inputs(0, 1, 32, 32, 2, 16)
  assert plan(q, k, v, causal=True, compute_capability=AMPERE).forward.backend == "triton"
  with pytest.raises(ValueError, match="head_dim must be"):
    plan(q[..., :12], k[..., :12], v[..., :12])
  with pytest.raises(TypeError, match="compute_capability"):
    plan(q, k, v, compute_capability="9.0")
  with pytest.raises(ValueError, match=r"sinks must have shape \[heads\] = \(2,\)"):
    plan(q, k, v, sinks=jnp.zeros((3,)))
  with pytest.raises(TypeError, match=r"plan\(\) got unexpected keyword arguments \['dropout_seed'\].*dropout_rng"):
    plan(q, k, v, dropout_rate=0.1, dropout_seed=1)


def test_layers_share_one_kernel_lowering(monkeypatch):
  """A model calling flash_attention in several identical layers lowers
  each kernel once, not once per layer (a shared jit inside the library):
  the lowered module of three layers holds as many kernels as that of one."""
  monkeypatch.setattr(backends, "default_compute_capability", lambda: HOPPER)
  q = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

  def kernels_in_module(layers):
    def model(q, k, v):
      for _ in range(layers):
        q = flash_attention(q, k, v, causal=True)
      return q

    text = jax.jit(model).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("flash2_fwd_mosaic")

  assert kernels_in_module(3) == kernels_in_module(1) > 0


@pytest.mark.parametrize(
    "seq_q, seq_k, causal, kv_heads",
    # Whole blocks, and ragged lengths with causal GQA (the interpreter is
    # slow: the kernels' causal and ragged paths are checked one by one in
    # test_mosaic.py).
    [(256, 256, False, None), (150, 260, True, 1)],
    ids=["full", "ragged_causal_gqa"],
)
def test_backend_mosaic_forward_and_backward(seq_q, seq_k, causal, kv_heads):
  """flash_attention(backend="mosaic"): the Mosaic forward and backward
  (interpreted here) through the custom_vjp, with a cotangent on the lse too,
  against the reference; at whole blocks and at ragged lengths."""
  q, k, v, dout = (x.astype(jnp.float16) for x in random_inputs(3, 1, seq_q, seq_k, 2, 64))
  if kv_heads is not None:
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  dlse = jax.random.normal(jax.random.PRNGKey(7), (1, 2, seq_q), jnp.float32)
  f = lambda q, k, v: flash_attention(q, k, v, backend="mosaic", return_lse=True, causal=causal, interpret=True)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  got = (out, lse, *vjp((dout, dlse)))
  want = reference_with_grads(q, k, v, dout, dlse, causal=causal, dtype=jnp.float32)
  for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    assert rel_err(x, ref) < 1e-2, name
