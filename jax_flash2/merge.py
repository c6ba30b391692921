"""Partial attentions merged exactly by their log-sum-exp.

Attention over the union of two disjoint key sets is a weighted sum of the
attentions over each: with lse = log(exp(lse_a) + exp(lse_b)),

    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).

An attention sink is such a part that carries no value (out_b = 0,
lse_b = sink). Ring attention merges one part per ring step this way
(jax_flash2.ring), and joins the sinks to the merged output with it (the
forward kernels join them in their last step, as `join_sinks` does).
(flash_decode's splits, computed together, are merged in one n-way sum in
jax_flash2.triton.decode.combine.)

A part that sees no key has out = 0 and lse = -inf; it weighs 0, so rows
that see no key in any part keep out = 0 and lse = -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weight(lse: jax.Array, total: jax.Array) -> jax.Array:
  """exp(lse - total), the share of a part with this lse in a merged row of
  this total; 0 where the part saw no key (lse = -inf, where a -inf total
  would give exp(NaN))."""
  return jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - total))


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


def join_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(out, lse) with each head's sink in every row's softmax denominator:
  lse' = log(exp(lse) + exp(sink)) and, the sink carrying no value,
  out' = out * exp(lse - lse').

  out: [batch, seq, heads, head_dim]; lse: float32 [batch, heads, seq],
  natural log, as is the lse' returned; sinks: float32 [batch or 1, heads].
  out' keeps out's dtype. A row that sees no key keeps out = 0 and gets
  lse' = sink."""
  joined = jnp.logaddexp(lse, sinks[..., None])
  kept = out.astype(jnp.float32) * _per_row(weight(lse, joined))
  return kept.astype(out.dtype), joined


def join_sink_rows(m: jax.Array, l: jax.Array, sink) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`join_sinks` inside a forward kernel, on its running softmax rows:
  (m', l', scale) with out = acc * scale / l' and lse = m' + log2(l'), in
  base 2, the sink taken into the denominator.

  m, l: float32 [rows], the row max of the base-2 scores and the sum of
  their exp2 under it (l = 0 where a row saw no key, whatever m holds);
  sink: a float32 scalar, base 2. m' is max(m, sink), 0 where both are
  -inf (a -inf sink on a row that saw no key: l' = 0 then)."""
  m = jnp.where(l != 0.0, m, -jnp.inf)
  top = jnp.maximum(m, sink)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  scale = jnp.exp2(m - top)
  return top, l * scale + jnp.exp2(sink - top), scale


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
