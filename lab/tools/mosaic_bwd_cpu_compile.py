"""Compiles the Mosaic GPU backward kernels (dkv, dq) to sm_90a on a machine without a GPU.

The backward counterpart of tools/mosaic_cpu_compile.py (same setup, same
/tmp venv with the CUDA plugin and ptxas; see its docstring):

  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/mosaic_bwd_cpu_compile.py [--dump DIR] [--only d256] \
      [--set stages=3] [--variant fused_dq=1+dkv_persistent=0+staging=0] [--variant kernels=2+softmax_overlap=1]

Prints, per kernel and case, ptxas's registers and spills and what the SASS
holds (HGMMA shapes, local memory).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "lab" / "tools"))

import mosaic_cpu_compile as fwd_tool  # noqa: E402

# (batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal, (block_q, block_kv, stages) or None)
CASES_ALL = [
    (2, 1024, 1024, 4, 4, head_dim, dtype, causal, None)
    for head_dim in (64, 128)
    for dtype in ("bfloat16", "float16")
    for causal in (False, True)
] + [
    (2, 1024, 2048, 8, 2, 128, "bfloat16", True, None),  # grouped-query, seq_q < seq_k
    (1, 2048, 1024, 4, 4, 128, "bfloat16", True, None),  # seq_q > seq_k
    (1, 4096, 4096, 4, 4, 128, "bfloat16", False, (128, 128, 2)),
    (1, 4096, 4096, 4, 4, 64, "bfloat16", True, (64, 64, 4)),
] + [
    # head_dim 256: backward_wide.py's kernels (--only d256)
    (1, 2048, 2048, 4, 4, 256, dtype, causal, None)
    for dtype in ("bfloat16", "float16")
    for causal in (False, True)
] + [
    (1, 1000, 1537, 8, 2, 256, "bfloat16", True, None),  # ragged, grouped-query
]
CASES = CASES_ALL


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dump", default=None, help="keep Mosaic's dumps (PTX, ptxas, SASS) here")
  parser.add_argument("--only", default="", help="only the cases whose name contains this")
  parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                      help="BackwardConfig fields set in every case (ints; bools as 0/1), e.g. stages=3")
  parser.add_argument("--variant", default="default",
                      help="a tools/mosaic_bwd_bench.py variant (fields and measurement experiments joined by '+'), "
                           "applied after --set")
  args = parser.parse_args()
  dump_root = pathlib.Path(args.dump or tempfile.mkdtemp(prefix="mosaic_bwd_dump_"))
  compile_fn = fwd_tool.setup_compiler()
  import jax
  import jax.numpy as jnp

  from jax_flash2.mosaic import backward
  import mosaic_bwd_bench  # tools/: its variant parser, with the measurement experiments

  failures = 0
  i = 0
  for batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal, tiles in CASES:
    config = backward.BackwardConfig(*tiles) if tiles else backward.default_backward_config(head_dim)
    config = fwd_tool.with_fields(config, args.set)
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
    vec = jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)
    for kernel in ("dkv", "dq"):
      name = f"{kernel}_d{head_dim}_{dtype}_{'causal' if causal else 'full'}_{seq_q}x{seq_k}_h{heads}-{kv_heads}"
      if tiles:
        name += "_q{}_kv{}_s{}".format(*tiles)
      if args.only not in name:
        continue
      variant, experiment = mosaic_bwd_bench._variant(config, args.variant)
      fn = lambda *a, fn=getattr(backward, kernel), causal=causal, config=variant: fn(*a, causal=causal, config=config)
      with experiment():
        failures += not fwd_tool.compile_case(compile_fn, fn, (q, kv, kv, q, vec, vec), dump_root / f"{i:02d}_{name}",
                                              name)
      i += 1
  print(f"dumps in {dump_root}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
