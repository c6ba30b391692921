"""Train the example GPT with its sequence split over devices (context
parallelism): `jax_flash2.ring_attention` inside `shard_map`, zigzag layout,
against the same steps on the whole sequence, and check the losses agree.

    # CPU: 8 host devices (set here unless XLA_FLAGS is already set)
    python examples/train_gpt_ring.py --backend xla --steps 3 --seq-len 64

    # GPUs: the sequence over all of them, the steps on the flash kernels
    python examples/train_gpt_ring.py --steps 20 --seq-len 8192 --batch 2

The model, data, init and optimizer are `train_gpt.py`'s (same seed, same
batches). Each batch of tokens, positions and labels is put in zigzag order
once (`zigzag_order`), so device r holds chunks r and 2P-1-r of every
sequence; the position embedding reads each token's true position, attention
is `ring_attention(causal=True)` and the loss is the mean over every token
(`pmean` of the shards' equal-sized means). Gradients come from JAX's
transpose of the `shard_map` (sums over the ring for the replicated params).
The unsharded run is the same loss on the whole sequence with
`make_attention_fn(causal=True)` on the same backend; both take
`train_gpt`'s optimizer (AdamW, clipping, warmup: the first step's learning
rate is 0).

It prints both runs' per-step losses and the relative difference of their
gradients, and returns (and prints) the largest relative loss and gradient
differences and the largest difference of the final params.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if __name__ == "__main__":  # before jax is imported: host devices for a CPU run
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import train_gpt
from gpt import GPT
from jax_flash2 import ring_attention, zigzag_order
from jax_flash2.flax import make_attention_fn

AXIS = "sp"
SEQ = P(None, AXIS)  # [batch, seq] split over the ring


def make_ring_attention_fn(backend: str):
  """A Flax attention_fn running ring_attention (causal, zigzag) over AXIS;
  inside the shard_map its q/k/v are the local [batch, seq / P, heads,
  head_dim] shards."""

  def attention_fn(query, key, value, bias=None, mask=None, dropout_rate=0.0, **unused):
    del unused  # dtype, precision, dropout_rng, ...: the kernels fix their own
    if bias is not None or mask is not None or dropout_rate:
      raise ValueError("the ring example takes no bias, mask or attention dropout")
    return ring_attention(query, key, value, axis_name=AXIS, causal=True, layout="zigzag", backend=backend)

  return attention_fn


def build_models(args: argparse.Namespace, vocab_size: int) -> tuple[GPT, GPT]:
  """(ring model, unsharded model): the same GPT, attention over the ring or
  the whole sequence; neither takes a mask array."""
  options = dict(vocab_size=vocab_size, max_len=args.seq_len, d_model=args.d_model, layers=args.layers,
                 heads=args.heads, dtype=train_gpt.DTYPES[args.dtype], causal_mask=False)
  whole = make_attention_fn(causal=True, backend=args.backend)
  return GPT(attention_fn=make_ring_attention_fn(args.backend), **options), GPT(attention_fn=whole, **options)


def make_steps(ring_model: GPT, whole_model: GPT, optimizer: optax.GradientTransformation,
               mesh: jax.sharding.Mesh):
  """(ring_grads, whole_grads, update), each jitted.

  ring_grads(params, x, y, positions) -> (loss, grads) on zigzag-ordered
  [batch, seq] inputs split over the mesh's AXIS; whole_grads(params, x, y)
  the same on the whole sequence in order; update(params, opt_state, grads)
  -> (params, opt_state), donating both, one program shared by the two runs
  (the optimizer's compile is a large part of a tiny run's time)."""

  def local_loss(params, x, y, positions):
    logits = ring_model.apply({"params": params}, x, positions)  # the local [batch, seq / P, vocab]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return jax.lax.pmean(loss, AXIS)  # equal shards: the mean over every token

  def whole_loss(params, x, y):
    logits = whole_model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ring_loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(), SEQ, SEQ, SEQ), out_specs=P())
  return (jax.jit(jax.value_and_grad(ring_loss)), jax.jit(jax.value_and_grad(whole_loss)),
          jax.jit(update, donate_argnums=(0, 1)))


def train(args: argparse.Namespace) -> dict[str, Any]:
  """Both runs from the same init and batches; returns their losses and
  differences."""
  num_devices = args.devices or jax.device_count()
  mesh = jax.make_mesh((num_devices,), (AXIS,), (AxisType.Auto,), devices=jax.devices()[:num_devices])
  shard = lambda x: jax.device_put(x, NamedSharding(mesh, SEQ))  # each device gets its zigzag shard
  perm, _ = zigzag_order(args.seq_len, num_devices)
  data = train_gpt.load_data()
  ring_model, whole_model = build_models(args, len(data.vocab))
  optimizer = train_gpt.make_optimizer(args)
  ring_grads, whole_grads, update = make_steps(ring_model, whole_model, optimizer, mesh)
  # Both runs' params and state replicated on the mesh (the unsharded run
  # computes the same on every device): one placement, so each program
  # compiles once and `update` once for both. Two copies of one init: each
  # run's update donates its own.
  replicated = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
  init = replicated(train_gpt.init_params(args, len(data.vocab)))
  params = {"ring": jax.tree.map(jnp.copy, init), "whole": init}
  state = {name: replicated(optimizer.init(p)) for name, p in params.items()}
  print(f"sequence {args.seq_len} over {num_devices} {jax.devices()[0].platform} devices "
        f"({args.seq_len // num_devices} tokens each, zigzag), backend {args.backend}")

  rng = np.random.default_rng(args.seed)
  losses, grad_diffs = {"ring": [], "whole": []}, []
  for step in range(args.steps):
    x, y = train_gpt.sample_batch(data.train, rng, args.batch, args.seq_len)
    positions = np.broadcast_to(perm, x.shape)  # each token's true position, in zigzag order
    got = {"ring": ring_grads(params["ring"], shard(x[:, perm]), shard(y[:, perm]), shard(positions)),
           "whole": whole_grads(params["whole"], x, y)}
    grad_diffs.append(_rel_diff(got["ring"][1], got["whole"][1]))
    for name, (loss, grads) in got.items():
      params[name], state[name] = update(params[name], state[name], grads)
      losses[name].append(float(loss))
    print(f"step {step:3d}  loss ring {losses['ring'][-1]:.6f}  unsharded {losses['whole'][-1]:.6f}  "
          f"grads differ by {grad_diffs[-1]:.1e} of their norm")
  ring, whole = (np.asarray(losses[name]) for name in ("ring", "whole"))
  record = {
      "num_devices": num_devices,
      "losses_ring": losses["ring"],
      "losses_unsharded": losses["whole"],
      "max_rel_loss_diff": float(np.max(np.abs(ring - whole) / np.abs(whole))),
      "max_rel_grad_diff": max(grad_diffs),
      # Adam divides each gradient by its own scale, so components near zero
      # carry rounding differences up to a fraction of the learning rate.
      "max_param_diff": float(max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                                  for a, b in zip(jax.tree.leaves(params["ring"]), jax.tree.leaves(params["whole"])))),
  }
  print(f"largest relative loss difference {record['max_rel_loss_diff']:.2e}, of the grads "
        f"{record['max_rel_grad_diff']:.2e}; largest param difference {record['max_param_diff']:.2e}")
  return record


def _rel_diff(a, b) -> float:
  """||a - b|| / ||b|| over all leaves of two pytrees, in float64."""
  pairs = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in pairs)) / np.sqrt(sum(np.sum(y ** 2) for _, y in pairs)))


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=0, help="devices in the ring (0: all)")
  p.add_argument("--backend", choices=("auto", "mosaic", "triton", "xla"), default="auto",
                 help="both runs' attention backend (auto on CPU: XLA, with a warning)")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--d-model", type=int, default=32)
  p.add_argument("--layers", type=int, default=1)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=tuple(train_gpt.DTYPES), default="f32",
                 help="compute dtype (params stay float32); f32 makes the runs agree to float32 rounding")
  args = p.parse_args(argv)
  num_devices = args.devices or jax.device_count()
  if not 1 <= num_devices <= jax.device_count():
    p.error(f"--devices {args.devices}: {jax.device_count()} devices here")
  if args.seq_len % (2 * num_devices):
    p.error(f"--seq-len {args.seq_len} must be divisible by 2 x {num_devices} devices (the zigzag chunks)")
  if args.d_model % args.heads or (args.d_model // args.heads) % 8:
    p.error(f"head_dim = d_model / heads must be a multiple of 8, got {args.d_model} / {args.heads}")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  return train(parse_args(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
  main()
