"""The lab tools on CPU: what each builds before anything reaches a GPU.

The tools time and compile jax_flash2 through its public API
(flash_attention with backend=, block_sizes=, mosaic_config=); these tests
check what they pass it, with flash_attention replaced by a recorder where
a call would need a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from jax_flash2 import defaults
from jax_flash2.config import BlockSizes, KernelConfig, MosaicBackwardConfig, MosaicConfig, MosaicForwardConfig

# The tools this suite owns and imports on CPU (lab/tools/mosaic_fingerprint.py and
# kernel_fingerprint.py have their owners' tests).
TOOLS = ("cli_ab", "determinism_check", "kernel_anatomy", "mosaic_bench", "mosaic_bwd_bench",
         "mosaic_bwd_cpu_compile", "mosaic_cpu_compile", "mosaic_profile", "ncu_profile", "plot_results", "power_probe",
         "schedule_model", "tma_reduce_bench", "trace_overlap", "tune", "wgmma_bench")


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_imports(load_tool, name):
  """Each tool imports on a CPU machine (no GPU, no CUDA plugin): what it
  takes from jax_flash2 exists."""
  assert load_tool(name).__doc__


class _Recorder:
  """Stands in for flash_attention: records its keyword arguments, returns q."""

  def __init__(self):
    self.calls = []

  def __call__(self, q, k, v, **kwargs):
    self.calls.append(kwargs)
    if kwargs.get("return_lse"):
      return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    return q


def _qkv(seq=8, heads=2, head_dim=64):
  x = jnp.ones((1, seq, heads, head_dim), jnp.bfloat16)
  return x, x, x


def test_determinism_check_counts_the_runs_whose_bits_differ(load_tool):
  """lab/tools/determinism_check.py: a function that returns the same bits on
  every call shows no difference; one whose dq drifts shows it on every
  rerun, with the largest difference, and leaves the other outputs clean."""
  tool = load_tool("determinism_check")
  x = jnp.arange(8, dtype=jnp.float32)
  clean = {name: (0, 0.0) for name in tool.OUTPUTS}
  assert tool.compare_runs(lambda x: (x, 2 * x, 3 * x, 4 * x), (x,), runs=3) == clean
  calls = itertools.count()

  def drifting(x):
    n = next(calls)
    return x, x + n * 0.25, x, x

  result = tool.compare_runs(drifting, (x,), runs=4)
  assert result == {**clean, "dq": (3, 0.75)}, result


def test_cli_ab_variants_are_the_defaults_with_their_fields_set(load_tool):
  """lab/tools/cli_ab.py: a variant's MosaicConfig is the measured default for
  the cell's shape with the spec's fields set, the side without a spec None;
  kernels=2 / kernels=1 switch the backward's fused_dq; a field the config
  does not have (the removed measurement switches among them) or a value
  its validation refuses stops the tool before any run."""
  tool = load_tool("cli_ab")
  config = tool.mosaic_config("consumers=3+block_q=192", "kernels=2", head_dim=64, seq_q=4096, causal=True)
  assert config == MosaicConfig(
      forward=dataclasses.replace(defaults.mosaic_forward(64, seq_q=4096, causal=True), consumers=3, block_q=192),
      backward=dataclasses.replace(defaults.mosaic_backward(64), fused_dq=False),
  )
  assert tool.mosaic_config(None, "default", head_dim=128, seq_q=2048, causal=False) == MosaicConfig(
      backward=defaults.mosaic_backward(128))
  assert tool.mosaic_config(None, None, head_dim=128, seq_q=2048, causal=False) == MosaicConfig()
  assert tool._variant(MosaicBackwardConfig(), "kernels=1").fused_dq is True
  assert tool._variant(MosaicForwardConfig(), "persistent=1+balanced=1+stages=3") == MosaicForwardConfig(
      persistent=True, balanced=True, stages=3)
  for spec in ("pingpong=1", "early_q=1", "consumers", "kernels=2"):  # kernels= is the backward's alone
    with pytest.raises(SystemExit, match="not a MosaicForwardConfig field"):
      tool._check(spec, None)
  for spec in ("adders=2", "dq_adder_warps=2", "kv_registers=1"):
    with pytest.raises(SystemExit, match="not a MosaicBackwardConfig field"):
      tool._check(None, spec)
  with pytest.raises(SystemExit, match="consumers must be 2 or 3"):
    tool._check("consumers=4", None)
  assert tool._specs(["two=default", "three=consumers=3+block_q=192"], "--fwd") == {
      "two": "default", "three": "consumers=3+block_q=192"}
  with pytest.raises(SystemExit, match="NAME=SPEC"):
    tool._specs(["three"], "--fwd")
  with pytest.raises(SystemExit, match="at least one"):
    tool.main(["--", "--seqlens", "2k"])


def test_cli_ab_registers_an_implementation_that_passes_its_config(monkeypatch, load_tool):
  """A registered variant is a bench implementation with flash2-mosaic's
  support rules whose function calls flash_attention(backend="mosaic",
  mosaic_config=<the variant's config for the cell's shape>)."""
  from jax_flash2.bench import impls as impls_lib
  from jax_flash2.bench.spec import Shape

  tool = load_tool("cli_ab")
  monkeypatch.setattr(impls_lib, "REGISTRY", dict(impls_lib.REGISTRY))
  recorder = _Recorder()
  monkeypatch.setattr(tool, "flash_attention", recorder)
  assert tool._register("three", "consumers=3+block_q=192", None) == "flash2:three"
  impl = impls_lib.get("flash2:three")
  assert impl.supports is impls_lib.get("flash2-mosaic").supports
  shape = Shape(batch=1, seqlen=4096, heads=2, kv_heads=2, head_dim=64, causal=True, dtype="bfloat16")
  fn = impl.factory(shape, impls_lib.Options(platform="cpu", interpret=True))
  fn(*_qkv())
  [kwargs] = recorder.calls
  assert kwargs["backend"] == "mosaic" and kwargs["causal"] is True and kwargs["interpret"] is True
  assert kwargs["mosaic_config"] == tool.mosaic_config("consumers=3+block_q=192", None, head_dim=64, seq_q=4096,
                                                       causal=True)
  with pytest.raises(SystemExit):
    tool._register("bad", None, "dq_addition_experiment=1")


def test_tune_sweeps_one_kernel_with_the_others_at_their_defaults(monkeypatch, load_tool):
  """lab/tools/tune.py: the candidates are valid KernelConfigs (none over
  64x64 tiles at head_dim 256), an explicit list parses, and a candidate
  reaches flash_attention as block_sizes on the Triton backend with the
  other two kernels at the measured defaults."""
  tool = load_tool("tune")
  assert len(list(tool.candidates("fwd", 128))) == 2 * 3 * 2 * 3
  assert all(c.block_q * c.block_k <= 64 * 64 for c in tool.candidates("dq", 256))
  assert tool.parse_configs("128,64,8,3;64,128,4,2") == [KernelConfig(128, 64, 8, 3), KernelConfig(64, 128, 4, 2)]
  base = tool.default_block_sizes(80, causal=True)
  assert base == defaults.block_sizes(128, True)
  tiles = tool.with_kernel(base, "dkv", KernelConfig(32, 64, 4, 3))
  assert tiles == BlockSizes(fwd=base.fwd, dkv=KernelConfig(32, 64, 4, 3), dq=base.dq)
  with pytest.raises(ValueError, match="kernel must be one of"):
    tool.with_kernel(base, "bwd", KernelConfig(64, 64))
  recorder = _Recorder()
  monkeypatch.setattr(tool, "flash_attention", recorder)
  tool.attention_fn(True, tiles)(*_qkv())
  assert recorder.calls == [dict(causal=True, backend="triton", block_sizes=tiles, interpret=False)]


def test_mosaic_benches_start_from_the_defaults_and_pass_configs(monkeypatch, load_tool):
  """lab/tools/mosaic_bench.py and mosaic_bwd_bench.py: rows start from the
  measured default for the shape (--block-kv, --stages, --block-q on top)
  and reach flash_attention as mosaic_config on backend="mosaic"."""
  fwd_tool = load_tool("mosaic_bench")
  bwd_tool = load_tool("mosaic_bwd_bench")
  start = fwd_tool.start_config(64, 8192, True, stages=2)
  assert start == dataclasses.replace(defaults.mosaic_forward(64, seq_q=8192, causal=True), stages=2)
  assert fwd_tool._variant(start, "consumers=2+block_q=128").consumers == 2
  recorder = _Recorder()
  monkeypatch.setattr(fwd_tool, "flash_attention", recorder)
  fwd_tool.mosaic_forward_fn(False, start)(*_qkv())
  assert recorder.calls == [dict(causal=False, return_lse=True, backend="mosaic",
                                 mosaic_config=MosaicConfig(forward=start), interpret=False)]
  bwd_start = bwd_tool.start_config(128, block_q=128)
  assert bwd_start == dataclasses.replace(defaults.mosaic_backward(128), block_q=128)
  assert bwd_tool._variant(defaults.mosaic_backward(64), "kernels=2").fused_dq is False


def test_mosaic_profile_compiles_with_the_profiler_only_inside(load_tool, tmp_path):
  """lab/tools/mosaic_profile.py: inside `profiled`, Mosaic GPU's
  CompilerParams (which the kernels build at trace time) carry the
  profiler's event buffer and trace folder on top of their own fields;
  outside, the class is jax's own again."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  tool = load_tool("mosaic_profile")
  original = plgpu.CompilerParams
  with tool.profiled(64, str(tmp_path)):
    params = plgpu.CompilerParams(approx_math=True)
  assert plgpu.CompilerParams is original
  assert (params.approx_math, params.profile_space, params.profile_dir) == (True, 64, str(tmp_path))
  assert original(approx_math=True).profile_space == 0


