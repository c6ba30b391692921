"""The one custom_vjp joining the forward and backward kernels.

Residuals are q, k, v, the optional operands, the output and the log-sum-exp:
memory linear in the sequence length. The backward recomputes the
probabilities from them.

Both passes go through jax_flash2.sharding (per-shard kernels under jit with
batch/head sharding, vmap folded into batch). The output and lse carry the
checkpoint names "flash2_out" and "flash2_lse", so a jax.checkpoint policy such
as save_only_these_names("flash2_out", "flash2_lse") can keep them and skip
rerunning the forward kernel in the backward pass.

Attention sinks (one logit per query head in every row's softmax
denominator, carrying no value) join in the forward kernels' last step, to
the output and lse they write (in one rounding of the output, with no pass
over it after them); the backward kernels get that lse and output, from
which the probabilities they recompute, and delta = rowsum(dO * out), are
already those with the sink, and dsinks follows from them here.

Only first-order reverse mode is defined: the kernels have no derivative
rules, so differentiating either pass again raises a NotImplementedError that
says so (see first_order_only).
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from jax_flash2 import compat, merge, sharding
from jax_flash2.backends import Call
from jax_flash2.problem import Operands

OUT_NAME = "flash2_out"
LSE_NAME = "flash2_lse"

SECOND_ORDER = (
    "jax_flash2: second-order gradients (grad of grad, jax.hessian, jvp of a vjp) and forward-mode "
    "differentiation of the flash kernels' {what} are not supported: the Pallas kernels define "
    "only a first-order reverse-mode derivative. Use flash_attention(..., backend='xla') where "
    "higher-order derivatives are needed."
)


def first_order_only(fn, what: str):
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
    raise NotImplementedError(SECOND_ORDER.format(what=what))

  return guarded


def _kernel_operands(operands: Operands) -> Operands:
  """The operands as the kernels' calls take them: the sinks [heads] as
  [1, heads], batched like the ALiBi slopes (a vmapped axis folds into it)."""
  return operands if operands.sinks is None else operands._replace(sinks=operands.sinks[None])


def _forward(q, k, v, operands: Operands, call: Call):
  """(out, lse) of the forward kernels, sinks joined; lse in the base the
  kernels write it (the residual the backward reads; backends.Call.natural_lse
  makes it natural)."""
  guarded = first_order_only(lambda q, k, v, operands: sharding.forward(q, k, v, operands, call), "forward pass")
  out, lse = guarded(q, k, v, _kernel_operands(operands))
  return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q: jax.Array, k: jax.Array, v: jax.Array, operands: Operands, call: Call) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of attention through the Pallas kernels; see api.flash_attention.

  q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim];
  operands: the call's optional arrays (problem.Operands).
  Returns out like q and lse float32 [batch, heads, seq_q], natural log.
  """
  out, lse = _forward(q, k, v, operands, call)
  return out, call.natural_lse(lse)


def _flash_fwd(q, k, v, operands: Operands, call: Call):
  # The kernels directly, not flash(): a custom_vjp called inside its own fwd
  # would meet a second-order JVP with JAX's generic custom_vjp error.
  out, lse = _forward(q, k, v, operands, call)
  return (out, call.natural_lse(lse)), (q, k, v, operands, out, lse)


def _flash_bwd(call: Call, residuals, cotangents):
  q, k, v, operands, out, lse = residuals
  do, dlse = cotangents
  sinks = operands.sinks
  operands = _kernel_operands(operands)  # the backward kernels read no sinks
  # dlse is the natural lse's cotangent: d lse / d s = P in natural units
  # either way, so it folds into delta whatever base the kernels' lse is in.
  # With sinks, out and lse are the joined ones: the kernels' recomputed P is
  # the true probability and dS = P (dP - delta + dlse) holds as it is.
  arrays = (q, k, v, out, call.backward_lse(lse), do, dlse)
  backward = first_order_only(lambda *args: sharding.backward(*args[:7], args[7], call), "backward pass")
  dq, dk, dv = backward(*arrays, operands)
  dbias = None
  if operands.bias is not None:
    # A kernel of its own: jit drops it when the bias takes no gradient.
    bias_gradient = first_order_only(lambda *args: sharding.bias_gradient(*args[:7], args[7], call),
                                      "backward pass")
    ds = bias_gradient(*arrays, operands)
    # The bias broadcasts over batch and/or heads where its axis is 1.
    bias = operands.bias
    broadcast = tuple(axis for axis in (0, 1) if bias.shape[axis] == 1 and ds.shape[axis] != 1)
    dbias = ds.sum(axis=broadcast, keepdims=True).astype(bias.dtype)
  dsinks = None if sinks is None else merge.sinks_gradient(out, call.natural_lse(lse), do, dlse, sinks)
  # The mask, the segment ids, the ALiBi slopes and the seed take no gradient.
  return dq, dk, dv, Operands(bias=dbias, sinks=dsinks)


flash.defvjp(_flash_fwd, _flash_bwd)


def flash_checked(q, k, v, operands: Operands, call: Call) -> tuple[jax.Array, jax.Array]:
  """`flash`, with forward-mode differentiation (jax.jvp, jax.jacfwd) of it
  refused in jax_flash2's words rather than JAX's generic custom_vjp error
  (which, under jit, comes only at lowering)."""
  if compat.is_forward_mode(q, k, v, operands):
    raise NotImplementedError(SECOND_ORDER.format(what="forward pass"))
  sharding.check_auto_sharded(q, k, v, operands)
  return flash(q, k, v, operands, call)
