"""Times the Mosaic GPU backward kernels (dkv, dq) against the Triton-lowering backward on a Hopper GPU.

  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py                      # d64 and d128, 1k..16k, causal and not
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --seq 8192 --head-dim 128 --block-q 64 --stages 3
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --variants kernels=2 kernels=2+softmax_overlap=1   # a row each
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --head-dim 128 --variants default stages=2+dq_persistent=1
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --head-dim 256 --seq 2048 8192      # backward_wide.py's kernels
  PYTHONPATH=. python lab/tools/mosaic_bwd_bench.py --head-dim 128 --variants default fused_dq=1+dkv_persistent=0 \
      fused_dq=1+dkv_persistent=0+adders=2   # the fused kernel with half its reduce-adds (wrong dQ: speed only)
  ... fused_dq=1+adders=2+alternate=1   # each tile adds at every other step (a cluster pair's share; speed only)
  ... fused_dq=1+dkv_persistent=0+unordered=1   # no adder waits for its rank (nondeterministic: speed only)
  ... fused_dq=1+dkv_persistent=0+staging=0+lockstep=0   # no hand-over of dQ, no wait for the other dS^T (speed only)
  ... --variants default elementwise=0   # P = S, dS = dP: the kernels without element-wise work (speed only)
  ... --seq 6144 --variants default whole_heads=1   # the fused schedule with whole heads per round (before session 14)

Bench convention (as tools/mosaic_bench.py): 16384 tokens per batch, hidden
2048, bf16; backward TFLOP/s = 2.5 x forward FLOPs / time (5 matmuls; the
Mosaic pair recomputes S and dP in both kernels, 7 matmuls, not counted).
Mosaic: delta = rowsum(dO * O) (XLA) + dkv + dq (with fused_dq: the dK/dV
kernel, which adds dQ as well, and dQ's scaling; dq ms 0), from the Triton
forward's out and lse. Triton: the vjp's backward, timed as (forward + backward) -
forward. Also prints each Mosaic kernel alone and the largest relative
difference of its gradients to Triton's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import flash_attention
from jax_flash2.bench.flops import forward_flops
from jax_flash2.mosaic import backward as mosaic_bwd

import mosaic_bench  # tools/, for its timer

_time_ms = mosaic_bench._time_ms


_EXPERIMENTS = ("adders=", "alternate=", "unordered=", "elementwise=", "staging=", "lockstep=", "whole_heads=")


def _variant(config, spec: str):
  """(config with spec's fields set, a context to time it in): `adders=N`,
  `alternate=1`, `unordered=1`, `staging=0` and `lockstep=0` in spec (not
  config fields) time the fused kernel under
  mosaic_bwd.dq_addition_experiment(N, alternate=True, ordered=False, ...);
  `elementwise=0` the kernels under mosaic_bwd.elementwise_experiment();
  `whole_heads=1` the fused kernel on the schedule of whole heads per round
  (mosaic_bwd._fused_schedule's fill_rounds off, patched in for the timing).
  `kernels=2` first takes dQ out of the dK/dV kernel (BackwardConfig.unfused:
  the head_dim-64 default fuses it), so that options of the two kernels
  such as softmax_overlap apply."""
  options = spec.split("+")
  if "kernels=2" in options:
    options.remove("kernels=2")
    config = config.unfused()
  experiment = {o.split("=")[0]: int(o.split("=")[1]) for o in options if o.startswith(_EXPERIMENTS)}
  rest = "+".join(o for o in options if not o.startswith(_EXPERIMENTS)) or "default"

  @contextlib.contextmanager
  def context():
    with contextlib.ExitStack() as stack:
      if {"adders", "alternate", "unordered", "staging", "lockstep"} & experiment.keys():
        every, ordered = experiment.get("adders", 1), not experiment.get("unordered", 0)
        stack.enter_context(mosaic_bwd.dq_addition_experiment(
            every, alternate=bool(experiment.get("alternate", 0)), ordered=ordered,
            staging=bool(experiment.get("staging", 1)), lockstep=bool(experiment.get("lockstep", 1))))
      if not experiment.get("elementwise", 1):
        stack.enter_context(mosaic_bwd.elementwise_experiment())
      if experiment.get("whole_heads", 0):
        stack.enter_context(unittest.mock.patch.object(
            mosaic_bwd, "_fused_schedule", functools.partial(mosaic_bwd._fused_schedule, fill_rounds=False)))
      yield

  return mosaic_bench._variant(config, rest), context


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
  parser.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--block-q", type=int, default=None)
  parser.add_argument("--block-kv", type=int, default=None)
  parser.add_argument("--stages", type=int, default=None)
  parser.add_argument("--variants", nargs="*", default=["default"],
                      help="BackwardConfigs to time, a row each: 'default', or fields set on the default as "
                           "NAME=VALUE joined by '+' (booleans 0/1)")
  args = parser.parse_args()
  print(jax.devices()[0].device_kind)
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  width = max(map(len, args.variants))
  print(f"{'d':>4} {'seq':>6} {'causal':>6} {'variant':>{width}} {'dkv ms':>8} {'dq ms':>8} {'mosaic ms':>10} {'TFLOP/s':>8}"
        f" {'triton ms':>10} {'TFLOP/s':>8} {'max rel diff':>12}")
  for head_dim in args.head_dim:
    config = mosaic_bwd.default_backward_config(head_dim)
    config = dataclasses.replace(
        config, block_q=args.block_q or config.block_q, block_kv=args.block_kv or config.block_kv,
        stages=args.stages or config.stages,
    )
    variants = {spec: _variant(config, spec) for spec in args.variants}
    for seq in args.seq:
      batch, heads = max(16384 // seq, 1), 2048 // head_dim
      keys = jax.random.split(jax.random.PRNGKey(seq), 4)
      q, k, v, do = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16) for key in keys)
      for causal in causals:
        flops = 5 * forward_flops(batch, heads, seq, seq, head_dim, causal) // 2
        fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, return_lse=True, backend="triton"))
        out, lse = fwd(q, k, v)
        delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))

        def triton_fwd_bwd(q, k, v, do):
          _, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton"), q, k, v)
          return vjp(do)

        tms = _time_ms(triton_fwd_bwd, (q, k, v, do)) - _time_ms(lambda *a: fwd(*a), (q, k, v))
        want = jax.jit(triton_fwd_bwd)(q, k, v, do)
        for spec, (variant, experiment) in variants.items():
          kw = dict(causal=causal, config=variant)

          def mosaic_grads(q, k, v, do, out, lse, kw=kw):
            delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
            return mosaic_bwd.backward(q, k, v, do, lse, delta, **kw)

          # With fused_dq the dK/dV kernel computes dQ as well, and there is no dQ kernel.
          with experiment():
            dkv_ms = _time_ms(lambda *a: mosaic_bwd.dkv(*a, **kw), (q, k, v, do, lse, delta))
            dq_ms = 0.0 if variant.fused_dq else _time_ms(lambda *a: mosaic_bwd.dq(*a, **kw), (q, k, v, do, lse, delta))
            ms = _time_ms(mosaic_grads, (q, k, v, do, out, lse))
            got = jax.jit(mosaic_grads)(q, k, v, do, out, lse)
          diff = max(
              float(np.linalg.norm(np.asarray(g, np.float32) - np.asarray(w, np.float32))
                    / np.linalg.norm(np.asarray(w, np.float32)))
              for g, w in zip(got, want)
          )
          print(f"{head_dim:>4} {seq:>6} {str(causal):>6} {spec:>{width}} {dkv_ms:>8.3f}"
                f" {dq_ms:>8.3f} {ms:>10.3f} {flops / ms / 1e9:>8.0f} {tms:>10.3f} {flops / tms / 1e9:>8.0f}"
                f" {diff:>12.2e}", flush=True)


if __name__ == "__main__":
  main()
