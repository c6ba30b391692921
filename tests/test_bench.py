"""The benchmark CLI (jax_flash2.bench) on CPU: parsing, FLOPs, output schema,
kernel-time traces, tokamax (a stand-in module, and the real one where
installed), a tiny run."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import sys
import types
import weakref
from typing import Literal

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from jax_flash2.bench import check, cli, flops, impls, kernel_trace, report, sweep, timing
from jax_flash2.bench.spec import CELL_FIELDS, CellResult, CheckResult, LeftOut, Shape

HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None
NO_TOKAMAX = LeftOut("tokamax", "tokamax is not installed (pip install tokamax)", requested=False)


def _shape(**kw) -> Shape:
  base = dict(batch=2, seqlen=1024, heads=4, kv_heads=4, head_dim=64, causal=False, dtype="bfloat16")
  return Shape(**(base | kw))


# ------------------------------------------------------------------ tokamax

type _Implementation = Literal["mosaic", "triton", "cudnn", "xla", "xla_chunked"]


def _fake_tokamax(calls: list[dict], implementations=_Implementation) -> types.ModuleType:
  """A stand-in for tokamax: its dot_product_attention signature and
  `DotProductAttentionImplementation` alias, jax.nn's XLA attention inside
  (which ignores logits_soft_cap), NotImplementedError for the GPU kernels as
  on a CPU; records each call's keyword arguments in `calls`."""
  module = types.ModuleType("tokamax")

  def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                            local_window_size=None, logits_soft_cap=None, implementation=None, **kwargs):
    calls.append(dict(mask=mask, is_causal=is_causal, local_window_size=local_window_size,
                      logits_soft_cap=logits_soft_cap, implementation=implementation))
    if implementation in ("mosaic", "triton"):
      raise NotImplementedError("Not supported on cpu.")
    return jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                        local_window_size=local_window_size, implementation="xla")

  module.dot_product_attention = dot_product_attention
  module.DotProductAttentionImplementation = implementations
  return module


@pytest.fixture
def fake_tokamax(monkeypatch) -> list[dict]:
  """Installs `_fake_tokamax` as `tokamax`; returns its list of calls."""
  calls: list[dict] = []
  monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax(calls))
  return calls


@pytest.fixture
def no_tokamax(monkeypatch) -> None:
  """Makes `import tokamax` fail, as where it is not installed."""
  monkeypatch.setitem(sys.modules, "tokamax", None)


# ------------------------------------------------------------------ parsing


def test_gpu_defaults(no_tokamax):
  cfg = cli.parse([], "gpu")
  assert cfg.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
  assert cfg.head_dims == (64, 128)
  assert cfg.causal == (False, True)
  assert cfg.dtypes == ("bfloat16",)
  assert cfg.modes == ("fwd", "bwd", "fwd+bwd")
  # tokamax is a default where it is installed; here it is not, and the run leaves it out without a word.
  assert cfg.impls == ("flash2", "cudnn", "xla") and cfg.left_out == (NO_TOKAMAX,)
  assert (cfg.warmup, cfg.iters, cfg.check, cfg.interpret, cfg.tiny, cfg.kernel_time) == (3, 20, True, False, False,
                                                                                          True)
  assert (cfg.save, cfg.out, cfg.plot, cfg.memory) == (True, None, True, False)
  # 16k tokens, hidden 2048.
  s = cfg.shape("bfloat16", 64, True, 512)
  assert (s.batch, s.heads, s.kv_heads) == (32, 32, 32)
  s = cfg.shape("bfloat16", 128, False, 16384)
  assert (s.batch, s.heads, s.kv_heads) == (1, 16, 16)
  assert cfg.num_cells() == 6 * 2 * 2 * 3 * 3


def test_cpu_defaults_are_tiny(no_tokamax):
  cfg = cli.parse([], "cpu")
  assert cfg.tiny and cfg.interpret and not cfg.kernel_time
  # No GPU: cuDNN is left out of the defaults (not a column of "unsupported"), silently.
  assert cfg.impls == ("flash2", "xla")
  assert cfg.left_out == (LeftOut("cudnn", "needs an NVIDIA GPU", requested=False), NO_TOKAMAX)
  assert cfg.seqlens == (64, 128) and cfg.head_dims == (64,)
  assert cfg.shape("bfloat16", 64, False, 128) == Shape(1, 128, 2, 2, 64, False, "bfloat16")
  assert cfg.causal == (False, True) and cfg.modes == ("fwd", "bwd", "fwd+bwd")


def test_overrides():
  cfg = cli.parse(
      [
          "--seqlens", "1k,2048", "4096",
          "--head-dims", "256",
          "--batch", "4",
          "--heads", "8",
          "--kv-heads", "2",
          "--causal", "true",
          "--dtype", "fp16", "fp32",
          "--modes", "fwd", "fwd+bwd",
          "--impls", "xla", "flash2-mosaic",
          "--warmup", "0",
          "--iters", "5",
          "--no-check",
          "--no-kernel-time",
          "--out", "somewhere",
          "--no-plot",
          "--memory",
          "--memory-max-seqlen", "8k",
      ],
      "gpu",
  )
  assert cfg.seqlens == (1024, 2048, 4096)
  assert cfg.head_dims == (256,)
  assert cfg.causal == (True,)
  assert cfg.dtypes == ("float16", "float32")
  assert cfg.modes == ("fwd", "fwd+bwd")
  assert cfg.impls == ("xla", "flash2-mosaic")
  assert (cfg.warmup, cfg.iters, cfg.check, cfg.kernel_time, cfg.left_out) == (0, 5, False, False, ())
  assert (cfg.save, cfg.out, cfg.plot, cfg.memory, cfg.memory_max_seqlen) == (True, "somewhere", False, True, 8192)
  # --plot is the default, still accepted as recorded commands spell it.
  assert cli.parse(["--plot", "--out", "d"], "gpu").plot and not cli.parse(["--no-save"], "gpu").save
  assert cfg.shape("float16", 256, True, 2048) == Shape(4, 2048, 8, 2, 256, True, "float16")
  assert cli.parse(["--causal", "false"], "gpu").causal == (False,)
  assert cli.parse(["--causal", "true", "false"], "gpu").causal == (True, False)
  assert cli.parse(["--hidden", "1024", "--tokens", "8192"], "gpu").shape("bfloat16", 64, False, 1024) == Shape(
      8, 1024, 16, 16, 64, False, "bfloat16"
  )


def test_window_and_segments_flags():
  cfg = cli.parse([], "gpu")
  assert (cfg.windows, cfg.segments) == ((None,), (1,))
  cfg = cli.parse(["--window", "1024,0", "256:0", "none", "1k:none", "none,4", "none,none", "1024:0",
                   "--segments", "1", "2,8", "8"], "gpu")
  # none,none is no window; repeats collapse.
  assert cfg.windows == ((1024, 0), (256, 0), None, (1024, None), (None, 4))
  assert cfg.segments == (1, 2, 8)
  assert cli.parse(["--window", "1024:0,256:0"], "gpu").windows == ((1024, 0), (256, 0))
  assert cli.parse(["--window", "512"], "gpu").windows == ((512, 0),)  # a lone LEFT means LEFT,0
  assert cli.parse(["--window", "0,0"], "gpu").windows == ((0, 0),)
  # Each window x segments pair is one more group of every (dtype, head_dim, causal).
  assert cfg.num_cells() == 6 * 2 * 2 * 5 * 3 * 3 * len(cfg.impls)
  assert len(cfg.groups()) == 2 * 2 * 5 * 3
  s = cfg.shape("bfloat16", 128, True, 16384, (1024, 0), 8)
  assert s == Shape(1, 16384, 16, 16, 128, True, "bfloat16", window_left=1024, window_right=0, segments=8)
  assert s.window == (1024, 0) and s.segments == 8
  assert s.describe() == "b1 s16384 h16 d128 causal win1024,0 seg8 bf16"
  assert s.mask == "causal window 1024,0 8 segments"
  plain = cfg.shape("bfloat16", 128, False, 16384)
  assert plain.window is None and plain.segments == 1 and plain.describe() == "b1 s16384 h16 d128 full bf16"
  assert cfg.shape("bfloat16", 64, False, 512, (None, 4)).describe() == "b32 s512 h32 d64 full winnone,4 bf16"
  assert "windows ['1024,0', '256,0', 'none', '1024,none', 'none,4'], segments [1, 2, 8]" in cli._describe(cfg)
  assert "windows" not in cli._describe(cli.parse([], "gpu"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--window", "abc"],
        ["--window", "1,2,3"],
        ["--window=-1,0"],
        ["--window", "1:x"],
        ["--window", "1,"],
        ["--segments", "0"],
        ["--segments", "x"],
        ["--segments", "3"],  # does not divide the default seqlens
        ["--seqlens", "1000", "--segments", "16"],
    ],
)
def test_bad_window_and_segments_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "gpu")
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert "--window" in err or "--segments" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--impls", "nope"],
        ["--dtype", "int8"],
        ["--modes", "sideways"],
        ["--causal", "maybe"],
        ["--no-save", "--out", "somewhere"],
        ["--heads", "8", "--kv-heads", "3"],
        ["--head-dims", "60"],
        ["--seqlens", "abc"],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "gpu")
  assert exc.value.code == 2


def test_requested_impls_that_cannot_run_here(capsys):
  """Named in --impls but unable to run on the machine: left out, with the
  reason (the CLI prints it); none left is a usage error that says why."""
  cfg = cli.parse(["--impls", "cudnn", "xla", "cudnn-deterministic"], "cpu")
  assert cfg.impls == ("xla",)
  assert cfg.left_out == (LeftOut("cudnn", "needs an NVIDIA GPU", requested=True),
                          LeftOut("cudnn-deterministic", "needs an NVIDIA GPU", requested=True))
  # On a GPU they run; flash2-mosaic runs on a CPU too (Mosaic's interpreter).
  assert cli.parse(["--impls", "cudnn", "xla"], "gpu").impls == ("cudnn", "xla")
  assert cli.parse(["--impls", "flash2-mosaic"], "cpu").impls == ("flash2-mosaic",)
  with pytest.raises(SystemExit) as exc:
    cli.parse(["--impls", "cudnn"], "cpu")
  assert exc.value.code == 2 and "cudnn: needs an NVIDIA GPU" in capsys.readouterr().err
  with pytest.raises(ValueError):
    LeftOut("cudnn", "", requested=True)


