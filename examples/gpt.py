"""A small decoder-only transformer (pre-LayerNorm GPT) in Flax linen.

Attention is Flax's own `nn.MultiHeadDotProductAttention`; only its
`attention_fn` changes between runs, which is what the example exercises.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
  """x + attn(ln(x)), then x + mlp(ln(x)). x: [batch, seq, d_model]."""

  d_model: int
  heads: int
  dtype: Any
  attention_fn: Callable[..., jax.Array]

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.heads, dtype=self.dtype, attention_fn=self.attention_fn, name="attn",
        out_kernel_init=nn.initializers.normal(0.02),
    )(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    h = nn.Dense(4 * self.d_model, dtype=self.dtype, name="mlp_in")(h)
    h = nn.Dense(self.d_model, dtype=self.dtype, name="mlp_out", kernel_init=nn.initializers.normal(0.02))(
        nn.gelu(h))
    return x + h


class GPT(nn.Module):
  """tokens [batch, seq] int -> logits [batch, seq, vocab] float32.

  Attributes:
    attention_fn: passed to every `nn.MultiHeadDotProductAttention`.
    causal_mask: pass `nn.make_causal_mask` to attention. False when the
      attention_fn applies causality itself (jax_flash2 with causal=True).
  """

  vocab_size: int
  max_len: int
  d_model: int
  layers: int
  heads: int
  dtype: Any
  attention_fn: Callable[..., jax.Array]
  causal_mask: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """positions: int [batch, seq], each token's index into the position
    embedding; None: 0..seq-1 (training, prefill). A decode step passes its
    new tokens' positions (each sequence's cached length)."""
    embed = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab_size, self.d_model, embedding_init=embed, name="tok_embed")(tokens)
    pos = self.param("pos_embed", embed, (self.max_len, self.d_model))
    x = (x + (pos[: tokens.shape[-1]] if positions is None else pos[positions])).astype(self.dtype)
    mask = nn.make_causal_mask(tokens) if self.causal_mask else None
    for i in range(self.layers):
      x = Block(self.d_model, self.heads, self.dtype, self.attention_fn, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(self.vocab_size, dtype=jnp.float32, name="head")(x)
