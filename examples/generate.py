"""Greedy generation with the example GPT over a KV cache: prefill with
jax_flash2.flash_attention, then one token per step with flash_decode, checked
against full recomputation. Needs jax_flash2 and Flax importable
(`pip install -e '.[flax]'`, or Flax installed and PYTHONPATH=. from the
repository root).

    python examples/generate.py                     # contiguous cache
    python examples/generate.py --paged 16          # paged cache, 16 tokens a page
    python examples/generate.py --interpret --steps 8 --d-model 32 --heads 2 --layers 1   # CPU: Pallas interpret mode

The weights are random (examples/train_gpt.py saves none), so the text is
gibberish; what the example shows is the cache plumbing. A batch of prompts
of different lengths (slices of the char_corpus text) is right-padded to the
longest and prefilled in one causal flash_attention call per layer, whose
keys and values go into per-layer caches with write_kv_cache; each sequence's
cached length is then set to its own prompt length, so the padding rows are
overwritten by the first generated tokens. Each decode step embeds the last
token at its sequence's position, writes its K/V at that position and attends
with flash_decode; the steps run in one jitted lax.scan with the caches
donated (updated in place).

The check: the same greedy generation by full recomputation, where every step
runs the whole model over the whole sequence so far with Flax's XLA attention
and a causal mask, no cache. The model runs in float32 so that rounding
differences between the two attention paths (~1e-6) cannot flip an argmax;
the tokens must be identical. Both are timed (wall clock of a second run,
after the first compiled them) and reported as generated tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import char_corpus
from gpt import GPT
from jax_flash2 import flash_attention, flash_decode, write_kv_cache


class CachedAttention:
  """An attention_fn for GPT that reads and writes one KV cache per layer.

  The model calls it once per layer, in order, while it is traced: the
  caches it holds after the call are the updated ones. prefill: the queries
  are the whole (padded) prompt and attend causally among themselves with
  flash_attention; else they are the new token and attend to the cache with
  flash_decode.
  """

  def __init__(self, caches, cache_seqlens, block_table, *, prefill: bool, backend: str, interpret: bool):
    self.caches = list(caches)  # [(k_cache, v_cache)] per layer
    self.cache_seqlens = cache_seqlens
    self.block_table = block_table
    self.prefill = prefill
    self.options = dict(backend=backend, interpret=interpret)
    self.layer = 0

  def __call__(self, query, key, value, **unused_flax_options):
    # query, key, value: [batch, seq, heads, head_dim]
    k_cache, v_cache = self.caches[self.layer]
    k_cache, v_cache, lens = write_kv_cache(k_cache, v_cache, key, value, self.cache_seqlens,
                                            block_table=self.block_table)
    self.caches[self.layer] = (k_cache, v_cache)
    self.layer += 1
    if self.prefill:
      return flash_attention(query, key, value, causal=True, **self.options)
    return flash_decode(query, k_cache, v_cache, lens, block_table=self.block_table, causal=True, **self.options)


def empty_caches(args: argparse.Namespace, batch: int, capacity: int):
  """Zeroed per-layer (k_cache, v_cache) and the block table (None unless
  --paged): [batch, capacity, heads, head_dim], or pages
  [batch * capacity / page_size, page_size, heads, head_dim] in shuffled
  order, so a sequence's pages are scattered over the pool."""
  head_dim = args.d_model // args.heads
  block_table = None
  if args.paged:
    pages_per_seq = capacity // args.paged
    order = np.random.default_rng(args.seed).permutation(batch * pages_per_seq)
    block_table = jnp.asarray(order.reshape(batch, pages_per_seq), jnp.int32)
    shape = (batch * pages_per_seq, args.paged, args.heads, head_dim)
  else:
    shape = (batch, capacity, args.heads, head_dim)
  caches = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)) for _ in range(args.layers)]
  return caches, block_table


def make_generate(model: GPT, args: argparse.Namespace):
  """generate(params, prompts, prompt_lens, caches, block_table) -> tokens
  [batch, steps]: prefill, then args.steps greedy decode steps."""
  attention = dict(backend=args.backend, interpret=args.interpret)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def prefill(params, prompts, prompt_lens, caches, block_table):
    fn = CachedAttention(caches, jnp.zeros_like(prompt_lens), block_table, prefill=True, **attention)
    logits = model.clone(attention_fn=fn, causal_mask=False).apply({"params": params}, prompts)
    last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    # The padding's K/V past each prompt were written too; the cached length
    # says where the sequence ends, and the next write overwrites them.
    return jnp.argmax(last, axis=-1).astype(jnp.int32), fn.caches

  @functools.partial(jax.jit, donate_argnums=(3,))
  def decode(params, first_token, prompt_lens, caches, block_table):
    def step(carry, _):
      token, lens, caches = carry
      fn = CachedAttention(caches, lens, block_table, prefill=False, **attention)
      logits = model.clone(attention_fn=fn, causal_mask=False).apply(
          {"params": params}, token[:, None], positions=lens[:, None])
      next_token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
      return (next_token, lens + 1, fn.caches), next_token

    (_, _, caches), tokens = jax.lax.scan(step, (first_token, prompt_lens, caches), None, length=args.steps - 1)
    return jnp.concatenate([first_token[:, None], tokens.T], axis=1), caches  # [batch, steps]

  def generate(params, prompts, prompt_lens, caches, block_table):
    first, caches = prefill(params, prompts, prompt_lens, caches, block_table)
    return decode(params, first, prompt_lens, caches, block_table)[0]

  return generate


