"""Hashes of the Mosaic GPU kernels' MLIR over their tilings and variants, lowered for CUDA on a CPU.

Where lab/tools/kernel_fingerprint.py covers the paths flash_attention takes
by default (and, with the CUDA plugin's venv, their SASS), this lowers the
kernel modules' entry points directly over the variants the tests lower:
every forward option of MosaicForwardConfig (stages, block sizes, softmax
overlap, persistent, balanced, three consumers), the two-kernel backward's
(overlap, persistent, early vectors, 128-row blocks), the fused kernel at
head_dim 64 and 128 and the wide kernels at 256, full and causal, grouped-
query, ragged, seq_q > seq_k, fp16. No CUDA plugin is needed: equal MLIR
compiles to equal SASS (ptxas is deterministic), so two trees whose lines
agree run the same machine code for these problems.

  JAX_PLATFORMS=cpu PYTHONPATH=/tmp/base python lab/tools/mosaic_mlir_fingerprint.py > before.txt
  JAX_PLATFORMS=cpu python lab/tools/mosaic_mlir_fingerprint.py > after.txt
  diff before.txt after.txt

Only keyword arguments every tree's entry points take (causal, config) are
passed, so a tree from before an option was added fingerprints the same way.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flash2.config import MosaicBackwardConfig as B  # noqa: E402
from jax_flash2.config import MosaicForwardConfig as F  # noqa: E402
from jax_flash2.mosaic import backward, backward_fused, backward_wide, forward  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kernel_fingerprint  # noqa: E402  (its MLIR extraction, names and hashes)

# (batch, seq_q, seq_k, heads, kv_heads, head_dim)
WHOLE, GQA, RAGGED, TALL = (1, 1024, 1024, 2, 2, 0), (1, 1024, 2048, 8, 2, 0), (1, 1000, 1537, 4, 2, 0), \
    (1, 2048, 1024, 2, 2, 0)

FORWARD = {
    "default": None,
    "two_slots": F(block_q=128, block_kv=128, stages=2),
    "kv64_s4": F(block_q=128, block_kv=64, stages=4),
    "q256_kv64_s3": F(block_q=256, block_kv=64, stages=3),
    "overlap": F(softmax_overlap=True),
    "persistent": F(stages=2, persistent=True),
    "persistent_overlap": F(softmax_overlap=True, persistent=True),
    "balanced": F(softmax_overlap=True, persistent=True, balanced=True),
    "three": F(block_q=192, block_kv=128, stages=4, softmax_overlap=True, consumers=3),
    "three_balanced": F(block_q=192, block_kv=128, stages=4, softmax_overlap=True, persistent=True, balanced=True,
                        consumers=3),
}
TWO_KERNELS = {
    "default": None,
    "plain": B(64, 64, 2),
    "blocks128": B(128, 128, 2),
    "overlap": B(64, 64, 2, dq_softmax_overlap=True),
    "persistent": B(64, 64, 2, dq_persistent=True, dkv_persistent=True),
    "early": B(64, 64, 3, early_vectors=True),
    "d64_default": B(64, 128, 4, dq_softmax_overlap=True, dq_persistent=True, dkv_persistent=True,
                     early_vectors=True),
}
FUSED = {64: [None, B(64, 128, 4, dkv_persistent=True, fused_dq=True)], 128: [B(64, 64, 2, fused_dq=True)]}
WIDE = {"default": None, "persistent": B(64, 64, 2, dq_persistent=True, dkv_persistent=True),
        "grid": B(64, 64, 2)}


def _structs(shape, head_dim, dtype):
  batch, seq_q, seq_k, heads, kv_heads, _ = shape
  q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
  vec = jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)
  return q, kv, vec


def _cases():
  """(name, function of the structs, structs)."""
  for head_dim in (64, 128, 256):
    for name, config in FORWARD.items():
      for shape_name, shape in (("whole", WHOLE), ("gqa", GQA), ("ragged", RAGGED), ("tall", TALL)):
        for causal in (False, True):
          if config is not None and config.balanced and not causal:
            continue
          for dtype in ((jnp.bfloat16, jnp.float16) if shape_name == "whole" else (jnp.bfloat16,)):
            q, kv, _ = _structs(shape, head_dim, dtype)
            f = lambda q, k, v, c=causal, config=config: forward.forward(q, k, v, causal=c, config=config)
            yield f"fwd_d{head_dim}_{name}_{shape_name}_{'causal' if causal else 'full'}_{jnp.dtype(dtype).name}", \
                f, (q, kv, kv)
  backward_shapes = (("whole", WHOLE), ("gqa", GQA), ("ragged", RAGGED), ("tall", TALL))
  for head_dim in (64, 128):
    for name, config in TWO_KERNELS.items():
      if name == "d64_default" and head_dim != 64:
        continue
      if config is None and head_dim == 64:
        config = TWO_KERNELS["d64_default"]
      for shape_name, shape in backward_shapes:
        for causal in (False, True):
          q, kv, vec = _structs(shape, head_dim, jnp.bfloat16)
          f = lambda *a, c=causal, config=config: backward.backward(*a, causal=c, config=config)
          yield f"bwd_d{head_dim}_{name}_{shape_name}_{'causal' if causal else 'full'}", f, (q, kv, kv, q, vec, vec)
    for i, config in enumerate(FUSED[head_dim]):
      for shape_name, shape in backward_shapes:
        for causal in (False, True):
          q, kv, vec = _structs(shape, head_dim, jnp.bfloat16)
          f = lambda *a, c=causal, config=config: backward_fused.backward(*a, causal=c, config=config)
          yield f"fused_d{head_dim}_{i}_{shape_name}_{'causal' if causal else 'full'}", f, (q, kv, kv, q, vec, vec)
  for name, config in WIDE.items():
    for shape_name, shape in backward_shapes:
      for causal in (False, True):
        q, kv, vec = _structs(shape, 256, jnp.bfloat16)
        f = lambda *a, c=causal, config=config: backward_wide.backward(*a, causal=c, config=config)
        yield f"wide_{name}_{shape_name}_{'causal' if causal else 'full'}", f, (q, kv, kv, q, vec, vec)


def _segment_cases():
  """(name, function, structs) of the kernels with segment ids (--segments):
  causal and a window, forward and each backward at its default tiling."""
  ids = jax.ShapeDtypeStruct((WHOLE[0], WHOLE[1]), jnp.int32)
  for head_dim in (64, 128, 256):
    q, kv, vec = _structs(WHOLE, head_dim, jnp.bfloat16)
    bwd = backward_wide.backward if head_dim == 256 else backward.backward
    for mask_name, mask in (("causal", dict(causal=True)), ("window", dict(window_size=(200, 0)))):
      f = lambda q, k, v, a, b, m=mask: forward.forward(q, k, v, q_segment_ids=a, kv_segment_ids=b, **m)
      yield f"seg_fwd_d{head_dim}_{mask_name}", f, (q, kv, kv, ids, ids)
      f = lambda q, k, v, o, l, d, a, b, m=mask, bwd=bwd: bwd(q, k, v, o, l, d, q_segment_ids=a, kv_segment_ids=b,
                                                              **m)
      yield f"seg_bwd_d{head_dim}_{mask_name}", f, (q, kv, kv, q, vec, vec, ids, ids)


def kernels_text(f, *args) -> list[str]:
  """The Mosaic GPU kernels of f lowered for CUDA: MLIR without debug
  locations or the per-process dump name (kernel_fingerprint's)."""
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  return [text for text, _ in kernel_fingerprint._mosaic_kernels(lowered)]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="only the cases whose name contains this")
  parser.add_argument("--segments", action="store_true", help="the kernels with segment ids instead")
  args = parser.parse_args()
  for name, f, structs in (_segment_cases() if args.segments else _cases()):
    if args.only not in name:
      continue
    try:
      texts = kernels_text(f, *structs)
    except ValueError as error:  # a tiling that does not fit shared memory at this head_dim
      print(f"{name} - {str(error).split(':')[0][-60:]}", flush=True)
      continue
    for i, text in enumerate(texts):
      print(f"{name} {i} {kernel_fingerprint._name(text)} {kernel_fingerprint._digest(text)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
