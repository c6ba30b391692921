"""Compiles the Mosaic GPU backward kernels to sm_90a on a machine without a GPU.

The backward counterpart of lab/tools/mosaic_cpu_compile.py (same setup, same
/tmp venv with the CUDA plugin and ptxas; see its docstring):

  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/mosaic_bwd_cpu_compile.py [--dump DIR] [--only d256] \
      [--set stages=3] [--variant fused_dq=1+dkv_persistent=0+stages=2] [--variant kernels=2]

Each case lowers jax.vjp of flash_attention(..., backend="mosaic",
mosaic_config=MosaicConfig(backward=...)) for CUDA as an H200 would run it,
the backward config the measured default for the head_dim
(jax_flash2.defaults) or the case's (block_q, block_kv, stages), then --set
and --variant (lab/tools/cli_ab.py's syntax, with kernels=1 or 2), and
compiles every Mosaic kernel of it: the forward and the backward's kernels
(the dK/dV and dQ kernels, or the fused one). Prints, per kernel and case,
ptxas's registers and spills and what the SASS holds (HGMMA shapes, local
memory). The measurement switches this tool once also took (dQ additions
skipped or unstaged) are gone with the kernels' own (lab/variants.md).
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
                      help="MosaicBackwardConfig fields set in every case (ints; bools as 0/1), e.g. stages=3")
  parser.add_argument("--variant", default="default",
                      help="a lab/tools/cli_ab.py backward variant (fields joined by '+', kernels=1 or 2), "
                           "applied after --set")
  args = parser.parse_args()
  dump_root = pathlib.Path(args.dump or tempfile.mkdtemp(prefix="mosaic_bwd_dump_"))
  compile_fn = fwd_tool.setup_compiler()
  fwd_tool.on_hopper()
  import dataclasses

  import jax

  from jax_flash2 import defaults, flash_attention
  from jax_flash2.config import MosaicConfig

  failures = 0
  for i, (batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal, tiles) in enumerate(CASES):
    config = defaults.mosaic_backward(head_dim)
    if tiles:
      config = dataclasses.replace(config, block_q=tiles[0], block_kv=tiles[1], stages=tiles[2])
    config = fwd_tool.with_fields(config, [*args.set, *([] if args.variant == "default" else [args.variant])])
    name = f"bwd_d{head_dim}_{dtype}_{'causal' if causal else 'full'}_{seq_q}x{seq_k}_h{heads}-{kv_heads}"
    if tiles:
      name += "_q{}_kv{}_s{}".format(*tiles)
    if args.only not in name:
      continue
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
    mosaic_config = MosaicConfig(backward=config)

    def grads(q, k, v, do, causal=causal, mosaic_config=mosaic_config):
      attn = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic", mosaic_config=mosaic_config)
      _, vjp = jax.vjp(attn, q, k, v)
      return vjp(do)

    failures += fwd_tool.compile_kernels(compile_fn, grads, (q, kv, kv, q), dump_root / f"{i:02d}_{name}", name)
  print(f"dumps in {dump_root}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
