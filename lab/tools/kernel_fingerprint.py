"""Fingerprints of every kernel flash_attention compiles, lowered for CUDA on a CPU.

Lowers `jax.vjp` of `flash_attention` (forward and backward, the bias's
gradient where there is one) for `cuda` from ShapeDtypeStructs, as an H200
(compute capability 9.0) would, and prints one line per kernel: the case,
the kernel's name and a hash of its IR without debug locations, the Mosaic
GPU kernels' MLIR and the Triton kernels' TTIR. Equal IR compiles to equal
machine code (ptxas and Triton are deterministic), so two runs that print
the same lines, before and after a change, show the change left every
kernel as it was:

  JAX_PLATFORMS=cpu python lab/tools/kernel_fingerprint.py > before.txt
  ... change ...
  JAX_PLATFORMS=cpu python lab/tools/kernel_fingerprint.py > after.txt
  diff before.txt after.txt

With --sass DIR (and the CUDA plugin's venv of lab/tools/mosaic_cpu_compile.py)
the Mosaic kernels are also compiled to sm_90a and their SASS, without
comments, hashed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _cases():
  """(name, flash_attention kwargs, shapes (batch, seq_q, seq_k, heads, kv_heads, head_dim), dtype)."""
  cases = []
  # auto on Hopper: the Mosaic kernels where they serve.
  for head_dim in (64, 128, 256):
    for causal in (False, True):
      cases.append((f"auto_d{head_dim}_{'causal' if causal else 'full'}_4096", dict(causal=causal),
                    (1, 4096, 4096, 2, 2, head_dim), "bfloat16"))
  cases += [
      ("auto_d64_full_2048_three", dict(causal=False), (1, 2048, 2048, 2, 2, 64), "bfloat16"),
      ("auto_d64_causal_8192_three", dict(causal=True), (1, 8192, 8192, 1, 1, 64), "bfloat16"),
      ("auto_d128_causal_gqa_ragged", dict(causal=True), (1, 4100, 4500, 4, 2, 128), "bfloat16"),
      ("auto_d128_causal_q_gt_k", dict(causal=True), (1, 2048, 1024, 2, 2, 128), "float16"),
      ("auto_d64_full_ragged_short", dict(causal=False), (1, 1000, 1537, 2, 2, 64), "bfloat16"),
  ]
  # The Triton kernels, every head_dim class and option.
  for head_dim in (64, 80, 128, 256):
    for causal in (False, True):
      cases.append((f"triton_d{head_dim}_{'causal' if causal else 'full'}", dict(causal=causal, backend="triton"),
                    (1, 1000, 1537, 4, 2, head_dim), "bfloat16"))
  options = {
      "mask": dict(mask=True), "window": dict(window_size=(256, 0)), "softcap": dict(softcap=30.0),
      "alibi": dict(alibi_slopes=True), "segments": dict(segments=True), "dropout": dict(dropout_rate=0.1),
      "bias": dict(bias=True), "window_both": dict(window_size=(100, 50)),
      "all": dict(mask=True, window_size=(300, 0), softcap=20.0, alibi_slopes=True, segments=True,
                  dropout_rate=0.2, bias=True),
  }
  for name, kwargs in options.items():
    cases.append((f"triton_d128_{name}", dict(kwargs, causal=True, backend="triton"), (2, 640, 768, 4, 2, 128),
                  "bfloat16"))
  cases.append(("triton_d64_f32", dict(causal=True, backend="triton"), (1, 256, 256, 2, 2, 64), "float32"))
  # auto on Hopper with the options the Mosaic kernels serve (issue 27).
  cases.append(("mosaic_d128_softcap", dict(causal=True, softcap=30.0, backend="mosaic"),
                (1, 1024, 1024, 2, 2, 128), "bfloat16"))
  mosaic_options = {
      "window": dict(window_size=(1024, 0)), "window_both": dict(window_size=(512, 512)),
      "alibi": dict(causal=True, alibi_slopes=True),
      "all": dict(causal=True, window_size=(1024, 0), softcap=20.0, alibi_slopes=True),
      "segments": dict(causal=True, segments=True), "sinks": dict(causal=True, sinks=True),
  }
  for head_dim in (64, 128, 256):
    for name, kwargs in mosaic_options.items():
      cases.append((f"auto_d{head_dim}_{name}_4096", kwargs, (1, 4096, 4096, 4, 2, head_dim), "bfloat16"))
  return cases


def _arguments(kwargs, shape, dtype):
  """(arrays, static kwargs): the optional arrays as ShapeDtypeStructs."""
  batch, seq_q, seq_k, heads, kv_heads, head_dim = shape
  kwargs = dict(kwargs)
  arrays = {}
  if kwargs.pop("mask", False):
    arrays["mask"] = jax.ShapeDtypeStruct((batch, 1, seq_q, seq_k), jnp.bool_)
  if kwargs.pop("bias", False):
    arrays["bias"] = jax.ShapeDtypeStruct((1, heads, seq_q, seq_k), jnp.float32)
  if kwargs.pop("alibi_slopes", False):
    arrays["alibi_slopes"] = jax.ShapeDtypeStruct((heads,), jnp.float32)
  if kwargs.pop("segments", False):
    arrays["q_segment_ids"] = jax.ShapeDtypeStruct((batch, seq_q), jnp.int32)
    arrays["kv_segment_ids"] = jax.ShapeDtypeStruct((batch, seq_k), jnp.int32)
  if kwargs.pop("sinks", False):
    arrays["sinks"] = jax.ShapeDtypeStruct((heads,), jnp.float32)
  if kwargs.get("dropout_rate"):
    arrays["dropout_rng"] = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return arrays, kwargs


def _on_hopper():
  """Makes the lowering believe it runs on an H200: the Triton lowering's
  GPU query and jax_flash2's view of the device."""
  from jax._src.lib import gpu_triton  # noqa: F401  (imported for its side effects in older jax)
  from jax._src.pallas.triton import pallas_call_registration as registration

  class _Info:
    compute_capability = 90

  registration.gpu_info_lib.get_gpu_info = lambda: _Info()
  import jax_flash2

  patched = False
  for module_name, attr in (("jax_flash2.backends", "default_compute_capability"),
                            ("jax_flash2.api", "_gpu_capability")):
    try:
      module = __import__(module_name, fromlist=[attr])
    except ImportError:
      continue
    if hasattr(module, attr):
      setattr(module, attr, lambda *a, **k: (9, 0))
      patched = True
  if not patched:
    raise SystemExit("kernel_fingerprint: found no device query to patch in jax_flash2")
  del jax_flash2


