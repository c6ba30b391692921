"""Sweeps the Triton-lowering kernels' tiles, warps and stages on the GPU.

    PYTHONPATH=. python lab/tools/tune.py --head-dim 128 --seq 8192 --kernels fwd,dkv,dq --out DIR
    PYTHONPATH=. python lab/tools/tune.py --kernels dq --configs "128,64,8,3;64,128,4,3"

Times every candidate KernelConfig of one kernel through the public API,
flash_attention(..., backend="triton", block_sizes=BlockSizes(...)), with
the other two kernels held at the measured defaults (jax_flash2.defaults),
and cuDNN in the same run as the yardstick. Timer: jax_flash2.bench.timing
(rounds of back-to-back calls of the compiled function, the median round).

  fwd: the forward alone (out and lse), TFLOP/s by the FlashAttention
    convention (4·B·H·S²·D, half when causal).
  dkv, dq: forward+backward (jax.vjp) with the candidate in that kernel's
    slot; the forward and the other backward kernel are the same for every
    candidate, so the ranking is the kernel's. Printed as fwd+bwd ms and
    TFLOP/s (3.5x the forward's FLOPs), and as the backward's share
    (fwd+bwd less the default forward's time, 2.5x).

A config that fails to compile (shared memory, registers) is reported and
skipped. lab/NOTES.md records what earlier sweeps found; the defaults they
chose are in jax_flash2/defaults.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp

from jax_flash2 import BlockSizes, KernelConfig, flash_attention
from jax_flash2 import defaults
from jax_flash2.bench import timing

KERNELS = ("fwd", "dkv", "dq")


def candidates(kernel: str, head_dim: int):
  """The sweep's KernelConfigs for one kernel (the grid of the earlier sweeps)."""
  blocks_q = (64, 128) if kernel != "dkv" else (32, 64, 128)
  blocks_k = (32, 64, 128) if kernel != "dkv" else (64, 128)
  stages = (2, 3, 4) if kernel == "fwd" else (1, 2, 3)
  for bq, bk, w, s in itertools.product(blocks_q, blocks_k, (4, 8), stages):
    if head_dim >= 256 and bq * bk > 64 * 64:
      continue
    yield KernelConfig(bq, bk, w, s)


def parse_configs(text: str) -> list[KernelConfig]:
  """'bq,bk,w,s;bq,bk,w,s' -> KernelConfigs."""
  return [KernelConfig(*map(int, c.split(","))) for c in text.split(";") if c.strip()]


def with_kernel(base: BlockSizes, kernel: str, config: KernelConfig) -> BlockSizes:
  """base with `kernel`'s slot (fwd, dkv or dq) set to config."""
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
  return dataclasses.replace(base, **{kernel: config})


def default_block_sizes(head_dim: int, causal: bool) -> BlockSizes:
  padded = max(16, 1 << (head_dim - 1).bit_length())
  return defaults.block_sizes(padded, causal)


def attention_fn(causal: bool, block_sizes: BlockSizes, *, interpret: bool = False):
  """(q, k, v) -> out through the public API on the Triton kernels, tiled by block_sizes."""

  def attn(q, k, v):
    return flash_attention(q, k, v, causal=causal, backend="triton", block_sizes=block_sizes, interpret=interpret)

  return attn


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--kernels", default="fwd,dkv,dq")
  parser.add_argument("--causal", default="false,true")
  parser.add_argument("--configs", default="", help="explicit bq,bk,w,s;... instead of the sweep")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)

  d = args.head_dim
  batch, heads = max(1, args.tokens // args.seq), args.hidden // d
  shape = (batch, args.seq, heads, d)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, shape {shape} bf16", flush=True)
  records = []
  for causal in [c == "true" for c in args.causal.split(",")]:
    fwd_flop = 4 * batch * heads * args.seq * args.seq * d / (2 if causal else 1)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    ms_f = timing.time_fn_ms(cudnn, q, k, v)
    ms_fb = timing.time_fn_ms(timing.fwd_bwd_fn(cudnn), q, k, v, do)
    print(f"causal={causal} cudnn fwd {ms_f:.3f} ms {fwd_flop / ms_f / 1e9:.0f} TF/s | "
          f"fwd+bwd {ms_fb:.3f} ms {3.5 * fwd_flop / ms_fb / 1e9:.0f} TF/s", flush=True)
    records.append(dict(impl="cudnn", causal=causal, fwd_ms=ms_f, fwdbwd_ms=ms_fb))
    base = default_block_sizes(d, causal)
    base_fwd_ms = timing.time_fn_ms(attention_fn(causal, base), q, k, v)
    print(f"causal={causal} defaults {base}: fwd {base_fwd_ms:.3f} ms", flush=True)
    for kernel in args.kernels.split(","):
      configs = parse_configs(args.configs) if args.configs else list(candidates(kernel, d))
      best = None
      for cfg in configs:
        attn = attention_fn(causal, with_kernel(base, kernel, cfg))
        try:
          if kernel == "fwd":
            ms = timing.time_fn_ms(attn, q, k, v)
          else:
            ms = timing.time_fn_ms(timing.fwd_bwd_fn(attn), q, k, v, do)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
          print(f"  {kernel} {cfg}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
          continue
        tag = f"  {kernel} bq={cfg.block_q} bk={cfg.block_k} w={cfg.num_warps} s={cfg.num_stages}:"
        if kernel == "fwd":
          tflops = fwd_flop / ms / 1e9
          print(f"{tag} fwd {ms:.3f} ms {tflops:.0f} TF/s", flush=True)
        else:
          tflops = 3.5 * fwd_flop / ms / 1e9
          bwd_ms = ms - base_fwd_ms
          print(f"{tag} fwd+bwd {ms:.3f} ms {tflops:.0f} TF/s (bwd ~{bwd_ms:.3f} ms "
                f"{2.5 * fwd_flop / bwd_ms / 1e9:.0f} TF/s)", flush=True)
        records.append(dict(kernel=kernel, causal=causal, config=dataclasses.asdict(cfg), ms=ms, tflops=tflops,
                            timed="fwd" if kernel == "fwd" else "fwd+bwd"))
        if best is None or ms < best[0]:
          best = (ms, cfg, tflops)
      if best:
        print(f"BEST {kernel} causal={causal}: {best[1]} {best[2]:.0f} TF/s", flush=True)
  if args.out:
    with open(f"{args.out}/tune_d{d}_s{args.seq}.json", "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, shape=shape, records=records), f, indent=1)


if __name__ == "__main__":
  main()
