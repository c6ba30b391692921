"""What a softcap costs the Mosaic kernels, and what cuts it: kernel time of
the forward and forward+backward with and without a softcap, under variants
of its tanh and the forward's exp2, each in the same run, with each
variant's error against a float32 reference at a small size.

  PYTHONPATH=. python lab/tools/softcap_ab.py [--seqlen 16384] [--head-dims 128 64]

Variants (lab equipment, not product switches), patched into the kernel
modules' `jnp` at trace time:
  product    tanh.approx.f32, the scores taken to base 2 before the row max
  tanh_f16   tanh.approx.f16x2: two scores a MUFU op (the rounding of the
             tanh input to float16 is ~2^-11 relative, tanh.approx.f32's own
             error ~2^-11)
  tanh_bf16  tanh.approx.bf16x2 (speed only: 2^-8 relative is coarse)
  poly16, poly32
             the forward's P tiles take exp2 of their last 16 / 32 columns
             as a cubic on the FP32 units (FlashAttention-4's trick; the
             `poly_columns` of commit dd6dc3a, which lost on plain attention
             where the MUFU is not the bound): under a softcap it is, so
             moving a quarter of the exponentials off it may pay here

Measured 2026-12-04 on the H200 (lab/results/2026-12-04_s24/), d128 16k
causal, kernel time over no softcap: folding tanh's softcap * log2(e) into
the exponential's FFMA with the row max taken on tanh
(lab/patches/softcap_unit_fold.diff, then the product) +35.5% fwd / +17.1%
fwd+bwd: not taken (lab/variants.md). The rows patched in after it that day
(unfolded, tanh_f16, tanh_bf16) may have run a cached trace of an earlier
variant: `variant` now clears jax's caches; rerun them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ab_timing import cell, wall_and_kernel_ms
from jax_flash2 import flash_attention, reference
from jax_flash2.mosaic import common
from jax_flash2.mosaic import forward as mosaic_forward

SOFTCAP = 30.0

# 2^f ~ 1 + f (C1 + f (C2 + f C3)) on [-1/2, 1/2], relative error ~1e-4
# (fitted in session 9, commit dd6dc3a's jax_flash2/mosaic/poly_exp2.py).
_C1, _C2, _C3 = 0.69328288, 0.24221021, 0.05500862
_ROUND = 1.5 * 2.0**23 + 127  # x + _ROUND holds j + 127 in its low mantissa bits


def poly_exp2(x):
  """2^x of float32 x <= ~1 on the FP32 units: 2^round(x) from the float
  addition's rounding shifted into the exponent field, times a cubic of the
  rest; -inf (clamped to -127) gives +0.0, as ex2 does."""
  x = jnp.maximum(x, -127.0)
  t = jax.lax.optimization_barrier(x + _ROUND)  # the interpreter's XLA must not fold (x + R) - R
  f = x - (t - _ROUND)
  two_j = jax.lax.bitcast_convert_type(
      jax.lax.shift_left(jax.lax.bitcast_convert_type(t, jnp.int32), jnp.int32(23)), jnp.float32)
  return two_j * (1.0 + f * (_C1 + f * (_C2 + f * _C3)))


class _Jnp:
  """A stand-in for a kernel module's `jnp`: tanh taken in `tanh_dtype`
  (None: as it is), and exp2 of a [rows, columns] tile with its last
  `poly_columns` columns on the FP32 units (`poly_exp2`)."""

  def __init__(self, tanh_dtype=None, poly_columns=0):
    self.tanh_dtype, self.poly_columns = tanh_dtype, poly_columns

  def __getattr__(self, name):
    return getattr(jnp, name)

  def tanh(self, x):
    return jnp.tanh(x) if self.tanh_dtype is None else jnp.tanh(x.astype(self.tanh_dtype)).astype(x.dtype)

  def exp2(self, x):
    if x.ndim != 2 or not self.poly_columns:
      return jnp.exp2(x)  # alpha, the row vectors
    split = x.shape[1] - self.poly_columns
    return jnp.concatenate([jnp.exp2(x[:, :split]), poly_exp2(x[:, split:])], axis=1)


# name: (tanh's dtype in Scores.log2, the forward's P columns on the FP32 units)
VARIANTS = {"product": (None, 0), "tanh_f16": (jnp.float16, 0), "tanh_bf16": (jnp.bfloat16, 0),
            "poly16": (None, 16), "poly32": (None, 32)}


@contextlib.contextmanager
def variant(name):
  """The variant patched in, jax's caches cleared on the way in and out: a
  trace cached under another variant would otherwise serve (the kernels sit
  under a jit whose static argument, the call, is the same for all)."""
  tanh_dtype, poly_columns = VARIANTS[name]
  jax.clear_caches()
  common.jnp, mosaic_forward.jnp = _Jnp(tanh_dtype=tanh_dtype), _Jnp(poly_columns=poly_columns)
  try:
    yield
  finally:
    common.jnp = mosaic_forward.jnp = jnp
    jax.clear_caches()


def _inputs(b, s, h, kvh, d, seed):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[1:3])
  do = jax.random.normal(keys[3], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v, do


INTERPRET = False  # --interpret: a CPU smoke test of the variants' errors, no timing


def _fns(softcap, window):
  kw = dict(causal=True, softcap=softcap, window_size=window, backend="mosaic", interpret=INTERPRET)

  def fwd(q, k, v, do):
    return flash_attention(q, k, v, **kw)

  def fwd_bwd(q, k, v, do):
    out, pull = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v)
    return (out, *pull(do))

  return fwd, fwd_bwd


def _errors(name, d):
  """Relative errors of out, dq, dk, dv against float32, and plain bf16's
  (2 x 2048 tokens, 4 heads; the same inputs for every variant)."""
  q, k, v, do = _inputs(2, 256 if INTERPRET else 2048, 4, 4, d, seed=7)
  with variant(name):
    got = jax.jit(_fns(SOFTCAP, None)[1])(q, k, v, do)

  def ref(dtype, q, k, v, do):
    def f(q, k, v):
      return reference.attention(q, k, v, causal=True, softcap=SOFTCAP, compute_dtype=dtype)[0]
    out, pull = jax.vjp(f, *(x.astype(dtype) for x in (q, k, v)))
    return (out, *pull(do.astype(dtype)))

  # Arguments, not closed-over constants: XLA would fold the reference's
  # products at compile time (minutes on the GPU machine's CPU).
  exact = jax.jit(functools.partial(ref, jnp.float32))(q, k, v, do)
  plain = jax.jit(functools.partial(ref, jnp.bfloat16))(q, k, v, do)

  def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  return [(rel(g, e), rel(p, e)) for g, e, p in zip(got, exact, plain)]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seqlen", type=int, default=16384)
  ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
  ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
  ap.add_argument("--interpret", action="store_true")
  args = ap.parse_args()
  global INTERPRET
  INTERPRET = args.interpret
  s = args.seqlen
  for d in args.head_dims:
    h = 2048 // d
    q, k, v, do = _inputs(1, s, h, h, d, seed=0)
    print(f"== d{d} h{h} s{s} causal, softcap {SOFTCAP}", flush=True)
    rows = [("none", None)] + [(n, SOFTCAP) for n in args.variants] + [("none again", None)]
    base = {}
    for name, cap in [] if INTERPRET else rows:
      fwd, fwd_bwd = _fns(cap, None)
      cells = []
      for what, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        with variant(name if cap else "product"):
          cells.append(cell(what, *wall_and_kernel_ms(fn, q, k, v, do, iters=7), base))
      print(f"  {name:11s} " + "   ".join(cells), flush=True)
    for name in args.variants:
      errs = _errors(name, d)
      print(f"  error {name:11s} " + "  ".join(f"{w}: {g:.2e} (plain {p:.2e}, {g / p:.2f}x)"
                                                 for w, (g, p) in zip(("out", "dq", "dk", "dv"), errs)), flush=True)


if __name__ == "__main__":
  main()
