"""tests/test_float32.py's cases over several input seeds: each array's
error against float64 divided by the plain float32 math's (the test's bar:
2 for out and lse, 3 for gradients), to see how far a case's ratio moves
with its inputs. Compiled kernels on a GPU, the interpreter elsewhere.
Lab equipment: not part of the product.

  PYTHONPATH=.:tests python lab/tools/float32_rule_seeds.py [--seeds 12]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import test_float32 as t
from conftest import reference_with_grads, rel_err

jax.config.update("jax_enable_x64", True)
NAMES = ("out", "lse", "dq", "dk", "dv")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=12)
  args = ap.parse_args()
  compiled = jax.default_backend() == "gpu"
  for case in t.CASES:
    worst = dict.fromkeys(NAMES, 0.0)
    for seed in range(args.seeds):
      q, k, v, dout, kernel, ref = t.problem(case, seed)
      got = t._kernel_grads(q, k, v, dout, compiled=compiled, **kernel)
      want = reference_with_grads(q, k, v, dout, **ref)
      plain = reference_with_grads(q, k, v, dout, dtype=jnp.float32, **ref)
      ratios = dict(zip(NAMES, (float(rel_err(x, w) / rel_err(p, w)) for x, w, p in zip(got, want, plain))))
      print(case, seed, " ".join(f"{n} {r:.2f}" for n, r in ratios.items()), flush=True)
      worst = {n: max(worst[n], ratios[n]) for n in NAMES}
    print(case, "worst", " ".join(f"{n} {r:.2f}" for n, r in worst.items()), flush=True)


if __name__ == "__main__":
  main()
