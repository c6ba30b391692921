"""What attention sinks cost over the same problem without them, in one
process, alternating (none, sinks, none, sinks) so that drift shows (lab
equipment): issue 27 asks for at most 3%.

  PYTHONPATH=. python lab/tools/sinks_ab.py [--shapes d128 gptoss]

d128: batch 1 x 16k tokens, 16 heads, causal. gptoss: batch 4 x 4k tokens,
64 query heads over 8 K/V heads, d64, causal. bf16, backend="auto".
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_flash2 import flash_attention
from ab_timing import cell, wall_and_kernel_ms

SHAPES = {"d128": (1, 16384, 16, 16, 128), "gptoss": (4, 4096, 64, 8, 64)}


def _fns(with_sinks):
  def attend(q, k, v, sinks):
    return flash_attention(q, k, v, causal=True, sinks=sinks if with_sinks else None)

  def fwd(q, k, v, sinks, do):
    return attend(q, k, v, sinks)

  def fwd_bwd(q, k, v, sinks, do):
    out, pull = jax.vjp(attend, q, k, v, sinks)
    return (out, *pull(do))

  return fwd, fwd_bwd


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
  args = ap.parse_args()
  for name in args.shapes:
    b, s, h, kvh, d = SHAPES[name]
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[2:4])
    sinks = jnp.log(float(s)) + jax.random.normal(keys[4], (h,), jnp.float32)
    print(f"== {name}: batch {b} seq {s} heads {h}/{kvh} d{d} causal", flush=True)
    base = {}
    for label, with_sinks in (("none", False), ("sinks", True), ("none again", False), ("sinks again", True)):
      fwd, fwd_bwd = _fns(with_sinks)
      cells = [cell(mode, *wall_and_kernel_ms(fn, q, k, v, sinks, do, iters=15), base)
               for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd))]
      print(f"  {label:12s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
  main()
