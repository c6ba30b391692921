"""jax_flash2.flax: Flax's attention modules with our attention_fn match the
same modules with Flax's default attention (outputs and parameter gradients),
kernels in interpret mode, float32."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from jax_flash2 import BlockSizes, KernelConfig
from jax_flash2.flax import FlashAttentionFn, attention_fn, make_attention_fn

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
FLASH = make_attention_fn(interpret=True, block_sizes=SMALL)
BATCH, SEQ, HEADS, HEAD_DIM = 2, 24, 2, 16
FEATURES = HEADS * HEAD_DIM
TOL = 1e-5
# Interpret-mode kernels make large programs; XLA's CPU optimisations cost more
# compile time than they save here (the comparisons are float32 either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _inputs(batch_shape=(BATCH,), seq=SEQ, seed=1):
  """x [batch..., seq, features] and an output cotangent of the same shape."""
  kx, kd = jax.random.split(jax.random.PRNGKey(seed))
  shape = (*batch_shape, seq, FEATURES)
  return jax.random.normal(kx, shape, jnp.float32), jax.random.normal(kd, shape, jnp.float32)


def _key_padding_mask(batch_shape, seq=SEQ):
  """[batch..., 1, seq, seq]: example i hides its last 3 * i keys (never all)."""
  n = int(np.prod(batch_shape))
  lengths = seq - 3 * np.arange(n).reshape(batch_shape)
  kv_valid = jnp.arange(seq) < lengths[..., None]
  return nn.make_attention_mask(jnp.ones((*batch_shape, seq), jnp.bool_), kv_valid)


def _causal_mask(batch_shape, seq=SEQ):
  return nn.make_causal_mask(jnp.ones((*batch_shape, seq)))


# ---------------------------------------------------------------- linen


def _linen_out_and_grads(attention, params, x, dout, mask):
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=attention)

  def loss(p):
    out = layer.apply(p, x, mask=mask)
    return jnp.sum(out * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)(params)
  return out, grads


def _assert_trees_close(got, want):
  """Leaf by leaf rel_err < tol. The key projection's bias has an exactly zero
  gradient (softmax ignores a shift shared by all keys), so each leaf's error
  is measured against at least 1% of the whole gradient's norm."""
  paths_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  paths_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  floor = 0.01 * float(jnp.sqrt(sum(jnp.sum(jnp.square(w)) for _, w in paths_want)))
  for (path, g), (_, w) in zip(paths_got, paths_want):
    assert rel_err(g, w, floor=floor) < TOL, jax.tree_util.keystr(path)


LINEN_CASES = {
    "no_mask": ((BATCH,), lambda b: None),
    "causal_mask": ((BATCH,), _causal_mask),
    "padding_mask": ((BATCH,), _key_padding_mask),
    "leading_batch_dims_padding_and_causal": (
        (2, 3), lambda b: nn.combine_masks(_key_padding_mask(b), _causal_mask(b))),
}


@pytest.mark.parametrize("case", list(LINEN_CASES))
def test_linen_matches_default_attention(case):
  batch_shape, make_mask = LINEN_CASES[case]
  x, dout = _inputs(batch_shape)
  mask = make_mask(batch_shape)
  params = nn.MultiHeadDotProductAttention(num_heads=HEADS).init(jax.random.PRNGKey(0), x)
  out, grads = _linen_out_and_grads(FLASH, params, x, dout, mask)
  want_out, want_grads = _linen_out_and_grads(nn.dot_product_attention, params, x, dout, mask)
  assert out.shape == x.shape and out.dtype == jnp.float32
  assert rel_err(out, want_out) < TOL
  _assert_trees_close(grads, want_grads)