def test_sinks_flag_runs_the_jax_flash2_impls_only(no_tokamax, capsys):
  """--sinks: the implementations without attention sinks are left out, the
  defaults silently, those asked for with the reason; none left is a usage
  error that says why."""
  assert not cli.parse([], "gpu").sinks
  cfg = cli.parse(["--sinks"], "gpu")
  assert cfg.sinks and cfg.impls == ("flash2",)
  no_sinks = "has no attention sinks (--sinks)"
  assert cfg.left_out == (LeftOut("cudnn", no_sinks, requested=False), LeftOut("xla", no_sinks, requested=False),
                          NO_TOKAMAX)
  assert "attention sinks" in cli._describe(cfg) and "sinks" not in cli._describe(cli.parse([], "gpu"))
  cfg = cli.parse(["--sinks", "--impls", "flash2-triton", "cudnn"], "gpu")
  assert cfg.impls == ("flash2-triton",) and cfg.left_out == (LeftOut("cudnn", no_sinks, requested=True),)
  with pytest.raises(SystemExit) as exc:
    cli.parse(["--sinks", "--impls", "xla"], "cpu")
  assert exc.value.code == 2 and f"xla: {no_sinks}" in capsys.readouterr().err


def test_tokamax_has_no_sinks(fake_tokamax):
  sinks = impls.Options(platform="gpu", sinks=True)
  for name in ("tokamax", "tokamax-mosaic", "tokamax-triton", "tokamax-xla"):
    assert impls.get(name).available(sinks) == "has no attention sinks (--sinks)"
    assert impls.get(name).supports(_shape(), sinks) == "has no attention sinks (--sinks)"


def test_flash2_takes_the_sinks_of_the_check_reference():
  """A --sinks run's check: flash2 (interpret) against the float32 reference
  with the same sink logits, which change the output."""
  shape = _shape(batch=1, seqlen=32, heads=2, kv_heads=2, head_dim=16, causal=True, dtype="float32")
  x = timing.make_inputs(shape, 0)
  result, _ = sweep.run_check(impls.get("flash2-triton"), shape, x,
                              impls.Options(platform="cpu", interpret=True, sinks=True), seed=0)
  assert result.status == "ok" and result.rel_err_out < 1e-5 and result.rel_err_grad < 1e-5
  with_sinks, without = (check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=True, sinks=sinks)[0]
                         for sinks in (True, False))
  assert not np.allclose(np.asarray(with_sinks), np.asarray(without), atol=1e-2)


def test_softcap_and_varlen_flags(no_tokamax):
  """--softcap: a sweep dimension like --window. --varlen: each occurrence one
  packing (spaces or commas), run as one batch-1 row of its sum in place of
  --seqlens, with flash2-segids beside flash2 and the others left out."""
  cfg = cli.parse([], "gpu")
  assert (cfg.softcaps, cfg.varlens) == ((None,), ())
  assert [(s, v) for s, v in cfg.rows()] == [(s, None) for s in cfg.seqlens]
  cfg = cli.parse(["--softcap", "none", "50", "30.5", "50.0", "--causal", "true"], "gpu")
  assert cfg.softcaps == (None, 50.0, 30.5) and len(cfg.groups()) == 2 * 3
  s = cfg.shape("bfloat16", 128, True, 4096, softcap=50.0)
  assert (s.softcap, s.mask, s.describe()) == (50.0, "causal softcap 50", "b4 s4096 h16 d128 causal cap50 bf16")
  assert "softcaps ['none', '50', '30.5']" in cli._describe(cfg)
  assert cfg.impls == ("flash2", "cudnn", "xla")  # a softcap leaves them cells, "unsupported" where it must

  cfg = cli.parse(["--varlen", "1024,3072,512", "--varlen", "1k", "512", "--varlen", "1024,3072,512"], "gpu")
  assert cfg.varlens == ((1024, 3072, 512), (1024, 512)) and cfg.seqlens == (4608, 1536)
  assert cfg.rows() == [(4608, (1024, 3072, 512)), (1536, (1024, 512))]
  assert cfg.num_cells() == 2 * 2 * 2 * 3 * 2  # head_dims x causal x packings x modes x impls
  s = cfg.shape("bfloat16", 128, True, 4608, varlen=(1024, 3072, 512))
  assert (s.batch, s.seqlen, s.heads, s.varlen) == (1, 4608, 16, (1024, 3072, 512))
  assert s.mask == "causal varlen 1024,3072,512" and s.describe() == "b1 s4608 h16 d128 causal varlen1024,3072,512 bf16"
  with pytest.raises(ValueError):
    cfg.shape("bfloat16", 128, True, 4096, varlen=(1024, 3072, 512))
  assert "varlen ['1024,3072,512', '1024,512'] (batch 1)" in cli._describe(cfg)
  no_packing = "has no packed sequences (--varlen): its sequence lengths pad, they do not pack"
  assert cfg.impls == ("flash2", "flash2-segids")
  assert cfg.left_out == (LeftOut("cudnn", no_packing, requested=False), LeftOut("xla", no_packing, requested=False),
                          NO_TOKAMAX)
  cfg = cli.parse(["--varlen", "64,32", "--impls", "flash2-triton", "flash2-triton-segids", "xla"], "cpu")
  assert cfg.impls == ("flash2-triton", "flash2-triton-segids")
  assert cfg.left_out == (LeftOut("xla", no_packing, requested=True),)
  # Without --varlen a -segids twin has nothing to pack.
  assert cli.parse(["--impls", "flash2", "flash2-segids"], "gpu").left_out == (
      LeftOut("flash2-segids", "only with --varlen (its lengths as segment ids)", requested=True),)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--softcap", "-5"], "--softcap"),
        (["--softcap=-5"], "--softcap"),
        (["--softcap", "0"], "--softcap"),
        (["--softcap", "x"], "--softcap"),
        (["--softcap", "inf"], "--softcap"),
        (["--softcap", "nan"], "--softcap"),
        (["--varlen", ""], "--varlen"),
        (["--varlen", ","], "--varlen"),
        (["--varlen", "16,0,8"], "--varlen"),
        (["--varlen", "-16"], "--varlen"),
        (["--varlen", "16,x"], "--varlen"),
        (["--varlen", "1.5"], "--varlen"),
        (["--varlen", "16", "--seqlens", "32"], "--seqlens"),
        (["--varlen", "16", "--segments", "2"], "--segments"),
        (["--varlen", "16", "--batch", "2"], "--batch"),
        (["--varlen", "16", "--memory"], "--memory"),
    ],
)
def test_bad_softcap_and_varlen_exit_2(argv, flag, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "gpu")
  assert exc.value.code == 2 and flag in capsys.readouterr().err


# -------------------------------------------------------------------- FLOPs


def test_flop_counts_exact():
  s = _shape()
  fwd = 4 * 2 * 4 * 1024 * 1024 * 64
  assert fwd == 2_147_483_648
  assert flops.mode_flops(s, "fwd") == fwd
  assert flops.mode_flops(s, "bwd") == 5 * fwd // 2 == 5_368_709_120
  assert flops.mode_flops(s, "fwd+bwd") == 7 * fwd // 2 == 7_516_192_768
  c = _shape(causal=True)
  assert flops.mode_flops(c, "fwd") == fwd // 2 == 1_073_741_824
  assert flops.mode_flops(c, "bwd") == 2_684_354_560
  assert flops.mode_flops(c, "fwd+bwd") == 3_758_096_384
  # The default sweep's 16k-token point: batch 1, 16 heads, seq 16384, d 128.
  assert flops.forward_flops(1, 16, 16384, 16384, 128, False) == 2_199_023_255_552
  # FLOPs count query heads; kv_heads does not change them.
  assert flops.mode_flops(_shape(kv_heads=1), "fwd") == fwd
  assert flops.tflops_per_s(2 * 10**12, 1000.0) == pytest.approx(2.0)
  with pytest.raises(ValueError):
    flops.mode_flops(s, "sideways")


def _brute_visible(seqlen: int, causal: bool, window, segments: int) -> int:
  """Visible (query, key) pairs, one by one, as flash_attention defines them (seq_q == seq_k)."""
  left, right = window if window is not None else (None, None)
  ids = np.arange(seqlen) // (seqlen // segments)
  count = 0
  for i in range(seqlen):
    for j in range(seqlen):
      count += bool(
          (left is None or j >= i - left) and (right is None or j <= i + right)
          and (not causal or j <= i) and ids[i] == ids[j]
      )
  return count


@pytest.mark.parametrize("seqlen, segments", [(1, 1), (6, 1), (6, 2), (6, 3), (16, 1), (16, 4), (24, 3), (24, 8)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (0, 2), (5, 5), (None, 1), (2, None), (100, 0)])
def test_visible_pairs_brute_force(seqlen, segments, causal, window):
  want = _brute_visible(seqlen, causal, window, segments)
  assert flops.visible_pairs(seqlen, causal, window, segments) == want
  left, right = window if window is not None else (None, None)
  s = _shape(batch=2, seqlen=seqlen, heads=3, head_dim=8, causal=causal, window_left=left, window_right=right,
             segments=segments)
  assert flops.visible_fraction(s) == pytest.approx(want / seqlen**2)
  if window is None and segments == 1:
    # Plain masks keep the FlashAttention convention: causal is half of dense, not the exact count.
    assert flops.flops_convention(s) == ("causal-half" if causal else "dense")
    assert flops.mode_flops(s, "fwd") == flops.forward_flops(2, 3, seqlen, seqlen, 8, causal)
  else:
    assert flops.flops_convention(s) == "visible"
    fwd = 4 * 8 * 2 * 3 * want
    assert flops.mode_flops(s, "fwd") == fwd
    assert flops.mode_flops(s, "bwd") == 5 * fwd // 2
    assert flops.mode_flops(s, "fwd+bwd") == 7 * fwd // 2


