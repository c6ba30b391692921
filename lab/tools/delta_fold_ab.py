"""The backward's delta folded into the dQ kernel (lab/patches/dq_delta_fold.diff)
against the product's small Triton delta kernel: forward+backward kernel
time and wall clock per call on the cases it should help (the window and
packed sequences, whose backwards are short), alternating the two in one
process, with the two variants' gradients compared.

Run it in a tree with the patch applied (lab/gpu_options_ab.sh deltafold
makes one):

  PYTHONPATH=. python lab/tools/delta_fold_ab.py [--cases window packed causal gptoss] [--rounds 3]
      [--interpret]  (CPU: the two variants' gradients at 512 tokens, no timing)

Prediction (lab/NOTES.md, session 26): the delta kernel is ~38 us at 16k
tokens x 16 heads x d128; the dQ kernel reads one more tile a Q tile (O)
under its score products. Window and packed fwd+bwd -2 to -3%, causal
-0.5%. Lab equipment: not part of the product.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from ab_timing import cell, wall_and_kernel_ms
from jax_flash2 import backends, flash_attention
from jax_flash2.mosaic import backward as mosaic_backward
from jax_flash2.triton import backward as triton_backward

if not hasattr(mosaic_backward, "backward_of_out"):
  raise SystemExit("apply lab/patches/dq_delta_fold.diff first (lab/gpu_options_ab.sh deltafold)")

FOLDED = backends.MosaicKernels.backward


def _triton_delta(self, q, k, v, out, lse, do, dlse, operands, problem, config, *, interpret):
  """The product's backward before the patch, for the two-kernel case: the
  Triton delta kernel, then dK/dV and dQ."""
  delta = triton_backward.backward_delta(out, do, dlse, problem, interpret=interpret)
  return mosaic_backward.backward(q, k, v, do, lse, delta, **backends._mosaic_options(operands, problem),
                                  config=config, interpret=interpret)


@contextlib.contextmanager
def variant(name: str):
  """`name` ("triton_delta" or "folded") patched into the Mosaic backend,
  jax's caches cleared on the way in and out (a cached trace of the other
  would serve)."""
  jax.clear_caches()
  backends.MosaicKernels.backward = _triton_delta if name == "triton_delta" else FOLDED
  try:
    yield
  finally:
    backends.MosaicKernels.backward = FOLDED
    jax.clear_caches()


def _case(name: str, s: int, interpret: bool):
  """(q, k, v, do, flash_attention keywords) of a case (interpret: an
  eighth of the heads and windows, in Mosaic's interpreter)."""
  d, h, kvh, kw = 128, 16, 16, dict(causal=True, backend="mosaic", interpret=interpret)
  if name == "window":
    kw["window_size"] = (128 if interpret else 1024, 0)
  elif name == "packed":
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), s // 8)[None]
    kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
  elif name == "gptoss":  # head_dim 64, 64 query heads over 8, window 128, sinks
    d, h, kvh = 64, 64, 8
    kw.update(window_size=(128, 0))
  elif name != "causal":
    raise ValueError(name)
  if interpret:
    h, kvh = h // 8, kvh // 8
  if name == "gptoss":
    kw["sinks"] = jnp.linspace(-1.0, 2.0, h, dtype=jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, do = (jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[:2])
  k, v = (jax.random.normal(kk, (1, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[2:])
  return q, k, v, do, kw


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", nargs="*", default=["window", "packed", "causal"],
                  choices=["window", "packed", "causal", "gptoss"])
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--interpret", action="store_true")
  args = ap.parse_args()
  seqlen = 512 if args.interpret else args.seqlen
  for case in args.cases:
    q, k, v, do, kw = _case(case, seqlen, args.interpret)

    def fwd_bwd(q, k, v, do):
      out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v)
      return (out, *pull(do))

    print(f"== {case}: q{q.shape} k{k.shape} {', '.join(sorted(kw))}", flush=True)
    base, grads, kernel_ms = {}, {}, {"triton_delta": [], "folded": []}
    for _ in range(args.rounds):
      for name in kernel_ms:
        with variant(name):
          if not args.interpret:
            wall, kernel = wall_and_kernel_ms(fwd_bwd, q, k, v, do, iters=7)
            kernel_ms[name].append(kernel)
            print(f"  {name:12s} " + cell("fwd+bwd", wall, kernel, base), flush=True)
          grads.setdefault(name, jax.jit(fwd_bwd)(q, k, v, do))
    if not args.interpret:
      # Rounds alternate, so drift hits both; the spread of each is the noise to beat.
      (a, b) = (np.asarray(kernel_ms[n]) for n in ("triton_delta", "folded"))
      print(f"  kernel ms median: triton_delta {np.median(a):.3f} (spread {np.ptp(a) / np.median(a):.1%}), "
            f"folded {np.median(b):.3f} (spread {np.ptp(b) / np.median(b):.1%}): folded "
            f"{np.median(b) / np.median(a) - 1:+.1%}", flush=True)
    for what, a, b in zip(("out", "dq", "dk", "dv"), grads["triton_delta"], grads["folded"]):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      print(f"  {what}: folded vs triton_delta rel diff {np.linalg.norm(a - b) / np.linalg.norm(a):.2e}", flush=True)


if __name__ == "__main__":
  main()
