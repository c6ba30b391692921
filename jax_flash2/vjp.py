"""The one custom_vjp joining the forward and backward Pallas kernels.

Residuals are q, k, v, the output and the log-sum-exp (and the caller's dense
mask, if any): memory linear in the sequence length. The backward recomputes the probabilities from them.

Both passes go through jax_flash2.sharding (per-shard kernels under jit with
batch/head sharding, vmap folded into batch). The output and lse carry the
checkpoint names "flash2_out" and "flash2_lse", so a jax.checkpoint policy such
as save_only_these_names("flash2_out", "flash2_lse") can keep them and skip
rerunning the forward kernel in the backward pass.

Only first-order reverse mode is defined: the kernels have no derivative
rules, so differentiating either pass again raises a NotImplementedError that
says so (see _first_order_only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from jax_flash2 import sharding
from jax_flash2.config import BlockSizes
from jax_flash2.mosaic.backward import BackwardConfig
from jax_flash2.mosaic.forward import MosaicConfig
from jax_flash2.triton.tiles import Problem

OUT_NAME = "flash2_out"
LSE_NAME = "flash2_lse"

_SECOND_ORDER = (
    "jax_flash2: second-order gradients (grad of grad, jax.hessian, jvp of a vjp) and forward-mode "
    "differentiation of the flash kernels' {what} are not supported: the Pallas kernels define "
    "only a first-order reverse-mode derivative. Use flash_attention(..., backend='xla') where "
    "higher-order derivatives are needed."
)


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """Everything static about one call: hashable, so jit caches on it."""

  problem: Problem
  block_sizes: BlockSizes
  interpret: bool
  # Set when the forward, or the backward, runs the Hopper (Mosaic GPU)
  # kernels; None: the Triton-lowering ones. Each pass needs only the other's
  # lse, so the two choices are independent.
  mosaic: MosaicConfig | None = None
  mosaic_backward: BackwardConfig | None = None


def _first_order_only(fn, what: str):
  """fn, with a JVP rule that raises. A second derivative reaches the kernels
  through a JVP of the forward or backward pass (jvp of the forward inside a
  vjp, or the linearisation of the backward); without this it fails deep in
  the Pallas JVP rule with a bare AssertionError."""

  @jax.custom_jvp
  def guarded(*args):
    return fn(*args)

  @guarded.defjvp
  def _jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(_SECOND_ORDER.format(what=what))

  return guarded


def _forward(q, k, v, optional, call: KernelCall):
  guarded = _first_order_only(lambda *args: sharding.forward(*args[:3], args[3:], call), "forward pass")
  out, lse = guarded(q, k, v, *optional)
  return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    alibi_slopes: jax.Array | None,
    dropout_seed: jax.Array | None,
    bias: jax.Array | None,
    call: KernelCall,
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of attention through the Pallas kernels; see api.flash_attention.

  q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim];
  mask: None, or int8 [batch or 1, heads or 1, seq_q, seq_k] (nonzero = visible);
  q_segment_ids, kv_segment_ids: None, or int32 [batch, seq_q] and [batch, seq_k];
  alibi_slopes: None, or float32 [batch or 1, heads];
  dropout_seed: None, or int32 [2] (jax_flash2.dropout.seed_words);
  bias: None, or float [batch or 1, heads or 1, seq_q, seq_k].
  Returns out like q and lse float32 [batch, heads, seq_q].
  """
  return _forward(q, k, v, (mask, q_segment_ids, kv_segment_ids, alibi_slopes, dropout_seed, bias), call)


def _flash_fwd(q, k, v, mask, q_segment_ids, kv_segment_ids, alibi_slopes, dropout_seed, bias, call: KernelCall):
  # The kernels directly, not flash(): a custom_vjp called inside its own fwd
  # would meet a second-order JVP with JAX's generic custom_vjp error.
  optional = (mask, q_segment_ids, kv_segment_ids, alibi_slopes, dropout_seed, bias)
  out, lse = _forward(q, k, v, optional, call)
  return (out, lse), (q, k, v, optional, out, lse)


def _flash_bwd(call: KernelCall, residuals, cotangents):
  q, k, v, optional, out, lse = residuals
  do, dlse = cotangents
  arrays = (q, k, v, out, lse, do, dlse)
  backward = _first_order_only(lambda *args: sharding.backward(*args[:7], args[7:], call), "backward pass")
  dq, dk, dv = backward(*arrays, *optional)
  dbias = None
  bias = optional[-1]
  if bias is not None:
    # A kernel of its own: jit drops it when the bias takes no gradient.
    bias_gradient = _first_order_only(
        lambda *args: sharding.bias_gradient(*args[:7], args[7:], call), "backward pass"
    )
    ds = bias_gradient(*arrays, *optional)
    # The bias broadcasts over batch and/or heads where its axis is 1.
    broadcast = tuple(axis for axis in (0, 1) if bias.shape[axis] == 1 and ds.shape[axis] != 1)
    dbias = ds.sum(axis=broadcast, keepdims=True).astype(bias.dtype)
  # The mask, the segment ids, the ALiBi slopes and the seed take no gradient.
  return dq, dk, dv, None, None, None, None, None, dbias


flash.defvjp(_flash_fwd, _flash_bwd)
