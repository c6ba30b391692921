"""The benchmark CLI (jax_flash2.bench) on CPU: parsing, FLOPs, output schema, a tiny run."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash2.bench import check, cli, flops, impls, report, timing
from jax_flash2.bench.spec import CELL_FIELDS, CellResult, CheckResult, Shape


def _shape(**kw) -> Shape:
  base = dict(batch=2, seqlen=1024, heads=4, kv_heads=4, head_dim=64, causal=False, dtype="bfloat16")
  return Shape(**(base | kw))


# ------------------------------------------------------------------ parsing


def test_gpu_defaults():
  cfg = cli.parse([], "gpu")
  assert cfg.seqlens == (512, 1024, 2048, 4096, 8192, 16384)
  assert cfg.head_dims == (64, 128)
  assert cfg.causal == (False, True)
  assert cfg.dtypes == ("bfloat16",)
  assert cfg.modes == ("fwd", "bwd", "fwd+bwd")
  assert cfg.impls == ("flash2", "cudnn", "xla")
  assert (cfg.warmup, cfg.iters, cfg.check, cfg.interpret, cfg.tiny) == (3, 20, True, False, False)
  assert (cfg.out, cfg.plot, cfg.memory) == (None, False, False)
  # 16k tokens, hidden 2048.
  s = cfg.shape("bfloat16", 64, True, 512)
  assert (s.batch, s.heads, s.kv_heads) == (32, 32, 32)
  s = cfg.shape("bfloat16", 128, False, 16384)
  assert (s.batch, s.heads, s.kv_heads) == (1, 16, 16)
  assert cfg.num_cells() == 6 * 2 * 2 * 3 * 3


def test_cpu_defaults_are_tiny():
  cfg = cli.parse([], "cpu")
  assert cfg.tiny and cfg.interpret
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
          "--out", "somewhere",
          "--plot",
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
  assert (cfg.warmup, cfg.iters, cfg.check) == (0, 5, False)
  assert (cfg.out, cfg.plot, cfg.memory, cfg.memory_max_seqlen) == ("somewhere", True, True, 8192)
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
  assert cfg.num_cells() == 6 * 2 * 2 * 5 * 3 * 3 * 3
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
        ["--plot"],  # needs --out
        ["--heads", "8", "--kv-heads", "3"],
        ["--head-dims", "60"],
        ["--seqlens", "abc"],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.parse(argv, "gpu")
  assert exc.value.code == 2


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


def _masked_attention(q, k, v, visible):
  """Plain float64 softmax attention with a [seq, seq] or [batch, 1, seq, seq] visibility mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(visible, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("impl", ["flash2-triton", "xla"])
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


def test_check_shape_keeps_segments_equal():
  s = _shape(batch=1, seqlen=3 * 8192, heads=16, segments=3)
  c = check.check_shape(s)
  assert c.seqlen < s.seqlen and c.seqlen % 3 == 0 and c.segments == 3
  w = _shape(batch=4, seqlen=16384, heads=16, window_left=1024, window_right=0, segments=8)
  c = check.check_shape(w)
  assert (c.window, c.segments) == ((1024, 0), 8) and c.seqlen % 8 == 0


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
    "error": (str, type(None)),
    "ms": (float, type(None)),
    "ms_min": (float, type(None)),
    "iters": (int, type(None)),
    "flops": (int, type(None)),
    "flops_convention": (str, type(None)),
    "visible_fraction": (float, type(None)),
    "tflops": (float, type(None)),
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
    plain = rec["window_left"] is None and rec["window_right"] is None and rec["segments"] == 1
    assert (rec["flops_convention"] == "visible") == (not plain)
  if rec["status"] == "ok":
    assert rec["ms"] > 0 and rec["tflops"] > 0
  else:
    assert rec["ms"] is None and rec["error"]


def test_json_and_csv_schema(tmp_path):
  cfg = cli.parse(["--out", str(tmp_path)], "cpu")
  ok = CellResult(
      impl="xla", mode="fwd+bwd", status="ok", ms=1.5, ms_min=1.4, iters=3, flops=10**9, tflops=0.6667,
      speed_vs_cudnn=0.9, compiled_bytes=1000, compiled_temp_bytes=10, device_peak_bytes=None,
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
  check = CheckResult(
      impl="xla", status="ok", rel_err_out=1e-3, rel_err_dq=2e-3, rel_err_dk=3e-3, rel_err_dv=1e-3,
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  meta = report.metadata(["--out", str(tmp_path)])
  path = tmp_path / "r.json"
  report.write_json(str(path), meta, cfg, [ok, bad, win], [check], [])
  doc = json.loads(path.read_text())  # strict JSON: the NaN became null
  assert doc["schema_version"] == report.SCHEMA_VERSION
  for key in ("date_utc", "command", "gpu_name", "driver_version", "jax_version", "jaxlib_version",
              "python_version", "device_kind", "backend"):
    assert key in doc["metadata"]
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
  assert "flops_convention" in doc["notes"]["tflops"] and "visible_fraction" in doc["notes"]

  csv_path = tmp_path / "r.csv"
  report.write_csv(str(csv_path), [ok, bad, win])
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  assert tuple(rows[0]) == CELL_FIELDS
  assert rows[0]["impl"] == "xla" and float(rows[0]["ms"]) == 1.5 and int(rows[0]["flops"]) == 10**9
  assert rows[0]["window_left"] == rows[0]["window_right"] == "" and rows[0]["segments"] == "1"
  assert rows[1]["status"] == "unsupported" and rows[1]["ms"] == ""
  assert (rows[2]["window_left"], rows[2]["window_right"], rows[2]["segments"]) == ("16", "0", "2")
  assert rows[2]["flops_convention"] == "visible" and float(rows[2]["visible_fraction"]) == pytest.approx(100 / 64**2)
  # The table names the mask of each block.
  table = report.format_table([ok, win], ["xla"])
  assert "== fwd+bwd  head_dim 64  causal  bf16 ==" in table
  assert "== fwd  head_dim 64  causal window 16,0 2 segments  bf16 ==" in table


# ----------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """(output dir, printed text, results.json) of one tiny CPU run of the CLI,
  shared by the end-to-end tests below: every mode and the default impls at
  two lengths, checks, --memory and --plot, with 4 query heads over 2 K/V
  heads (GQA). One run instead of one per test: each run compiles its
  kernels anew."""
  out = tmp_path_factory.mktemp("bench")
  argv = ["--seqlens", "32", "64", "--heads", "4", "--kv-heads", "2", "--causal", "true", "--iters", "2",
          "--warmup", "0", "--out", str(out), "--plot", "--no-progress", "--memory", "--memory-max-seqlen", "64"]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert cli.main(argv) == 0
  return out, printed.getvalue(), json.loads((out / "results.json").read_text())


def test_cli_tiny_cpu_run(tiny_run):
  out, printed, doc = tiny_run
  assert "NOT GPU figures" in printed
  assert "Accuracy vs float32 reference" in printed and "Memory probe" in printed
  for name in ("results.json", "results.csv", "tflops_bf16.png"):
    assert (out / name).is_file() and os.path.getsize(out / name) > 0
  assert doc["metadata"]["backend"] == "cpu"
  cells = doc["cells"]
  assert len(cells) == 2 * 3 * 3  # seqlens x modes x impls
  for rec in cells:
    _check_cell_record(rec)
    if rec["impl"] in ("flash2", "xla"):
      assert rec["status"] == "ok", rec
      assert rec["rel_err_out"] < 2e-2 and rec["rel_err_grad"] < 2e-2
      if rec["mode"] == "fwd+bwd":
        assert rec["compiled_bytes"] >= rec["min_bytes"] > 0
    else:
      assert rec["impl"] == "cudnn" and rec["status"] == "unsupported"
  assert {r["impl"]: r["status"] for r in doc["checks"]} == {
      "flash2": "ok", "cudnn": "unsupported", "xla": "ok"
  }
  probe = {(r["impl"], r["seqlen"]): r["status"] for r in doc["memory_probe"]}
  assert probe[("flash2", 64)] == "ok" and probe[("xla", 64)] == "ok"
  with open(out / "results.csv") as f:
    assert len(list(csv.DictReader(f))) == len(cells)


def test_cli_runs_gqa(tiny_run):
  """Grouped-query shapes (4 query heads, 2 K/V heads) through both impls: the
  shared run's cells and checks."""
  _, printed, doc = tiny_run
  assert "heads 4, kv_heads 2" in printed
  for impl in ("flash2", "xla"):
    cells = [r for r in doc["cells"] if r["impl"] == impl]
    assert len(cells) == 2 * 3
    for rec in cells:
      assert rec["status"] == "ok" and (rec["heads"], rec["kv_heads"]) == (4, 2), rec
    check = [r for r in doc["checks"] if r["impl"] == impl][0]
    assert check["status"] == "ok" and check["kv_heads"] == 2 and check["rel_err_out"] < 2e-2


def test_cli_runs_window_and_segments(tmp_path, capsys):
  argv = ["--seqlens", "32", "--causal", "true", "--window", "none", "8,0", "--segments", "2", "--modes",
          "fwd+bwd", "--iters", "1", "--warmup", "0", "--no-progress", "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "windows ['none', '8,0'], segments [2]" in printed
  assert "== fwd+bwd  head_dim 64  causal 2 segments  bf16 ==" in printed
  assert "== fwd+bwd  head_dim 64  causal window 8,0 2 segments  bf16 ==" in printed
  doc = json.loads((tmp_path / "results.json").read_text())
  assert doc["config"]["windows"] == [None, [8, 0]] and doc["config"]["segments"] == [2]
  cells = doc["cells"]
  assert len(cells) == 2 * 3  # masks x impls
  for rec in cells:
    _check_cell_record(rec)
    assert rec["segments"] == 2 and rec["flops_convention"] == "visible"
    window = (rec["window_left"], rec["window_right"])
    assert window in ((None, None), (8, 0))
    pairs = _brute_visible(32, True, None if window == (None, None) else window, 2)
    assert rec["visible_fraction"] == pytest.approx(pairs / 32**2)
    assert rec["flops"] == 4 * 64 * 2 * pairs * 7 // 2
    if rec["impl"] == "cudnn":
      assert rec["status"] == "unsupported"
    else:
      assert rec["status"] == "ok", rec
      assert rec["rel_err_out"] < 2e-2 and rec["rel_err_grad"] < 2e-2
  checks = {(r["impl"], r["window_left"]): r for r in doc["checks"]}
  assert len(checks) == 6 and checks[("xla", 8)]["status"] == "ok" and checks[("flash2", 8)]["segments"] == 2
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert {(r["window_left"], r["window_right"], r["segments"]) for r in rows} == {("", "", "2"), ("8", "0", "2")}


def test_failures_become_cells_and_the_sweep_goes_on(monkeypatch):
  from jax_flash2.bench import sweep

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
  cfg = cli.parse(["--impls", "oom", "boom", "xla", "--seqlens", "32", "--causal", "false", "--iters", "1",
                   "--warmup", "0"], "cpu")
  cells, checks = sweep.run_sweep(cfg)
  by = {(c.impl, c.mode): c for c in cells}
  assert len(cells) == 3 * 3
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
            "xla-bad-option", "--iters", "1", "--warmup", "0", "--memory", "--no-progress", "--out", str(tmp_path)]
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