def test_schedule_model_balanced_table_evens_the_causal_ctas(load_tool):
  """lab/tools/schedule_model.py at head_dim 128, 4k: the balanced table
  leaves the busiest CTA nearer the mean than the heavy-light pairs dealt
  round-robin (lab/NOTES.md, session 15: 3.1% against 0.2-0.5%)."""
  tool = load_tool("schedule_model")
  paired, balanced, work = tool.schedules(4096, 128, defaults.mosaic_forward(128, seq_q=4096, causal=True))
  assert len(work) == 4096 // 128 and work[0] == max(work)
  assert tool.busiest_over_mean(balanced, work) < tool.busiest_over_mean(paired, work)


def test_plot_results_draws_a_run_from_its_results_files(load_tool, tmp_path):
  """lab/tools/plot_results.py: the cells of results.json files (schema 1
  files lack some fields) become the bench's CellResults, renamed for the
  legend, and report.write_plots draws them into the PNG asked for."""
  import json

  pytest.importorskip("matplotlib")
  tool = load_tool("plot_results")
  base = dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, head_dim=64, causal=False, status="ok")
  cells = [dict(base, impl=impl, seqlen=seq, mode=mode, ms=1.0, tflops=float(seq // 10 + i))
           for i, impl in enumerate(("flash2", "cudnn")) for seq in (1024, 2048) for mode in ("fwd", "fwd+bwd")]
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"cells": cells + [dict(cells[0], impl="xla", status="OOM", tflops=None)]}))
  read = tool.read_cells([str(path)])
  assert len(read) == 9 and read[0].window_left is None and read[0].segments == 1
  out = tmp_path / "plots" / "tflops.png"
  assert tool.main([str(path), "--out", str(out), "--impls", "flash2", "cudnn", "--title", "test"]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
