"""Random option combinations of flash_attention against a float64 oracle.

Each case draws a small problem (batch 1-2, seq <= 192, heads <= 4) and,
independently, the options a backend serves: causal, window_size, softcap,
ALiBi slopes, sinks, segment ids (sorted packings, ids only in q, unsorted),
GQA, ragged seq_q / seq_k, head_dim, dtype, softmax_scale, the tiling
(block_sizes on Triton, mosaic_config on Mosaic: small tiles make the
kernels loop over many blocks and skip some), and on Triton a bias and a
dense mask. It runs flash_attention(..., backend=B,
interpret=True, return_lse=True) and its vjp with random cotangents on out
and lse, and compares out, lse, dq, dk, dv (dsinks, dbias where present)
with a plain-jnp float64 attention written here from the docstrings of
jax_flash2.api (not jax_flash2.reference: the oracle must not share the
library's code).

  PYTHONPATH=. python lab/tools/fuzz_options.py [--seed 0] [--cases 30]
      [--backends triton mosaic] [--mosaic-cases 8] [--only 3 17]
      [--case-timeout 600] [--show]

Case i of a seed draws from its own generator (seed, backend, i), so
`--only i` reruns one case exactly; --show prints its options as Python.
Statuses: ok; rejected (jax_flash2.plan refuses the combination with a
ValueError/TypeError: fine); rejected-late (plan() accepted it, the call
refuses it with a ValueError/TypeError from one of the library's check_*
functions (check_smem, check_config), e.g. a Mosaic tiling over shared
memory); MISMATCH (an array errs beyond the dtype's
tolerance, or a -inf / zero row misplaced); NAN (a NaN or inf where the
oracle has a finite value); ERROR (an exception once the plan accepted the
call); TIMEOUT. Errors are max |got - want| over the oracle's max |want|
per array (gradients with a floor of 0.1 max |cotangent|, for gradients
that vanish exactly). A 16-bit array over its tolerance still passes
(the note says why) within 2x (out, lse) / 3x (gradients) the error of the
same math done plainly in that dtype (FlashAttention's test rule), or, for
a gradient, within tolerance of the exact gradient given the kernel's own
rounded out (FlashAttention-2 takes delta = rowsum(dO * out) from it, which
cancels badly where a row's P is nearly one-hot). Lab equipment: not part
of the product.

Environment (CPU): JAX_PLATFORMS=cpu JAX_ENABLE_X64=1 OPENBLAS_NUM_THREADS=1,
XLA_FLAGS with --xla_backend_optimization_level=0 as in tests/conftest.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import sys
import time
import traceback
import zlib

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import jax_flash2  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
SEQS = (1, 7, 16, 33, 64, 65, 100, 128, 130, 192)


# ---------------------------------------------------------------- drawing a case


@dataclasses.dataclass
class Case:
  index: int
  backend: str
  dtype: str
  batch: int
  seq_q: int
  seq_k: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  window: tuple | None = None
  softcap: float | None = None
  alibi: str | None = None  # "h" ([heads]) or "bh" ([batch, heads])
  sinks: str | None = None  # the sinks' dtype
  segments: str | None = None  # "same", "indep", "qonly", "unsorted", "padk"
  bias: tuple | None = None  # (shape kind, dtype)
  mask: tuple | None = None  # (shape kind, dtype)
  softmax_scale: float | None = None
  input_scale: float = 1.0
  blocks: tuple | None = None  # Triton: ((block_q, block_k) of fwd, dkv, dq)
  mosaic: tuple | None = None  # Mosaic: (MosaicForwardConfig or None, MosaicBackwardConfig or None)

  def describe(self) -> str:
    parts = [self.backend, self.dtype, f"b{self.batch}", f"sq{self.seq_q}", f"sk{self.seq_k}",
             f"h{self.heads}/{self.kv_heads}", f"d{self.head_dim}"]
    if self.causal:
      parts.append("causal")
    if self.window is not None:
      parts.append(f"win={self.window}")
    if self.softcap is not None:
      parts.append(f"softcap={self.softcap:g}")
    if self.alibi:
      parts.append(f"alibi[{self.alibi}]")
    if self.sinks:
      parts.append(f"sinks({self.sinks})")
    if self.segments:
      parts.append(f"seg({self.segments})")
    if self.bias:
      parts.append(f"bias[{self.bias[0]},{self.bias[1]}]")
    if self.mask:
      parts.append(f"mask[{self.mask[0]},{self.mask[1]}]")
    if self.softmax_scale is not None:
      parts.append(f"scale={self.softmax_scale:.3g}")
    if self.input_scale != 1.0:
      parts.append(f"x{self.input_scale:g}")
    if self.blocks:
      parts.append("blocks=" + ",".join(f"{a}x{b}" for a, b in self.blocks))
    if self.mosaic:
      f, b = self.mosaic
      short = lambda c: "-" if c is None else ",".join(
          f"{x.name}={getattr(c, x.name)}" for x in dataclasses.fields(c) if getattr(c, x.name) != x.default)
      parts.append(f"mfwd[{short(f)}] mbwd[{short(b)}]")
    return " ".join(parts)


def _pick(rng, options, p=None):
  return options[rng.choice(len(options), p=p)]


def draw_case(seed: int, backend: str, index: int) -> Case:
  rng = np.random.default_rng([seed, zlib.crc32(backend.encode()), index])
  mosaic = backend == "mosaic"
  if mosaic:
    dtype = _pick(rng, ("bfloat16", "float16"))
    head_dim = _pick(rng, (64, 128, 256), p=(0.6, 0.3, 0.1))
  else:
    dtype = _pick(rng, ("float32", "bfloat16", "float16"), p=(0.35, 0.35, 0.3))
    head_dim = _pick(rng, (64, 128, 96, 256), p=(0.55, 0.3, 0.1, 0.05))
  heads = _pick(rng, (1, 2, 4), p=(0.2, 0.4, 0.4))
  kv_heads = _pick(rng, [d for d in (1, 2, 4) if heads % d == 0])
  seq_q = _pick(rng, SEQS)
  seq_k = seq_q if rng.random() < 0.25 else _pick(rng, SEQS)
  case = Case(index, backend, dtype, int(rng.integers(1, 3)), seq_q, seq_k, heads, kv_heads, head_dim)
  case.causal = bool(rng.random() < 0.4)
  if rng.random() < 0.35:
    case.window = (_pick(rng, (None, 0, 1, 5, 17, 64)), _pick(rng, (None, 0, 1, 9, 40)))
  if rng.random() < 0.25:
    case.softcap = float(_pick(rng, (1.0, 5.0, 30.0)))
  if rng.random() < 0.25:
    case.alibi = _pick(rng, ("h", "bh"))
  if rng.random() < 0.3:
    case.sinks = _pick(rng, ("float32", "bfloat16", dtype))
  if rng.random() < 0.3:
    case.segments = _pick(rng, ("same", "indep", "qonly", "unsorted", "padk"))
  if not mosaic:  # a bias and a dense mask send Mosaic's passes to Triton anyway
    if rng.random() < 0.15:
      case.bias = (_pick(rng, ("bhqk", "1hqk", "b1qk", "qk", "k")), _pick(rng, ("float32", dtype)))
    if rng.random() < 0.12:
      case.mask = (_pick(rng, ("qk", "b1qk", "1hqk")), _pick(rng, ("bool", "int32", "float32")))
  if rng.random() < 0.15:
    case.softmax_scale = float(rng.uniform(0.03, 0.3))
  if rng.random() < 0.3:
    case.input_scale = float(_pick(rng, (2.0, 3.0)))
  # Drawn last, so that the draws above stay those of earlier versions.
  if not mosaic and rng.random() < 0.5:
    case.blocks = tuple((int(_pick(rng, (16, 32, 64, 128))), int(_pick(rng, (16, 32, 64, 128)))) for _ in range(3))
  if mosaic and rng.random() < 0.5:
    forward = backward = None
    if rng.random() < 0.7:
      consumers = int(_pick(rng, (2, 3), p=(0.75, 0.25)))
      persistent = bool(rng.random() < 0.5)
      forward = jax_flash2.MosaicForwardConfig(
          block_q=int(consumers * 64 * _pick(rng, (1, 2))), block_kv=int(_pick(rng, (64, 128, 256))),
          stages=int(rng.integers(2, 5)), softmax_overlap=bool(rng.random() < 0.5), persistent=persistent,
          balanced=persistent and bool(rng.random() < 0.5), consumers=consumers)
    if rng.random() < 0.7:
      fused = bool(rng.random() < 0.3)
      backward = jax_flash2.MosaicBackwardConfig(
          block_q=64 if fused else int(_pick(rng, (64, 128))), block_kv=int(_pick(rng, (64, 128))),
          stages=int(rng.integers(2, 5)), dq_softmax_overlap=bool(rng.random() < 0.5),
          dq_persistent=bool(rng.random() < 0.5), dkv_persistent=bool(rng.random() < 0.5), fused_dq=fused,
          early_vectors=bool(rng.random() < 0.5))
    if forward or backward:
      case.mosaic = (forward, backward)
  if not mosaic and rng.random() < 0.08:
    case.head_dim = int(_pick(rng, (8, 40, 72)))
  return case


def _segment_ids(rng, kind: str, batch: int, seq_q: int, seq_k: int):
  """(q ids, kv ids) int32 [batch, seq]."""

  def packed(n, pieces, base=0):
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(pieces - 1, n - 1), replace=False)) if n > 1 else []
    ids = np.zeros(n, np.int64)
    for c in cuts:
      ids[c:] += 1
    return ids + base

  qs, ks = [], []
  for _ in range(batch):
    pieces = int(rng.integers(1, 4))
    if kind == "same" and seq_q == seq_k:
      a = packed(seq_q, pieces)
      b = a.copy()
    elif kind in ("same", "indep"):
      a, b = packed(seq_q, pieces), packed(seq_k, pieces)
    elif kind == "qonly":  # a segment of q no key belongs to: its rows see nothing
      a, b = packed(seq_q, pieces), packed(seq_k, pieces)
      start = int(rng.integers(0, seq_q))
      a[start:start + max(1, seq_q // 4)] = 7
    elif kind == "unsorted":
      a, b = rng.integers(0, 3, seq_q), rng.integers(0, 3, seq_k)
    else:  # "padk": packed, the trailing keys padding (-1)
      a, b = packed(seq_q, pieces), packed(seq_k, pieces)
      b[seq_k - int(rng.integers(0, max(1, seq_k // 3) + 1)):] = -1
    qs.append(a)
    ks.append(b)
  return jnp.asarray(np.stack(qs), jnp.int32), jnp.asarray(np.stack(ks), jnp.int32)


def _per_score_shape(kind: str, b: int, h: int, sq: int, sk: int) -> tuple:
  return {"bhqk": (b, h, sq, sk), "1hqk": (1, h, sq, sk), "b1qk": (b, 1, sq, sk), "qk": (sq, sk), "k": (sk,)}[kind]


def build_inputs(case: Case, seed: int):
  """(q, k, v, do, dlse, options): options are flash_attention's keyword
  arguments for the case (arrays included)."""
  rng = np.random.default_rng([seed, zlib.crc32(case.backend.encode()), case.index, 1])
  dt = jnp.dtype(case.dtype)
  b, sq, sk, h, hk, d = case.batch, case.seq_q, case.seq_k, case.heads, case.kv_heads, case.head_dim
  normal = lambda *shape: rng.standard_normal(shape)
  q = jnp.asarray(normal(b, sq, h, d) * case.input_scale).astype(dt)
  k = jnp.asarray(normal(b, sk, hk, d) * case.input_scale).astype(dt)
  v = jnp.asarray(normal(b, sk, hk, d)).astype(dt)
  do = jnp.asarray(normal(b, sq, h, d)).astype(dt)
  dlse = jnp.asarray(normal(b, h, sq), jnp.float32)
  options = {}
  if case.causal:
    options["causal"] = True
  if case.window is not None:
    options["window_size"] = case.window
  if case.softcap is not None:
    options["softcap"] = case.softcap
  if case.alibi:
    shape = (h,) if case.alibi == "h" else (b, h)
    options["alibi_slopes"] = jnp.asarray(rng.uniform(0.0, 0.5, shape), jnp.float32)
  if case.sinks:
    options["sinks"] = jnp.asarray(rng.normal(0.5, 2.0, (h,))).astype(case.sinks)
  if case.segments:
    options["q_segment_ids"], options["kv_segment_ids"] = _segment_ids(rng, case.segments, b, sq, sk)
  if case.bias:
    options["bias"] = jnp.asarray(rng.normal(0.0, 1.0, _per_score_shape(case.bias[0], b, h, sq, sk))).astype(
        case.bias[1])
  if case.mask:
    visible = rng.random(_per_score_shape(case.mask[0], b, h, sq, sk)) < 0.7
    visible[..., int(rng.integers(0, sq)), :] = False  # a row that sees nothing
    options["mask"] = jnp.asarray(visible).astype(case.mask[1])
  if case.softmax_scale is not None:
    options["softmax_scale"] = case.softmax_scale
  if case.blocks:
    options["block_sizes"] = jax_flash2.BlockSizes(*(jax_flash2.KernelConfig(a, b) for a, b in case.blocks))
  if case.mosaic:
    options["mosaic_config"] = jax_flash2.MosaicConfig(*case.mosaic)
  return q, k, v, do, dlse, options


# ---------------------------------------------------------------- the oracle


def oracle(q, k, v, sinks, bias, *, static, arrays, dtype=jnp.float64):
  """(out, lse) of exact softmax attention with every operation in `dtype`
  (float64: the oracle; the inputs' own dtype: the "plain" baseline of what
  that precision gives done naively), as api.flash_attention's docstring
  defines it. sinks and bias are differentiable (None if absent)."""
  opts = dict(static)
  b, sq, h, d = q.shape
  sk, hk = k.shape[1], k.shape[2]
  f = dtype
  q, k, v = (x.astype(f) for x in (q, k, v))
  k, v = (jnp.repeat(x, h // hk, axis=2) for x in (k, v))  # head i reads kv head i // group
  scale = opts.get("softmax_scale") or 1.0 / np.sqrt(d)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  if opts.get("softcap") is not None:
    c = opts["softcap"]
    s = c * jnp.tanh(s / c)
  i = np.arange(sq)[:, None]
  j = np.arange(sk)[None, :]
  offset = sk - sq
  if "alibi_slopes" in arrays:
    slopes = jnp.reshape(arrays["alibi_slopes"].astype(f), (-1, h))[:, :, None, None]
    s = s - slopes * jnp.asarray(np.abs(i + offset - j), f)
  if bias is not None:
    s = s + bias.astype(f)  # broadcasts right-aligned, as the docstring's [batch, heads, seq_q, seq_k]
  visible = np.ones((sq, sk), bool)
  left, right = opts.get("window_size") or (None, None)
  if opts.get("causal"):
    right = 0 if right is None else min(right, 0)
  if right is not None:
    visible &= j <= i + offset + right
  if left is not None:
    visible &= j >= i + offset - left
  vis = jnp.broadcast_to(jnp.asarray(visible), s.shape)
  if "mask" in arrays:
    m = arrays["mask"]
    vis = vis & jnp.broadcast_to((m != 0).reshape((1,) * (4 - m.ndim) + m.shape), s.shape)
  if "q_segment_ids" in arrays:
    vis = vis & (arrays["q_segment_ids"][:, None, :, None] == arrays["kv_segment_ids"][:, None, None, :])
  s = jnp.where(vis, s, -jnp.inf)
  row_max = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(f)[None, :, None, None], row_max.shape)
    row_max = jnp.maximum(row_max, sink)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, jnp.zeros((), f)))
  p = jnp.where(vis, jnp.exp(s - row_max), jnp.zeros((), f))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  seen = denom > 0
  safe = jnp.where(seen, denom, jnp.ones((), f))
  out = jnp.einsum("bhqk,bkhd->bqhd", p / safe, v, precision="highest")
  lse = jnp.where(seen, row_max + jnp.log(safe), -jnp.inf)[..., 0]
  return out, lse.astype(jnp.float32 if f != jnp.float64 else f)


# ---------------------------------------------------------------- running a case


def _split(options):
  arrays = {n: x for n, x in options.items() if isinstance(x, jax.Array)}
  static = tuple(sorted((n, x) for n, x in options.items() if n not in arrays))
  return arrays, static


def run_flash(q, k, v, do, dlse, options, backend):
  """out, lse, dq, dk, dv[, dsinks][, dbias] of flash_attention, one jitted program."""
  arrays, static = _split(options)
  sinks, bias = arrays.pop("sinks", None), arrays.pop("bias", None)

  @jax.jit
  def program(q, k, v, do, dlse, arrays, sinks, bias):
    def f(q, k, v, sinks, bias):
      extra = {}
      if sinks is not None:
        extra["sinks"] = sinks
      if bias is not None:
        extra["bias"] = bias
      return jax_flash2.flash_attention(q, k, v, **arrays, **extra, **dict(static), return_lse=True,
                                        backend=backend, interpret=True)

    (out, lse), vjp = jax.vjp(f, q, k, v, sinks, bias)
    return (out, lse, *vjp((do, dlse)))

  return program(q, k, v, do, dlse, arrays, sinks, bias)


def run_oracle(q, k, v, do, dlse, options, dtype=jnp.float64):
  """The oracle's out, lse and gradients; dtype float64, or q's own for the
  plain baseline (the inputs then stay in their dtypes)."""
  arrays, static = _split(options)
  sinks, bias = arrays.pop("sinks", None), arrays.pop("bias", None)
  plain = jnp.dtype(dtype) != jnp.float64

  @jax.jit
  def program(q, k, v, do, dlse, arrays, sinks, bias):
    f = lambda q, k, v, sinks, bias: oracle(q, k, v, sinks, bias, static=static, arrays=arrays, dtype=dtype)
    up = lambda x: None if x is None or plain else x.astype(jnp.float64)
    (out, lse), vjp = jax.vjp(f, *(x if plain else up(x) for x in (q, k, v, sinks, bias)))
    return (out, lse, *vjp((do.astype(out.dtype), dlse.astype(lse.dtype))))

  return program(q, k, v, do, dlse, arrays, sinks, bias)


def errors_against(got, want, names, floors):
  """{name: (error, note)} of got against want: NaN where got is non-finite
  and want finite, inf where a non-finite entry (-inf lse) is misplaced or
  a shape differs, else max |got - want| / max(max |want|, floor)."""
  result = {}
  for name, x, w in zip(names, got, want):
    x = np.asarray(jnp.asarray(x, jnp.float64))
    w = np.asarray(w, np.float64)
    if x.shape != w.shape:
      result[name] = (float("inf"), f"shape {x.shape} != {w.shape}")
      continue
    finite = np.isfinite(w)
    if (~np.isfinite(x) & finite).any():
      bad = np.argwhere(~np.isfinite(x) & finite)
      result[name] = (float("nan"), f"{len(bad)} non-finite where finite expected, first at "
                                    f"{tuple(int(a) for a in bad[0])}: {x[tuple(bad[0])]}")
      continue
    if not np.array_equal(x[~finite], w[~finite]):
      bad = np.argwhere((x != w) & ~finite)
      at = tuple(int(a) for a in bad[0])
      result[name] = (float("inf"), f"{len(bad)} entries should be {w[at]}, first at {at}: got {x[at]}")
      continue
    scale = max(float(np.abs(w[finite]).max(initial=0.0)), floors.get(name, 0.0), 1e-30)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf: masked out
      diff = np.where(finite, np.abs(x - w), -1.0)
    at = np.unravel_index(np.argmax(diff), x.shape)
    err = float(max(diff.max(initial=0.0), 0.0)) / scale
    result[name] = (err, f"at {tuple(int(a) for a in at)}: got {x[at]:.6g}, want {w[at]:.6g} (scale {scale:.3g})")
  return result


class CaseTimeout(Exception):
  pass


def _alarm(signum, frame):
  raise CaseTimeout()


def _innermost_library_frame(exc) -> str:
  frames = [f for f in traceback.extract_tb(exc.__traceback__) if "jax_flash2" in f.filename]
  if not frames:
    return "?"
  f = frames[-1]
  return f"{os.path.relpath(f.filename)}:{f.lineno} ({f.name})"


def run_case(case: Case, seed: int, timeout: int, show: bool = False) -> tuple[str, str]:
  q, k, v, do, dlse, options = build_inputs(case, seed)
  if show:
    print("  options:", {n: (x.shape, str(x.dtype)) if isinstance(x, jax.Array) else x for n, x in options.items()})
  try:
    plan = jax_flash2.plan(q, k, v, backend=case.backend, interpret=True, **options)
  except (ValueError, TypeError, NotImplementedError) as e:
    return "rejected", f"{type(e).__name__}: {e}"
  passes = f"fwd={plan.forward.backend} bwd={plan.backward.backend}"
  names = ["out", "lse", "dq", "dk", "dv"]
  if "sinks" in options:
    names.append("dsinks")
  if "bias" in options:
    names.append("dbias")
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(timeout)
  try:
    got = run_flash(q, k, v, do, dlse, options, case.backend)
    got = [np.asarray(jnp.asarray(x, jnp.float64)) for x in got if x is not None]
  except CaseTimeout:
    return "TIMEOUT", passes
  except Exception as e:  # noqa: BLE001
    msg = str(e).strip().splitlines()
    where = _innermost_library_frame(e)
    text = f"{passes} | {type(e).__name__}: {msg[0][:300] if msg else ''} [at {where}]"
    if isinstance(e, (ValueError, TypeError)) and "check" in where.rsplit("(", 1)[-1]:
      # A clear refusal by one of the library's checks, though plan() accepted the call.
      return "rejected-late", text
    return "ERROR", text
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
  want = [np.asarray(x) for x in run_oracle(q, k, v, do, dlse, options) if x is not None]
  tol = TOL[case.dtype]
  tols = {n: tol for n in names}
  if "sinks" in options:
    tols["dsinks"] = max(tol, TOL[str(options["sinks"].dtype)])
  if "bias" in options:
    tols["dbias"] = max(tol, TOL[str(options["bias"].dtype)])
  floor = 0.1 * float(np.abs(np.asarray(do, np.float64)).max())
  floors = {"dq": floor, "dk": floor, "dv": floor, "dbias": floor, "dsinks": 0.1 * float(np.abs(dlse).max())}
  errors = errors_against(got, want, names, floors)
  passes_by = {}
  failing = [n for n, (e, _) in errors.items() if not e <= tols[n]]
  if case.dtype != "float32" and any(np.isfinite(errors[n][0]) for n in failing):
    # 1. FlashAttention's test rule: a 16-bit kernel may err up to 2x (out,
    # lse) or 3x (gradients) what the same math done plainly in that dtype errs.
    plain = [x for x in run_oracle(q, k, v, do, dlse, options, q.dtype) if x is not None]
    for n, (e, _) in errors_against(plain, want, names, floors).items():
      if n in failing and np.isfinite(errors[n][0]) and errors[n][0] <= (2.0 if n in ("out", "lse") else 3.0) * e:
        passes_by[n] = f"within {2.0 if n in ('out', 'lse') else 3.0:g}x plain {case.dtype} ({e:.2g})"
    # 2. FlashAttention-2's backward takes delta = rowsum(dO * out) from the
    # forward's rounded out: exact gradients given that out are those of
    # the oracle with dlse - rowsum(dO * (out_kernel - out_exact)).
    shift = np.einsum("bqhd,bqhd->bhq", np.asarray(do, np.float64), got[0] - want[0])
    fa2 = [x for x in run_oracle(q, k, v, do, jnp.asarray(np.asarray(dlse, np.float64) - shift), options)
           if x is not None]
    for n, (e, _) in errors_against(got, fa2, names, floors).items():
      if n in failing and n.startswith("d") and n not in passes_by and np.isfinite(errors[n][0]) and e <= tols[n]:
        passes_by[n] = f"matches the exact gradient given the kernel's own out ({e:.2g})"
  status, notes = "ok", []
  for n in failing:
    e, where = errors[n]
    if n in passes_by:
      notes.append(f"{n}: err {e:.3g} > {tols[n]:.0e} {where}; passes: {passes_by[n]}")
    else:
      notes.append(f"{n}: err {e:.3g} > {tols[n]:.0e} {where}")
      status = "NAN" if np.isnan(e) or status == "NAN" else "MISMATCH"
  detail = " ".join(f"{n} {e:.1e}" for n, (e, _) in errors.items())
  return status, f"{passes} | {detail}" + "".join(f"\n      {n}" for n in notes)

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--cases", type=int, default=30, help="Triton cases (and Mosaic ones unless --mosaic-cases)")
  ap.add_argument("--mosaic-cases", type=int, default=None, help="Mosaic cases (its interpreter is slow)")
  ap.add_argument("--backends", nargs="+", default=["triton", "mosaic"], choices=["triton", "mosaic"])
  ap.add_argument("--only", type=int, nargs="*", default=None, help="run only these case indices")
  ap.add_argument("--start", type=int, default=0, help="first case index (with --cases: cases start..N-1)")
  ap.add_argument("--case-timeout", type=int, default=600, help="seconds per case (checked in Python)")
  ap.add_argument("--show", action="store_true", help="print each case's options")
  args = ap.parse_args(argv)
  summary: dict[str, dict[str, int]] = {}
  findings = []
  for backend in args.backends:
    n = args.cases if backend == "triton" or args.mosaic_cases is None else args.mosaic_cases
    indices = args.only if args.only is not None else range(args.start, n)
    counts = summary.setdefault(backend, {})
    for i in indices:
      case = draw_case(args.seed, backend, i)
      start = time.time()
      status, detail = run_case(case, args.seed, args.case_timeout, show=args.show)
      # Every case compiles new programs; without this a few hundred cases
      # exhaust the process's memory maps (LLVM: "Unable to allocate section memory").
      jax.clear_caches()
      gc.collect()
      counts[status] = counts.get(status, 0) + 1
      line = f"[{backend} #{i}] {case.describe()} | {status} | {detail} ({time.time() - start:.1f}s)"
      print(line, flush=True)
      if status not in ("ok", "rejected", "rejected-late"):
        findings.append(line.splitlines()[0])
  print("\nsummary (seed %d):" % args.seed)
  for backend, counts in summary.items():
    print(f"  {backend}: {sum(counts.values())} cases, " + ", ".join(f"{s} {c}" for s, c in sorted(counts.items())))
  for line in findings:
    print("  finding:", line)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())
