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

from jax_flash2.triton import backward as triton_backward
from jax_flash2.triton import forward as triton_forward
from jax_flash2.triton.tiles import OptionalInputs

if TYPE_CHECKING:
  from jax_flash2.vjp import KernelCall


def _factors(q_shape, kv_shape, mask_shape, slopes_shape=None) -> dict[str, str]:
  """Shardy factors of each kind of operand.

  b batch, i seq_q, j seq_k, d head_dim, h heads. Under GQA the query heads
  (qh) and K/V heads (kh) get factors of their own: a shared compound factor
  would let Shardy split a mesh axis across them into sub-axes, which
  custom_partitioning cannot hand to the partition callback;
  _plan keeps them consistent instead. mb / mh are a mask's broadcast (size 1)
  batch / heads axes, which can share no factor with the full-size ones; ab
  the ALiBi slopes' broadcast batch axis; z the dropout seed's two words.
  """
  if q_shape[2] == kv_shape[2]:
    heads = kv_heads = "h"
  else:
    heads, kv_heads = "qh", "kh"
  names = {
      "qo": f"b i {heads} d", "kv": f"b j {kv_heads} d", "rows": f"b {heads} i",
      "q_segments": "b i", "kv_segments": "b j", "seed": "z",
  }
  if mask_shape is not None:
    batch = "b" if mask_shape[0] > 1 else "mb"
    mask_heads = heads if mask_shape[1] > 1 else "mh"
    names["mask"] = f"{batch} {mask_heads} i j"
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
  kv_partial_over: str | tuple[str, ...] | None