def make_recompute(model: GPT, steps: int):
  """The check's generator: each step runs the whole model (XLA attention,
  causal mask) over a [batch, max_prompt + steps] buffer holding prompt and
  generated tokens so far; padding after a sequence's end cannot affect it."""

  @jax.jit
  def recompute(params, prompts, prompt_lens):
    batch = prompts.shape[0]
    buffer = jnp.zeros((batch, prompts.shape[1] + steps), jnp.int32).at[:, : prompts.shape[1]].set(prompts)
    rows = jnp.arange(batch)

    def step(buffer, t):
      logits = model.apply({"params": params}, buffer)
      token = jnp.argmax(logits[rows, prompt_lens - 1 + t], axis=-1).astype(jnp.int32)
      return buffer.at[rows, prompt_lens + t].set(token), token

    _, tokens = jax.lax.scan(step, buffer, jnp.arange(steps))
    return tokens.T

  return recompute


def timed(fn, make_args) -> tuple[np.ndarray, float]:
  """fn(*make_args())'s result and the wall clock of its second call (the
  first compiles); fresh arguments each time, as the caches are donated."""
  jax.block_until_ready(fn(*make_args()))
  args = make_args()
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return np.asarray(out), time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  text = char_corpus.generate(20_000, seed=0)
  vocab = "".join(sorted(set(text)))
  index = {c: i for i, c in enumerate(vocab)}

  # Ragged prompts: slices of the corpus, right-padded to the longest.
  rng = np.random.default_rng(args.seed)
  lens = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, size=args.batch)
  lens[0] = args.prompt_len
  starts = rng.integers(0, len(text) - args.prompt_len, size=args.batch)
  prompts = np.zeros((args.batch, args.prompt_len), np.int32)
  for b, (start, n) in enumerate(zip(starts, lens)):
    prompts[b, :n] = [index[c] for c in text[start:start + n]]
  prompts, prompt_lens = jnp.asarray(prompts), jnp.asarray(lens, jnp.int32)

  total = args.prompt_len + args.steps
  capacity = -(-total // args.paged) * args.paged if args.paged else total
  model = GPT(vocab_size=len(vocab), max_len=capacity, d_model=args.d_model, layers=args.layers, heads=args.heads,
              dtype=jnp.float32, attention_fn=nn.dot_product_attention)  # XLA attention, causal mask
  params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), prompts)["params"]

  generate = make_generate(model, args)
  new_caches = lambda: (params, prompts, prompt_lens, *empty_caches(args, args.batch, capacity))
  tokens, t_cache = timed(generate, new_caches)
  expected, t_full = timed(make_recompute(model, args.steps), lambda: (params, prompts, prompt_lens))

  cache = f"paged, {args.paged} tokens a page, shuffled block table" if args.paged else "contiguous"
  print(f"{args.batch} prompts of {lens.tolist()} characters; {args.steps} greedy steps; KV cache {cache}; "
        f"attention backend {args.backend}{' (interpret)' if args.interpret else ''}")
  for b in range(args.batch):
    prompt = "".join(vocab[i] for i in np.asarray(prompts[b, :lens[b]]))
    print(f"  [{b}] {prompt!r} -> {''.join(vocab[i] for i in tokens[b])!r}")
  n = args.batch * args.steps
  print(f"KV cache (flash_attention prefill + flash_decode): {n / t_cache:,.0f} tokens/s ({t_cache * 1e3:.1f} ms)")
  print(f"full recomputation (XLA attention, no cache):     {n / t_full:,.0f} tokens/s ({t_full * 1e3:.1f} ms)")
  same = bool((tokens == expected).all())
  if same:
    print("tokens identical to full recomputation (float32)")
  else:
    row, step = np.argwhere(tokens != expected)[0]
    print(f"MISMATCH with full recomputation: {(tokens != expected).sum()} of {n} tokens differ, the first at "
          f"sequence {row}, step {step}")
  if not same:
    raise SystemExit(1)
  return dict(tokens=tokens, expected=expected, cache_s=t_cache, recompute_s=t_full)


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=48, help="the longest prompt; the others are 1/2 to 1 of it")
  p.add_argument("--steps", type=int, default=32, help="tokens generated per prompt")
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--paged", type=int, default=0, metavar="PAGE_SIZE",
                 help="paged KV cache with pages of PAGE_SIZE tokens (a multiple of 16); 0: contiguous")
  p.add_argument("--backend", choices=("auto", "triton", "xla"), default="auto",
                 help="flash_attention's and flash_decode's backend (auto: the kernels on an NVIDIA GPU, else XLA)")
  p.add_argument("--interpret", action="store_true", help="the Triton kernels in Pallas interpret mode (CPU; slow)")
  args = p.parse_args(argv)
  if args.d_model % args.heads or (args.d_model // args.heads) % 8:
    p.error(f"d_model / heads = {args.d_model / args.heads} must be a multiple of 8")
  if args.steps < 1:
    p.error("--steps must be >= 1")
  if args.paged % 16:
    p.error(f"--paged {args.paged} must be a multiple of 16")
  if args.interpret and args.backend == "auto":
    args.backend = "triton"
  return args


if __name__ == "__main__":
  main()
