"""A staged kernel patch (lab/patches/*.diff) against the product, in one
process: the patched tree is imported beside the product as a second
package, `jax_flash2_b`, and the two alternate round by round on a few
cases, each call compiled once per round; kernel time (profiler) and wall
clock per call, each side's median and spread over the rounds, and the two
sides' outputs and gradients compared.

  PYTHONPATH=. python lab/tools/patch_ab.py lab/patches/dq_delta_fold.diff
      [--cases window packed causal gptoss] [--modes fwd+bwd fwd] [--rounds 3] [--seqlen 16384]
      [--interpret]   (CPU: the two sides' results at 512 tokens in Mosaic's interpreter, no timing)

Only the patch's hunks under jax_flash2/ are applied (its test changes run
with the GPU suite on a patched copy: lab/gpu_options_ab.sh patchtests).
The cases, all causal, bf16, backend="mosaic":
  window   d128, 16 heads, window (1024, 0)
  packed   d128, 16 heads, 8 equal sequences as segment ids
  causal   d128, 16 heads
  gptoss   d64, 64 query heads over 8, window (128, 0), sinks
  softcap  d128, 16 heads, softcap 50
Alternating rounds let drift hit both sides alike; a side's spread is the
noise a difference has to beat (session 25 saw repeats of one variant 4%
apart). Lab equipment: not part of the product.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from ab_timing import cell, wall_and_kernel_ms

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHED = "jax_flash2_b"


def patched_package(patch: pathlib.Path, name: str = PATCHED):
  """The product with `patch`'s jax_flash2/ hunks applied, imported as the
  package `name` (a copy in a temporary folder, its imports renamed)."""
  folder = pathlib.Path(tempfile.mkdtemp(prefix="patch_ab_"))
  shutil.copytree(ROOT / "jax_flash2", folder / "jax_flash2", ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run(["git", "apply", "--include=jax_flash2/*", str(patch.resolve())], cwd=folder, check=True)
  (folder / "jax_flash2").rename(folder / name)
  for path in (folder / name).rglob("*.py"):
    path.write_text(re.sub(r"\bjax_flash2\b", name, path.read_text()))
  sys.path.insert(0, str(folder))
  return importlib.import_module(name)


def _case(name: str, s: int, interpret: bool):
  """(q, k, v, do, flash_attention keywords) of a case (interpret: an
  eighth of the heads and windows)."""
  d, h, kvh, kw = 128, 16, 16, dict(causal=True, backend="mosaic", interpret=interpret)
  if name == "window":
    kw["window_size"] = (128 if interpret else 1024, 0)
  elif name == "packed":
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), s // 8)[None]
    kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
  elif name == "gptoss":
    d, h, kvh = 64, 64, 8
    kw["window_size"] = (128, 0)
  elif name == "softcap":
    kw["softcap"] = 50.0
  if interpret:
    h, kvh = h // 8, kvh // 8
  if name == "gptoss":
    kw["sinks"] = jnp.linspace(-1.0, 2.0, h, dtype=jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, do = (jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[:2])
  k, v = (jax.random.normal(kk, (1, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[2:])
  return q, k, v, do, kw


def _fn(flash_attention, mode: str, kw: dict):
  """fn(q, k, v, do): the forward's output, or it and the three gradients."""

  def fwd(q, k, v, do):
    return (flash_attention(q, k, v, **kw),)

  def fwd_bwd(q, k, v, do):
    out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v)
    return (out, *pull(do))

  return fwd if mode == "fwd" else fwd_bwd


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("patch", type=pathlib.Path)
  ap.add_argument("--cases", nargs="*", default=["window", "packed", "causal"],
                  choices=["window", "packed", "causal", "gptoss", "softcap"])
  ap.add_argument("--modes", nargs="*", default=["fwd+bwd"], choices=["fwd", "fwd+bwd"])
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--interpret", action="store_true")
  args = ap.parse_args()
  import jax_flash2  # the product: PYTHONPATH=. from the repository root

  sides = {"product": jax_flash2.flash_attention, "patched": patched_package(args.patch).flash_attention}
  seqlen = 512 if args.interpret else args.seqlen
  print(f"patch {args.patch}; jax {jax.__version__}; {jax.devices()[0].device_kind}", flush=True)
  for case in args.cases:
    q, k, v, do, kw = _case(case, seqlen, args.interpret)
    for mode in args.modes:
      print(f"== {case} {mode}: q{q.shape} k{k.shape} {', '.join(sorted(kw))}", flush=True)
      fns = {side: _fn(fa, mode, kw) for side, fa in sides.items()}
      for side, fn in fns.items():  # which kernels each side runs
        kernels = sorted(set(re.findall(r"flash2_\w+", str(jax.make_jaxpr(fn)(q, k, v, do)))))
        print(f"  {side:8s} kernels {' '.join(kernels)}", flush=True)
      base, results, kernel_ms = {}, {}, {side: [] for side in sides}
      for _ in range(1 if args.interpret else args.rounds):
        for side, fn in fns.items():
          if not args.interpret:
            wall, kernel = wall_and_kernel_ms(fn, q, k, v, do, iters=7)
            kernel_ms[side].append(kernel)
            print(f"  {side:8s} " + cell(mode, wall, kernel, base), flush=True)
          if side not in results:
            results[side] = jax.jit(fn)(q, k, v, do)
      if not args.interpret:
        a, b = (np.asarray(kernel_ms[side]) for side in sides)
        print(f"  kernel ms median: product {np.median(a):.3f} (spread {np.ptp(a) / np.median(a):.1%}), "
              f"patched {np.median(b):.3f} (spread {np.ptp(b) / np.median(b):.1%}): patched "
              f"{np.median(b) / np.median(a) - 1:+.1%}", flush=True)
      for what, a, b in zip(("out", "dq", "dk", "dv"), results["product"], results["patched"]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        print(f"  {what}: patched vs product, relative difference {np.linalg.norm(a - b) / np.linalg.norm(a):.2e}",
              flush=True)


if __name__ == "__main__":
  main()