@pytest.mark.parametrize("batch_shape, mask_shape", [
    ((2, 3), (1, 1, 1, SEQ, SEQ)),  # shared by every example
    ((2, 3), (2, 1, 1, 1, SEQ)),  # per outer batch index, key padding style
    ((2, 3), (HEADS, SEQ, SEQ)),  # fewer dims than the inputs
    ((), (HEADS, SEQ, SEQ)),  # no batch axis at all
], ids=["shared", "partly_broadcast", "low_rank", "unbatched"])
def test_mask_shapes_broadcast_like_flax(batch_shape, mask_shape):
  """Mask reshaping around the flattened batch (XLA backend: cheap)."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (*batch_shape, SEQ, HEADS, HEAD_DIM), jnp.float32)
             for i in range(3))
  mask = jax.random.bernoulli(jax.random.PRNGKey(7), 0.7, mask_shape).at[..., 0].set(True)  # no empty row
  both = jax.jit(lambda q, k, v, mask: (make_attention_fn(backend="xla")(q, k, v, mask=mask),
                                         nn.dot_product_attention(q, k, v, mask=mask)))
  got, want = both(q, k, v, mask)
  assert got.shape == q.shape
  assert rel_err(got, want) < TOL


def test_linen_bound_causal_matches_causal_mask():
  x, dout = _inputs()
  params = nn.MultiHeadDotProductAttention(num_heads=HEADS).init(jax.random.PRNGKey(0), x)
  causal = make_attention_fn(causal=True, interpret=True, block_sizes=SMALL)
  out, grads = _linen_out_and_grads(causal, params, x, dout, None)
  want_out, want_grads = _linen_out_and_grads(nn.dot_product_attention, params, x, dout, _causal_mask((BATCH,)))
  assert rel_err(out, want_out) < TOL
  _assert_trees_close(grads, want_grads)


def test_fully_masked_query_rows_give_zeros_not_flaxs_mean():
  """Documented difference: a query that sees no key gets zeros here, the mean
  of the values in Flax. Every other row matches."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32) for i in range(3))
  q_valid = jnp.arange(SEQ) < 20  # queries 20.. are padding: their rows see nothing
  mask = nn.make_attention_mask(jnp.broadcast_to(q_valid, (BATCH, SEQ)), jnp.ones((BATCH, SEQ)))
  got = jax.jit(lambda q, k, v: FLASH(q, k, v, mask=mask), compiler_options=FAST_COMPILE)(q, k, v)
  want = nn.dot_product_attention(q, k, v, mask=mask)
  assert rel_err(got[:, :20], want[:, :20]) < TOL
  np.testing.assert_array_equal(np.asarray(got[:, 20:]), 0.0)
  np.testing.assert_allclose(np.asarray(want[:, 20:]), np.broadcast_to(v.mean(1, keepdims=True), want[:, 20:].shape),
                             rtol=1e-5, atol=1e-5)


def test_linen_decode_with_bound_causal():
  """Linen's cached decoding: one query against the whole cache under the
  cache-occupancy mask; the bottom-right causal flag leaves it unchanged
  (XLA backend: this tests the wrapper, and is cheap)."""
  x, _ = _inputs()
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True,
                                         attention_fn=make_attention_fn(causal=True, backend="xla"))
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
  variables = theirs.init(jax.random.PRNGKey(0), x)  # shapes the cache: [batch, SEQ, heads, head_dim]
  step_ours, step_theirs = (jax.jit(functools.partial(m.apply, mutable=["cache"])) for m in (ours, theirs))
  params, cache_ours, cache_theirs = variables["params"], variables["cache"], variables["cache"]
  for t in range(4):
    got, upd_ours = step_ours({"params": params, "cache": cache_ours}, x[:, t:t + 1])
    want, upd_theirs = step_theirs({"params": params, "cache": cache_theirs}, x[:, t:t + 1])
    cache_ours, cache_theirs = upd_ours["cache"], upd_theirs["cache"]
    assert rel_err(got, want) < TOL, t


def test_linen_dtype_is_applied():
  x, _ = _inputs()
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16,
                                          attention_fn=make_attention_fn(backend="xla"))
  params = layer.init(jax.random.PRNGKey(0), x)
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16)
  out, want = jax.jit(lambda p, x: (layer.apply(p, x), ref.apply(p, x)))(params, x)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, want) < 2e-2


