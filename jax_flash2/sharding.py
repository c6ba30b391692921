"""The kernels under SPMD partitioning and vmap.

A `pallas_call` has a batching rule but no sharding rule. Under `jax.jit` with
operands sharded over a mesh, the partitioner does not know that the kernels
work on each (batch, head) independently, so it gathers the operands and runs
the whole problem on every device. Here the forward and the backward kernels
are each wrapped in a `custom_partitioning` whose Shardy rule says so: batch
and heads pass through (each device runs the kernels on its own shard, no
collective); seq_q, seq_k and head_dim must be replicated. A caller who shards
a sequence or head_dim axis gets it gathered before the kernels (queries could
be split, but the causal offset would then depend on the shard; keys are
reduced over). Under GQA the K/V heads are split with the query heads when
whole groups stay together; MQA's one K/V head is replicated and dK/dV are
summed over the head shards (an all-reduce, the only collective).

`custom_partitioning` has no batching rule, so a `custom_vmap` sits outside it:
a vmapped axis is folded into the kernels' batch axis, which they handle
anyway, and the partitioned function is called again on the folded arrays.

Neither wrapper is differentiable; vjp.py puts the one custom_vjp around them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash2.mosaic import backward as mosaic_backward
from jax_flash2.mosaic import forward as mosaic_forward
from jax_flash2.triton import backward as triton_backward
from jax_flash2.triton import forward as triton_forward
from jax_flash2.triton.tiles import OptionalInputs

if TYPE_CHECKING:
  from jax_flash2.vjp import KernelCall


def _factors(q_shape, kv_shape, mask_shape, slopes_shape=None, bias_shape=None) -> dict[str, str]:
  """Shardy factors of each kind of operand.

  b batch, i seq_q, j seq_k, d head_dim, h heads. Under GQA the query heads
  (qh) and K/V heads (kh) get factors of their own: a shared compound factor
  would let Shardy split a mesh axis across them into sub-axes, which
  custom_partitioning cannot hand to the partition callback;
  _plan keeps them consistent instead. mb / mh are a mask's broadcast (size 1)
  batch / heads axes, which can share no factor with the full-size ones; ab
  the ALiBi slopes' broadcast batch axis; z the dropout seed's two words.
  The bias (and dS, its gradient) takes the mask's factors.
  """
  if q_shape[2] == kv_shape[2]:
    heads = kv_heads = "h"
  else:
    heads, kv_heads = "qh", "kh"
  names = {
      "qo": f"b i {heads} d", "kv": f"b j {kv_heads} d", "rows": f"b {heads} i",
      "q_segments": "b i", "kv_segments": "b j", "seed": "z",
  }
  names["scores"] = f"b {heads} i j"
  for name, shape in (("mask", mask_shape), ("bias", bias_shape)):
    if shape is not None:
      names[name] = f"{'b' if shape[0] > 1 else 'mb'} {heads if shape[1] > 1 else 'mh'} i j"
  if slopes_shape is not None:
    names["slopes"] = f"{'b' if slopes_shape[0] > 1 else 'ab'} {heads}"
  return names


def _rule(operands: list[str], results: list[str]) -> tuple[str, dict]:
  """The einsum-like rule: batch and heads pass through; seq_q, seq_k,
  head_dim and the broadcast mask axes must be replicated."""
  rule = f"{', '.join(operands)} -> {', '.join(results)}"
  # Shardy wants the special factors listed in the order they first appear.
  order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
  replicated = tuple(f for f in order if f in ("i", "j", "d", "mb", "mh", "ab", "z"))
  return rule, {"need_replication_factors": replicated}


def _shape(ir_type) -> tuple[int, ...]:
  # The rule callback is handed MLIR types, not avals.
  return tuple(ir.RankedTensorType(ir_type).shape)


def _axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  return math.prod(mesh.shape[name] for name in (axes if isinstance(axes, tuple) else (axes,)))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How one call runs per shard: the operand shardings (q-like, K/V-like,
  row-vector-like, mask), and the mesh axes that dK/dV are summed over."""

  qo: NamedSharding
  kv: NamedSharding
  rows: NamedSharding
  mask: NamedSharding | None
  q_segments: NamedSharding
  kv_segments: NamedSharding
  slopes: NamedSharding | None
  seed: NamedSharding
  bias: NamedSharding | None
  scores: NamedSharding
  kv_partial_over: str | tuple[str, ...] | None


