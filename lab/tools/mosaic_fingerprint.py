"""Fingerprints of the Mosaic GPU kernels at their default tilings, compiled to sm_90a on a CPU.

Lowers each Mosaic kernel entry point directly (the forward, and the
backward each head_dim takes by default: the fused kernel at head_dim 64,
dK/dV + dQ at 128, the wide kernels at 256; and the fused kernel at 128,
not a default, to keep it compiling) for CUDA from ShapeDtypeStructs,
compiles every kernel to sm_90a through the CUDA plugin and ptxas
(lab/tools/mosaic_cpu_compile.py's fake driver), and prints one line per
kernel:

  case kernel mlir_hash sass_hash

the MLIR without debug locations and the SASS as instructions alone
(kernel_fingerprint._sass). Two trees whose lines agree compile to the
same machine code. `--tree` picks the source tree, so one script serves
the package layout before and after a change:

  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/mosaic_fingerprint.py --tree /tmp/base > before.txt
  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/mosaic_fingerprint.py > after.txt
  diff before.txt after.txt

The tree's jax_flash2/__init__.py is not run (only jax_flash2.mosaic and
what it imports), so a tree whose public API is mid-change still
fingerprints.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import tempfile
import types

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]

# (case, (batch, seq_q, seq_k, heads, kv_heads, head_dim), dtype, causal)
SHAPES = [
    (f"d{head_dim}_{'causal' if causal else 'full'}_4096", (1, 4096, 4096, 2, 2, head_dim), "bfloat16", causal)
    for head_dim in (64, 128, 256)
    for causal in (False, True)
] + [
    ("d64_full_2048_three", (1, 2048, 2048, 2, 2, 64), "bfloat16", False),
    ("d64_causal_8192_three", (1, 8192, 8192, 2, 2, 64), "bfloat16", True),
    ("d128_causal_q_gt_k_fp16", (1, 2048, 1024, 2, 2, 128), "float16", True),
    ("d128_causal_gqa_ragged", (1, 4100, 4500, 4, 2, 128), "bfloat16", True),
]
# The shapes whose backward also runs the fused kernel at head_dim 128.
FUSED_128 = ("d128_full_4096", "d128_causal_4096", "d128_causal_gqa_ragged")


class Tree:
  """The kernel entry points of one source tree: the package layout with
  jax_flash2/mosaic/common.py (forward, backward, backward_fused,
  backward_wide modules and jax_flash2.config's configs), or the one before
  it (forward and backward modules, backward.py routing every head_dim)."""

  def __init__(self, new: bool):
    self.new = new

  @classmethod
  def at(cls, path: pathlib.Path) -> Tree:
    """The tree at `path`, whose jax_flash2 this process then imports (its
    __init__.py not run: the API is not imported)."""
    package = types.ModuleType("jax_flash2")
    package.__path__ = [str(path / "jax_flash2")]
    sys.modules["jax_flash2"] = package
    sys.path.insert(0, str(path))
    return cls(new=(path / "jax_flash2" / "mosaic" / "common.py").exists())

  @staticmethod
  def module(name: str):
    """jax_flash2.NAME, imported when first asked for (so that a tree whose
    backward is mid-change still fingerprints its forward)."""
    return importlib.import_module(f"jax_flash2.{name}")

  def forward(self):
    return self.module("mosaic.forward").forward

  def default_backward(self, head_dim: int):
    """The backward entry point the head_dim takes by default (config None)."""
    if not self.new:
      return self.module("mosaic.backward").backward
    return self.module("mosaic." + {64: "backward_fused", 128: "backward", 256: "backward_wide"}[head_dim]).backward

  def fused_backward_128(self):
    """The fused kernel at head_dim 128: 64-row blocks, two ring slots, its
    additions in two adder warps."""
    if self.new:
      config = self.module("config").MosaicBackwardConfig(block_q=64, block_kv=64, stages=2, fused_dq=True)
      backward = self.module("mosaic.backward_fused").backward
    else:
      config = self.module("mosaic.backward").BackwardConfig(block_q=64, block_kv=64, stages=2, fused_dq=True,
                                                      dq_adder_warp=True, dq_adder_warps=2)
      backward = self.module("mosaic.backward").backward
    return lambda *a, **k: backward(*a, config=config, **k)


def _calls(tree: Tree):
  """(case, function of ShapeDtypeStructs, its arguments) per kernel call."""
  import jax
  import jax.numpy as jnp

  for case, (batch, seq_q, seq_k, heads, kv_heads, head_dim), dtype, causal in SHAPES:
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
    vec = jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)
    yield f"fwd_{case}", lambda q, k, v, causal=causal: tree.forward()(q, k, v, causal=causal), (q, kv, kv)
    backwards = [("bwd", lambda head_dim=head_dim: tree.default_backward(head_dim))]
    if case in FUSED_128:
      backwards.append(("bwd_fused", tree.fused_backward_128))
    for prefix, backward in backwards:
      yield (f"{prefix}_{case}", lambda *a, backward=backward, causal=causal: backward()(*a, causal=causal),
             (q, kv, kv, q, vec, vec))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tree", default=str(ROOT), help="the source tree to fingerprint (default: this one)")
  parser.add_argument("--only", default="", help="only the cases whose name contains this")
  parser.add_argument("--dump", default=None, help="keep Mosaic's dumps (PTX, ptxas, SASS) here")
  args = parser.parse_args()
  sys.path.insert(0, str(TOOLS))
  import mosaic_cpu_compile

  compile_fn = mosaic_cpu_compile.setup_compiler()
  sys.path.remove(str(ROOT))  # setup_compiler puts this tree first; --tree decides
  tree = Tree.at(pathlib.Path(args.tree).resolve())
  import jax
  import kernel_fingerprint as fingerprint

  dump = pathlib.Path(args.dump or tempfile.mkdtemp(prefix="mosaic_fingerprint_"))
  for case, fn, structs in _calls(tree):
    if args.only not in case:
      continue
    lowered = jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",))
    kernels = sorted(fingerprint._mosaic_kernels(lowered), key=lambda k: fingerprint._name(k[0]))
    for text, raw in kernels:
      name = fingerprint._name(text)
      sass = fingerprint._sass(compile_fn, raw, str(dump / f"{case}_{name}"))
      print(f"{case} {name} {fingerprint._digest(text)} {fingerprint._digest(sass)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
