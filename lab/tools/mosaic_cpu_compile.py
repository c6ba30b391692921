"""Compiles the Mosaic GPU forward to sm_90a machine code on a machine without a GPU.

Lowering for CUDA (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`)
runs only the Python half of Mosaic GPU; the MLIR -> PTX -> ptxas half runs in
the XLA CUDA plugin when the custom call is compiled. This script calls that
half directly (MosaicGpuCompile, as Mosaic's torch bridge does) with
lab/tools/fakecuda.c standing in for the driver, and reports for each case what
ptxas says (registers, spills) and what the SASS holds (HGMMA, local memory).

Each case is lowered through the public API, as an H200 would run it
(lab/tools/kernel_fingerprint.py's view of the device): jax.jit of
flash_attention(q, k, v, causal=..., return_lse=True, backend="mosaic",
mosaic_config=MosaicConfig(forward=...)) from ShapeDtypeStructs, the
forward config the measured default for the case (jax_flash2.defaults) or
the case's (block_q, block_kv, stages), with --set's fields on top.

Not part of the test suite: it needs the CUDA plugin and ptxas, which the
project does not install. Set up once, in a venv of its own:

  python3.12 -m venv /tmp/cudavenv
  /tmp/cudavenv/bin/pip install jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 \\
      jax-cuda13-pjrt==0.11.2 "nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-nvvm>=13.0,<13.1" \\
      nvidia-cuda-nvdisasm==13.2.86   # nvdisasm is optional (SASS)
  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/mosaic_cpu_compile.py [--dump DIR] [--set stages=3]

A case that fails to compile prints the compiler's error on stderr.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal, config or None)
CASES = [
    (2, 1024, 1024, 4, 4, head_dim, dtype, causal, None)
    for head_dim in (64, 128, 256)
    for dtype in ("bfloat16", "float16")
    for causal in (False, True)
] + [
    (2, 1024, 2048, 8, 2, 128, "bfloat16", True, None),  # grouped-query, seq_q < seq_k
    (1, 2048, 1024, 4, 4, 128, "bfloat16", True, None),  # seq_q > seq_k
    (1, 4096, 4096, 4, 4, 128, "bfloat16", True, (128, 64, 4)),
    (1, 4096, 4096, 4, 4, 64, "bfloat16", False, (192, 128, 3)),
]


def _cuda_root() -> pathlib.Path:
  import nvidia.cu13  # from nvidia-cuda-nvcc

  for path in nvidia.cu13.__path__:
    if (pathlib.Path(path) / "bin" / "ptxas").exists():
      return pathlib.Path(path)
  raise SystemExit("ptxas not found: pip install 'nvidia-cuda-nvcc>=13.0,<13.1'")


def _load_fake_driver(build_dir: str) -> None:
  # The plugin dlopens "libcuda.so.1"; a library of that soname already loaded
  # into the process is the one it gets.
  lib = os.path.join(build_dir, "libcuda.so.1")
  subprocess.run(
      ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", lib, str(ROOT / "lab" / "tools" / "fakecuda.c")],
      check=True,
  )
  ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_A_FROM_REGISTERS = re.compile(r"HGMMA\.\S+ R\d+, R(\d+),")
_WRITE = re.compile(r"^(?:@!?U?P[T\d] )?([A-Z][A-Z0-9_.]*) R(\d+)\b")


def _registers_read(body: str) -> set[int]:
  """The registers an instruction reads (its operands after the first, a
  wgmma A fragment as four, a 64-bit operand as two)."""
  if operand := _A_FROM_REGISTERS.match(body):
    return set(range(int(operand.group(1)), int(operand.group(1)) + 4))
  opcode, _, operands = body.partition(" ")
  sources = operands.split(",")[1:] if _WRITE.match(body) else operands.split(",")
  width = 2 if ".64" in opcode else 1
  return {r + i for token in sources for r in map(int, re.findall(r"\bR(\d+)", token)) for i in range(width)}


def wgmma_operand_clobbers(sass: str) -> list[str]:
  """Registers that a loop's HGMMA reads as its A operand (4 per fragment)
  as values carried into the iteration (read before anything in the loop
  writes them) and whose last write in the loop is read again in the same
  iteration: at the back edge they hold that iteration's temporary, which
  the next iteration's HGMMA then reads as its operand. (A value carried on
  purpose, as the forward's P into the next step's P V, is written last and
  read only by the next iteration, and is not reported.)
  ptxas 13.0 does this to the dK/dV kernel with K and V in registers
  (session 9's wrong gradients; lab/NOTES.md, session 10). A static check
  of the SASS's innermost loops; one line per clobbered register."""
  instructions, labels, pending = [], {}, []
  for line in sass.splitlines():
    if label := _LABEL.match(line):
      pending.append(label.group(1))
    elif match := _INSTRUCTION.search(line):
      address = int(match.group(1), 16)
      labels.update((name, address) for name in pending)
      pending = []
      instructions.append((address, match.group(2)))
  loops = []  # (start, end) of each backward branch's range that holds an HGMMA
  for end, text in instructions:
    branch = re.search(r"BRA `\((\.L_x_\d+)\)", text)
    start = labels.get(branch.group(1)) if branch else None
    if start is None or start >= end:
      continue  # not a backward branch
    body = [text for address, text in instructions if start <= address <= end]
    # ptxas puts the slow paths of barrier waits after the function's EXIT
    # and branches back from there: such a range holds an EXIT, a loop none.
    if any("HGMMA" in t for t in body) and "EXIT" not in body:
      loops.append((start, end))
  found = []
  for start, end in loops:
    if any(start <= inner_start and inner_end <= end and (inner_start, inner_end) != (start, end)
           for inner_start, inner_end in loops):
      continue  # an outer loop: its inner loops reuse registers between them
    loop = [(address, body) for address, body in instructions if start <= address <= end]
    first_read, last_write = {}, {}
    for address, body in loop:
      if operand := _A_FROM_REGISTERS.match(body):
        for r in range(int(operand.group(1)), int(operand.group(1)) + 4):
          if r not in last_write:
            first_read.setdefault(r, address)
      elif (write := _WRITE.match(body)) and not write.group(1).startswith(("ST", "BRA", "SYNCS", "WARPGROUP")):
        width = 4 if ".128" in write.group(1) or ".M88.4" in write.group(1) else 2 if (
            ".64" in write.group(1) or write.group(1).startswith("CS2R")) else 1
        for r in range(int(write.group(2)), int(write.group(2)) + width):
          last_write[r] = (address, body)
    for r in sorted(first_read):
      if r not in last_write:
        continue  # loop-invariant and left alone
      written_at, body = last_write[r]
      if any(r in _registers_read(later) for address, later in loop if address > written_at):
        found.append(f"R{r}: read by HGMMA at {first_read[r]:#x}, last overwritten at {written_at:#x} ({body}) "
                     f"in the loop {start:#x}..{end:#x}")
  return found


def with_fields(config, settings: list[str]):
  """config with the fields of `settings` ("FIELD=VALUE", ints; bools as
  0/1) set together, since the config's checks relate them: the variant
  syntax of lab/tools/cli_ab.py, imported once jax may be."""
  import cli_ab

  return cli_ab._variant(config, "+".join(settings) or "default")


def _summarise(dump: pathlib.Path) -> str:
  report = " ".join(p.read_text() for p in dump.glob("*.ptxas"))
  regs = re.search(r"Used (\d+) registers", report)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
  parts = [f"regs={regs.group(1) if regs else '?'}"]
  parts.append(f"spill={spills.group(1)}/{spills.group(2)}B" if spills else "spill=?")
  sass = "".join(p.read_text() for p in dump.glob("*.sass*"))
  if sass:
    mma = collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))
    parts.append("HGMMA " + ",".join(f"{n}x{shape}" for shape, n in sorted(mma.items())))
    parts.append(f"LDL/STL={len(re.findall(r'\b(?:LDL|STL)\b', sass))}")
    clobbers = wgmma_operand_clobbers(sass)
    parts.append(f"A-clobbers={len(clobbers)}" + (f" (first: {clobbers[0]})" if clobbers else ""))
  return " ".join(parts)