def _plan(mesh, q, k, mask, slopes, bias) -> _Plan:
  """Every device holds whole (batch, head) problems: q's batch and head
  sharding is kept and everything else is replicated.

  q, k, mask, slopes, bias: ShapeDtypeStructs carrying the partitioner's
  shardings (mask, slopes and bias may be None). Under GQA the K/V heads are split like the query heads when that
  keeps whole groups on a shard; MQA's single K/V head is replicated, and
  each shard's dK/dV is then a partial sum over its query heads; any other
  split of the heads is gathered.
  """
  spec = tuple(q.sharding.spec) + (None,) * (4 - len(q.sharding.spec))
  batch, heads = spec[0], spec[2]
  kv_heads, partial = heads, None
  if k.shape[2] != q.shape[2] and heads is not None:
    if k.shape[2] == 1:
      kv_heads, partial = None, heads
    elif k.shape[2] % _axes_size(mesh, heads):
      heads = kv_heads = None
  def per_score(x):  # mask, bias: [batch or 1, heads or 1, seq_q, seq_k]
    if x is None:
      return None
    return NamedSharding(mesh, P(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None, None, None))

  slopes_sharding = None
  if slopes is not None:
    slopes_sharding = NamedSharding(mesh, P(batch if slopes.shape[0] > 1 else None, heads))
  return _Plan(
      qo=NamedSharding(mesh, P(batch, None, heads, None)),
      kv=NamedSharding(mesh, P(batch, None, kv_heads, None)),
      rows=NamedSharding(mesh, P(batch, heads, None)),
      mask=per_score(mask),
      q_segments=NamedSharding(mesh, P(batch, None)),
      kv_segments=NamedSharding(mesh, P(batch, None)),
      slopes=slopes_sharding,
      seed=NamedSharding(mesh, P(None)),
      bias=per_score(bias),
      scores=NamedSharding(mesh, P(batch, heads, None, None)),
      kv_partial_over=partial,
  )


def _local(call: KernelCall, q, k) -> KernelCall:
  """The call for one shard: the same static problem, except that the GQA
  group shrinks when the query heads are split and a single K/V head is not."""
  group = q.shape[2] // k.shape[2]
  if call.problem.group == group:
    return call
  return dataclasses.replace(call, problem=dataclasses.replace(call.problem, group=group))


# ---------------------------------------------------------------- forward


# The optional operands, in this order, follow the arrays of every function
# here: (mask, q_segments, kv_segments, slopes, seed, bias).
_NUM_OPTIONAL = 6
_SEED = 4  # its position among them


def _one_lowering(kernels: Callable, num_arrays: int) -> Callable:
  """kernels(*arrays, *optional, call) under one jax.jit, the KernelCall
  static: identical calls (a model's layers) then share one trace, and one
  lowering in the module that holds them, so the Pallas kernels are lowered
  and compiled once per distinct problem rather than once per call site.
  (Without it, 4 stacked calls at the example GPT's shapes lowered 4 copies
  of each kernel: 8.5 s against 2.5 s for one call, before compiling each
  copy.)"""
  return jax.jit(kernels, static_argnums=(num_arrays + _NUM_OPTIONAL,))


def _optional_inputs(mask, q_segments, kv_segments, slopes, seed, bias) -> OptionalInputs:
  segments = None if q_segments is None else (q_segments, kv_segments)
  return OptionalInputs(mask=mask, segments=segments, slopes=slopes, seed=seed, bias=bias)