def _captured_triton(store: list):
  from jax._src.pallas.triton import lowering, pallas_call_registration as registration

  original = lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    store.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture


def _mosaic_kernels(lowered) -> list[tuple[str, bytes]]:
  """(MLIR text without debug info, the serialized module) of each Mosaic GPU kernel."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import dialect

  module = lowered.compiler_ir("stablehlo")
  context = jax_mlir.make_ir_context()
  dialect.register_dialect(context)
  context.allow_unregistered_dialects = True
  kernels = []

  def visit(op):
    if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
      config = ir.DictAttr(op.attributes["mhlo.backend_config"])
      if "module" in config:
        raw = ir.StringAttr(config["module"]).value_bytes
        kernel = ir.Module.parse(raw, context=context)
        kernels.append((re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "",
                               kernel.operation.get_asm(enable_debug_info=False)), raw))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner.operation)

  visit(module.operation)
  return kernels


def _name(text: str) -> str:
  """The kernel's own name (flash2_...), else its first function's."""
  found = re.search(r"\b(flash2_\w+?)(?:_mosaic_gpu)?\b", text) or re.search(r"func\.func (?:public |private )?@([\w$.]+)", text)
  return found.group(1) if found else "?"


def _sass(compile_fn, module: bytes, dump: str) -> str:
  """The SASS of one serialized Mosaic GPU module, compiled for sm_90a, as
  instructions alone (no addresses, comments or file names)."""
  import glob

  os.makedirs(dump, exist_ok=True)
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump
  if not compile_fn(module, len(module)):
    return "compile failed"
  sass = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(dump, "*.sass*"))))
  lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip() for line in sass.splitlines()]
  return "\n".join(line for line in lines if line and not line.startswith(("//", ".", "#")))


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="only the cases whose name contains this")
  parser.add_argument("--show", default=None, help="write each kernel's IR into this folder")
  parser.add_argument("--sass", default=None,
                      help="also compile the Mosaic kernels to sm_90a (dumps in this folder) and hash their SASS")
  args = parser.parse_args()
  compile_fn = None
  if args.sass:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mosaic_cpu_compile

    compile_fn = mosaic_cpu_compile.setup_compiler()
  _on_hopper()
  from jax_flash2 import flash_attention

  triton_ir: list[str] = []
  _captured_triton(triton_ir)
  for name, kwargs, shape, dtype in _cases():
    if args.only not in name:
      continue
    batch, seq_q, seq_k, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
    arrays, static = _arguments(kwargs, shape, dtype)
    names = tuple(arrays)
    differentiable = ("bias",)

    def step(q, k, v, *extra, static=static, names=names):
      extras = dict(zip(names, extra))
      if "dropout_rng" in extras:
        extras["dropout_rng"] = extras["dropout_rng"]
      diff = {n: extras.pop(n) for n in differentiable if n in extras}

      def f(q, k, v, *d):
        return flash_attention(q, k, v, **extras, **dict(zip(diff, d)), **static, return_lse=True)

      (out, lse), vjp = jax.vjp(f, q, k, v, *diff.values())
      return vjp((jnp.ones_like(out), jnp.ones_like(lse)))

    triton_ir.clear()
    lowered = jax.jit(step).trace(q, kv, kv, *arrays.values()).lower(lowering_platforms=("cuda",))
    kernels = [("mosaic", text, raw) for text, raw in _mosaic_kernels(lowered)]
    kernels += [("triton", text, None) for text in triton_ir]
    for i, (family, text, raw) in enumerate(sorted(kernels, key=lambda k: (k[0], _name(k[1]), _digest(k[1])))):
      line = f"{name} {family} {_name(text)} {_digest(text)}"
      if compile_fn is not None and raw is not None:
        line += f" sass={_digest(_sass(compile_fn, raw, os.path.join(args.sass, f'{name}_{i}')))}"
      print(line, flush=True)
      if args.show:
        os.makedirs(args.show, exist_ok=True)
        with open(os.path.join(args.show, f"{name}_{i}_{family}_{_name(text)}.mlir"), "w") as f:
          f.write(text)
  return 0


if __name__ == "__main__":
  np.set_printoptions(threshold=sys.maxsize)
  sys.exit(main())
