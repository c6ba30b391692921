"""Persistent CTAs loading the next tile's outer rows before computing the
current tile, not after: an A/B on the short-loop cases of issue 27.

A persistent consumer (common.run_tiles, two buffers) issues the next tile's
rows (Q in the forward and dQ kernels, K/V in dK/dV) only once the current
tile's compute is done, so that the load's latency hides only behind the
store of the current tile's results. A tile of a window (1024, 0) or of a
packed 2k sequence runs about 9 K/V blocks at ~1.4 us each (d128), against a
load of ~1-2 us: up to ~10% of a tile may wait. Loading at the start of the
tile instead waits for the previous tile's stores to have read the other
buffer (issued just before; a shared-memory read) and hides the load behind
the whole tile. FlashAttention's `early_q` (commit dd6dc3a) did this in the
forward and measured noise on long causal tiles; short tiles are where it
should show.

The variant is run_tiles' own source with those lines moved, patched into
the kernel modules at trace time (lab equipment, not a product switch).

  PYTHONPATH=. python lab/tools/early_rows_ab.py [--cases window packed short causal] [--interpret]

Cases (d128, causal, bf16): a (1024, 0) window at 16k; 8 packed 2k sequences
at 16k on the paired persistent schedule (the defaults under segment ids are
one CTA a tile, which has no next tile); 8 separate 2k sequences; 16k plain
causal (the long-tile control). --interpret: the variant's forward and
backward in Mosaic's interpreter against the reference at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect

import jax
import jax.numpy as jnp

from jax_flash2 import MosaicConfig, defaults, flash_attention
from jax_flash2.mosaic import backward, backward_fused, backward_wide, common, forward

_MODULES = (forward, backward, backward_fused, backward_wide)
_PRODUCT = common.run_tiles
_LATE = """      buffer = lax.rem(i, jnp.int32(2))
      result = compute(tile, buffer, ring_base)
      # The next tile's rows go to the other buffer, which staged the
      # previous tile's results, issued a whole tile ago: their stores must
      # have read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(i + 1 < num_tiles)(lambda: load(next_tile, 1 - buffer))
      store(tile, buffer, result)
"""
_EARLY = """      buffer = lax.rem(i, jnp.int32(2))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(i + 1 < num_tiles)(lambda: load(next_tile, 1 - buffer))
      result = compute(tile, buffer, ring_base)
      store(tile, buffer, result)
"""


def _early_run_tiles():
  source = inspect.getsource(_PRODUCT)
  if _LATE not in source:
    raise RuntimeError("common.run_tiles changed: update early_rows_ab.py's patch")
  namespace = dict(vars(common))
  exec(compile(source.replace(_LATE, _EARLY), "<early run_tiles>", "exec"), namespace)
  return namespace["run_tiles"]


@contextlib.contextmanager
def early_rows(on: bool):
  """The variant (or the product) patched in, jax's caches cleared on the
  way in and out: a trace cached under the other would otherwise serve (the
  kernels sit under a jit whose static argument, the call, is the same)."""
  patched = _early_run_tiles() if on else _PRODUCT
  jax.clear_caches()
  for module in _MODULES:
    module.run_tiles = patched
  try:
    yield
  finally:
    for module in _MODULES:
      module.run_tiles = _PRODUCT
    jax.clear_caches()


def _case(name, s):
  kw = dict(causal=True, backend="mosaic")
  batch, seq = 1, s
  config = None
  if name == "window":
    kw["window_size"] = (1024, 0)
  elif name == "packed":
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), s // 8)[None]
    kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    fwd = dataclasses.replace(defaults.mosaic_forward(128, seq_q=s, causal=True), balanced=False)
    config = MosaicConfig(forward=fwd, backward=defaults.mosaic_backward(128, fused=False))
  elif name == "short":
    batch, seq = 8, s // 8
  return batch, seq, kw, config


def _interpret_check():
  import sys
  sys.path.insert(0, "tests")
  from conftest import assert_matches_reference, flash_with_grads, random_inputs, reference_with_grads
  from jax_flash2.config import MosaicBackwardConfig as B
  from jax_flash2.config import MosaicForwardConfig as F

  q, k, v, do = (x.astype(jnp.bfloat16) for x in random_inputs(0, 1, 384, 384, 2, 64))
  dlse = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 384), jnp.float32)
  config = MosaicConfig(forward=F(128, 64, 2, softmax_overlap=True, persistent=True),
                        backward=B(64, 64, 2, dq_persistent=True, dkv_persistent=True))
  for window in ((None, None), (100, 0)):
    with early_rows(True):
      got = flash_with_grads(q, k, v, do, dlse, backend="mosaic", interpret=True, causal=True, window_size=window,
                             mosaic_config=config)
    want = reference_with_grads(q, k, v, do, dlse, causal=True, window=window)
    assert_matches_reference(got, want, do, tol=1e-2)
    print("interpreter, window", window, "matches the reference", flush=True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", nargs="*", default=["window", "packed", "short"])
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--interpret", action="store_true")
  args = ap.parse_args()
  if args.interpret:
    _interpret_check()
    return
  from ab_timing import cell, wall_and_kernel_ms

  for name in args.cases:
    batch, seq, kw, config = _case(name, args.seqlen)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (batch, seq, 16, 128), jnp.float32).astype(jnp.bfloat16) for kk in keys)
    print(f"== {name}: batch {batch} seq {seq} d128 causal {kw.get('window_size', '')}", flush=True)
    base = {}
    for label, on in (("late (product)", False), ("early", True), ("late again", False)):
      cells = []
      for mode in ("fwd", "fwd+bwd"):
        def f(q, k, v, do, mode=mode):
          attend = lambda q, k, v: flash_attention(q, k, v, mosaic_config=config, **kw)
          if mode == "fwd":
            return attend(q, k, v)
          out, pull = jax.vjp(attend, q, k, v)
          return (out, *pull(do))

        with early_rows(on):
          cells.append(cell(mode, *wall_and_kernel_ms(f, q, k, v, do), base))
      print(f"  {label:15s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
  main()