# ---------------------------------------------------------------- nnx


def _nnx_layer(attention, num_kv_heads=None):
  kwargs = {} if attention is None else {"attention_fn": attention}
  return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, num_kv_heads=num_kv_heads, decode=False,
                                rngs=nnx.Rngs(0), **kwargs)


def _nnx_out_and_grads(layer, x, dout, x_kv=None, **call):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params):
    out = nnx.merge(graphdef, params, rest)(x, x_kv, **call)
    return jnp.sum(out * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)(params)
  return out, grads


# (No mask at all is covered by the linen tests: the same attention_fn code path.)
NNX_CASES = {
    "is_causal": dict(batch_shape=(BATCH,), call=lambda b: {"is_causal": True}),
    "leading_batch_dims_padding_mask_and_is_causal": dict(
        batch_shape=(2, 3), call=lambda b: {"mask": _key_padding_mask(b), "is_causal": True}),
    "grouped_query_is_causal": dict(batch_shape=(BATCH,), call=lambda b: {"is_causal": True}, num_kv_heads=1),
    # seq_q != seq_k: is_causal keeps Flax's top-left tril (applied as a mask).
    "cross_is_causal": dict(batch_shape=(BATCH,), call=lambda b: {"is_causal": True}, seq_kv=40),
}


@pytest.mark.parametrize("case", list(NNX_CASES))
def test_nnx_matches_default_attention(case):
  spec = NNX_CASES[case]
  x, dout = _inputs(spec["batch_shape"])
  x_kv = _inputs(spec["batch_shape"], seq=spec["seq_kv"], seed=2)[0] if "seq_kv" in spec else None
  call = spec["call"](spec["batch_shape"])
  ours, theirs = _nnx_layer(FLASH, spec.get("num_kv_heads")), _nnx_layer(None, spec.get("num_kv_heads"))
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)), jax.tree.leaves(nnx.state(theirs, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same init
  out, grads = _nnx_out_and_grads(ours, x, dout, x_kv, **call)
  want_out, want_grads = _nnx_out_and_grads(theirs, x, dout, x_kv, **call)
  assert out.shape == x.shape
  assert rel_err(out, want_out) < TOL
  _assert_trees_close(grads, want_grads)


# ---------------------------------------------------------------- options and errors


def test_make_attention_fn_is_a_hashable_frozen_dataclass():
  fn = make_attention_fn(causal=True, softmax_scale=0.5, block_sizes=SMALL)
  assert isinstance(fn, FlashAttentionFn) and fn.causal and fn.softmax_scale == 0.5
  assert fn == make_attention_fn(causal=True, softmax_scale=0.5, block_sizes=SMALL)
  assert hash(fn) == hash(make_attention_fn(causal=True, softmax_scale=0.5, block_sizes=SMALL))
  assert attention_fn == FlashAttentionFn()
  with pytest.raises(AttributeError):
    fn.causal = False  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(causal="yes"), TypeError, "causal"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(backend="xla", interpret=True), ValueError, "interpret"),
    (dict(block_sizes=(16, 16)), TypeError, "block_sizes"),
])
def test_make_attention_fn_validates(kwargs, error, message):
  with pytest.raises(error, match=message):
    make_attention_fn(**kwargs)


XLA_SAME_HASH = make_attention_fn(backend="xla")  # draws the kernels' dropout mask in plain jnp


@pytest.mark.parametrize("broadcast", [True, False])
def test_linen_dropout_reaches_the_kernels(broadcast):
  """Flax's dropout_rate, dropout rng and broadcast_dropout pass through: the
  kernels' output equals jax_flash2's XLA path with the same key (same hash),
  and differs from the deterministic call."""
  x, _ = _inputs()
  layer = lambda fn: nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.3, attention_fn=fn,
                                                     broadcast_dropout=broadcast)
  params = layer(FLASH).init(jax.random.PRNGKey(0), x, deterministic=True)
  rngs = {"dropout": jax.random.PRNGKey(1)}
  apply = lambda fn, deterministic: jax.jit(
      lambda params, x, rngs: layer(fn).apply(params, x, deterministic=deterministic, rngs=rngs),
      compiler_options=FAST_COMPILE)(params, x, rngs)
  got = apply(FLASH, False)
  want = apply(XLA_SAME_HASH, False)
  assert rel_err(got, want) < TOL
  assert rel_err(got, apply(FLASH, True)) > 1e-2