def test_window_and_segment_flops_at_16k():
  """The issue's targets compare window (1024, 0) and 8 causal segments with causal at 16k."""
  base = dict(batch=1, seqlen=16384, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16")
  causal = flops.mode_flops(Shape(causal=True, **base), "fwd+bwd")
  window = flops.mode_flops(Shape(causal=True, window_left=1024, window_right=0, **base), "fwd+bwd")
  # 1025 keys for all but the first 1024 queries.
  pairs = 16384 * 1025 - 1024 * 1025 // 2
  assert window == 7 * 4 * 128 * 16 * pairs // 2
  assert 8.0 < causal / window < 8.3
  segs = flops.mode_flops(Shape(causal=True, segments=8, **base), "fwd+bwd")
  assert segs == 7 * 4 * 128 * 16 * (8 * 2048 * 2049 // 2) // 2
  assert causal / segs == pytest.approx(8, rel=1e-3)
  # Window and causal on the right side: (1024, 5) with causal is (1024, 0).
  assert flops.mode_flops(Shape(causal=True, window_left=1024, window_right=5, **base), "fwd") == window * 2 // 7
  with pytest.raises(ValueError):
    flops.visible_pairs(10, False, None, 3)


def test_varlen_flops_hand_computed():
  """A varlen row counts the visible pairs of each sequence: len^2, or
  len(len+1)/2 when causal; a softcap changes no FLOPs."""
  base = dict(batch=1, seqlen=10, heads=2, kv_heads=2, head_dim=8, dtype="bfloat16")
  full = Shape(causal=False, varlen=(3, 5, 2), **base)
  assert flops.flops_convention(full) == "visible"
  assert flops.shape_visible_pairs(full) == 9 + 25 + 4
  assert flops.mode_flops(full, "fwd") == 4 * 8 * 2 * 38 == 2432
  assert flops.visible_fraction(full) == pytest.approx(38 / 100)
  causal = Shape(causal=True, varlen=(3, 5, 2), **base)
  assert flops.shape_visible_pairs(causal) == 6 + 15 + 3
  assert flops.mode_flops(causal, "fwd+bwd") == 7 * 4 * 8 * 2 * 24 // 2 == 5376
  # Window (1, 0): each query sees itself and its predecessor within its sequence: 2n - 1.
  window = Shape(causal=False, window_left=1, window_right=0, varlen=(3, 5, 2), **base)
  assert flops.shape_visible_pairs(window) == 5 + 9 + 3
  assert flops.mode_flops(Shape(causal=True, varlen=(3, 5, 2), softcap=30.0, **base), "fwd+bwd") == 5376
  assert flops.mode_flops(_shape(softcap=30.0), "fwd") == flops.mode_flops(_shape(), "fwd")
  # The kind of packing: 1024 + 3072 + 512 tokens, causal, 16 heads of 128.
  big = Shape(batch=1, seqlen=4608, heads=16, kv_heads=16, head_dim=128, causal=True, dtype="bfloat16",
              varlen=(1024, 3072, 512))
  assert flops.shape_visible_pairs(big) == 524_800 + 4_720_128 + 131_328
  assert flops.mode_flops(big, "fwd") == 44_042_289_152
  assert flops.mode_flops(big, "fwd+bwd") == 154_148_012_032


def test_min_bytes():
  s = _shape(batch=1, seqlen=128, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16")
  q = 128 * 4 * 64 * 2
  kv = 128 * 2 * 64 * 2
  assert flops.min_fwd_bwd_bytes(s) == 4 * q + 4 * kv + 4 * 128 * 4
  s32 = _shape(batch=1, seqlen=128, heads=4, kv_heads=4, head_dim=64, dtype="float32")
  assert flops.min_fwd_bwd_bytes(s32) == 8 * 128 * 4 * 64 * 4 + 4 * 128 * 4


# ------------------------------------------------------- registry, errors


def test_registry_and_supports():
  assert set(impls.DEFAULT_IMPLS) <= set(impls.REGISTRY)
  assert "flash2-mosaic" in impls.REGISTRY
  cpu = impls.Options(platform="cpu", interpret=True)
  gpu = impls.Options(platform="gpu")
  assert impls.get("flash2-triton").supports(_shape(), cpu) is None
  assert impls.get("flash2-triton").supports(_shape(kv_heads=2), gpu) is None
  assert "multiple" in impls.get("flash2-triton").supports(_shape(kv_heads=3), gpu)
  assert impls.get("flash2-triton").supports(_shape(), impls.Options(platform="cpu")) is not None
  assert impls.get("cudnn").supports(_shape(), cpu) is not None
  assert impls.get("cudnn").supports(_shape(dtype="float32"), gpu) is not None
  assert impls.get("cudnn").supports(_shape(kv_heads=2), gpu) is None
  assert impls.get("xla").supports(_shape(kv_heads=2), cpu) is None
  assert impls.get("xla").supports(_shape(kv_heads=3), cpu) is not None
  with pytest.raises(ValueError):
    impls.get("nope")


def test_window_and_segment_support():
  cpu = impls.Options(platform="cpu", interpret=True)
  gpu = impls.Options(platform="gpu")
  win = dict(window_left=128, window_right=0)
  for kw in (win, dict(segments=4), dict(window_left=8, window_right=8), dict(window_left=None, window_right=4)):
    assert impls.get("flash2-triton").supports(_shape(**kw), cpu) is None
    assert impls.get("xla").supports(_shape(**kw), cpu) is None
  # cuDNN windows are left-only: right 0, or capped by causal.
  assert impls.get("cudnn").supports(_shape(**win), gpu) is None
  assert impls.get("cudnn").supports(_shape(causal=True, window_left=128, window_right=16), gpu) is None
  assert "left-only" in impls.get("cudnn").supports(_shape(window_left=128, window_right=16), gpu)
  assert "left-only" in impls.get("cudnn").supports(_shape(window_left=128, window_right=None), gpu)
  assert impls.get("cudnn").supports(_shape(segments=4), gpu) is None  # as a dense mask
  # What jax.nn.dot_product_attention is given.
  assert impls._dpa_window(_shape(**win), "cudnn") == (True, (128, 0))
  assert impls._dpa_window(_shape(causal=True, window_left=128, window_right=16), "cudnn") == (True, (128, 0))
  assert impls._dpa_window(_shape(window_left=None, window_right=0), "cudnn") == (True, None)
  assert impls._dpa_window(_shape(window_left=None, window_right=4), "xla") == (False, (1024, 4))
  assert impls._dpa_window(_shape(causal=True, window_left=7, window_right=None), "xla") == (True, (7, 1024))
  assert impls._dpa_window(_shape(causal=True), "xla") == (True, None)
  ids = impls.segment_ids(2, 12, 3)
  assert ids.dtype == jnp.int32 and ids.shape == (2, 12)
  np.testing.assert_array_equal(ids[1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
  assert impls.segment_ids(2, 12, 1) is None


def test_softcap_and_varlen_support(fake_tokamax, monkeypatch):
  """Who serves a softcap and who a varlen packing; unsupported ones say why."""
  gpu, varlen = impls.Options(platform="gpu"), impls.Options(platform="gpu", varlen=True)
  capped = _shape(softcap=30.0)
  packed = _shape(batch=1, seqlen=96, varlen=(64, 32))
  for name in ("flash2", "flash2-triton"):
    assert impls.get(name).supports(capped, gpu) is None and impls.get(name).supports(packed, varlen) is None
    assert impls.get(f"{name}-segids").supports(packed, varlen) is None
    assert impls.get(f"{name}-segids").supports(capped, gpu) == "only with --varlen (its lengths as segment ids)"
  for name in ("cudnn", "cudnn-deterministic", "xla"):
    assert impls.get(name).supports(capped, gpu) == "jax.nn.dot_product_attention has no softcap"
    assert impls.get(name).available(varlen).startswith("has no packed sequences (--varlen)")
  for name in ("tokamax", "tokamax-xla"):
    assert impls.get(name).supports(capped, gpu) is None
    assert impls.get(name).available(varlen).startswith("has no packed sequences (--varlen)")
  x = timing.make_inputs(dataclasses.replace(capped, seqlen=16, head_dim=8), 0)
  impls.get("tokamax-xla").factory(dataclasses.replace(capped, seqlen=16, head_dim=8), gpu)(x.q, x.k, x.v)
  assert fake_tokamax[-1]["logits_soft_cap"] == 30.0
  # A tokamax whose API has no logits_soft_cap.
  old = _fake_tokamax([])
  monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(
      dot_product_attention=lambda query, key, value, *, implementation=None: None,
      DotProductAttentionImplementation=old.DotProductAttentionImplementation))
  assert impls.get("tokamax").supports(capped, gpu) == "this tokamax has no logits_soft_cap"
  assert impls.get("tokamax").supports(_shape(), gpu) is None
  # The lengths as flash_attention's segment ids, and as cu_seqlens.
  np.testing.assert_array_equal(impls.shape_segment_ids(_shape(batch=1, seqlen=5, varlen=(2, 3))), [[0, 0, 1, 1, 1]])
  np.testing.assert_array_equal(impls.cu_seqlens((2, 3)), [0, 2, 5])


def _masked_attention(q, k, v, visible):
  """Plain float64 softmax attention with a [seq, seq] or [batch, 1, seq, seq] visibility mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(visible, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize(
    "impl", ["flash2-triton", "xla",
             pytest.param("tokamax-xla", marks=pytest.mark.skipif(not HAS_TOKAMAX, reason="tokamax is not installed"))],
)
@pytest.mark.parametrize(
    "mask", [dict(causal=True, window_left=5, window_right=0), dict(window_left=3, window_right=2),
             dict(causal=True, segments=2), dict(window_left=None, window_right=1, segments=4)],
)
def test_impls_apply_window_and_segments(impl, mask):
  """Each implementation's output is attention under the mask the shape names (checked pair by pair)."""
  shape = _shape(batch=2, seqlen=32, heads=2, kv_heads=2, head_dim=16, dtype="float32", **mask)
  x = timing.make_inputs(shape, 0)
  got = impls.get(impl).factory(shape, impls.Options(platform="cpu", interpret=True))(x.q, x.k, x.v)
  left, right = shape.window or (None, None)
  i, j = np.arange(32)[:, None], np.arange(32)[None, :]
  ids = np.arange(32) // (32 // shape.segments)
  visible = ((left is None) | (j >= i - (left or 0))) & ((right is None) | (j <= i + (right or 0)))
  visible &= (ids[:, None] == ids[None, :]) & ((not shape.causal) | (j <= i))
  np.testing.assert_allclose(np.asarray(got), _masked_attention(x.q, x.k, x.v, visible), atol=2e-5, rtol=2e-5)
  # ... and the float32 reference the accuracy check uses agrees.
  want = check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=shape.causal, window=shape.window,
                                     segments=shape.segments)
  np.testing.assert_allclose(np.asarray(want[0]), np.asarray(got), atol=2e-5, rtol=2e-5)
  plain = check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=shape.causal)
  assert not np.allclose(np.asarray(plain[0]), np.asarray(got), atol=1e-3)


def test_tokamax_availability(no_tokamax):
  """Without tokamax every tokamax implementation says so, and is left out of the defaults silently."""
  cpu, gpu = impls.Options(platform="cpu", interpret=True), impls.Options(platform="gpu")
  for name in ("tokamax", "tokamax-mosaic", "tokamax-triton", "tokamax-xla"):
    assert impls.get(name).available(gpu) == NO_TOKAMAX.reason
    assert impls.get(name).supports(_shape(), cpu) == NO_TOKAMAX.reason
  assert cli.parse(["--impls", "xla", "tokamax-xla"], "gpu").left_out == (dataclasses.replace(NO_TOKAMAX,
                                                                                               impl="tokamax-xla",
                                                                                               requested=True),)


def test_tokamax_impls_on_a_stand_in(fake_tokamax, monkeypatch):
  """Which tokamax implementations run where, and what tokamax.dot_product_attention is given."""
  cpu, gpu = impls.Options(platform="cpu", interpret=True), impls.Options(platform="gpu")
  assert [n for n in impls.DEFAULT_IMPLS if n.startswith("tokamax")] == ["tokamax"]
  for name in ("tokamax", "tokamax-xla"):
    assert impls.get(name).available(cpu) is None and impls.get(name).supports(_shape(kv_heads=2), cpu) is None
  assert impls.get("tokamax-mosaic").available(cpu) == "tokamax's Mosaic kernels need an NVIDIA GPU"
  assert impls.get("tokamax-triton").available(cpu) == "tokamax's Triton kernels need an NVIDIA GPU"
  for name in ("tokamax", "tokamax-mosaic", "tokamax-triton", "tokamax-xla"):
    assert impls.get(name).available(gpu) is None
    assert "multiple" in impls.get(name).supports(_shape(kv_heads=3), gpu)
  assert cli.parse([], "cpu").impls == ("flash2", "xla", "tokamax")
  assert cli.parse([], "gpu").impls == ("flash2", "cudnn", "xla", "tokamax")

  shape = _shape(batch=2, seqlen=32, heads=4, kv_heads=2, head_dim=16, dtype="float32", causal=True,
                 window_left=None, window_right=4, segments=2)
  x = timing.make_inputs(shape, 0)
  got = impls.get("tokamax-xla").factory(shape, cpu)(x.q, x.k, x.v)
  (call,) = fake_tokamax
  # An unbounded side becomes seqlen (tokamax takes two ints); the segments a dense [batch, 1, seq, seq] mask.
  assert (call["implementation"], call["is_causal"], call["local_window_size"]) == ("xla", True, (32, 4))
  assert call["mask"].shape == (2, 1, 32, 32) and call["mask"].dtype == jnp.bool_
  want = check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=True, window=(None, 4), segments=2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), atol=2e-5, rtol=2e-5)
  plain = _shape(batch=1, seqlen=16, heads=2, kv_heads=2, head_dim=8)
  y = timing.make_inputs(plain, 1)
  impls.get("tokamax").factory(plain, cpu)(y.q, y.k, y.v)
  assert fake_tokamax[-1] == dict(mask=None, is_causal=False, local_window_size=None, logits_soft_cap=None,
                                  implementation=None)

  # An implementation this tokamax does not declare.
  type Fewer = Literal["xla", "cudnn"]
  monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax([], implementations=Fewer))
  assert impls.get("tokamax-triton").available(gpu) == "this tokamax has no implementation 'triton' (it has xla, cudnn)"
  assert impls.get("tokamax").available(gpu) is None


