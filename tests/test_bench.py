"""The benchmark CLI (jax_flash2.bench) on CPU: parsing, FLOPs, output schema, a tiny run."""

from __future__ import annotations

import csv
import json
import os

import pytest

from jax_flash2.bench import cli, flops, impls, report, timing
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
  assert cfg.impls == ("flash2-triton", "cudnn", "xla")
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
    "error": (str, type(None)),
    "ms": (float, type(None)),
    "ms_min": (float, type(None)),
    "iters": (int, type(None)),
    "flops": (int, type(None)),
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
  check = CheckResult(
      impl="xla", status="ok", rel_err_out=1e-3, rel_err_dq=2e-3, rel_err_dk=3e-3, rel_err_dv=1e-3,
      **dict(dtype="bfloat16", batch=1, heads=2, kv_heads=2, seqlen=64, head_dim=64, causal=True),
  )
  meta = report.metadata(["--out", str(tmp_path)])
  path = tmp_path / "r.json"
  report.write_json(str(path), meta, cfg, [ok, bad], [check], [])
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

  csv_path = tmp_path / "r.csv"
  report.write_csv(str(csv_path), [ok, bad])
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  assert tuple(rows[0]) == CELL_FIELDS
  assert rows[0]["impl"] == "xla" and float(rows[0]["ms"]) == 1.5 and int(rows[0]["flops"]) == 10**9
  assert rows[1]["status"] == "unsupported" and rows[1]["ms"] == ""


# ----------------------------------------------------------- end to end


def test_cli_tiny_cpu_run(tmp_path, capsys):
  out = tmp_path / "bench"
  argv = ["--seqlens", "32", "64", "--causal", "true", "--iters", "2", "--warmup", "0",
          "--out", str(out), "--plot", "--no-progress", "--memory", "--memory-max-seqlen", "64"]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "NOT GPU figures" in printed
  assert "Accuracy vs float32 reference" in printed and "Memory probe" in printed
  for name in ("results.json", "results.csv", "tflops_bf16.png"):
    assert (out / name).is_file() and os.path.getsize(out / name) > 0
  doc = json.loads((out / "results.json").read_text())
  assert doc["metadata"]["backend"] == "cpu"
  cells = doc["cells"]
  assert len(cells) == 2 * 3 * 3  # seqlens x modes x impls
  for rec in cells:
    _check_cell_record(rec)
    if rec["impl"] in ("flash2-triton", "xla"):
      assert rec["status"] == "ok", rec
      assert rec["rel_err_out"] < 2e-2 and rec["rel_err_grad"] < 2e-2
      if rec["mode"] == "fwd+bwd":
        assert rec["compiled_bytes"] >= rec["min_bytes"] > 0
    else:
      assert rec["impl"] == "cudnn" and rec["status"] == "unsupported"
  assert {r["impl"]: r["status"] for r in doc["checks"]} == {
      "flash2-triton": "ok", "cudnn": "unsupported", "xla": "ok"
  }
  probe = {(r["impl"], r["seqlen"]): r["status"] for r in doc["memory_probe"]}
  assert probe[("flash2-triton", 64)] == "ok" and probe[("xla", 64)] == "ok"
  with open(out / "results.csv") as f:
    assert len(list(csv.DictReader(f))) == len(cells)


def test_cli_runs_gqa(tmp_path):
  argv = ["--seqlens", "32", "--heads", "4", "--kv-heads", "2", "--causal", "false", "--modes", "fwd",
          "--impls", "flash2-triton", "xla", "--iters", "1", "--warmup", "0", "--no-progress",
          "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  doc = json.loads((tmp_path / "results.json").read_text())
  status = {r["impl"]: r for r in doc["cells"]}
  for impl in ("flash2-triton", "xla"):
    assert status[impl]["status"] == "ok" and status[impl]["kv_heads"] == 2
    check = [r for r in doc["checks"] if r["impl"] == impl][0]
    assert check["status"] == "ok" and check["rel_err_out"] < 2e-2


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