def test_nnx_dropout_reaches_the_kernels():
  x, _ = _inputs()
  layer = lambda fn: nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, dropout_rate=0.3,
                                            decode=False, attention_fn=fn, rngs=nnx.Rngs(0))
  got, want = layer(FLASH)(x, deterministic=False), layer(XLA_SAME_HASH)(x, deterministic=False)
  assert rel_err(got, want) < TOL
  assert rel_err(got, layer(FLASH)(x, deterministic=True)) > 1e-2


def test_linen_sow_weights_raises():
  x, _ = _inputs()
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=FLASH)
  params = layer.init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="never materialise"):
    layer.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_nnx_sow_weights_raises():
  x, _ = _inputs()
  with pytest.raises(ValueError, match="never materialise"):
    _nnx_layer(FLASH)(x, sow_weights=True)


def test_nnx_input_positions_raise():
  x, _ = _inputs()
  with pytest.raises(NotImplementedError, match="no position embedding"):
    _nnx_layer(FLASH)(x, input_positions=jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ)))


def test_bias_matches_flax_with_its_gradient():
  """Flax's `bias` argument (added to the scaled scores) reaches the kernels,
  with extra batch dims flattened and the gradient flowing back to it."""
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, v = (jax.random.normal(key, (2, BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32) for key in keys[:3])
  bias = jax.random.normal(keys[3], (1, BATCH, HEADS, SEQ, SEQ), jnp.float32)
  loss = lambda fn: lambda q, bias: jnp.sum(fn(q, k, v, bias=bias) ** 2)
  value_and_grad = lambda fn: jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1)), compiler_options=FAST_COMPILE)
  got = value_and_grad(FLASH)(q, bias)
  want = value_and_grad(nn.dot_product_attention)(q, bias)
  for x, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(x, w) < TOL


class _LinenWithSinks(nn.Module):
  """A model's own module: learned sinks, bound into the attention_fn."""

  attention: FlashAttentionFn

  @nn.compact
  def __call__(self, x):
    sinks = self.param("sinks", nn.initializers.normal(2.0), (HEADS,))
    attend = functools.partial(self.attention, sinks=sinks)
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=attend)(x, mask=_causal_mask((BATCH,)))


class _NnxSinks(nnx.Module):
  """An attention_fn that is itself a module holding the sinks parameter."""

  def __init__(self, attention: FlashAttentionFn):
    self.attention = attention
    self.sinks = nnx.Param(2.0 * jax.random.normal(jax.random.PRNGKey(4), (HEADS,)))

  def __call__(self, *args, **kwargs):
    return self.attention(*args, sinks=self.sinks[...], **kwargs)


def test_sinks_from_a_linen_module_with_their_gradient():
  """The kernels against jax_flash2's XLA path (the reference, with the sink
  column): outputs and every parameter's gradient, the sinks' included."""
  x, dout = _inputs()
  params = _LinenWithSinks(FLASH).init(jax.random.PRNGKey(0), x)

  def out_and_grads(attention):
    loss = lambda p: (lambda out: (jnp.sum(out * dout), out))(_LinenWithSinks(attention).apply(p, x))
    return jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)(params)

  (_, out), grads = out_and_grads(FLASH)
  (_, want_out), want_grads = out_and_grads(make_attention_fn(backend="xla"))
  assert rel_err(out, want_out) < TOL
  _assert_trees_close(grads, want_grads)
  assert float(jnp.abs(grads["params"]["sinks"]).min()) > 0


