"""`attention_fn` for Flax's multi-head attention modules, backed by jax_flash2.

`flax.linen.MultiHeadDotProductAttention` and `flax.nnx.MultiHeadAttention`
project the inputs to query/key/value and then call
``attention_fn(query, key, value, **kwargs)``. Passing an attention function
from this module makes them run `jax_flash2.flash_attention` instead of
Flax's `dot_product_attention`; parameters, initialisation and outputs are
unchanged, so existing checkpoints load as they are.

Linen::

    import flax.linen as nn
    import jax, jax.numpy as jnp
    from jax_flash2.flax import attention_fn, make_attention_fn

    x = jnp.ones((4, 1024, 512), jnp.bfloat16)           # [batch, length, features]

    # Drop-in: same module, same params, flash kernels underneath.
    layer = nn.MultiHeadDotProductAttention(num_heads=8, dtype=jnp.bfloat16, attention_fn=attention_fn)
    mask = nn.make_causal_mask(jnp.ones((4, 1024)))        # [batch, 1, length, length]
    params = layer.init(jax.random.key(0), x, mask=mask)
    y = layer.apply(params, x, mask=mask)                  # [4, 1024, 512]

    # Causal without a mask array: no [batch, 1, L, L] mask in memory, and the
    # kernels skip the blocks above the diagonal. Same params as above.
    causal = nn.MultiHeadDotProductAttention(
        num_heads=8, dtype=jnp.bfloat16, attention_fn=make_attention_fn(causal=True))
    y = causal.apply(params, x)

NNX::

    from flax import nnx
    import jax.numpy as jnp
    from jax_flash2.flax import attention_fn

    layer = nnx.MultiHeadAttention(
        num_heads=8, in_features=512, dtype=jnp.bfloat16, decode=False,
        attention_fn=attention_fn, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 1024, 512), jnp.bfloat16)
    y = layer(x, is_causal=True)                           # causal via the kernel's flag
    y = layer(x, mask=nnx.make_causal_mask(jnp.ones((4, 1024))))  # or any mask

What maps onto what (the keywords the modules pass, as of flax 0.12):

- ``query``/``key``/``value`` ``[batch..., length, heads, head_dim]``: any
  number of leading batch axes (none included) are flattened into one and
  restored on the output. head_dim must be a multiple of 8 in [8, 256].
  Grouped-query attention (NNX ``num_kv_heads``): passed through as it is;
  the kernels share each K/V head across its query group without copying.
- ``mask`` ``[batch..., heads or 1, q_length, kv_length]`` (or anything
  broadcastable to it), nonzero = visible: passed to the kernels.
- ``bias``, broadcastable like the mask: added to the scores inside the
  kernels, with its gradient.
- ``sinks`` ``[heads]``: attention sinks (see ``flash_attention``), with
  their gradient. Flax's modules pass none, so the model's own module holds
  them as a parameter and binds them. Linen, inside ``@nn.compact``::

      sinks = self.param("sinks", nn.initializers.zeros, (8,))
      attend = functools.partial(attention_fn, sinks=sinks)
      y = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=attend)(x)

  NNX: the attention_fn is itself a module holding the parameter::

      class WithSinks(nnx.Module):
        def __init__(self, heads):
          self.sinks = nnx.Param(jnp.zeros((heads,)))
        def __call__(self, *args, **kwargs):
          return attention_fn(*args, sinks=self.sinks[...], **kwargs)

      layer = nnx.MultiHeadAttention(..., num_heads=8, attention_fn=WithSinks(8))
- ``is_causal`` (NNX): with q_length == kv_length the kernel's causal flag;
  otherwise Flax's top-left ``tril(ones((q_length, kv_length)))`` is applied
  as a mask, as Flax does. (NNX turns it off in decode mode itself.)
- ``dtype``: query/key/value are cast to it when given; otherwise promoted to
  their common dtype. The output has that dtype. float16, bfloat16, float32.
- ``precision``: accepted and ignored; the kernels fix their own precision
  (float32 accumulation; float32 inputs use full-precision dots).
- ``force_fp32_for_softmax``: accepted; the softmax is always float32.
- ``dropout_rate``, ``dropout_rng``, ``deterministic``, ``broadcast_dropout``:
  attention dropout inside the kernels when ``dropout_rate > 0`` and not
  ``deterministic`` (the mask is a hash of the key and the element's
  position, regenerated in the backward; see ``flash_attention``).
  ``broadcast_dropout=True`` (Flax's default) shares one mask across batch
  and heads, as Flax does.

Decoding: in a ``decode=True`` module (linen or NNX) each step attends one
query to the whole cache under Flax's cache mask ``arange(max_length) <=
cache_index``. Such a call (one query row, a mask of one row per sequence,
no bias, no dropout) runs `jax_flash2.flash_decode` over the cache, its
lengths read off the mask: the split-KV kernel reads only the written part
of the cache. A mask whose visible keys are not a prefix (the cache mask
joined with a left-padding mask) takes flash_attention instead, decided on
the device; gradients go through flash_attention. A one-query call that
cannot be served (a per-head mask, a bias, dropout) warns with the reason;
``FlashAttentionFn.why_not_decode`` says it too, and
``make_attention_fn(decode=False)`` keeps flash_attention throughout.

Not supported (each raises a clear error rather than silently differing):

- Sowing the weights (``sow_weights=True``, which passes ``module``):
  ValueError; the attention weights are never materialised.
- Linen's ``qk_attn_weights_einsum``/``attn_weights_value_einsum`` (AQT):
  ValueError when not None.
- ``input_positions`` (NNX forwards it to attention functions that apply
  RoPE themselves, e.g. ``nnx.dot_product_attention_with_rope``): this
  function applies no position embedding, so a non-None value raises
  NotImplementedError rather than being ignored. Apply RoPE to the inputs or
  projections before attention instead.

Semantics that differ from Flax's default:

- A query row whose mask hides every key gets zeros here; Flax's
  ``dot_product_attention`` returns the mean of the values for it (a softmax
  over equal ``finfo.min`` scores).
- The ``causal`` flag bound with `make_attention_fn` follows
  `jax_flash2.flash_attention`: with q_length != kv_length it is aligned
  bottom-right (query i sees key j iff j <= i + kv_length - q_length), which
  also makes it correct in linen's single-query decode step. NNX's
  ``is_causal`` keeps Flax's top-left alignment (see above). Both agree when
  q_length == kv_length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_flash2.api import flash_attention
from jax_flash2.backends import Backend
from jax_flash2.config import BlockSizes, MosaicConfig
from jax_flash2.decode import flash_decode


@dataclasses.dataclass(frozen=True)
class FlashAttentionFn:
  """A Flax-compatible attention function with the flash options bound.

  Frozen and hashable, so it can be a field of a Flax module or a static
  argument. Build it with `make_attention_fn`; call it like Flax's
  `dot_product_attention`.

  Attributes:
    causal: jax_flash2's causal flag (bottom-right aligned), always applied.
    softmax_scale: scale of q.k; None means 1 / sqrt(head_dim), as in Flax.
    backend: "auto", "mosaic", "triton" or "xla" (see `jax_flash2.flash_attention`).
    interpret: run the Pallas kernels in interpret mode (CPU tests).
    block_sizes: the Triton kernels' tiles; None for the measured defaults.
    mosaic_config: the Mosaic kernels' tilings; None for the measured defaults.
    decode: serve one query row against a cache under a one-row mask (Flax's
      decode=True cache step) through `jax_flash2.flash_decode`; see
      `why_not_decode`. False: always flash_attention.
  """

  causal: bool = False
  softmax_scale: float | None = None
  backend: str = "auto"
  interpret: bool = False
  block_sizes: BlockSizes | None = None
  mosaic_config: MosaicConfig | None = None
  decode: bool = True

  def __post_init__(self):
    if not isinstance(self.causal, bool):
      raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
    if self.backend not in [b.value for b in Backend]:
      raise ValueError(f"backend must be one of {[b.value for b in Backend]}, got {self.backend!r}")
    if not isinstance(self.interpret, bool):
      raise TypeError(f"interpret must be a bool, got {type(self.interpret).__name__}")
    if self.interpret and self.backend == "xla":
      raise ValueError("interpret=True runs the Pallas kernels; it cannot be combined with backend='xla'")
    if self.block_sizes is not None and not isinstance(self.block_sizes, BlockSizes):
      raise TypeError(f"block_sizes must be a jax_flash2.BlockSizes or None, got {type(self.block_sizes).__name__}")
    if self.mosaic_config is not None and not isinstance(self.mosaic_config, MosaicConfig):
      raise TypeError(
          f"mosaic_config must be a jax_flash2.MosaicConfig or None, got {type(self.mosaic_config).__name__}")
    if not isinstance(self.decode, bool):
      raise TypeError(f"decode must be a bool, got {type(self.decode).__name__}")
    if self.softmax_scale is not None and not isinstance(self.softmax_scale, (int, float)):
      raise TypeError(f"softmax_scale must be a float or None, got {type(self.softmax_scale).__name__}")

  def __call__(
      self,
      query: jax.Array,
      key: jax.Array,
      value: jax.Array,
      bias: jax.Array | None = None,
      mask: jax.Array | None = None,
      broadcast_dropout: bool = True,
      dropout_rng: jax.Array | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      dtype: Any = None,
      precision: Any = None,
      module: Any = None,
      force_fp32_for_softmax: bool = False,
      *,
      sinks: jax.Array | None = None,
      is_causal: bool = False,
      input_positions: jax.Array | None = None,
      qk_attn_weights_einsum: Any = None,
      attn_weights_value_einsum: Any = None,
  ) -> jax.Array:
    """Attention over [batch..., length, heads, head_dim] inputs.

    Args:
      query: [batch..., q_length, heads, head_dim].
      key: [batch..., kv_length, kv_heads, head_dim]; heads % kv_heads == 0.
      value: [batch..., kv_length, kv_heads, head_dim].
      bias: broadcastable to [batch..., heads, q_length, kv_length]; added
        to the scores.
      mask: broadcastable to [batch..., heads, q_length, kv_length]; nonzero
        = visible.
      broadcast_dropout: one dropout mask for every batch element and head.
      dropout_rng: the PRNG key of the dropout mask.
      dropout_rate, deterministic: dropout applies when dropout_rate > 0
        and not deterministic.
      dtype: cast query/key/value to it; None promotes them to a common dtype.
      precision: ignored (the kernels fix their precision).
      module: must be None (attention weights are never materialised).
      force_fp32_for_softmax: ignored (the softmax is always float32).
      sinks: float [heads]: attention sinks, one logit per query head in
        each row's softmax denominator (jax_flash2.flash_attention).
      is_causal: NNX's causal flag (top-left aligned, as in Flax).
      input_positions: must be None (no position embedding is applied here).
      qk_attn_weights_einsum, attn_weights_value_einsum: must be None.

    Returns:
      [batch..., q_length, heads, head_dim] in the compute dtype.
    """
    del precision, force_fp32_for_softmax
    _check_unsupported(module, input_positions, qk_attn_weights_einsum, attn_weights_value_einsum)
    if deterministic or dropout_rate == 0.0:
      dropout_rate, dropout_rng = 0.0, None
    query, key, value = _cast(query, key, value, dtype)
    batch_shape = _batch_shape(query, key, value)
    q, k, v = (_flatten_batch(x, batch_shape) for x in (query, key, value))
    if mask is not None:
      mask = _flatten_mask(mask, batch_shape)
    if bias is not None:
      bias = _flatten_mask(bias, batch_shape, "bias")
    causal = self.causal
    if is_causal:
      if q.shape[1] == k.shape[1]:
        causal = True
      else:
        mask = _and_masks(mask, jnp.tril(jnp.ones((q.shape[1], k.shape[1]), jnp.bool_)))
    attend = functools.partial(
        flash_attention, bias=bias, causal=causal, softmax_scale=self.softmax_scale, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, dropout_broadcast=broadcast_dropout, backend=self.backend, interpret=self.interpret,
        block_sizes=self.block_sizes, mosaic_config=self.mosaic_config)
    why = self.why_not_decode(q, k, mask, bias=bias, dropout_rate=dropout_rate)
    if why is None:
      out = _prefix_decode(attend, self._decode)(q, k, v, _visible_keys(mask, q.shape[0], k.shape[1]), sinks)
    else:
      if self.decode and q.shape[1] == 1 and mask is not None:
        # Shaped like Flax's cache step (one query under a mask), yet served
        # by flash_attention: say why, as flash_attention says why it runs XLA.
        warnings.warn(
            f"jax_flash2.flax: this one-query call over {k.shape[1]} keys (Flax's decode=True cache step) runs "
            f"flash_attention, not flash_decode: {why}. Pass make_attention_fn(decode=False) to silence this.",
            RuntimeWarning, stacklevel=2)
      out = attend(q, k, v, mask=mask, sinks=sinks)
    return out.reshape(batch_shape + out.shape[1:])

  def why_not_decode(self, query: jax.Array, key: jax.Array, mask: jax.Array | None, *,
                     bias: jax.Array | None = None, dropout_rate: float = 0.0) -> str | None:
    """None when a call serves one query row per sequence through
    flash_decode, else why it runs flash_attention (a sentence).

    Served: decode is set, q_length is 1, and the mask is one row per
    sequence ([batch..., 1, 1, kv_length] or broadcastable: Flax's decode=True
    cache step passes arange(kv_length) <= cache_index); no bias and no
    active dropout. The mask's keys must also be a prefix (keys 0..n-1
    visible, n the sequence's cache length), which only the values tell: a
    mask that is not (Flax's cache mask joined with a left-padding mask, say)
    takes flash_attention on the device (a lax.cond), with the same result.

    Args:
      query: [batch..., q_length, heads, head_dim].
      key: [batch..., kv_length, kv_heads, head_dim] (the cache).
      mask: as __call__'s (None: no mask).
      bias, dropout_rate: as __call__'s (dropout_rate 0 when deterministic).
    """
    if not self.decode:
      return "decode=False"
    if query.shape[-3] != 1:
      return f"q_length is {query.shape[-3]}; flash_decode serves one query row per sequence"
    if mask is None:
      return "there is no mask (Flax's cache step passes one: the written part of the cache)"
    shape = (1, 1) + tuple(jnp.shape(mask))  # a heads and a query axis, where a low-rank mask has none
    if shape[-3] != 1:
      return f"the mask {tuple(jnp.shape(mask))} differs between heads; flash_decode takes one length per sequence"
    if shape[-2] != 1 or shape[-1] not in (1, key.shape[-3]):
      # Not a mask for this call at all: flash_attention says what is wrong.
      return f"the mask {tuple(jnp.shape(mask))} is not one row over {key.shape[-3]} keys"
    if bias is not None:
      return "there is a bias; flash_decode takes none"
    if dropout_rate > 0.0:
      return "attention dropout is on; flash_decode is inference only"
    return None

  def _decode(self, q, k, v, cache_seqlens, sinks):
    # Mosaic has no decode kernel; backend="mosaic" means the Mosaic kernels
    # where they serve and the Triton ones for the rest (backends.choose).
    backend = Backend.TRITON.value if self.backend == Backend.MOSAIC.value else self.backend
    return flash_decode(q, k, v, cache_seqlens, sinks=sinks, softmax_scale=self.softmax_scale, backend=backend,
                        interpret=self.interpret)


def make_attention_fn(
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
    mosaic_config: MosaicConfig | None = None,
    decode: bool = True,
) -> FlashAttentionFn:
  """An `attention_fn` for Flax's attention modules with these flash options
  bound (see `jax_flash2.flash_attention` for their meaning; decode: see
  `FlashAttentionFn`)."""
  return FlashAttentionFn(
      causal=causal, softmax_scale=softmax_scale, backend=backend, interpret=interpret,
      block_sizes=block_sizes, mosaic_config=mosaic_config, decode=decode,
  )


# The drop-in with default options.
attention_fn = make_attention_fn()


def _check_unsupported(module, input_positions, qk_einsum, v_einsum) -> None:
  if module is not None:
    raise ValueError(
        "jax_flash2.flax: cannot sow attention weights (sow_weights=True): the flash kernels never "
        "materialise them. Call without sow_weights, or use Flax's default attention_fn to inspect them."
    )
  if input_positions is not None:
    raise NotImplementedError(
        "jax_flash2.flax: attention_fn got input_positions, which NNX forwards for RoPE; this attention "
        "function applies no position embedding. Rotate query/key before attention instead."
    )
  if qk_einsum is not None or v_einsum is not None:
    raise ValueError(
        "jax_flash2.flax: custom attention einsums (qk_attn_weights_einsum_cls / "
        "attn_weights_value_einsum_cls) cannot be used with the flash kernels"
    )


def _cast(query, key, value, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Casts to `dtype`, or promotes to the common dtype when it is None."""
  dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _batch_shape(query, key, value) -> tuple[int, ...]:
  """The shared leading batch shape of [batch..., length, heads, head_dim] inputs."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise ValueError(f"{name} must be [batch..., length, heads, head_dim], got shape {tuple(x.shape)}")
  batch_shape = tuple(query.shape[:-3])
  if tuple(key.shape[:-3]) != batch_shape or tuple(value.shape[:-3]) != batch_shape:
    raise ValueError(
        f"query, key and value batch dims must match: query {tuple(query.shape)}, key {tuple(key.shape)}, "
        f"value {tuple(value.shape)}"
    )
  return batch_shape


def _flatten_batch(x: jax.Array, batch_shape: tuple[int, ...]) -> jax.Array:
  """[batch..., length, heads, dim] -> [prod(batch), length, heads, dim]."""
  return x.reshape((math.prod(batch_shape),) + x.shape[-3:])


def _flatten_mask(mask, batch_shape: tuple[int, ...], name: str = "mask") -> jax.Array:
  """[batch..., heads or 1, q, k] (or broadcastable) -> [prod(batch) or 1, heads or 1, q, k]."""
  mask = jnp.asarray(mask)
  rank = len(batch_shape) + 3
  if mask.ndim > rank:
    raise ValueError(
        f"{name} must be broadcastable to [batch..., heads, q_length, kv_length] with batch dims "
        f"{batch_shape}, got shape {tuple(mask.shape)}"
    )
  mask = mask.reshape((1,) * (rank - mask.ndim) + tuple(mask.shape))
  tail = tuple(mask.shape[len(batch_shape):])
  if all(d == 1 for d in mask.shape[:len(batch_shape)]):
    return mask.reshape((1,) + tail)
  try:
    mask = jnp.broadcast_to(mask, batch_shape + tail)
  except ValueError:
    raise ValueError(f"{name} batch dims {tuple(mask.shape[:len(batch_shape)])} do not broadcast to "
                     f"{batch_shape}") from None
  return mask.reshape((math.prod(batch_shape),) + tail)


def _visible_keys(mask: jax.Array, batch: int, kv_length: int) -> jax.Array:
  """A one-row mask [batch or 1, 1, 1, kv_length] (or broadcastable) as bool [batch, kv_length]."""
  return jnp.broadcast_to(mask[:, 0, 0, :] != 0, (batch, kv_length))


def _prefix_decode(attend: Callable, decode: Callable) -> Callable:
  """f(q, k, v, visible, sinks) -> out like q: one query row per sequence
  (q [batch, 1, heads, head_dim]) over k, v [batch, kv_length, kv_heads,
  head_dim] where the bool [batch, kv_length] `visible` allows.

  Where every sequence's visible keys are a prefix, k and v are a KV cache
  whose lengths are the prefixes' and `decode` (flash_decode) serves the
  call; otherwise `attend` (flash_attention with that mask) does: a
  lax.cond on the device, so any mask gives the same result. flash_decode
  has no gradient, so a differentiated call runs `attend` and its vjp.
  """

  def run(q, k, v, visible, sinks):
    lens = jnp.sum(visible, axis=1, dtype=jnp.int32)
    prefix = jnp.all(visible == (jnp.arange(visible.shape[1], dtype=jnp.int32)[None, :] < lens[:, None]))
    return jax.lax.cond(prefix, lambda: decode(q, k, v, lens, sinks),
                        lambda: attend(q, k, v, mask=visible[:, None, None, :], sinks=sinks))

  @jax.custom_vjp
  def served(q, k, v, visible, sinks):
    return run(q, k, v, visible, sinks)

  def fwd(q, k, v, visible, sinks):
    # The vjp function is a pytree of flash_attention's residuals.
    out, vjp = jax.vjp(lambda q, k, v, sinks: attend(q, k, v, mask=visible[:, None, None, :], sinks=sinks),
                       q, k, v, sinks)
    return out, vjp

  def bwd(vjp, dout):
    dq, dk, dv, dsinks = vjp(dout)
    return dq, dk, dv, None, dsinks  # the mask takes no gradient

  served.defvjp(fwd, bwd)
  return served


def _and_masks(mask: jax.Array | None, extra: jax.Array) -> jax.Array:
  """Visible where both are (either may broadcast)."""
  return extra if mask is None else jnp.logical_and(mask != 0, extra)
