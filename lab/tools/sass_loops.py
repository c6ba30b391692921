"""The instruction mix of the Mosaic kernels' innermost loops, from sm_90a SASS
compiled on a machine without a GPU (lab/tools/mosaic_cpu_compile.py's set-up).

For each case, every forward and backward kernel of jax.grad of
flash_attention(..., backend="mosaic") is compiled; for each loop that holds
an HGMMA and no EXIT (a K/V or Q step), it prints the loop's instruction
count and its most frequent opcodes. A change to a kernel's step shows here
as instructions a step before any GPU times it (session 29: the span mask).

  JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python lab/tools/sass_loops.py OUT_DIR window causal gptoss packed softcap
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
    "gptoss": dict(head_dim=64, heads=8, kv_heads=1, seq=4096, options=dict(causal=True, window_size=(128, 0))),
    "softcap": dict(head_dim=128, heads=4, kv_heads=4, seq=4096, options=dict(causal=True, softcap=50.0)),
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
    lines.append(f"loop {start:#x}-{end:#x}: {len(body)} instr; HGMMA {ops['HGMMA']} MUFU {ops['MUFU']}; "
                 + " ".join(f"{k}:{v}" for k, v in ops.most_common(18)))
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  if argv[:1] == ["--sass"]:
    print(report(pathlib.Path(argv[1]).read_text()))
    return 0
  import jax
  import jax.numpy as jnp

  import mosaic_cpu_compile
  from jax_flash2 import flash_attention

  compile_fn = mosaic_cpu_compile.setup_compiler()
  mosaic_cpu_compile.on_hopper()
  out = pathlib.Path(argv[0])
  for name in argv[1:]:
    case = CASES[name]
    q = jax.ShapeDtypeStruct((1, case["seq"], case["heads"], case["head_dim"]), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, case["seq"], case["kv_heads"], case["head_dim"]), jnp.bfloat16)

    def loss(q, k, v, case=case):
      options = dict(case["options"])
      if segments := case.get("segments"):
        ids = jnp.repeat(jnp.arange(segments, dtype=jnp.int32), case["seq"] // segments)[None]
        options.update(q_segment_ids=ids, kv_segment_ids=ids)
      return flash_attention(q, k, v, backend="mosaic", **options).astype(jnp.float32).sum()

    mosaic_cpu_compile.compile_kernels(compile_fn, jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv), out / name, name)
    for sass in sorted((out / name).rglob("*.sass_ctrl")):
      print(f"== {name} {sass.relative_to(out / name)}")
      print(report(sass.read_text()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
