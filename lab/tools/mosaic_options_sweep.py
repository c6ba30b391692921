"""One-at-a-time changes to the Mosaic kernels' tiling on the option cases
whose speed targets miss (a causal window (1024, 0) and 8 packed causal
sequences at 16k, head_dim 128): forward+backward kernel time (profiler)
and wall clock per call, each variant against the defaults in the same run.

  PYTHONPATH=. python lab/tools/mosaic_options_sweep.py [--cases window packed ragged] [--seqlen 16384]
      [--variants default persistent=False ...] [--modes fwd fwd+bwd] [--check]

(ragged: 8 causal sequences of the varlen bench's lengths 1024, 3072, 512, 4096,
2560, 1536, 2048, 1536 as segment ids.)

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
import numpy as np

from ab_timing import cell, wall_and_kernel_ms
from jax_flash2 import MosaicConfig, defaults, flash_attention

FORWARD = {
    "block_kv=64": dict(block_kv=64),
    "stages=3": dict(stages=3),
    "block_kv=64 stages=4": dict(block_kv=64, stages=4),
    "balanced=False": dict(balanced=False),
    "persistent=False": dict(persistent=False, balanced=False),
    # One Q set leaves room for a third K/V slot at d128 (230,512 of 232,448
    # bytes by Mosaic's count, with no reduction scratch; session 28: the
    # window's first block waits for its K block).
    "persistent=False stages=3": dict(persistent=False, balanced=False, stages=3),
    "softmax_overlap=False": dict(softmax_overlap=False),
    # 192-row tiles: a tile's start and end shared by a third more rows. Only
    # 64-row K/V blocks keep three consumers at d128 free of spills (sm_90a,
    # session 31: 128-row blocks spill 760 B), and one CTA a tile, since two
    # 192-row Q buffers and the ring do not fit.
    "consumers=3 block_kv=64 stages=4": dict(consumers=3, block_q=192, block_kv=64, stages=4, persistent=False,
                                             balanced=False),
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
  ap.add_argument("--variants", nargs="*", default=None, help="names to run (default: all)")
  ap.add_argument("--modes", nargs="*", default=["fwd+bwd"], choices=["fwd", "fwd+bwd"])
  ap.add_argument("--check", action="store_true", help="compare each variant's out and gradients to the default's")
  args = ap.parse_args()
  s, h, d = args.seqlen, args.heads, 128
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys)

  def variants_of(segments: bool) -> list:
    """(name, forward, backward) from the product's defaults for the case:
    segment ids take one CTA a tile (defaults.mosaic_forward)."""
    fwd0 = defaults.mosaic_forward(d, seq_q=s, causal=True, segments=segments)
    bwd0 = defaults.mosaic_backward(d, fused=False, segments=segments)
    variants = [("default", fwd0, bwd0)]
    variants += [(name, dataclasses.replace(fwd0, **kw), bwd0) for name, kw in FORWARD.items()]
    variants += [(name, fwd0, dataclasses.replace(bwd0, **kw)) for name, kw in BACKWARD.items()]
    variants.append(("persistent=False all", dataclasses.replace(fwd0, persistent=False, balanced=False),
                     dataclasses.replace(bwd0, dq_persistent=False, dkv_persistent=False)))
    variants.append(("default again", fwd0, bwd0))
    if args.variants is not None:
      variants = [v for v in variants if v[0] in args.variants or v[0] == "default again"]
    return variants

  for case in args.cases:
    kw = dict(causal=True, backend="mosaic")
    if case == "causal":
      pass
    elif case == "window":
      kw["window_size"] = (1024, 0)
    elif case == "packed":
      ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), s // 8)[None]
      kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    elif case == "ragged":
      lengths = [1024, 3072, 512, 4096, 2560, 1536, 2048, 1536]
      ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), jnp.asarray(lengths), total_repeat_length=s)[None]
      kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    print(f"== {case}: s{s} h{h} d{d} causal {kw.get('window_size', '')}", flush=True)
    base = {}
    reference = {}
    for name, fwd, bwd in variants_of("q_segment_ids" in kw):
      config = MosaicConfig(forward=fwd, backward=bwd)

      def f_fwd(q, k, v, do, config=config):
        return flash_attention(q, k, v, mosaic_config=config, **kw)

      def f_both(q, k, v, do, config=config):
        out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, mosaic_config=config, **kw), q, k, v)
        return (out, *pull(do))

      cells = []
      for mode in args.modes:
        f = f_fwd if mode == "fwd" else f_both
        try:
          wall, kern = wall_and_kernel_ms(f, q, k, v, do)
        except Exception as e:  # a tiling that does not fit: say so, go on
          cells.append(f"{mode} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
          continue
        cells.append(cell(mode, wall, kern, base))
      if args.check:  # a tiling changes no result: each variant's against the default's, bitwise
        got = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(f_both)(q, k, v, do)]
        first = reference.setdefault(case, got)
        cells.append("max |diff| out/dq/dk/dv " + " ".join(f"{np.abs(a - b).max():.1e}" for a, b in zip(got, first)))
      print(f"  {name:30s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
  main()