def test_tokamax_cells_on_a_stand_in(fake_tokamax):
  """tokamax through the sweep: checked against the float32 reference like
  the others; its GPU kernels, named in --impls, left out on a CPU."""
  cfg = cli.parse(["--impls", "tokamax", "tokamax-mosaic", "tokamax-xla", "--seqlens", "32", "--causal", "false",
                   "--modes", "fwd", "fwd+bwd", "--iters", "1", "--warmup", "0"], "cpu")
  assert cfg.impls == ("tokamax", "tokamax-xla")
  assert cfg.left_out == (LeftOut("tokamax-mosaic", "tokamax's Mosaic kernels need an NVIDIA GPU", requested=True),)
  cells, checks = sweep.run_sweep(cfg)
  assert [(r.impl, r.status) for r in checks] == [("tokamax", "ok"), ("tokamax-xla", "ok")]
  assert all(r.rel_err_out < 2e-2 and r.rel_err_grad < 2e-2 for r in checks)
  assert [(c.impl, c.mode, c.status) for c in cells] == [
      ("tokamax", "fwd", "ok"), ("tokamax", "fwd+bwd", "ok"), ("tokamax-xla", "fwd", "ok"),
      ("tokamax-xla", "fwd+bwd", "ok")]
  assert {c["implementation"] for c in fake_tokamax} == {None, "xla"}


@pytest.mark.skipif(not HAS_TOKAMAX, reason="tokamax is not installed")
def test_real_tokamax_on_cpu():
  """The installed tokamax: its XLA implementation (and its own choice, XLA
  on a CPU) pass the accuracy check; its GPU kernels are not offered here."""
  cpu = impls.Options(platform="cpu", interpret=True)
  shape = _shape(batch=1, seqlen=32, heads=4, kv_heads=2, head_dim=16, causal=True)
  x = timing.make_inputs(shape, 0)
  for name in ("tokamax", "tokamax-xla"):
    result, _ = sweep.run_check(impls.get(name), shape, x, cpu, seed=0)
    assert result.status == "ok" and result.rel_err_out < 2e-2 and result.rel_err_grad < 2e-2, result
  assert impls.get("tokamax-mosaic").available(cpu) is not None
  assert impls.get("tokamax-triton").available(cpu) is not None


def test_check_shape_keeps_segments_equal():
  s = _shape(batch=1, seqlen=3 * 8192, heads=16, segments=3)
  c = check.check_shape(s)
  assert c.seqlen < s.seqlen and c.seqlen % 3 == 0 and c.segments == 3
  w = _shape(batch=4, seqlen=16384, heads=16, window_left=1024, window_right=0, segments=8)
  c = check.check_shape(w)
  assert (c.window, c.segments) == ((1024, 0), 8) and c.seqlen % 8 == 0


def test_check_shape_halves_varlen_lengths():
  s = _shape(batch=1, seqlen=32768, heads=16, varlen=(8192, 16384, 8192))
  c = check.check_shape(s)
  assert (c.batch, c.seqlen, c.varlen) == (1, 4096, (1024, 2048, 1024))
  assert check.check_shape(_shape(batch=1, seqlen=96, varlen=(64, 32))).varlen == (64, 32)


def test_classify():
  assert timing.classify(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))[0] == "OOM"
  assert timing.classify(NotImplementedError("head dim 512"))[0] == "unsupported"
  status, short = timing.classify(ValueError("boom\nsecond line"))
  assert status == "error" and short == "ValueError: boom"


# ------------------------------------------------------------ JSON and CSV

_TYPES = {
    "impl": str,
    "dtype": str,
    "batch": int,
    "heads": int,
    "kv_heads": int,
    "seqlen": int,
    "head_dim": int,
    "causal": bool,
    "mode": str,
    "status": str,
    "window_left": (int, type(None)),
    "window_right": (int, type(None)),
    "segments": int,
    "softcap": (float, type(None)),
    "varlen": (list, type(None)),
    "error": (str, type(None)),
    "ms": (float, type(None)),
    "ms_min": (float, type(None)),
    "kernel_ms": (float, type(None)),
    "iters": (int, type(None)),
    "flops": (int, type(None)),
    "flops_convention": (str, type(None)),
    "visible_fraction": (float, type(None)),
    "tflops": (float, type(None)),
    "kernel_tflops": (float, type(None)),
    "speed_vs_cudnn": (float, type(None)),
    "compiled_bytes": (int, type(None)),
    "compiled_temp_bytes": (int, type(None)),
    "device_peak_bytes": (int, type(None)),
    "device_peak_new": (bool, type(None)),
    "min_bytes": (int, type(None)),
    "rel_err_out": (float, type(None)),
    "rel_err_grad": (float, type(None)),
}


def _check_cell_record(rec: dict) -> None:
  assert set(rec) == set(_TYPES) == set(CELL_FIELDS)
  for key, types in _TYPES.items():
    assert isinstance(rec[key], types), (key, rec[key])
  assert rec["status"] in ("ok", "unsupported", "OOM", "error")
  assert rec["mode"] in ("fwd", "bwd", "fwd+bwd")
  assert rec["segments"] >= 1
  if rec["flops_convention"] is not None:
    assert rec["flops_convention"] in ("dense", "causal-half", "visible")
    assert 0 < rec["visible_fraction"] <= 1
    plain = (rec["window_left"] is None and rec["window_right"] is None and rec["segments"] == 1
             and rec["varlen"] is None)
    assert (rec["flops_convention"] == "visible") == (not plain)
  if rec["status"] == "ok":
    assert rec["ms"] > 0 and rec["tflops"] > 0
    assert (rec["kernel_ms"] is None) == (rec["kernel_tflops"] is None)
    if rec["kernel_ms"] is not None:
      assert rec["kernel_tflops"] == pytest.approx(rec["flops"] / (rec["kernel_ms"] * 1e-3) / 1e12)
  else:
    assert rec["ms"] is None and rec["kernel_ms"] is None and rec["error"]