def setup_compiler():
  """Points Mosaic at ptxas, asks it for PTX/ptxas/SASS dumps, loads the fake
  driver and returns the CUDA plugin's MosaicGpuCompile. Call before jax is
  imported."""
  # MOSAIC_GPU_CUDA_ROOT, if set, picks another ptxas (a folder with bin/ptxas).
  cuda_root = pathlib.Path(os.environ.get("MOSAIC_GPU_CUDA_ROOT") or _cuda_root())
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["MOSAIC_GPU_CUDA_ROOT"] = str(cuda_root)
  os.environ["PATH"] = f"{cuda_root / 'bin'}:{os.environ['PATH']}"
  for flag in ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS"):
    os.environ[flag] = "1"
  _load_fake_driver(tempfile.mkdtemp(prefix="fakecuda_"))
  sys.path.insert(0, str(ROOT))
  import jax_plugins.xla_cuda13 as cuda_plugin

  compile_fn = ctypes.CDLL(cuda_plugin._get_library_path()).MosaicGpuCompile
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
  return compile_fn


def compile_case(compile_fn, fn, args, dump: pathlib.Path, name: str) -> bool:
  """Lowers jax.jit(fn)(*args) for CUDA, compiles its one Mosaic kernel with
  dumps into `dump` and prints a line for it; True if it compiled."""
  import jax
  from jax.experimental.mosaic.gpu import core as mosaic_core

  dump.mkdir(parents=True, exist_ok=True)
  os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)
  mosaic_core.KNOWN_KERNELS.clear()
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  [module] = mosaic_core.KNOWN_KERNELS.values()
  ok = bool(compile_fn(module, len(module)))
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {_summarise(dump)}", flush=True)
  return ok