def _forward_kernels(q, k, v, *args):
  *optional, call = args
  call = _local(call, q, k)
  if call.mosaic is not None:
    # Only plain (causal or full) problems get here; see api._mosaic_config.
    problem = call.problem
    return mosaic_forward.forward(
        q, k, v, causal=problem.window_right == 0, softmax_scale=problem.softmax_scale, config=call.mosaic,
        interpret=call.interpret,
    )
  return triton_forward.forward(
      q, k, v, _optional_inputs(*optional), call.problem, call.block_sizes.fwd, interpret=call.interpret
  )


_forward_kernels = _one_lowering(_forward_kernels, 3)
_forward_partitioned = custom_partitioning(_forward_kernels, static_argnums=(3 + _NUM_OPTIONAL,))


def _optional_factors(f: dict[str, str], call: KernelCall) -> list[str]:
  """Rule entries of the optional operands a call has (None ones are absent)."""
  problem = call.problem
  return (
      ([f["mask"]] if problem.has_mask else [])
      + ([f["q_segments"], f["kv_segments"]] if problem.has_segments else [])
      + ([f["slopes"]] if problem.has_alibi else [])
      + ([f["seed"]] if problem.has_dropout else [])
      + ([f["bias"]] if problem.has_bias else [])
  )


def _optional_shardings(plan: _Plan, call: KernelCall) -> tuple:
  """Shardings of the optional operands, None where absent."""
  segments = (plan.q_segments, plan.kv_segments) if call.problem.has_segments else (None, None)
  seed = plan.seed if call.problem.has_dropout else None
  return (plan.mask, *segments, plan.slopes, seed, plan.bias)


def _optional_shapes(shapes: list, num_fixed: int, call: KernelCall):
  """(mask, slopes, bias) shapes out of the operand shapes, None where absent."""
  rest = list(shapes[num_fixed:])
  mask = rest.pop(0) if call.problem.has_mask else None
  if call.problem.has_segments:
    rest = rest[2:]
  slopes = rest.pop(0) if call.problem.has_alibi else None
  if call.problem.has_dropout:
    rest = rest[1:]
  bias = rest.pop(0) if call.problem.has_bias else None
  return mask, slopes, bias


def _forward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  shapes = [_shape(t) for t in operand_types]
  f = _factors(shapes[0], shapes[1], *_optional_shapes(shapes, 3, call))
  return _rule([f["qo"], f["kv"], f["kv"], *_optional_factors(f, call)], [f["qo"], f["rows"]])


def _forward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  q, k, _, mask, _, _, slopes, _, bias = arg_shapes
  plan = _plan(mesh, q, k, mask, slopes, bias)
  # Every shard is a set of whole (batch, head) problems: the same kernels run
  # it on shard-shaped operands, with no communication.
  lower = lambda *args: _forward_kernels(*args, call)
  operands = (plan.qo, plan.kv, plan.kv, *_optional_shardings(plan, call))
  return mesh, lower, (plan.qo, plan.rows), operands


_forward_partitioned.def_partition(partition=_forward_partition, sharding_rule=_forward_rule)


# ---------------------------------------------------------------- backward


def _on_shard(kernels: Callable) -> Callable:
  """kernels(q, k, v, out, lse, do, dlse, optional, problem, block_sizes,
  interpret=) (a backward entry point of triton.backward), called on one
  shard's operands: (q, k, v, out, lse, do, dlse, *optional, call)."""

  def run(q, k, v, out, lse, do, dlse, *args):
    *optional, call = args
    call = _local(call, q, k)
    return kernels(
        q, k, v, out, lse, do, dlse, _optional_inputs(*optional), call.problem, call.block_sizes,
        interpret=call.interpret,
    )

  return run