def _plan(mesh, q, k, mask, slopes) -> _Plan:
  """Every device holds whole (batch, head) problems: q's batch and head
  sharding is kept and everything else is replicated.

  q, k, mask, slopes: ShapeDtypeStructs carrying the partitioner's shardings
  (mask and slopes may be None). Under GQA the K/V heads are split like the query heads when that
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
  mask_sharding = None
  if mask is not None:
    mask_spec = P(batch if mask.shape[0] > 1 else None, heads if mask.shape[1] > 1 else None, None, None)
    mask_sharding = NamedSharding(mesh, mask_spec)
  slopes_sharding = None
  if slopes is not None:
    slopes_sharding = NamedSharding(mesh, P(batch if slopes.shape[0] > 1 else None, heads))
  return _Plan(
      qo=NamedSharding(mesh, P(batch, None, heads, None)),
      kv=NamedSharding(mesh, P(batch, None, kv_heads, None)),
      rows=NamedSharding(mesh, P(batch, heads, None)),
      mask=mask_sharding,
      q_segments=NamedSharding(mesh, P(batch, None)),
      kv_segments=NamedSharding(mesh, P(batch, None)),
      slopes=slopes_sharding,
      seed=NamedSharding(mesh, P(None)),
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


def _optional_inputs(mask, q_segments, kv_segments, slopes, seed) -> OptionalInputs:
  segments = None if q_segments is None else (q_segments, kv_segments)
  return OptionalInputs(mask=mask, segments=segments, slopes=slopes, seed=seed)


def _forward_kernels(q, k, v, mask, q_segments, kv_segments, slopes, seed, call: KernelCall):
  call = _local(call, q, k)
  optional = _optional_inputs(mask, q_segments, kv_segments, slopes, seed)
  return triton_forward.forward(q, k, v, optional, call.problem, call.block_sizes.fwd, interpret=call.interpret)


_forward_partitioned = custom_partitioning(_forward_kernels, static_argnums=(8,))


def _optional_factors(f: dict[str, str], call: KernelCall) -> list[str]:
  """Rule entries of the optional operands a call has (None ones are absent)."""
  problem = call.problem
  return (
      ([f["mask"]] if problem.has_mask else [])
      + ([f["q_segments"], f["kv_segments"]] if problem.has_segments else [])
      + ([f["slopes"]] if problem.has_alibi else [])
      + ([f["seed"]] if problem.has_dropout else [])
  )


def _optional_shardings(plan: _Plan, call: KernelCall) -> tuple:
  """Shardings of (mask, q segment ids, kv segment ids, slopes, seed), None where absent."""
  segments = (plan.q_segments, plan.kv_segments) if call.problem.has_segments else (None, None)
  return (plan.mask, *segments, plan.slopes, plan.seed if call.problem.has_dropout else None)


def _optional_shapes(shapes: list, num_fixed: int, call: KernelCall):
  """(mask shape, slopes shape) out of the operand shapes, None where absent."""
  rest = list(shapes[num_fixed:])
  mask = rest.pop(0) if call.problem.has_mask else None
  if call.problem.has_segments:
    rest = rest[2:]
  slopes = rest.pop(0) if call.problem.has_alibi else None
  return mask, slopes


def _forward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  shapes = [_shape(t) for t in operand_types]
  f = _factors(shapes[0], shapes[1], *_optional_shapes(shapes, 3, call))
  return _rule([f["qo"], f["kv"], f["kv"], *_optional_factors(f, call)], [f["qo"], f["rows"]])


def _forward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  q, k, _, mask, _, _, slopes, _ = arg_shapes
  plan = _plan(mesh, q, k, mask, slopes)
  # Every shard is a set of whole (batch, head) problems: the same kernels run
  # it on shard-shaped operands, with no communication.
  lower = lambda *args: _forward_kernels(*args, call)
  operands = (plan.qo, plan.kv, plan.kv, *_optional_shardings(plan, call))
  return mesh, lower, (plan.qo, plan.rows), operands


_forward_partitioned.def_partition(partition=_forward_partition, sharding_rule=_forward_rule)


# ---------------------------------------------------------------- backward


def _backward_kernels(q, k, v, out, lse, do, dlse, mask, q_segments, kv_segments, slopes, seed, call: KernelCall):
  call = _local(call, q, k)
  optional = _optional_inputs(mask, q_segments, kv_segments, slopes, seed)
  return triton_backward.backward(
      q, k, v, out, lse, do, dlse, optional, call.problem, call.block_sizes, interpret=call.interpret
  )


_backward_partitioned = custom_partitioning(_backward_kernels, static_argnums=(12,))


def _backward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  shapes = [_shape(t) for t in operand_types]
  f = _factors(shapes[0], shapes[1], *_optional_shapes(shapes, 7, call))
  qo, kv, rows = f["qo"], f["kv"], f["rows"]
  return _rule([qo, kv, kv, qo, rows, qo, rows, *_optional_factors(f, call)], [qo, kv, kv])


def _backward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  (q, k), (mask, _, _, slopes, _) = arg_shapes[:2], arg_shapes[7:]
  plan = _plan(mesh, q, k, mask, slopes)

  def lower(*args):
    dq, dk, dv = _backward_kernels(*args, call)
    if plan.kv_partial_over is not None:
      # MQA with the query heads split: the K/V head's gradient sums over
      # query heads held by several shards (the one collective here).
      dk, dv = jax.lax.psum((dk, dv), plan.kv_partial_over)
    return dq, dk, dv

  qo, kv, rows = plan.qo, plan.kv, plan.rows
  return mesh, lower, (qo, kv, kv), (qo, kv, kv, qo, rows, qo, rows, *_optional_shardings(plan, call))


_backward_partitioned.def_partition(partition=_backward_partition, sharding_rule=_backward_rule)


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
    arrays, optional, seed = args[:num_arrays], args[num_arrays:-1], args[-1]
    if in_batched[-1]:
      raise NotImplementedError(
          "jax_flash2: vmap over dropout_rng is not supported (one key draws the masks of every batch "
          "element and head already); pass one key, or fold the mapped axis into batch"
      )
    # The batch of one vmapped instance, read off q.
    batch = arrays[0].shape[1] if in_batched[0] else arrays[0].shape[0]
    folded = [_fold(x, axis_size, b) for x, b in zip(arrays, in_batched[:num_arrays])]
    # mask, q/kv segment ids, slopes: batch on axis 0, possibly broadcast.
    optional = [_fold_mask(x, axis_size, b, batch) for x, b in zip(optional, in_batched[num_arrays:-1])]
    # fn, not partitioned: under nested vmaps this runs inside the outer one,
    # whose axis is folded in turn.
    outs = fn(*folded, *optional, seed)
    return tuple(_unfold(x, axis_size) for x in outs), (True,) * len(outs)

  return fn


def forward(q, k, v, mask, q_segments, kv_segments, slopes, seed, call: KernelCall) -> tuple[jax.Array, jax.Array]:
  """(out, lse): out like q, lse float32 [batch, heads, seq_q].

  q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim]
  (kv_heads divides heads); mask: None or int8 [batch or 1, heads or 1,
  seq_q, seq_k]; q_segments, kv_segments: None or int32 [batch, seq_q] and
  [batch, seq_k]; slopes: None or float32 ALiBi slopes [batch or 1, heads];
  seed: None or the int32 [2] dropout seed.
  """
  return _with_vmap(_forward_partitioned, 3, call)(q, k, v, mask, q_segments, kv_segments, slopes, seed)


def backward(
    q, k, v, out, lse, do, dlse, mask, q_segments, kv_segments, slopes, seed, call: KernelCall
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv), each like its primal; lse, dlse float32 [batch, heads, seq_q]."""
  optional = (mask, q_segments, kv_segments, slopes, seed)
  return _with_vmap(_backward_partitioned, 7, call)(q, k, v, out, lse, do, dlse, *optional)