def compile_kernels(compile_fn, fn, args, dump: pathlib.Path, name: str) -> int:
  """Lowers jax.jit(fn)(*args) for CUDA and compiles every Mosaic kernel in
  it, each with its dumps in a folder of `dump`, printing a line per
  kernel; returns how many failed."""
  import jax
  from jax.experimental.mosaic.gpu import core as mosaic_core

  mosaic_core.KNOWN_KERNELS.clear()
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  failures = 0
  for j, module in enumerate(list(mosaic_core.KNOWN_KERNELS.values())):
    kernel_dump = dump / f"kernel{j}"
    kernel_dump.mkdir(parents=True, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(kernel_dump)
    ok = bool(compile_fn(module, len(module)))
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} kernel {j}: {_summarise(kernel_dump)}", flush=True)
  if not mosaic_core.KNOWN_KERNELS:
    print(f"FAIL {name}: no Mosaic kernel in the lowering", flush=True)
    failures += 1
  return failures


def on_hopper() -> None:
  """Makes jax_flash2 and the Triton lowering see an H200 (compute
  capability 9.0) on this CPU machine: lab/tools/kernel_fingerprint.py's
  patch, the one place that knows where jax_flash2 asks for the device."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import kernel_fingerprint

  kernel_fingerprint._on_hopper()


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dump", default=None, help="keep Mosaic's dumps (PTX, ptxas, SASS) here")
  parser.add_argument("--only", default="", help="only the cases whose name contains this")
  parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                      help="MosaicForwardConfig fields set in every case (ints; bools as 0/1), e.g. stages=3")
  args = parser.parse_args()
  dump_root = pathlib.Path(args.dump or tempfile.mkdtemp(prefix="mosaic_dump_"))
  compile_fn = setup_compiler()
  on_hopper()
  import dataclasses

  import jax

  from jax_flash2 import defaults, flash_attention
  from jax_flash2.config import MosaicConfig

  failures = 0
  for i, (batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal, tiles) in enumerate(CASES):
    config = defaults.mosaic_forward(head_dim, seq_q=seq_q, causal=causal)
    if tiles:
      config = dataclasses.replace(config, block_q=tiles[0], block_kv=tiles[1], stages=tiles[2])
    config = with_fields(config, args.set)
    q = jax.ShapeDtypeStruct((batch, seq_q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_k, kv_heads, head_dim), dtype)
    name = f"d{head_dim}_{dtype}_{'causal' if causal else 'full'}_{seq_q}x{seq_k}_h{heads}-{kv_heads}"
    if tiles:
      name += "_q{}_kv{}_s{}".format(*tiles)
    if args.only not in name:
      continue
    mosaic_config = MosaicConfig(forward=config)
    fn = lambda q, k, v, causal=causal, mosaic_config=mosaic_config: flash_attention(
        q, k, v, causal=causal, return_lse=True, backend="mosaic", mosaic_config=mosaic_config)
    failures += compile_kernels(compile_fn, fn, (q, kv, kv), dump_root / f"{i:02d}_{name}", name)
  print(f"dumps in {dump_root}")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