def _backward_kernels(q, k, v, out, lse, do, dlse, *args):
  *optional, call = args
  if call.mosaic_backward is None:
    return _triton_backward_kernels(q, k, v, out, lse, do, dlse, *args)
  # Only plain (causal or full) problems get here; see api._mosaic_backward_config.
  problem = call.problem
  delta = triton_backward.backward_delta(out, do, dlse, problem, interpret=call.interpret)
  return mosaic_backward.backward(q, k, v, do, lse, delta, causal=problem.window_right == 0,
                                  softmax_scale=problem.softmax_scale, config=call.mosaic_backward,
                                  interpret=call.interpret)


_triton_backward_kernels = _on_shard(triton_backward.backward)
_backward_kernels = _one_lowering(_backward_kernels, 7)
_backward_partitioned = custom_partitioning(_backward_kernels, static_argnums=(7 + _NUM_OPTIONAL,))


def _backward_operand_factors(call, operand_types) -> tuple[dict[str, str], list[str]]:
  shapes = [_shape(t) for t in operand_types]
  f = _factors(shapes[0], shapes[1], *_optional_shapes(shapes, 7, call))
  qo, kv, rows = f["qo"], f["kv"], f["rows"]
  return f, [qo, kv, kv, qo, rows, qo, rows, *_optional_factors(f, call)]


def _backward_plan(mesh, arg_shapes) -> _Plan:
  (q, k), (mask, _, _, slopes, _, bias) = arg_shapes[:2], arg_shapes[7:]
  return _plan(mesh, q, k, mask, slopes, bias)


def _backward_operand_shardings(plan: _Plan, call: KernelCall) -> tuple:
  qo, kv, rows = plan.qo, plan.kv, plan.rows
  return (qo, kv, kv, qo, rows, qo, rows, *_optional_shardings(plan, call))


def _backward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  f, operands = _backward_operand_factors(call, operand_types)
  return _rule(operands, [f["qo"], f["kv"], f["kv"]])


def _backward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _backward_plan(mesh, arg_shapes)

  def lower(*args):
    dq, dk, dv = _backward_kernels(*args, call)
    if plan.kv_partial_over is not None:
      # MQA with the query heads split: the K/V head's gradient sums over
      # query heads held by several shards (the one collective here).
      dk, dv = jax.lax.psum((dk, dv), plan.kv_partial_over)
    return dq, dk, dv

  return mesh, lower, (plan.qo, plan.kv, plan.kv), _backward_operand_shardings(plan, call)


_backward_partitioned.def_partition(partition=_backward_partition, sharding_rule=_backward_rule)


# ---------------------------------------------------------------- bias gradient


_bias_gradient_kernels = _one_lowering(_on_shard(triton_backward.bias_gradient), 7)
_bias_gradient_partitioned = custom_partitioning(_bias_gradient_kernels, static_argnums=(7 + _NUM_OPTIONAL,))


def _bias_gradient_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  f, operands = _backward_operand_factors(call, operand_types)
  return _rule(operands, [f["scores"]])


def _bias_gradient_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _backward_plan(mesh, arg_shapes)
  # dS of each (batch, head) is computed where its problem lives; the sum
  # over the bias's broadcast axes happens outside, in plain JAX.
  lower = lambda *args: _bias_gradient_kernels(*args, call)
  return mesh, lower, plan.scores, _backward_operand_shardings(plan, call)


_bias_gradient_partitioned.def_partition(partition=_bias_gradient_partition, sharding_rule=_bias_gradient_rule)


# ---------------------------------------------------------------- vmap


def _fold(x: jax.Array, axis_size: int, batched: bool) -> jax.Array:
  """[axis_size, batch, ...] (or [batch, ...] when not batched) -> [axis_size * batch, ...]."""
  if not batched:
    x = jnp.broadcast_to(x, (axis_size, *x.shape))
  return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def _fold_mask(mask: jax.Array | None, axis_size: int, batched: bool, batch: int) -> jax.Array | None:
  """Folds a mask (or the ALiBi slopes: any array with batch on axis 0) like
  _fold, keeping a batch axis that is broadcast over everything at size 1."""
  if mask is None or (not batched and mask.shape[0] == 1):
    return mask
  if not batched:
    mask = jnp.broadcast_to(mask, (axis_size, *mask.shape))
  elif mask.shape[1] != batch:  # broadcast over batch, not over the vmapped axis
    mask = jnp.broadcast_to(mask, (axis_size, batch, *mask.shape[2:]))
  return mask.reshape(axis_size * mask.shape[1], *mask.shape[2:])