def test_sinks_from_an_nnx_module_with_their_gradient():
  x, dout = _inputs()
  ours, theirs = (_nnx_layer(_NnxSinks(fn), num_kv_heads=1) for fn in (FLASH, make_attention_fn(backend="xla")))
  out, grads = _nnx_out_and_grads(ours, x, dout, is_causal=True)
  want_out, want_grads = _nnx_out_and_grads(theirs, x, dout, is_causal=True)
  assert rel_err(out, want_out) < TOL
  _assert_trees_close(grads, want_grads)
  assert float(jnp.abs(grads["attention_fn"]["sinks"][...]).min()) > 0


def test_custom_einsum_raises():
  q = jnp.zeros((BATCH, SEQ, HEADS, HEAD_DIM))
  with pytest.raises(ValueError, match="einsum"):
    FLASH(q, q, q, qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)


def test_mismatched_batch_dims_raise():
  q = jnp.zeros((BATCH, SEQ, HEADS, HEAD_DIM))
  with pytest.raises(ValueError, match="batch dims must match"):
    FLASH(q, q[:1], q[:1])


# ---------------------------------------------------------------- decoding (flash_decode)

VOCAB = 11


class _Decoder(nn.Module):
  """Tokens -> logits through one cached (decode=True) self-attention layer."""

  attention: Any = nn.dot_product_attention

  @nn.compact
  def __call__(self, tokens, mask=None):
    x = nn.Embed(VOCAB, FEATURES)(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True, attention_fn=self.attention)(x, mask=mask)
    return nn.Dense(VOCAB)(x)


def _decode_step(attention):
  """(logits [batch, 1, VOCAB], cache) of one jitted decode step."""
  model = _Decoder(attention)
  return jax.jit(lambda params, cache, token, mask: model.apply(
      {"params": params, "cache": cache}, token, mask=mask, mutable=["cache"]), compiler_options=FAST_COMPILE)


def _greedy(step, params, cache, mask, steps=4):
  """(tokens [batch, steps], logits [batch, steps, VOCAB]) of greedy decoding from tokens 3 and 5."""
  token, tokens, logits = jnp.asarray([[3], [5]], jnp.int32), [], []
  for _ in range(steps):
    out, variables = step(params, cache, token, mask)
    cache, token = variables["cache"], jnp.argmax(out, axis=-1).astype(jnp.int32)  # int64 under x64: a recompile
    tokens.append(token[:, 0])
    logits.append(out[:, 0])
  return jnp.stack(tokens, 1), jnp.stack(logits, 1)


def test_linen_decode_runs_flash_decode_and_generates_flaxs_tokens():
  """Greedy generation with a decode=True model: jax_flash2's attention_fn
  (interpret mode) gives Flax's tokens and logits.

  Our cache is poisoned with NaN (Flax's step writes each new key and value
  over it), Flax's is zeros: flash_decode reads only the written keys, while
  flash_attention and Flax's attention multiply every value (0 * NaN), so
  NaN-free logits show flash_decode served the steps. Then a mask hiding key
  1 of sequence 1, not a prefix from step 2 on, takes flash_attention on the
  device in the same compiled step, again with Flax's result."""
  variables = _Decoder().init(jax.random.PRNGKey(0), jnp.zeros((BATCH, SEQ), jnp.int32))  # sizes the cache: SEQ
  params, cache = variables["params"], variables["cache"]
  poisoned = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.ndim == 4 else x, cache)
  ones = jnp.ones((BATCH, 1, 1, SEQ), jnp.float32)
  ours, theirs = _decode_step(FLASH), _decode_step(nn.dot_product_attention)
  for mask, our_cache in ((ones, poisoned), (ones.at[1, ..., 1].set(0.0), cache)):
    tokens, logits = _greedy(ours, params, our_cache, mask)
    want_tokens, want_logits = _greedy(theirs, params, cache, mask)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    assert rel_err(logits, want_logits) < TOL


