"""tests/test_float32.py's cases over several input seeds on the GPU: each
array's error against float64 divided by the plain float32 math's (the
test's bar: 2 for out and lse, 3 for gradients), to see how far a case's
ratio moves with its inputs. Lab equipment: not part of the product.

  PYTHONPATH=.:tests python lab/tools/float32_rule_seeds.py [--seeds 12]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import test_float32 as t
from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import dropout

jax.config.update("jax_enable_x64", True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=12)
  args = ap.parse_args()
  for case, ((batch, seq_q, seq_k, heads, kv_heads, head_dim), options) in t.CASES.items():
    kernel, ref = {}, {}
    for name in ("causal", "softcap"):
      if name in options:
        kernel[name] = ref[name] = options[name]
    if "window_size" in options:
      kernel["window_size"] = ref["window"] = options["window_size"]
    if options.get("dropout_rate"):
      kernel.update(dropout_rate=options["dropout_rate"], dropout_rng=t.RNG)
      ref["dropout"] = (options["dropout_rate"], dropout.seed_words(t.RNG), False)
    if options.get("alibi"):
      kernel["alibi_slopes"] = ref["alibi_slopes"] = 2.0 ** -jnp.arange(1, heads + 1, dtype=jnp.float32)
    worst = {}
    for seed in range(args.seeds):
      q, k, v, dout = random_inputs(seed, batch, seq_q, seq_k, heads, head_dim, jnp.float32)
      k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
      got = t._kernel_grads(q, k, v, dout, compiled=jax.default_backend() == "gpu", **kernel)
      want = reference_with_grads(q, k, v, dout, **ref)
      plain = reference_with_grads(q, k, v, dout, dtype=jnp.float32, **ref)
      ratios = [float(rel_err(x, w) / rel_err(p, w)) for x, w, p in zip(got, want, plain)]
      print(case, seed, " ".join(f"{n} {r:.2f}" for n, r in zip(("out", "lse", "dq", "dk", "dv"), ratios)), flush=True)
      for n, r in zip(("out", "lse", "dq", "dk", "dv"), ratios):
        worst[n] = max(worst.get(n, 0.0), r)
    print(case, "worst", " ".join(f"{n} {r:.2f}" for n, r in worst.items()), flush=True)


if __name__ == "__main__":
  main()
