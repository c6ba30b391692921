"""`--memory`: the longest sequence each implementation's fwd+bwd runs at.

Batch 1, 16 heads, head_dim 128, sequence doubling from 1k to 128k; the probe
stops at an implementation's first failure. On a machine without a GPU it
runs a tiny version (batch 1, 2 heads, head_dim 64, sequence 64..256) that
only shows the probe works.
"""

from __future__ import annotations

import dataclasses

from jax_flash2.bench import flops as flops_lib
from jax_flash2.bench import impls as impls_lib
from jax_flash2.bench import timing
from jax_flash2.bench.progress import Progress
from jax_flash2.bench.spec import MemoryStep, Shape, SweepConfig

GPU_PROBE = dict(batch=1, heads=16, head_dim=128, start=1024, stop=131072)
CPU_PROBE = dict(batch=1, heads=2, head_dim=64, start=64, stop=256)


def probe_seqlens(cfg: SweepConfig) -> list[int]:
  p = CPU_PROBE if cfg.tiny else GPU_PROBE
  stop = cfg.memory_max_seqlen or p["stop"]
  seqs, s = [], p["start"]
  while s <= stop:
    seqs.append(s)
    s *= 2
  return seqs


def probe_shape(cfg: SweepConfig, seqlen: int) -> Shape:
  p = CPU_PROBE if cfg.tiny else GPU_PROBE
  return Shape(
      batch=p["batch"],
      seqlen=seqlen,
      heads=p["heads"],
      kv_heads=p["heads"],
      head_dim=p["head_dim"],
      causal=cfg.causal[0],
      dtype=cfg.dtypes[0],
  )


def run_memory_probe(cfg: SweepConfig, progress: Progress | None = None) -> list[MemoryStep]:
  """Every step tried, per implementation, up to and including its first failure."""
  opts = impls_lib.run_options(cfg)
  progress = progress or Progress(0, enabled=False)
  steps: list[MemoryStep] = []
  seqs = probe_seqlens(cfg)
  for name in cfg.impls:
    impl = impls_lib.get(name)
    for i, seqlen in enumerate(seqs):
      shape = probe_shape(cfg, seqlen)
      step = _probe_step(impl, shape, opts, cfg.seed)
      steps.append(step)
      progress.update(f"memory {name} s{seqlen} {step.status}")
      if step.status != "ok":
        for _ in seqs[i + 1 :]:
          progress.update(f"memory {name} skipped")
        break
  return steps


def _probe_step(impl: impls_lib.Impl, shape: Shape, opts: impls_lib.Options, seed: int) -> MemoryStep:
  fields = dict(impl=impl.name, min_bytes=flops_lib.min_fwd_bwd_bytes(shape), **dataclasses.asdict(shape))
  reason = impl.supports(shape, opts)
  if reason is not None:
    return MemoryStep(status="unsupported", error=reason, **fields)
  prepared = None
  try:
    inputs = timing.make_inputs(shape, seed)
    prepared = timing.prepare(impl.factory(shape, opts), "fwd+bwd", [inputs], compiler_options=impl.compiler_options)
    del inputs
    before = timing.device_peak_bytes()
    times = timing.time_calls(prepared, warmup=0, iters=1, calls_per_round=1)
    after = timing.device_peak_bytes()
    total, temp = timing.compiled_memory(prepared.compiled)
  except Exception as exc:  # noqa: BLE001 - the failure is the answer
    status, short = timing.classify(exc)
    return MemoryStep(status=status, error=short, **fields)
  finally:
    del prepared
    timing.free()
  return MemoryStep(
      status="ok",
      ms=times[0] * 1e3,
      compiled_bytes=total,
      compiled_temp_bytes=temp,
      device_peak_bytes=after,
      device_peak_new=(after > before) if (after is not None and before is not None) else None,
      **fields,
  )


def summarize(steps: list[MemoryStep]) -> dict[str, dict]:
  """Per implementation: the longest sequence that ran and the first failure."""
  out: dict[str, dict] = {}
  for s in steps:
    entry = out.setdefault(s.impl, {"max_seqlen_ok": None, "ok_step": None, "first_failure": None})
    if s.status == "ok":
      entry["max_seqlen_ok"] = s.seqlen
      entry["ok_step"] = s
    elif entry["first_failure"] is None:
      entry["first_failure"] = s
  return out