def _unfold(x: jax.Array, axis_size: int) -> jax.Array:
  return x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])


def _with_vmap(partitioned: Callable, num_arrays: int, call: KernelCall) -> Callable:
  """partitioned(*arrays, mask, q_segments, kv_segments, slopes, seed, call)
  under a custom_vmap that folds the vmapped axis into batch. arrays all
  carry batch on axis 0; the optional inputs may keep a broadcast batch axis
  of size 1; the dropout seed has no batch axis and is shared."""

  @jax.custom_batching.custom_vmap
  def fn(*args):
    return partitioned(*args, call)

  @fn.def_vmap
  def rule(axis_size, in_batched, *args):
    arrays, optional = args[:num_arrays], list(args[num_arrays:])
    if in_batched[num_arrays + _SEED]:
      raise NotImplementedError(
          "jax_flash2: vmap over dropout_rng is not supported (one key draws the masks of every batch "
          "element and head already); pass one key, or fold the mapped axis into batch"
      )
    # The batch of one vmapped instance, read off q.
    batch = arrays[0].shape[1] if in_batched[0] else arrays[0].shape[0]
    folded = [_fold(x, axis_size, b) for x, b in zip(arrays, in_batched[:num_arrays])]
    # mask, segment ids, slopes, bias: batch on axis 0, possibly broadcast;
    # the seed has no batch axis and is shared.
    optional = [
        x if i == _SEED else _fold_mask(x, axis_size, b, batch)
        for i, (x, b) in enumerate(zip(optional, in_batched[num_arrays:]))
    ]
    # fn, not partitioned: under nested vmaps this runs inside the outer one,
    # whose axis is folded in turn.
    outs = fn(*folded, *optional)
    if not isinstance(outs, tuple):
      return _unfold(outs, axis_size), True
    return tuple(_unfold(x, axis_size) for x in outs), (True,) * len(outs)

  return fn


def forward(q, k, v, optional: tuple, call: KernelCall) -> tuple[jax.Array, jax.Array]:
  """(out, lse): out like q, lse float32 [batch, heads, seq_q].

  q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim]
  (kv_heads divides heads); optional: (mask, q_segments, kv_segments, slopes,
  seed, bias), None where absent: mask int8 and bias float [batch or 1,
  heads or 1, seq_q, seq_k]; segment ids int32 [batch, seq_q] and [batch,
  seq_k]; ALiBi slopes float32 [batch or 1, heads]; the dropout seed int32 [2].
  """
  # Mosaic's interpreter steps the kernel through ordered io_callbacks,
  # which custom_partitioning cannot lower under jit: on CPU, unsharded,
  # the kernels are called directly.
  partitioned = _forward_kernels if call.mosaic is not None and call.interpret else _forward_partitioned
  return _with_vmap(partitioned, 3, call)(q, k, v, *optional)


def backward(q, k, v, out, lse, do, dlse, optional: tuple, call: KernelCall) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv), each like its primal; lse, dlse float32 [batch, heads, seq_q]."""
  # As in forward(): Mosaic's interpreter is called directly.
  partitioned = _backward_kernels if call.mosaic_backward is not None and call.interpret else _backward_partitioned
  return _with_vmap(partitioned, 7, call)(q, k, v, out, lse, do, dlse, *optional)


def bias_gradient(q, k, v, out, lse, do, dlse, optional: tuple, call: KernelCall) -> jax.Array:
  """dS, float32 [batch, heads, seq_q, seq_k]: the bias's gradient before the
  sum over its broadcast axes."""
  return _with_vmap(_bias_gradient_partitioned, 7, call)(q, k, v, out, lse, do, dlse, *optional)