def test_nnx_decode_with_grouped_heads():
  """NNX's decode=True cache step with GQA (num_kv_heads): flash_decode's XLA
  path against Flax's attention."""
  x, _ = _inputs()
  layers = [nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, num_kv_heads=1, decode=True,
                                   rngs=nnx.Rngs(0), **kwargs)
            for kwargs in ({"attention_fn": make_attention_fn(backend="xla")}, {})]
  steps, states = [], []
  for layer in layers:
    layer.init_cache(x.shape)
    graphdef, state = nnx.split(layer)

    def step(state, x, graphdef=graphdef):
      layer = nnx.merge(graphdef, state)
      return layer(x), nnx.state(layer)

    steps.append(jax.jit(step, compiler_options=FAST_COMPILE))
    states.append(state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # served: no fallback warning
    for t in range(3):
      (got, states[0]), (want, states[1]) = (step(state, x[:, t:t + 1]) for step, state in zip(steps, states))
      assert rel_err(got, want) < TOL, t


def test_one_query_fallbacks_say_why():
  """A one-query call that flash_decode cannot serve runs flash_attention
  with Flax's result and warns why (XLA backend: cheap)."""
  keys = jax.random.split(jax.random.PRNGKey(5), 4)
  q = jax.random.normal(keys[0], (BATCH, 1, HEADS, HEAD_DIM), jnp.float32)
  k, v = (jax.random.normal(key, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32) for key in keys[1:3])
  per_head = jnp.arange(SEQ) < jnp.asarray([5, 9])[:, None, None, None]  # [heads, 1, 1, SEQ] -> per head
  per_head = jnp.broadcast_to(jnp.swapaxes(per_head, 0, 1), (BATCH, HEADS, 1, SEQ))
  prefix = jnp.broadcast_to(jnp.arange(SEQ) < 7, (BATCH, 1, 1, SEQ))
  bias = jax.random.normal(keys[3], (BATCH, HEADS, 1, SEQ), jnp.float32)
  fn = make_attention_fn(backend="xla")
  both = lambda fn, **options: jax.jit(lambda q, k, v: (fn(q, k, v, **options), nn.dot_product_attention(
      q, k, v, **options)), compiler_options=FAST_COMPILE)(q, k, v)
  for options, reason in ((dict(mask=per_head), "differs between heads"), (dict(mask=prefix, bias=bias), "bias")):
    with pytest.warns(RuntimeWarning, match=f"runs flash_attention, not flash_decode: .*{reason}"):
      got, want = both(fn, **options)
    assert rel_err(got, want) < TOL
  with pytest.warns(RuntimeWarning, match="dropout is on"):
    jax.eval_shape(functools.partial(fn, mask=prefix, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(0)), q, k, v)
  assert fn.why_not_decode(q, k, prefix) is None
  assert "q_length is 2" in fn.why_not_decode(jnp.zeros((BATCH, 2, HEADS, HEAD_DIM)), k, prefix)
  quiet = make_attention_fn(backend="xla", decode=False)
  assert quiet.why_not_decode(q, k, prefix) == "decode=False"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.eval_shape(functools.partial(quiet, mask=per_head), q, k, v)
  with pytest.raises(TypeError, match="decode must be a bool"):
    make_attention_fn(decode=1)


def test_one_query_gradient_goes_through_flash_attention():
  """flash_decode has no gradient: a differentiated one-query call under a
  prefix mask takes flash_attention's, equal to Flax's (XLA backend)."""
  keys = jax.random.split(jax.random.PRNGKey(6), 4)
  q = jax.random.normal(keys[0], (BATCH, 1, HEADS, HEAD_DIM), jnp.float32)
  k, v = (jax.random.normal(key, (BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32) for key in keys[1:3])
  mask = (jnp.arange(SEQ) < jnp.asarray([4, 11])[:, None])[:, None, None, :]
  dout = jax.random.normal(keys[3], q.shape, jnp.float32)
  grads = lambda fn: jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask) * dout), (0, 1, 2)),
                             compiler_options=FAST_COMPILE)(q, k, v)
  for got, want in zip(grads(make_attention_fn(backend="xla")), grads(nn.dot_product_attention)):
    assert rel_err(got, want) < TOL
