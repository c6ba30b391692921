"""The lab tools that read the Mosaic kernels' machine code and traces, on CPU.

lab/tools/mosaic_cpu_compile.py's static check of the SASS,
mosaic_profile.py's summary of a profiler trace, kernel_anatomy.py's reading
of a device trace, and mosaic_fingerprint.py's cases: inputs made up here,
no GPU or CUDA plugin needed. Not part of the product suite (`python -m
pytest lab/tests`).
"""

from __future__ import annotations

import gzip
import json
import os

import jax
import pytest


def _sass(*instructions: str) -> str:
  """SASS text in nvdisasm's layout from instructions and '.L_x_N:' labels."""
  lines, address = [], 0
  for text in instructions:
    if text.endswith(":"):
      lines.append(text)
    else:
      lines.append(f"        /*{address:04x}*/                   {text} ;")
      address += 0x10
  return "\n".join(lines)


def test_wgmma_operand_clobber_check(load_tool):
  """mosaic_cpu_compile.py's check of the SASS: a loop whose HGMMA reads
  registers carried into it (K in registers) and that hands them to a
  temporary read in the same iteration (what ptxas 13.0 did to the two-kernel
  dK/dV loop with K and V in registers) is reported; a value carried on
  purpose (P into the next step's P V), a loop that leaves them alone, and a
  barrier's slow path after EXIT are not."""
  check = load_tool("mosaic_cpu_compile").wgmma_operand_clobbers
  clobbered = _sass("LDSM.16.M88.4 R160, [R4]", ".L_x_1:", "HGMMA.64x64x16.F32.BF16 R56, R160, gdesc[UR4], R56",
                    "F2FP.BF16.F32.PACK_AB R160, R13, R12", "HGMMA.64x64x16.F32.BF16 R120, R160, gdesc[UR8], R120",
                    "@P0 BRA `(.L_x_1)", "EXIT")
  [report] = check(clobbered)  # R160 only: the F2FP writes one register of the fragment
  assert report.startswith("R160: read by HGMMA at 0x10, last overwritten at 0x20")
  carried = _sass("F2FP.BF16.F32.PACK_AB R160, R13, R12", ".L_x_1:",
                  "HGMMA.64x64x16.F32.BF16 R88, R160, gdesc[UR8], R88", "FMNMX R161, R24, R28, !PT",
                  "FADD R30, R161, R31", "F2FP.BF16.F32.PACK_AB R160, R33, R32",
                  "F2FP.BF16.F32.PACK_AB R161, R35, R34", "@P0 BRA `(.L_x_1)", "EXIT")
  untouched = _sass("LDSM.16.M88.4 R160, [R4]", ".L_x_1:", "HGMMA.64x64x16.F32.BF16 R56, R160, gdesc[UR4], R56",
                    "F2FP.BF16.F32.PACK_AB R12, R13, R12", "HGMMA.64x64x16.F32.BF16 R120, R12, gdesc[UR8], R120",
                    "@P0 BRA `(.L_x_1)", "EXIT")
  slow_path = _sass("LDSM.16.M88.4 R160, [R4]", ".L_x_1:", "HGMMA.64x64x16.F32.BF16 R56, R160, gdesc[UR4], R56",
                    "F2FP.BF16.F32.PACK_AB R160, R13, R12", "FADD R1, R160, R2", "EXIT", "BRA `(.L_x_1)")
  assert check(carried) == check(untouched) == check(slow_path) == []


def test_profile_summary_of_a_trace(load_tool):
  """mosaic_profile.py's summary of a Mosaic GPU profiler trace: per
  warpgroup role (tid = 1 + warpgroup + 3 * CTA), the mean time per CTA in
  each region, nested regions counted in both, shares of the span."""
  tool = load_tool("mosaic_profile")
  events = []
  for cta, scale in ((0, 1.0), (1, 3.0)):
    for warpgroup in range(3):
      tid = 1 + warpgroup + 3 * cta
      marks = [("B", "step", 0), ("B", "scores", 1), ("E", "scores", 3), ("E", "step", 4), ("B", "step", 6),
               ("E", "step", 10)]
      events += [dict(ph=ph, name=name, ts=ts * scale + 100 * cta, tid=tid, pid=1) for ph, name, ts in marks]
  summary = tool.summarize({"traceEvents": events})
  assert list(summary) == ["consumer 0", "consumer 1", "producer"]
  for regions in summary.values():
    assert regions["(span)"] == (20.0, 1.0)  # spans 10 and 30
    assert regions["step"] == pytest.approx((16.0, 0.8))  # (4 + 4) and (12 + 12)
    assert regions["scores"] == pytest.approx((4.0, 0.2))  # 2 and 6
  assert "scores" in tool.format_summary(summary)


def test_kernel_anatomy_reads_gpu_kernels_from_a_trace(tmp_path, load_tool):
  """kernel_anatomy.py's reading of a profiler trace: the durations of the
  complete events on a GPU device's timelines, by kernel name; host events
  and metadata left out, the newest trace taken."""
  tool = load_tool("kernel_anatomy")
  events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
            dict(ph="X", name="bprop", pid=1, tid=7, ts=0, dur=30.0),
            dict(ph="X", name="bprop", pid=1, tid=7, ts=40, dur=32.0),
            dict(ph="X", name="memset", pid=1, tid=8, ts=80, dur=2.5),
            dict(ph="X", name="bprop", pid=2, tid=1, ts=0, dur=99.0)]  # the host's launch, not a kernel
  for run, trace in (("old", dict(traceEvents=[])), ("new", dict(traceEvents=events, metadata={}))):
    path = tmp_path / "plugins" / "profile" / run / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
      json.dump(trace, f)
    os.utime(path, (1, 1) if run == "old" else None)
  assert tool.gpu_kernel_times(tmp_path) == {"bprop": [30.0, 32.0], "memset": [2.5]}


def test_mosaic_fingerprint_covers_every_default_kernel(load_tool):
  """mosaic_fingerprint.py's cases on this tree's entry points (as imported,
  without Tree.at's stand-in package): each lowers for CUDA to the kernels
  its head_dim takes by default (the forward; the fused kernel at 64, dK/dV
  and dQ at 128, the wide kernels at 256; the fused kernel at 128 where the
  case says so), so that a run with the CUDA plugin fingerprints them all."""
  tool = load_tool("mosaic_fingerprint")
  fingerprint = load_tool("kernel_fingerprint")
  backward_kernels = {64: {"flash2_bwd_dkv_mosaic"}, 128: {"flash2_bwd_dkv_mosaic", "flash2_bwd_dq_mosaic"},
                      256: {"flash2_bwd_dkv_wide_mosaic", "flash2_bwd_dq_wide_mosaic"}}
  cases = []
  for case, fn, structs in tool._calls(tool.Tree(new=True)):
    lowered = jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",))
    names = {fingerprint._name(text) for text, _ in fingerprint._mosaic_kernels(lowered)}
    head_dim = structs[0].shape[-1]
    if case.startswith("fwd_"):
      assert names == {"flash2_fwd_mosaic"}, case
    elif case.startswith("bwd_fused_"):
      assert head_dim == 128 and names == {"flash2_bwd_dkv_mosaic"}, case
    else:
      assert names == backward_kernels[head_dim], case
    cases.append(case)
  assert len(cases) == 2 * len(tool.SHAPES) + len(tool.FUSED_128)
