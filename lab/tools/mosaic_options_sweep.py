"""One-at-a-time changes to the Mosaic kernels' tiling on the option cases
whose speed targets miss (a causal window (1024, 0) and 8 packed causal
sequences at 16k, head_dim 128): forward+backward kernel time (profiler)
and wall clock per call, each variant against the defaults in the same run.

  PYTHONPATH=. python lab/tools/mosaic_options_sweep.py [--cases window packed] [--seqlen 16384]

The defaults (jax_flash2.defaults.mosaic_forward/backward) were tuned on
plain full and causal attention; a variant that wins here by more than the
run-to-run spread (repeat the default: it runs first and last) is a lead
for per-option defaults. Lab equipment: not part of the product.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jax_flash2 import MosaicConfig, defaults, flash_attention
from jax_flash2.bench import kernel_trace, timing

FORWARD = {
    "block_kv=64": dict(block_kv=64),
    "stages=3": dict(stages=3),
    "balanced=False": dict(balanced=False),
    "persistent=False": dict(persistent=False, balanced=False),
    "softmax_overlap=False": dict(softmax_overlap=False),
}
BACKWARD = {
    "bwd block_kv=128": dict(block_kv=128),
    "bwd stages=3": dict(stages=3),
    "bwd early_vectors": dict(early_vectors=True),
    "bwd dq_persistent=False": dict(dq_persistent=False),
    "bwd dkv_persistent=False": dict(dkv_persistent=False),
    "bwd dq_softmax_overlap=False": dict(dq_softmax_overlap=False),
}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", nargs="*", default=["window", "packed"])
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--heads", type=int, default=16)
  args = ap.parse_args()
  s, h, d = args.seqlen, args.heads, 128
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys)
  fwd0 = defaults.mosaic_forward(d, seq_q=s, causal=True)
  bwd0 = defaults.mosaic_backward(d, fused=False)
  variants = [("default", fwd0, bwd0)]
  variants += [(name, dataclasses.replace(fwd0, **kw), bwd0) for name, kw in FORWARD.items()]
  variants += [(name, fwd0, dataclasses.replace(bwd0, **kw)) for name, kw in BACKWARD.items()]
  variants.append(("default again", fwd0, bwd0))
  for case in args.cases:
    kw = dict(causal=True, backend="mosaic")
    if case == "window":
      kw["window_size"] = (1024, 0)
    elif case == "packed":
      ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), s // 8)[None]
      kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    print(f"== {case}: s{s} h{h} d{d} causal {kw.get('window_size', '')}", flush=True)
    base = None
    for name, fwd, bwd in variants:
      config = MosaicConfig(forward=fwd, backward=bwd)

      def f(q, k, v, do, config=config):
        out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, mosaic_config=config, **kw), q, k, v)
        return (out, *pull(do))

      try:
        fn = jax.jit(f)
        wall = timing.time_fn_ms(fn, q, k, v, do, warmup=2, iters=9)
        kern = kernel_trace.device_ms_per_call(lambda i: fn(q, k, v, do), 10)
      except Exception as e:  # a tiling that does not fit: say so, go on
        print(f"  {name:30s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        continue
      base = base or kern
      print(f"  {name:30s} wall {wall:7.3f} ms  kernel {kern:7.3f} ms  ({kern / base - 1:+.1%} kernel)", flush=True)


if __name__ == "__main__":
  main()
