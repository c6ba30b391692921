"""The instruction mix of the Mosaic kernels' innermost loops, from sm_90a SASS
compiled on a machine without a GPU (lab/tools/mosaic_cpu_compile.py's set-up).

For each case, every forward and backward kernel of jax.grad of
flash_attention(..., backend="mosaic") is compiled; for each loop that holds
an HGMMA and no EXIT (a K/V or Q step), it prints the loop's instruction
count and its most frequent opcodes. A change to a kernel's step shows here
as instructions a step before any GPU times it (session 29: the span mask).

  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/sass_loops.py OUT_DIR window causal gptoss packed softcap
      [--forward consumers=3 block_q=192 block_kv=64 stages=4 persistent=false balanced=false]
  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/sass_loops.py --sass FILE.sass_ctrl
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

CASES = {
    "window": dict(head_dim=128, heads=4, kv_heads=4, seq=4096, options=dict(causal=True, window_size=(1024, 0))),
    "causal": dict(head_dim=128, heads=4, kv_heads=4, seq=4096, options=dict(causal=True)),
    "causal64": dict(head_dim=64, heads=4, kv_heads=4, seq=4096, options=dict(causal=True)),
    "gptoss": dict(head_dim=64, heads=8, kv_heads=1, seq=4096, options=dict(causal=True, window_size=(128, 0))),
    "softcap": dict(head_dim=128, heads=4, kv_heads=4, seq=4096, options=dict(causal=True, softcap=50.0)),
    "softcap64": dict(head_dim=64, heads=4, kv_heads=4, seq=4096, options=dict(causal=True, softcap=50.0)),
    "softcap256": dict(head_dim=256, heads=4, kv_heads=4, seq=4096, options=dict(causal=True, softcap=50.0)),
    # Eight packed causal sequences (segment ids).
    "packed": dict(head_dim=128, heads=4, kv_heads=4, seq=4096, options=dict(causal=True), segments=8),
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def step_loops(sass: str):
  """[(start, end, body)] of the loops that branch back over an HGMMA."""
  instructions, labels, pending = [], {}, []
  for line in sass.splitlines():
    if label := _LABEL.match(line):
      pending.append(label.group(1))
    elif found := _INSTRUCTION.search(line):
      address = int(found.group(1), 16)
      labels.update((name, address) for name in pending)
      pending = []
      instructions.append((address, found.group(2)))
  loops = []
  for end, text in instructions:
    branch = re.search(r"BRA `\((\.L_x_\d+)\)", text)
    start = labels.get(branch.group(1)) if branch else None
    if start is None or start >= end:
      continue
    body = [x for a, x in instructions if start <= a <= end]
    if any("HGMMA" in x for x in body) and not any("EXIT" in x for x in body):
      loops.append((start, end, body))
  return loops


def report(sass: str) -> str:
  lines = []
  for start, end, body in step_loops(sass):
    ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", x).split(" ")[0].split(".")[0] for x in body)
    lines.append(f"loop {start:#x}-{end:#x}: {len(body)} instr; HGMMA {ops['HGMMA']} MUFU {ops['MUFU']} "
                 f"LDL {ops['LDL']} STL {ops['STL']}; "
                 + " ".join(f"{k}:{v}" for k, v in ops.most_common(18)))
  return "\n".join(lines)


def _forward_config(case: dict, fields: list[str]):
  """The case's default Mosaic forward config with FIELD=VALUE overrides
  (ints, or true/false), or None without any."""
  if not fields:
    return None
  import dataclasses

  from jax_flash2 import defaults

  config = defaults.mosaic_forward(case["head_dim"], seq_q=case["seq"], causal=bool(case["options"].get("causal")),
                                   segments=bool(case.get("segments")))
  values = {}
  for field in fields:
    name, value = field.split("=")
    values[name] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
  return dataclasses.replace(config, **values)


def main(argv: list[str]) -> int:
  if argv[:1] == ["--sass"]:
    print(report(pathlib.Path(argv[1]).read_text()))
    return 0
  import argparse

  import jax
  import jax.numpy as jnp

  import mosaic_cpu_compile
  from jax_flash2 import MosaicConfig, flash_attention

  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("cases", nargs="+", choices=list(CASES))
  ap.add_argument("--forward", nargs="*", default=[], metavar="FIELD=VALUE",
                  help="MosaicForwardConfig fields over the case's default (e.g. consumers=3 block_q=192)")
  args = ap.parse_args(argv)
  compile_fn = mosaic_cpu_compile.setup_compiler()
  mosaic_cpu_compile.on_hopper()
  out = pathlib.Path(args.out)
  for name in args.cases:
    case = CASES[name]
    q = jax.ShapeDtypeStruct((1, case["seq"], case["heads"], case["head_dim"]), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, case["seq"], case["kv_heads"], case["head_dim"]), jnp.bfloat16)
    forward = _forward_config(case, args.forward)
    if forward is not None:
      print(f"== {name} forward {forward}")

    def loss(q, k, v, case=case, forward=forward):
      options = dict(case["options"])
      if segments := case.get("segments"):
        ids = jnp.repeat(jnp.arange(segments, dtype=jnp.int32), case["seq"] // segments)[None]
        options.update(q_segment_ids=ids, kv_segment_ids=ids)
      if forward is not None:
        options.update(mosaic_config=MosaicConfig(forward=forward))
      return flash_attention(q, k, v, backend="mosaic", **options).astype(jnp.float32).sum()

    mosaic_cpu_compile.compile_kernels(compile_fn, jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv), out / name, name)
    for sass in sorted((out / name).rglob("*.sass_ctrl")):
      print(f"== {name} {sass.relative_to(out / name)}")
      print(report(sass.read_text()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