def test_json_and_csv_schema(tmp_path):
  cfg = cli.parse(["--out", str(tmp_path)], "cpu")
  ok = CellResult(
      impl="xla", mode="fwd+bwd", status="ok", ms=1.5, ms_min=1.4, kernel_ms=1.25, iters=3, flops=10**9,
      tflops=0.6667, kernel_tflops=0.8, speed_vs_cudnn=0.9, compiled_bytes=1000, compiled_temp_bytes=10, device_peak_bytes=None,
      device_peak_new=None, min_bytes=500, rel_err_out=1e-3, rel_err_grad=float("nan"),
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  bad = CellResult(
      impl="cudnn", mode="fwd", status="unsupported", error="needs an NVIDIA GPU",
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  win = CellResult(
      impl="xla", mode="fwd", status="ok", ms=0.5, ms_min=0.4, iters=3, flops=4 * 64 * 2 * 100, tflops=0.1,
      flops_convention="visible", visible_fraction=100 / 64**2, window_left=16, window_right=0, segments=2,
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  packed = CellResult(
      impl="flash2-segids", mode="fwd", status="ok", ms=0.5, ms_min=0.4, iters=3, flops=4 * 64 * 2 * 2560,
      tflops=0.1, flops_convention="visible", visible_fraction=2560 / 64**2, softcap=30.0, varlen=(16, 48),
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=False),
  )
  check = CheckResult(
      impl="xla", status="ok", rel_err_out=1e-3, rel_err_dq=2e-3, rel_err_dk=3e-3, rel_err_dv=1e-3,
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  meta = report.metadata(["--out", str(tmp_path)])
  path = tmp_path / "r.json"
  report.write_json(str(path), meta, cfg, [ok, bad, win, packed], [check], [])
  doc = json.loads(path.read_text())  # strict JSON: the NaN became null
  assert doc["schema_version"] == report.SCHEMA_VERSION == 6
  for key in ("date_utc", "command", "gpu_name", "driver_version", "jax_version", "jaxlib_version",
              "python_version", "device_kind", "backend", "cuda_runtime_version", "cudnn_version", "cupti_version",
              "jax_cuda_plugin", "jax_cuda_plugin_version", "tokamax_version"):
    assert key in doc["metadata"]
  # No CUDA plugin here: no CUDA, cuDNN or plugin versions; jaxlib's is there.
  assert doc["metadata"]["cudnn_version"] is None and doc["metadata"]["jax_cuda_plugin"] is None
  assert doc["metadata"]["jaxlib_version"] == jaxlib.__version__
  try:
    tokamax_version = importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    tokamax_version = None
  assert doc["metadata"]["tokamax_version"] == tokamax_version
  assert datetime.datetime.fromisoformat(doc["metadata"]["date_utc"]).utcoffset() == datetime.timedelta(0)
  assert "kernel_ms" in doc["notes"] and "kernel_tflops" in doc["notes"]
  assert doc["metadata"]["command"] == f"jax-flash2-bench --out {tmp_path}"
  assert doc["config"]["seqlens"] == [64, 128]
  for rec in doc["cells"]:
    _check_cell_record(rec)
  assert doc["cells"][0]["rel_err_grad"] is None
  assert doc["checks"][0]["rel_err_grad"] == pytest.approx(3e-3)
  assert doc["checks"][0]["segments"] == 1 and doc["checks"][0]["window_left"] is None
  w = doc["cells"][2]
  assert (w["window_left"], w["window_right"], w["segments"], w["flops_convention"]) == (16, 0, 2, "visible")
  assert w["visible_fraction"] == pytest.approx(100 / 64**2)
  assert doc["config"]["windows"] == [None] and doc["config"]["segments"] == [1]
  assert (doc["cells"][3]["softcap"], doc["cells"][3]["varlen"]) == (30.0, [16, 48])
  assert doc["cells"][0]["softcap"] is None and doc["cells"][0]["varlen"] is None
  assert doc["config"]["softcaps"] == [None] and doc["config"]["varlens"] == []
  assert "softcap" in doc["notes"] and "varlen" in doc["notes"]
  assert "flops_convention" in doc["notes"]["tflops"] and "visible_fraction" in doc["notes"]

  csv_path = tmp_path / "r.csv"
  report.write_csv(str(csv_path), [ok, bad, win, packed])
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  assert tuple(rows[0]) == CELL_FIELDS
  assert rows[0]["impl"] == "xla" and float(rows[0]["ms"]) == 1.5 and int(rows[0]["flops"]) == 10**9
  assert float(rows[0]["kernel_ms"]) == 1.25 and float(rows[0]["kernel_tflops"]) == 0.8
  assert rows[2]["kernel_ms"] == rows[2]["kernel_tflops"] == ""
  assert rows[0]["window_left"] == rows[0]["window_right"] == "" and rows[0]["segments"] == "1"
  assert rows[1]["status"] == "unsupported" and rows[1]["ms"] == ""
  assert (rows[2]["window_left"], rows[2]["window_right"], rows[2]["segments"]) == ("16", "0", "2")
  assert rows[2]["flops_convention"] == "visible" and float(rows[2]["visible_fraction"]) == pytest.approx(100 / 64**2)
  assert (rows[3]["softcap"], rows[3]["varlen"]) == ("30.0", "16,48") and rows[0]["softcap"] == rows[0]["varlen"] == ""
  # The table names the mask of each block; kernel figures where traced, "-" where not.
  table = report.format_table([ok, win], ["xla"])
  assert "== fwd+bwd  head_dim 64  causal  bf16 ==" in table
  assert "== fwd  head_dim 64  causal window 16,0 2 segments  bf16 ==" in table
  assert "== fwd  head_dim 64  non-causal varlen 16,48 softcap 30  bf16 ==" in report.format_table([packed], ["xla"])
  assert list(table.splitlines()[4].split("|")[1].split()) == ["ms", "kern", "ms", "TFLOP/s", "kern", "TF/s"]
  assert [line.split("|")[1].split() for line in table.splitlines() if line.startswith("    64")] == [
      ["1.500", "1.250", "0.67", "0.80"], ["0.500", "-", "0.10", "-"]]
  assert "vs cuDNN" not in table and "vs cuDNN" in report.format_table([ok, bad], ["xla", "cudnn"])


# ----------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """(output dir, printed text, results.json) of one tiny CPU run of the CLI:
  every mode of flash2 and XLA (cuDNN asked for too, and left out), checks
  and the plots, with 4 query heads over 2 K/V heads (GQA). One run, and one
  test reading it (pytest-xdist would run the fixture again for a test on
  another worker): each run compiles its kernels anew, seconds each in
  interpret mode. The memory probe runs in
  test_compiler_options_reach_every_executable."""
  out = tmp_path_factory.mktemp("bench")
  argv = ["--seqlens", "32", "--heads", "4", "--kv-heads", "2", "--causal", "true", "--iters", "2", "--warmup",
          "0", "--impls", "flash2", "cudnn", "xla", "--out", str(out), "--no-progress"]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert cli.main(argv) == 0
  return out, printed.getvalue(), json.loads((out / "results.json").read_text())


def test_cli_tiny_cpu_run(tiny_run):
  out, printed, doc = tiny_run
  assert "NOT GPU figures" in printed and "Accuracy vs float32 reference" in printed
  # cuDNN was asked for: one line says why it is left out, and it has no column.
  assert "left out cudnn: needs an NVIDIA GPU\n" in printed and "unsupported" not in printed
  assert doc["config"]["impls"] == ["flash2", "xla"]
  assert doc["config"]["left_out"] == [dict(impl="cudnn", reason="needs an NVIDIA GPU", requested=True)]
  assert f"results in {out}{os.sep}: results.json, results.csv, tflops_bf16.png" in printed
  for name in ("results.json", "results.csv", "tflops_bf16.png"):
    assert (out / name).is_file() and os.path.getsize(out / name) > 0
  assert doc["metadata"]["backend"] == "cpu" and doc["metadata"]["cudnn_version"] is None
  assert doc["config"]["kernel_time"] is False
  cells = doc["cells"]
  assert len(cells) == 3 * 2  # modes x impls
  for rec in cells:
    _check_cell_record(rec)
    assert rec["status"] == "ok", rec
    assert rec["rel_err_out"] < 2e-2 and rec["rel_err_grad"] < 2e-2
    # No GPU, no device kernels: no kernel time, a "-" in the table.
    assert rec["kernel_ms"] is None and rec["kernel_tflops"] is None
    if rec["mode"] == "fwd+bwd":
      assert rec["compiled_bytes"] >= rec["min_bytes"] > 0
  # Three timing rows (a mode each), then the fwd+bwd memory row.
  rows = [line.split("|") for line in printed.splitlines() if line.startswith("    32")]
  assert len(rows) == 3 + 1 and all(part.split()[1::2] == ["-", "-"] for row in rows[:3] for part in row[1:])
  assert {r["impl"]: r["status"] for r in doc["checks"]} == {"flash2": "ok", "xla": "ok"}
  assert doc["memory_probe"] == []
  with open(out / "results.csv") as f:
    assert len(list(csv.DictReader(f))) == len(cells)

  # Grouped-query shapes (4 query heads, 2 K/V heads) through both impls.
  assert "heads 4, kv_heads 2" in printed
  for impl in ("flash2", "xla"):
    assert all((rec["heads"], rec["kv_heads"]) == (4, 2) for rec in cells if rec["impl"] == impl)
    check = [r for r in doc["checks"] if r["impl"] == impl][0]
    assert check["status"] == "ok" and check["kv_heads"] == 2 and check["rel_err_out"] < 2e-2


def test_cli_runs_window_and_segments(tmp_path, capsys):
  argv = ["--seqlens", "32", "--causal", "true", "--window", "none", "8,0", "--segments", "2", "--modes",
          "fwd+bwd", "--impls", "xla", "--iters", "1", "--warmup", "0", "--no-progress", "--no-plot",
          "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "windows ['none', '8,0'], segments [2]" in printed
  assert "== fwd+bwd  head_dim 64  causal 2 segments  bf16 ==" in printed
  assert "== fwd+bwd  head_dim 64  causal window 8,0 2 segments  bf16 ==" in printed
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["config"]["windows"] == [None, [8, 0]] and doc["config"]["segments"] == [2]
  cells = doc["cells"]
  assert len(cells) == 2  # masks
  for rec in cells:
    _check_cell_record(rec)
    assert rec["segments"] == 2 and rec["flops_convention"] == "visible"
    window = (rec["window_left"], rec["window_right"])
    assert window in ((None, None), (8, 0))
    pairs = _brute_visible(32, True, None if window == (None, None) else window, 2)
    assert rec["visible_fraction"] == pytest.approx(pairs / 32**2)
    assert rec["flops"] == 4 * 64 * 2 * pairs * 7 // 2
    assert rec["status"] == "ok", rec
    assert rec["rel_err_out"] < 2e-2 and rec["rel_err_grad"] < 2e-2
  checks = {(r["impl"], r["window_left"]): r for r in doc["checks"]}
  assert len(checks) == 2 and checks[("xla", 8)]["status"] == "ok" and checks[("xla", 8)]["segments"] == 2
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert {(r["window_left"], r["window_right"], r["segments"]) for r in rows} == {("", "", "2"), ("8", "0", "2")}


def test_cli_runs_softcap(tmp_path, capsys):
  """A --softcap cell: flash2-triton passes the check against the softcapped
  reference; jax.nn's XLA attention is a column of "unsupported", saying why."""
  argv = ["--seqlens", "32", "--head-dims", "16", "--causal", "true", "--softcap", "1", "--dtype", "fp32",
          "--modes", "fwd+bwd", "--impls", "flash2-triton", "xla", "--iters", "1", "--warmup", "0", "--no-progress",
          "--no-plot", "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "softcaps ['1']" in printed and "== fwd+bwd  head_dim 16  causal softcap 1  fp32 ==" in printed
  doc = json.loads((tmp_path / "results.json").read_text())
  checks = {r["impl"]: r for r in doc["checks"]}
  assert checks["flash2-triton"]["status"] == "ok" and checks["flash2-triton"]["softcap"] == 1.0
  assert checks["flash2-triton"]["rel_err_out"] < 1e-5 and checks["flash2-triton"]["rel_err_grad"] < 1e-5
  assert checks["xla"]["status"] == "unsupported"
  cells = {c["impl"]: c for c in doc["cells"]}
  for rec in cells.values():
    _check_cell_record(rec)
    assert rec["softcap"] == 1.0 and rec["flops"] == 7 * 4 * 16 * 2 * (32 * 32 // 2) // 2
  assert cells["flash2-triton"]["status"] == "ok"
  assert cells["xla"]["status"] == "unsupported"
  assert cells["xla"]["error"] == "jax.nn.dot_product_attention has no softcap"
  # The check's reference applies the softcap: without it the output is another.
  x = timing.make_inputs(_shape(batch=1, seqlen=32, heads=2, kv_heads=2, head_dim=16, dtype="float32"), 0)
  capped, plain = (check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=True, softcap=cap)[0]
                   for cap in (1.0, None))
  assert not np.allclose(np.asarray(capped), np.asarray(plain), atol=1e-2)


def test_cli_runs_varlen(tmp_path, capsys):
  """A --varlen cell with a causal window, a softcap and sinks: the varlen call
  and its segment-ids twin pass the check against the reference (each
  sequence on its own), with FLOPs over each sequence's visible pairs."""
  argv = ["--varlen", "16,40,8", "--head-dims", "16", "--causal", "true", "--window", "8,0", "--softcap", "2",
          "--sinks", "--dtype", "fp32", "--modes", "fwd+bwd", "--impls", "flash2-triton", "flash2-triton-segids",
          "cudnn", "--iters", "1", "--warmup", "0", "--no-progress", "--no-plot", "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "left out cudnn:" in printed and "varlen ['16,40,8'] (batch 1)" in printed
  assert "== fwd+bwd  head_dim 16  causal window 8,0 varlen 16,40,8 softcap 2  fp32 ==" in printed
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["config"]["varlens"] == [[16, 40, 8]] and doc["config"]["seqlens"] == [64]
  pairs = sum(n * 9 - 36 for n in (16, 40)) + 8 * 9 // 2  # window 8,0: 9 keys a query, fewer in the first 8
  assert pairs == sum(_brute_visible(n, True, (8, 0), 1) for n in (16, 40, 8))
  assert [(r["impl"], r["status"]) for r in doc["checks"]] == [("flash2-triton", "ok"), ("flash2-triton-segids", "ok")]
  for rec in doc["cells"]:
    _check_cell_record(rec)
    assert rec["status"] == "ok" and (rec["batch"], rec["seqlen"], rec["varlen"]) == (1, 64, [16, 40, 8])
    assert rec["flops"] == 7 * 4 * 16 * 2 * pairs // 2 and rec["visible_fraction"] == pytest.approx(pairs / 64**2)
    assert rec["rel_err_out"] < 1e-5 and rec["rel_err_grad"] < 1e-5
  with open(tmp_path / "results.csv") as f:
    assert {r["varlen"] for r in csv.DictReader(f)} == {"16,40,8"}
  # The reference packs: one 64-token sequence would be another output.
  x = timing.make_inputs(_shape(batch=1, seqlen=64, heads=2, kv_heads=2, head_dim=16, dtype="float32"), 0)
  packed, whole = (check.reference_fwd_bwd_jit(x.q, x.k, x.v, x.dout, causal=True, varlen=v)[0]
                   for v in ((16, 40, 8), None))
  assert not np.allclose(np.asarray(packed), np.asarray(whole), atol=1e-2)


def test_failures_become_cells_and_the_sweep_goes_on(monkeypatch):

  def raising(exc):
    def factory(shape, opts):
      def attn(q, k, v):
        raise exc
      return attn
    return factory

  monkeypatch.setitem(impls.REGISTRY, "oom", impls.Impl("oom", "raises OOM", raising(
      RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes")), lambda s, o: None))
  monkeypatch.setitem(impls.REGISTRY, "boom", impls.Impl("boom", "raises", raising(ValueError("kaput")),
                                                          lambda s, o: None))
  cfg = cli.parse(["--impls", "oom", "boom", "xla", "--seqlens", "32", "--causal", "false", "--modes", "fwd",
                   "fwd+bwd", "--iters", "1", "--warmup", "0"], "cpu")
  cells, checks = sweep.run_sweep(cfg)
  by = {(c.impl, c.mode): c for c in cells}
  assert len(cells) == 3 * 2
  for mode in cfg.modes:
    assert by[("oom", mode)].status == "OOM"
    assert by[("boom", mode)].status == "error" and by[("boom", mode)].error == "ValueError: kaput"
    assert by[("xla", mode)].status == "ok"
  assert [r.status for r in checks] == ["OOM", "error", "ok"]
  table = report.format_table(cells, cfg.impls)
  assert "OOM" in table and "error: ValueError: kaput" in table


def test_time_fn_ms_times_a_jitted_function():
  """The one-function timer the tools share: compiled ahead, a positive
  median per call."""
  x = jnp.ones((64, 64), jnp.float32)
  ms = timing.time_fn_ms(lambda x: x @ x, x, warmup=1, iters=3, calls_per_round=2)
  assert isinstance(ms, float) and ms > 0


def test_rounds_fill_their_time_and_hold_one_result():
  """A timed round launches as many calls as fill ROUND_SECONDS by the last
  warm-up call's time (at least CALLS_PER_ROUND, at most
  MAX_CALLS_PER_ROUND), and holds only its latest call's outputs."""
  assert timing.round_size(None) == timing.CALLS_PER_ROUND
  assert timing.round_size(1.0) == timing.CALLS_PER_ROUND
  assert timing.round_size(timing.ROUND_SECONDS / 40) == 40
  assert timing.round_size(1e-7) == timing.MAX_CALLS_PER_ROUND
  calls, live, held = [], weakref.WeakSet(), []

  class Output:
    def block_until_ready(self):
      return self

  def call(i):
    calls.append(i)
    held.append(len(live))  # earlier outputs still alive as this call starts
    out = Output()
    live.add(out)
    return out

  times = timing.time_calls(call, warmup=0, iters=2)
  assert len(times) == 2 and all(t > 0 for t in times)
  assert calls == list(range(timing.CALLS_PER_ROUND)) * 2 and max(held) <= 1
  calls.clear()
  timing.time_calls(call, warmup=1, iters=1, calls_per_round=7)
  assert calls == [0] + list(range(7))


def test_cudnn_deterministic_is_cudnn_compiled_for_determinism():
  """The deterministic yardstick is cuDNN's own attention, with the XLA
  option that picks its deterministic backward, and the same limits."""
  det, plain = impls.get("cudnn-deterministic"), impls.get("cudnn")
  assert dict(det.compiler_options) == {"xla_gpu_deterministic_ops": True} and plain.compiler_options is None
  gpu = impls.Options(platform="gpu")
  for shape in (_shape(), _shape(dtype="float32"), _shape(window_left=128, window_right=16)):
    assert det.supports(shape, gpu) == plain.supports(shape, gpu)
  assert "cudnn-deterministic" not in impls.DEFAULT_IMPLS


def test_compiler_options_reach_every_executable(tmp_path, capsys):
  """An implementation's compiler_options go to XLA in the timed cells, the
  accuracy check and the memory probe: an option XLA does not know fails
  each of them, the same implementation without it runs."""
  xla = impls.get("xla")
  for name, options in (("xla-bad-option", {"xla_gpu_no_such_option": True}),
                        ("xla-deterministic", {"xla_gpu_deterministic_ops": True})):
    impls.register(dataclasses.replace(xla, name=name, compiler_options=options))
  try:
    argv = ["--seqlens", "32", "--causal", "false", "--modes", "fwd", "fwd+bwd", "--impls", "xla-deterministic",
            "xla-bad-option", "--iters", "1", "--warmup", "0", "--memory", "--memory-max-seqlen", "64",
            "--no-progress", "--no-plot",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
  finally:
    for name in ("xla-bad-option", "xla-deterministic"):
      impls.REGISTRY.pop(name)
  doc = json.loads((tmp_path / "results.json").read_text())
  statuses = {(r["impl"], r["mode"]): r["status"] for r in doc["cells"]}
  assert statuses == {("xla-deterministic", "fwd"): "ok", ("xla-deterministic", "fwd+bwd"): "ok",
                      ("xla-bad-option", "fwd"): "error", ("xla-bad-option", "fwd+bwd"): "error"}, statuses
  assert all("xla_gpu_no_such_option" in r["error"] for r in doc["cells"] if r["impl"] == "xla-bad-option")
  assert {r["impl"]: r["status"] for r in doc["checks"]} == {"xla-deterministic": "ok", "xla-bad-option": "error"}
  probe = {r["impl"]: r["status"] for r in doc["memory_probe"]}
  assert probe["xla-deterministic"] == "ok" and probe["xla-bad-option"] != "ok", probe
  assert "Memory probe: longest fwd+bwd sequence" in capsys.readouterr().out


# ------------------------------------------------------------ kernel time


def _write_trace(path, trace: dict) -> None:
  path.parent.mkdir(parents=True)
  with gzip.open(path, "wt") as f:
    json.dump(trace, f)


def _gpu_trace() -> dict:
  """A trace as jax.profiler writes it on a GPU: GPU 0 with a compute and a
  memset stream and the per-op timelines a converter may add over the same
  work, GPU 1 with one kernel, and the host with its launches."""
  meta = lambda pid, name, tid=None, kind="process_name": dict(
      ph="M", pid=pid, name=kind, args=dict(name=name), **({} if tid is None else dict(tid=tid)))
  kernel = lambda pid, tid, name, ts, dur: dict(
      ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur,
      args=dict(device_id=str(pid - 1), stream_id=str(tid), correlation_id="7"))
  return dict(
      displayTimeUnit="ns",
      metadata=dict(highres_ticks=True),
      traceEvents=[
          meta(1, "/device:GPU:0"), dict(ph="M", pid=1, name="process_sort_index", args=dict(sort_index=1)),
          meta(1, "Stream #13(Compute)", 13, "thread_name"), meta(1, "Stream #14(Memset)", 14, "thread_name"),
          meta(1, "XLA Ops", 2, "thread_name"), meta(1, "XLA Modules", 1, "thread_name"),
          meta(2, "/device:GPU:1"), meta(2, "Stream #7(Compute)", 7, "thread_name"),
          meta(701, "/host:CPU"), meta(701, "python", 99, "thread_name"),
          kernel(1, 13, "flash2_fwd_mosaic", 10.0, 30.0), kernel(1, 14, "Memset", 5.0, 2.0),
          kernel(1, 13, "flash2_fwd_mosaic", 50.0, 32.0), kernel(2, 7, "nccl", 0.0, 6.0),
          dict(ph="X", pid=1, tid=2, name="fusion.1", ts=10.0, dur=30.0),  # the same work, per HLO op
          dict(ph="X", pid=1, tid=1, name="jit_attn", ts=5.0, dur=77.0),  # ... per module
          dict(ph="X", pid=701, tid=99, name="PjitFunction(attn)", ts=0.0, dur=99.0),  # the host's launch
          dict(ph="i", pid=1, tid=13, name="marker", ts=1.0),
      ],
  )


def test_kernel_trace_reads_the_gpu_streams(tmp_path, monkeypatch):
  """The device activities of a GPU trace: the complete events on the GPU
  streams, not the per-op timelines over them nor the host's; the newest
  trace of the folder; per call, their summed duration."""
  _write_trace(tmp_path / "plugins" / "profile" / "old" / "host.trace.json.gz", dict(traceEvents=[]))
  os.utime(tmp_path / "plugins" / "profile" / "old" / "host.trace.json.gz", (1, 1))
  path = tmp_path / "plugins" / "profile" / "2026_12_02_03_12_32" / "host.trace.json.gz"
  _write_trace(path, _gpu_trace())
  assert kernel_trace.newest_trace_file(tmp_path) == path
  assert kernel_trace.newest_trace_file(tmp_path / "nothing") is None
  got = kernel_trace.device_activities(kernel_trace.read_trace(path))
  assert got == [
      kernel_trace.DeviceActivity("flash2_fwd_mosaic", "/device:GPU:0", "Stream #13(Compute)", 10.0, 30.0),
      kernel_trace.DeviceActivity("Memset", "/device:GPU:0", "Stream #14(Memset)", 5.0, 2.0),
      kernel_trace.DeviceActivity("flash2_fwd_mosaic", "/device:GPU:0", "Stream #13(Compute)", 50.0, 32.0),
      kernel_trace.DeviceActivity("nccl", "/device:GPU:1", "Stream #7(Compute)", 0.0, 6.0),
  ]
  assert kernel_trace.device_activities({}) == []
  # Two profiled calls of 70 us: 0.035 ms each.
  monkeypatch.setattr(kernel_trace, "profile", lambda call, calls, log_dir: path)
  assert kernel_trace.device_ms_per_call(lambda i: None, calls=2) == pytest.approx(0.035)
  # --ring's reading: each device apart, its NCCL kernels' share beside; the trace kept where asked.
  keep = tmp_path / "kept" / "cell.trace.json.gz"
  assert kernel_trace.device_ms_by_device(lambda i: None, calls=2, keep=str(keep)) == {
      "/device:GPU:0": kernel_trace.DeviceTime(pytest.approx(0.032), 0.0),
      "/device:GPU:1": kernel_trace.DeviceTime(pytest.approx(0.003), pytest.approx(0.003))}
  assert keep.read_bytes() == path.read_bytes()
  monkeypatch.setattr(kernel_trace, "profile", lambda call, calls, log_dir: None)
  assert kernel_trace.device_ms_per_call(lambda i: None, calls=2) is None
  assert kernel_trace.device_ms_by_device(lambda i: None, calls=2) == {}


def test_kernel_trace_of_a_cpu_run_has_no_kernels(tmp_path):
  """A real jax.profiler trace on this CPU: the file where jax writes it,
  host events in it, no device activity, so no kernel time."""
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((32, 32))
  jax.block_until_ready(f(x))
  path = kernel_trace.profile(lambda i: f(x), 3, tmp_path)
  assert path is not None and path.relative_to(tmp_path).parts[:2] == ("plugins", "profile")
  trace = kernel_trace.read_trace(path)
  names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
  assert "/host:CPU" in names and not any(n.startswith("/device:GPU") for n in names)
  assert any(e.get("ph") == "X" for e in trace["traceEvents"])
  assert kernel_trace.device_activities(trace) == []
  assert kernel_trace.device_ms_per_call(lambda i: f(x), 2) is None


def test_cells_carry_the_kernel_time(monkeypatch):
  """With kernel_time on, a cell's kernel_ms is the traced figure and
  kernel_tflops its flops over it; a profiler that fails costs only those.
  Off (as without a GPU), no trace is taken."""
  cfg = dataclasses.replace(cli.parse(["--impls", "xla", "--iters", "1", "--warmup", "0"], "cpu"), kernel_time=True)
  shape = cfg.shape("bfloat16", 64, False, 32)
  inputs = [timing.make_inputs(shape, 0)]
  opts = impls.Options(platform="cpu", interpret=True)
  traced = []

  def fake_trace(call, calls):
    traced.append(calls)
    return 0.004

  monkeypatch.setattr(kernel_trace, "device_ms_per_call", fake_trace)
  cell = sweep.run_cell(impls.get("xla"), shape, "fwd", inputs, opts, cfg)
  assert cell.status == "ok" and traced == [timing.CALLS_PER_ROUND]
  assert cell.kernel_ms == 0.004 and cell.kernel_tflops == pytest.approx(flops.tflops_per_s(cell.flops, 0.004))
  assert cell.ms != cell.kernel_ms

  def failing(call, calls):
    raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")

  monkeypatch.setattr(kernel_trace, "device_ms_per_call", failing)
  cell = sweep.run_cell(impls.get("xla"), shape, "fwd", inputs, opts, cfg)
  assert cell.status == "ok" and cell.ms > 0 and cell.kernel_ms is None and cell.kernel_tflops is None
  monkeypatch.setattr(kernel_trace, "device_ms_per_call", fake_trace)
  cell = sweep.run_cell(impls.get("xla"), shape, "fwd", inputs, opts, dataclasses.replace(cfg, kernel_time=False))
  assert cell.kernel_ms is None and traced == [timing.CALLS_PER_ROUND]


# ------------------------------------------------------------------ output


def test_results_go_to_a_dated_folder_unless_told_otherwise(tmp_path, monkeypatch, capsys):
  """By default: bench_results/<UTC date-time>/ under the current directory,
  its path printed; --no-save writes nothing."""
  monkeypatch.chdir(tmp_path)
  argv = ["--impls", "xla", "--seqlens", "32", "--causal", "false", "--modes", "fwd", "--iters", "1", "--warmup",
          "0", "--no-check", "--no-progress", "--no-plot"]
  assert cli.main(argv + ["--no-save"]) == 0
  assert "results in" not in capsys.readouterr().out and not list(tmp_path.iterdir())
  before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
  assert cli.main(argv) == 0
  (folder,) = (tmp_path / "bench_results").iterdir()
  started = datetime.datetime.strptime(folder.name, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc)
  assert before <= started <= datetime.datetime.now(datetime.timezone.utc)
  assert sorted(p.name for p in folder.iterdir()) == ["results.csv", "results.json"]
  assert f"results in {os.path.join('bench_results', folder.name)}{os.sep}: results.json, results.csv" in (
      capsys.readouterr().out)
  doc = json.loads((folder / "results.json").read_text())
  assert datetime.datetime.fromisoformat(doc["metadata"]["date_utc"]) == started
  assert doc["config"]["out"] == os.path.join("bench_results", folder.name)
  # Two runs in one second get two folders.
  now = datetime.datetime(2026, 12, 2, 3, 15, 32, tzinfo=datetime.timezone.utc)
  made = [report.make_dated_dir(str(tmp_path / "runs"), now) for _ in range(3)]
  assert [os.path.basename(m) for m in made] == ["20261202T031532Z", "20261202T031532Z-2", "20261202T031532Z-3"]
  assert all(os.path.isdir(m) for m in made)


# ------------------------------------------------------------------- --decode


def test_decode_parsing(no_tokamax):
  """--decode defaults (GPU: bf16, d128, 32/4 heads, batch 8, 8k..32k; CPU tiny), its flags, and the
  defaults it leaves out with their reasons."""
  from jax_flash2.bench.decode import DecodeSweepConfig, DecodeShape

  cfg = cli.parse(["--decode"], "gpu")
  assert isinstance(cfg, DecodeSweepConfig)
  assert (cfg.cache_lens, cfg.page_sizes, cfg.head_dims, cfg.dtypes) == ((8192, 16384, 32768), (None,), (128,),
                                                                          ("bfloat16",))
  assert (cfg.batch, cfg.heads, cfg.kv_heads, cfg.q_len, cfg.kernel_time) == (8, 32, 4, 1, True)
  assert cfg.impls == ("flash2", "xla", "cudnn")
  assert cfg.left_out == (NO_TOKAMAX,)
  cpu = cli.parse(["--decode"], "cpu")
  assert cpu.interpret and not cpu.kernel_time and cpu.impls == ("flash2", "xla")
  assert LeftOut("cudnn", "needs an NVIDIA GPU", requested=False) in cpu.left_out
  cfg = cli.parse(["--decode", "--cache-lens", "8k", "128k", "--page-size", "none", "64,256", "--batch", "2",
                   "--kv-heads", "8", "--q-len", "4", "--impls", "flash2", "xla"], "gpu")
  assert cfg.cache_lens == (8192, 131072) and cfg.page_sizes == (None, 64, 256)
  assert (cfg.batch, cfg.heads, cfg.kv_heads, cfg.q_len, cfg.impls) == (2, 32, 8, 4, ("flash2", "xla"))
  assert cfg.num_cells() == 2 * 3 * 2
  assert cfg.shapes()[-1] == DecodeShape(2, 131072, 32, 8, 128, 4, "bfloat16", 256)
  # --heads alone: kv_heads follows it (no GQA) unless --kv-heads says otherwise.
  assert cli.parse(["--decode", "--heads", "6"], "gpu").kv_heads == 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "--seqlens", "1k"], "drop --seqlens"),
        (["--decode", "--varlen", "16,16"], "drop --varlen"),
        (["--decode", "--window", "8"], "drop --window"),
        (["--decode", "--sinks"], "drop --sinks"),
        (["--decode", "--memory"], "drop --memory"),
        (["--cache-lens", "8k"], "--cache-lens belongs to --decode"),
        (["--page-size", "16"], "--page-size belongs to --decode"),
        (["--q-len", "2"], "--q-len belongs to --decode"),
        (["--decode", "--page-size", "24"], "not a multiple of 16"),
        (["--decode", "--page-size", "x"], "not an integer"),
        (["--decode", "--cache-lens", "1000", "--page-size", "16"], "does not divide cache length 1000"),
        (["--decode", "--cache-lens", "0"], "must be positive"),
        (["--decode", "--q-len", "0"], "--q-len must be positive"),
        (["--decode", "--cache-lens", "16", "--q-len", "32"], "exceeds cache length 16"),
        (["--decode", "--kv-heads", "5"], "does not divide heads 32"),
        (["--decode", "--impls", "flash2-mosaic"], "unknown decode implementation"),
        (["--decode", "--impls", "cudnn"], "cudnn: needs an NVIDIA GPU"),
    ],
)
def test_decode_bad_flags_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "cpu" if "cudnn" in argv else "gpu")
  assert exc.value.code == 2 and message in capsys.readouterr().err


def test_decode_bytes_by_hand():
  from jax_flash2.bench import decode

  # K and V: 8 x 8192 x 4 x 128 x 2 tensors x 2 bytes; q and out: 2 x 8 x 1 x 32 x 128 x 2 bytes.
  shape = decode.DecodeShape(8, 8192, 32, 4, 128, 1, "bfloat16")
  assert decode.bytes_moved(shape) == 8 * 8192 * 4 * 128 * 2 * 2 + 2 * 8 * 32 * 128 * 2 == 134_348_800
  # Paged: plus the int32 block table, 8 sequences x 8192 / 64 pages.
  paged = dataclasses.replace(shape, page_size=64)
  assert decode.bytes_moved(paged) == 134_348_800 + 8 * 128 * 4
  # float32, q_len 3.
  f32 = decode.DecodeShape(2, 64, 4, 2, 32, 3, "float32", 16)
  assert decode.bytes_moved(f32) == 2 * 64 * 2 * 32 * 2 * 4 + 2 * (64 // 16) * 4 + 2 * 2 * 3 * 4 * 32 * 4
  assert decode.tb_per_s(2 * 10**9, 1.0) == 2.0 and decode.tb_per_s(1, None) is None


def test_decode_unsupported_cells_say_why(monkeypatch):
  """cuDNN and tokamax read one query row of a contiguous cache; tokamax is left out where not installed."""
  from jax_flash2.bench import decode

  cfg = cli.parse(["--decode", "--impls", "flash2", "xla", "--no-save"], "gpu")
  one = decode.DecodeShape(8, 8192, 32, 4, 128, 1, "bfloat16")
  assert decode.DECODE_REGISTRY["cudnn"].supports(one, cfg) is None
  assert "contiguous" in decode.DECODE_REGISTRY["cudnn"].supports(dataclasses.replace(one, page_size=64), cfg)
  assert "one query row" in decode.DECODE_REGISTRY["cudnn"].supports(dataclasses.replace(one, q_len=2), cfg)
  assert "fp16/bf16" in decode.DECODE_REGISTRY["cudnn"].supports(dataclasses.replace(one, dtype="float32"), cfg)
  monkeypatch.setitem(sys.modules, "tokamax", None)
  assert decode.DECODE_REGISTRY["tokamax"].supports(one, cfg) == "tokamax is not installed (pip install tokamax)"
  fake = types.ModuleType("tokamax")
  fake.dot_product_attention = lambda query, key, value, *, is_causal=False: None
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  assert decode.DECODE_REGISTRY["tokamax"].supports(one, cfg) == "this tokamax has no key_value_seq_lengths"
  cell = decode.run_cell(decode.DECODE_REGISTRY["cudnn"], dataclasses.replace(one, page_size=64), [], cfg, {}, None)
  assert cell.status == "unsupported" and "contiguous" in cell.error and cell.bytes == 134_348_800 + 8 * 128 * 4


def test_decode_tiny_cpu_run(tmp_path, no_tokamax):
  """A tiny --decode run on the CPU, contiguous and paged, q_len 2: each cell passes its check and the
  files say the bandwidth figures are host figures."""
  from jax_flash2.bench import decode

  argv = ["--decode", "--cache-lens", "32", "--page-size", "none", "16", "--q-len", "2", "--iters", "1",
          "--warmup", "0", "--input-sets", "1", "--impls", "flash2", "xla", "cudnn", "--out", str(tmp_path),
          "--no-progress"]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert cli.main(argv) == 0
  text = printed.getvalue()
  assert "left out cudnn: needs an NVIDIA GPU" in text and "host figures" in text
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["schema_version"] == 6 and doc["kind"] == "decode" and doc["notes"]["tiny_cpu_run"]
  meta = doc["metadata"]
  assert meta["copy_tb_s"] > 0 and meta["copy_kernel_tb_s"] is None and "host" in meta["copy_note"]
  cells = doc["cells"]
  assert [(c["impl"], c["page_size"]) for c in cells] == [("flash2", None), ("xla", None), ("flash2", 16),
                                                         ("xla", 16)]
  for c in cells:
    assert c["status"] == "ok", c
    assert c["rel_err_out"] < 2e-2 and c["kernel_ms"] is None and c["tb_s"] > 0
    assert c["bytes"] == decode.bytes_moved(decode.DecodeShape(2, 32, 4, 2, 32, 2, "bfloat16", c["page_size"]))
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["impl"] for r in rows] == ["flash2", "xla", "flash2", "xla"] and list(rows[0]) == list(
      decode.DECODE_FIELDS)


def test_decode_tokamax_stand_in(monkeypatch):
  """tokamax (a stand-in with its signature, jax.nn's XLA attention inside) runs q_len 2 over a contiguous
  cache with decoding's causal mask and passes the check; a paged cache is unsupported, with the reason."""
  from jax_flash2.bench import decode

  fake = types.ModuleType("tokamax")
  fake.dot_product_attention = lambda query, key, value, bias=None, mask=None, *, key_value_seq_lengths=None, \
      **kw: jax.nn.dot_product_attention(query, key, value, bias, mask, key_value_seq_lengths=key_value_seq_lengths)
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  cfg = cli.parse(["--decode", "--impls", "tokamax", "--iters", "1", "--warmup", "0"], "cpu")
  assert cfg.impls == ("tokamax",)
  shape = decode.DecodeShape(2, 32, 4, 2, 32, 2, "float32")
  x = decode.make_inputs(shape, 0)
  copy = dict(copy_tb_s=2.0, copy_kernel_tb_s=4.0)  # each fraction divides by the copy timed its own way
  cell = decode.run_cell(decode.DECODE_REGISTRY["tokamax"], shape, [x], cfg, copy, decode.reference_out(x))
  assert cell.status == "ok" and cell.rel_err_out < 1e-5, cell
  assert cell.copy_fraction == cell.tb_s / 2.0 and cell.kernel_copy_fraction is None  # no kernel time on CPU
  paged = decode.run_cell(decode.DECODE_REGISTRY["tokamax"], dataclasses.replace(shape, page_size=16), [], cfg,
                          copy, None)
  assert paged.status == "unsupported" and "contiguous" in paged.error


# --------------------------------------------------------------------- --ring


def test_ring_parsing():
  """--ring defaults (GPU: 8k and 16k tokens per device, d128, 16 heads, both layouts and strategies, fwd and
  fwd+bwd, over every device; CPU tiny on XLA steps) and its flags."""
  from jax_flash2 import RingLayout, RingStrategy
  from jax_flash2.bench.ring import RingSweepConfig

  cfg = cli.parse(["--ring"], "gpu", device_count=8)
  assert isinstance(cfg, RingSweepConfig) and cfg.num_devices == 8
  assert (cfg.tokens_per_device, cfg.head_dims, cfg.heads, cfg.kv_heads, cfg.batch) == ((8192, 16384), (128,), 16,
                                                                                       16, 1)
  assert cfg.layouts == (RingLayout.CONTIGUOUS, RingLayout.ZIGZAG)
  assert cfg.strategies == (RingStrategy.RING, RingStrategy.ALLGATHER)
  assert cfg.modes == ("fwd", "fwd+bwd") and cfg.impls == ("flash2",) and cfg.kernel_time and not cfg.interpret
  assert not cfg.keep_traces and cli.parse(["--ring", "--keep-traces"], "gpu", device_count=8).keep_traces
  assert cfg.num_cells() == 2 * 2 * 2 * 2
  cpu = cli.parse(["--ring", "--devices", "4"], "cpu", device_count=8)
  assert cpu.tiny and cpu.num_devices == 4 and cpu.impls == ("xla",) and not cpu.kernel_time
  cfg = cli.parse(["--ring", "--layout", "zigzag", "--strategy", "allgather", "--tokens-per-device", "4k",
                   "--modes", "fwd+bwd", "--kv-heads", "4"], "gpu", device_count=2)
  assert (cfg.layouts, cfg.strategies, cfg.tokens_per_device, cfg.modes, cfg.kv_heads) == (
      (RingLayout.ZIGZAG,), (RingStrategy.ALLGATHER,), (4096,), ("fwd+bwd",), 4)
  shape = cfg.shape("bfloat16", 128, RingLayout.ZIGZAG, RingStrategy.ALLGATHER, 4096)
  assert shape.causal and shape.seqlen == 8192 and shape.single_kv_len == 3 * 2048
  # The config validates itself: enums, not their names.
  with pytest.raises(ValueError, match="RingLayout"):
    dataclasses.replace(cfg, layouts=("zigzag",))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ring", "--devices", "9"], "between 1 and the 8 devices"),
        (["--ring", "--causal", "true"], "the layout fixes the mask"),
        (["--ring", "--seqlens", "1k"], "drop --seqlens"),
        (["--ring", "--layout", "diagonal"], "--layout: unknown 'diagonal'"),
        (["--ring", "--strategy", "tree"], "--strategy: unknown 'tree'"),
        (["--ring", "--tokens-per-device", "15"], "must be even"),
        (["--ring", "--modes", "bwd"], "--ring times fwd and fwd+bwd"),
        (["--ring", "--impls", "cudnn"], "unknown ring implementation"),
        (["--layout", "zigzag"], "--layout belongs to --ring"),
        (["--devices", "2"], "--devices belongs to --ring"),
        (["--keep-traces"], "--keep-traces belongs to --ring"),
    ],
)
def test_ring_bad_flags_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "gpu", device_count=8)
  assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("num_devices, n", [(1, 4), (2, 4), (4, 6), (8, 2)])
def test_ring_per_device_work_by_brute_force(num_devices, n):
  """Zigzag causal: every device sees the same pairs, 1/P of the causal problem's, and the one-device call
  (n queries over single_kv_len keys, causal bottom-right) sees as many; contiguous non-causal: n x S."""
  from jax_flash2 import RingLayout, RingStrategy, zigzag_order
  from jax_flash2.bench.ring import RingShape

  shape = RingShape(num_devices, n, 1, 1, 1, 8, "float32", RingLayout.ZIGZAG, RingStrategy.RING)
  seq = shape.seqlen
  positions = zigzag_order(seq, num_devices)[0].reshape(num_devices, n)
  per_device = [sum(int(i) + 1 for i in rows) for rows in positions]  # query i sees keys 0..i
  assert per_device == [shape.pairs_per_device] * num_devices
  assert shape.pairs_per_device * num_devices == seq * (seq + 1) // 2
  keys = shape.single_kv_len
  assert sum(i + keys - n + 1 for i in range(n)) == shape.pairs_per_device  # j <= i + keys - n
  assert shape.forward_flops() == 4 * 8 * shape.pairs_per_device
  full = dataclasses.replace(shape, layout=RingLayout.CONTIGUOUS)
  assert (full.pairs_per_device, full.single_kv_len, full.causal) == (n * seq, seq, False)


def test_ring_tiny_cpu_run(tmp_path):
  """A tiny --ring run on 2 host devices (zigzag causal, XLA steps, fwd+bwd): the check passes, the cell has
  the ring's and the single device's times, equal FLOPs, and the files say what the figures mean."""
  from jax_flash2.bench import ring as ring_bench

  argv = ["--ring", "--devices", "2", "--layout", "zigzag", "--strategy", "ring", "--tokens-per-device", "16",
          "--head-dims", "16", "--modes", "fwd+bwd", "--iters", "1", "--warmup", "0", "--input-sets", "1",
          "--out", str(tmp_path), "--no-progress"]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert cli.main(argv) == 0
  text = printed.getvalue()
  assert "ring: 2 devices" in text and "host figures" in text and "NOT GPU figures" in text
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["schema_version"] == report.SCHEMA_VERSION and doc["kind"] == "ring" and doc["notes"]["tiny_cpu_run"]
  assert {"per_device_work", "single_device", "flops", "efficiency", "kernel_ms", "rel_err"} <= set(doc["notes"])
  assert doc["config"]["layouts"] == ["zigzag"] and doc["metadata"]["device_count"] == 2
  assert [c["status"] for c in doc["checks"]] == ["ok"]
  (cell,) = doc["cells"]
  assert cell["status"] == "ok" and cell["single_status"] == "ok", cell
  assert (cell["layout"], cell["strategy"], cell["causal"], cell["seqlen"]) == ("zigzag", "ring", True, 32)
  # 2 chunks of 8 per device: 2P c^2 + c = 264 pairs, half the causal problem's 32 * 33 / 2.
  assert (cell["pairs_per_device"], cell["single_kv_len"]) == (264, 24)
  assert cell["flops"] == 4 * 1 * 2 * 16 * 264 * 7 // 2
  assert cell["ms"] > 0 and cell["single_ms"] > 0 and cell["efficiency"] == pytest.approx(
      cell["single_ms"] / cell["ms"])
  assert cell["tflops"] == pytest.approx(cell["flops"] / cell["ms"] / 1e9)
  assert cell["kernel_ms"] is None and cell["kernel_efficiency"] is None  # no GPU, no kernel times
  assert cell["compiled_bytes"] > 0
  assert cell["rel_err_out"] < 2e-2 and cell["rel_err_grad"] < 2e-2 and cell["check_tokens_per_device"] == 16
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 1 and list(rows[0]) == list(ring_bench.RING_FIELDS)
