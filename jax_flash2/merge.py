"""Partial attentions merged exactly by their log-sum-exp.

Attention over the union of two disjoint key sets is a weighted sum of the
attentions over each: with lse = log(exp(lse_a) + exp(lse_b)),

    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).

An attention sink is such a part that carries no value (out_b = 0,
lse_b = sink). Ring attention merges one part per ring step this way
(jax_flash2.ring); vjp.py joins the sinks to the kernels' output with it.
(flash_decode's splits, computed together, are merged in one n-way sum in
jax_flash2.triton.decode.combine.)

A part that sees no key has out = 0 and lse = -inf; it weighs 0, so rows
that see no key in any part keep out = 0 and lse = -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash2.triton.common import LOG2_E


def weight(lse: jax.Array, total: jax.Array, *, log2: bool = False) -> jax.Array:
  """exp(lse - total) (exp2 with log2), the share of a part with this lse
  in a merged row of this total; 0 where the part saw no key (lse = -inf,
  where a -inf total would give exp(NaN))."""
  exp = jnp.exp2 if log2 else jnp.exp
  return jnp.where(lse == -jnp.inf, 0.0, exp(lse - total))


def _per_row(w: jax.Array) -> jax.Array:
  """[batch, heads, seq] row weights as [batch, seq, heads, 1], out's layout."""
  return jnp.swapaxes(w, 1, 2)[..., None]


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The attention over two disjoint key sets from those over each.

  out_*: [batch, seq, heads, head_dim]; lse_*: float32 [batch, heads, seq],
  natural log. Returns (out float32, lse)."""
  total = jnp.logaddexp(lse_a, lse_b)
  out = (out_a.astype(jnp.float32) * _per_row(weight(lse_a, total))
         + out_b.astype(jnp.float32) * _per_row(weight(lse_b, total)))
  return out, total


def join_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array, *, log2: bool = False) -> tuple[jax.Array, jax.Array]:
  """(out, lse) with each head's sink in every row's softmax denominator:
  lse' = log(exp(lse) + exp(sink)) and, the sink carrying no value,
  out' = out * exp(lse - lse').

  out: [batch, seq, heads, head_dim]; lse: float32 [batch, heads, seq], in
  base 2 with log2 (the Triton kernels' base: the lse the backward reads is
  then rounded once), else natural, as is the lse' returned; sinks: float32
  [heads], natural. out' keeps out's dtype. A row that sees no key keeps
  out = 0 and gets lse' = sink."""
  sink = sinks[None, :, None] * LOG2_E if log2 else sinks[None, :, None]
  joined = jnp.logaddexp2(lse, sink) if log2 else jnp.logaddexp(lse, sink)
  kept = out.astype(jnp.float32) * _per_row(weight(lse, joined, log2=log2))
  return kept.astype(out.dtype), joined


def sinks_gradient(out: jax.Array, lse: jax.Array, do: jax.Array, dlse: jax.Array, sinks: jax.Array) -> jax.Array:
  """dsinks, float32 [heads], from the joined out and natural lse.

  The sink's probability p = exp(sink - lse) is d lse / d sink, and
  d out / d sink = -p * out (it takes mass from the values and carries none;
  dropout scales only the values' probabilities, so this holds under it
  too). Hence dsink = sum over batch and rows of p * (dlse - delta), with
  delta = rowsum(dO * out).
  """
  p = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sinks[None, :, None] - lse))
  # A float32 multiply-and-sum, not an einsum: a dot may round to TF32 on GPUs.
  delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)
  return jnp.sum(p * (dlse - delta), axis=(0, 2))
