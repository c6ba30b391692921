"""Times a Flax decode=True cache step through jax_flash2.flax.attention_fn
on the GPU: does the lax.cond that checks the mask's prefix (on the device)
cost a host round trip per layer? Three attention_fns over the same layers:
'cond' (attention_fn as shipped), 'direct' (flash_decode with no cond), and
'flax' (Flax's own attention). Lab equipment: not part of the product.

  python lab/tools/flax_decode_step.py [--layers 8 --batch 8 --cache 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_flash2.flax as jf


class Stack(nn.Module):
  layers: int
  heads: int
  attention_fn: object

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=jnp.bfloat16, decode=True,
                                              attention_fn=self.attention_fn)(x)
    return x


def direct_prefix_decode(attend, decode):
  """jax_flash2.flax._prefix_decode without the lax.cond: flash_decode always."""
  def run(q, k, v, visible, sinks):
    return decode(q, k, v, jnp.sum(visible, axis=1, dtype=jnp.int32), sinks)
  return run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--cache", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--iters", type=int, default=50)
  args = ap.parse_args()
  width = args.heads * 128
  fns = {"cond": jf.attention_fn, "direct": None, "flax": nn.dot_product_attention}
  results = {}
  shipped = jf._prefix_decode
  for name, fn in fns.items():
    jf._prefix_decode = direct_prefix_decode if name == "direct" else shipped
    model = Stack(args.layers, args.heads, fn if fn is not None else jf.attention_fn)
    full = jnp.zeros((args.batch, args.cache, width), jnp.bfloat16)
    variables = model.init(jax.random.key(0), full)
    params, cache = variables["params"], variables["cache"]
    # Half the cache written: the steps attend to ~cache/2 keys.
    cache = jax.tree_util.tree_map(
        lambda a: jnp.full_like(a, args.cache // 2) if a.dtype == jnp.int32 else
        jax.random.normal(jax.random.key(1), a.shape, jnp.float32).astype(a.dtype), cache)
    step = jax.jit(lambda p, c, x: model.apply({"params": p, "cache": c}, x, mutable=["cache"]))
    x = jax.random.normal(jax.random.key(2), (args.batch, 1, width), jnp.bfloat16)
    out, _ = step(params, cache, x)
    jax.block_until_ready(out)
    times = []
    for _ in range(args.iters):
      t = time.perf_counter()
      out, _ = step(params, cache, x)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t)
    # Back to back without waiting: where the cond syncs, dispatch cannot run ahead.
    t = time.perf_counter()
    for _ in range(args.iters):
      out, _ = step(params, cache, x)
    jax.block_until_ready(out)
    back_to_back = (time.perf_counter() - t) / args.iters
    results[name] = (statistics.median(times) * 1e3, back_to_back * 1e3, out.astype(jnp.float32))
    print(f"{name:7s} step {results[name][0]:.3f} ms (median, synced), {results[name][1]:.3f} ms back to back",
          flush=True)
  jf._prefix_decode = shipped
  ref = results["flax"][2]
  for name in ("cond", "direct"):
    err = float(jnp.linalg.norm(results[name][2] - ref) / jnp.linalg.norm(ref))
    print(f"{name} vs flax: rel err {err:.1e}")


if __name__ == "__main__":
  main()
