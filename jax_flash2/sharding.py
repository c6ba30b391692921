"""The kernels under SPMD partitioning and vmap.

A `pallas_call` has a batching rule but no sharding rule. Under `jax.jit` with
operands sharded over a mesh, the partitioner does not know that the kernels
work on each (batch, head) independently, so it gathers the operands and runs
the whole problem on every device. Here the forward and the backward kernels
are each wrapped in a `custom_partitioning` whose Shardy rule says so: batch
and heads pass through (each device runs the kernels on its own shard, no
collective); head_dim must be replicated. A sequence split over the mesh
stays split where the problem rides the ring (`rides_ring`: self-attention
without a dense mask, bias, ALiBi or dropout): q, k, v, the lse and the
segment ids are split alike, and each shard runs jax_flash2.ring's contiguous
ring round those mesh axes (collective-permutes of K/V, and of dK/dV in the
backward), its steps calling the kernels directly. Any other problem has its
sequence gathered before the kernels, as has a split head_dim. Under GQA the
K/V heads are split with the query heads when whole groups stay together;
MQA's one K/V head is replicated and dK/dV are summed over the head shards
(an all-reduce).

`custom_partitioning` has no batching rule, so a `custom_vmap` sits outside it:
a vmapped axis is folded into the kernels' batch axis, which they handle
anyway, and the partitioned function is called again on the folded arrays.

Neither wrapper is differentiable; vjp.py puts the one custom_vjp around them.

flash_decode's kernel and combine get the same two wrappers (the last
section); decode.py wraps them in a custom_vjp that refuses gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash2 import backends, ring_steps
from jax_flash2.backends import Call, DecodeCall
from jax_flash2.problem import Operands, Problem


# The optional operands follow the arrays of every function here, in this
# order, None where a call has none (problem.Operands).
_OPERANDS = Operands._fields
_SEED = _OPERANDS.index("dropout_seed")


def _present(problem: Problem) -> tuple[str, ...]:
  """The names of the optional operands a problem has, in Operands order."""
  has = {
      "mask": problem.mask.dense, "q_segment_ids": problem.mask.segments, "kv_segment_ids": problem.mask.segments,
      "alibi_slopes": problem.has_alibi, "dropout_seed": problem.has_dropout, "bias": problem.has_bias,
      "sinks": problem.has_sinks,
  }
  return tuple(name for name in _OPERANDS if has[name])


def rides_ring(problem: Problem) -> bool:
  """Whether a sequence split over the mesh runs ring attention
  (jax_flash2.ring, contiguous layout) rather than being gathered:
  self-attention (seq_q = seq_k) with none of a dense mask, a bias, ALiBi
  or dropout (segment ids, windows and softcap ride along)."""
  return (problem.seq_q == problem.seq_k and not problem.mask.dense
          and not (problem.has_bias or problem.has_alibi or problem.has_dropout))


def _factors(q_shape, kv_shape, shapes: dict[str, tuple[int, ...]], ring: bool = False) -> dict[str, str]:
  """Shardy factors of each operand, by name; `shapes` holds the optional
  operands a call has.

  b batch, i seq_q, j seq_k, d head_dim, h heads. Under GQA the query heads
  (qh) and K/V heads (kh) get factors of their own: a shared compound factor
  would let Shardy split a mesh axis across them into sub-axes, which
  custom_partitioning cannot hand to the partition callback;
  _shard_plan keeps them consistent instead. mb / mh are a mask's broadcast
  (size 1) batch / heads axes, which can share no factor with the full-size
  ones; ab the broadcast batch axis of the ALiBi slopes and the sinks; z the
  dropout seed's two words. The bias (and dS, its gradient) takes the mask's
  factors. With ring, seq_k shares seq_q's factor: the two are split alike,
  and the ring (rides_ring) runs on the shards.
  """
  if q_shape[2] == kv_shape[2]:
    heads = kv_heads = "h"
  else:
    heads, kv_heads = "qh", "kh"
  j = "i" if ring else "j"
  names = {
      "qo": f"b i {heads} d", "kv": f"b {j} {kv_heads} d", "rows": f"b {heads} i", "scores": f"b {heads} i j",
      "q_segment_ids": "b i", "kv_segment_ids": f"b {j}", "dropout_seed": "z",
  }
  for name in ("mask", "bias"):
    if name in shapes:
      shape = shapes[name]
      names[name] = f"{'b' if shape[0] > 1 else 'mb'} {heads if shape[1] > 1 else 'mh'} i j"
  for name in ("alibi_slopes", "sinks"):  # [batch or 1, heads]
    if name in shapes:
      names[name] = f"{'b' if shapes[name][0] > 1 else 'ab'} {heads}"
  return names


# The factors that must be replicated: every one but batch and heads (see
# _factors and _decode_factors), except seq_q and seq_k (i, j) where a call
# rides the ring.
_REPLICATED = ("i", "j", "d", "mb", "mh", "ab", "z", "n", "p", "t", "sb")


def _rule(operands: list[str], results: list[str], ring: bool = False) -> tuple[str, dict]:
  """The einsum-like rule: batch and heads pass through; head_dim and the
  broadcast mask axes must be replicated, and so must seq_q and seq_k
  unless the call rides the ring."""
  rule = f"{', '.join(operands)} -> {', '.join(results)}"
  # Shardy wants the special factors listed in the order they first appear.
  order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
  replicated = tuple(f for f in order if f in _REPLICATED and not (ring and f in ("i", "j")))
  return rule, {"need_replication_factors": replicated}


def _shape(ir_type) -> tuple[int, ...]:
  # The rule callback is handed MLIR types, not avals.
  return tuple(ir.RankedTensorType(ir_type).shape)


def _axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  return math.prod(mesh.shape[name] for name in (axes if isinstance(axes, tuple) else (axes,)))


@dataclasses.dataclass(frozen=True)
class _ShardPlan:
  """How one call runs per shard: the shardings of the q-like, K/V-like and
  row-vector-like arrays, of dS, and of each optional operand (by name, None
  where absent), the mesh axes that dK/dV are summed over, and those the
  sequence is split over (None: gathered), round which the ring runs."""

  qo: NamedSharding
  kv: NamedSharding
  rows: NamedSharding
  scores: NamedSharding
  operands: dict[str, NamedSharding | None]
  kv_partial_over: str | tuple[str, ...] | None
  seq: str | tuple[str, ...] | None = None


def _group_split(mesh, heads, q_heads: int, kv_heads: int) -> tuple[Any, Any, bool]:
  """(the query heads' split, the K/V heads', whether a single K/V head is
  replicated) for query heads split as `heads` (a PartitionSpec entry):
  under GQA the K/V heads split like the query heads when that keeps whole
  groups on a shard; MQA's single K/V head is replicated, each shard
  reading it for its query heads; any other split of the heads is gathered."""
  if kv_heads == q_heads or heads is None:
    return heads, heads, False
  if kv_heads == 1:
    return heads, None, True
  if kv_heads % _axes_size(mesh, heads):
    return None, None, False
  return heads, heads, False


def _shard_plan(mesh, q, k, operands: dict, ring: bool = False) -> _ShardPlan:
  """Every device holds whole (batch, head) problems: q's batch and head
  sharding is kept and everything else is replicated; with ring (the
  problem rides_ring), q's sequence split is kept too, for q, k, v, the
  rows and the segment ids alike.

  q, k and the optional operands (by name, None where absent):
  ShapeDtypeStructs carrying the partitioner's shardings. Under GQA the K/V
  heads are split like the query heads when that keeps whole groups on a
  shard; MQA's single K/V head is replicated, and each shard's dK/dV is then
  a partial sum over its query heads; any other split of the heads is
  gathered.
  """
  spec = tuple(q.sharding.spec) + (None,) * (4 - len(q.sharding.spec))
  batch, seq = spec[0], spec[1] if ring else None
  heads, kv_heads, mqa = _group_split(mesh, spec[2], q.shape[2], k.shape[2])
  partial = heads if mqa else None
  sharded = lambda *spec: NamedSharding(mesh, P(*spec))

  def of_operand(name, x):
    if x is None:
      return None
    if name in ("mask", "bias"):  # [batch or 1, heads or 1, seq_q, seq_k]
      return sharded(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None, None, None)
    if name in ("alibi_slopes", "sinks"):  # [batch or 1, heads]
      return sharded(batch if x.shape[0] > 1 else None, heads)
    if name == "dropout_seed":
      return sharded(None)
    return sharded(batch, seq)  # segment ids

  return _ShardPlan(
      qo=sharded(batch, seq, heads, None),
      kv=sharded(batch, seq, kv_heads, None),
      rows=sharded(batch, heads, seq),
      scores=sharded(batch, heads, None, None),
      operands={name: of_operand(name, x) for name, x in operands.items()},
      kv_partial_over=partial,
      seq=seq,
  )


def _local(call: Call, q, k) -> Call:
  """The call for one shard: the same static problem, except that the GQA
  group shrinks when the query heads are split and a single K/V head is not."""
  group = q.shape[2] // k.shape[2]
  if call.problem.group == group:
    return call
  return dataclasses.replace(call, problem=dataclasses.replace(call.problem, group=group))


def _one_lowering(kernels: Callable, num_arrays: int) -> Callable:
  """kernels(*arrays, *operands, call) under one jax.jit, the Call static:
  identical calls (a model's layers) then share one trace, and one lowering
  in the module that holds them, so the Pallas kernels are lowered and
  compiled once per distinct problem rather than once per call site.
  (Without it, 4 stacked calls at the example GPT's shapes lowered 4 copies
  of each kernel: 8.5 s against 2.5 s for one call, before compiling each
  copy.)"""
  return jax.jit(kernels, static_argnums=(num_arrays + len(_OPERANDS),))


def _partitioned(kernels: Callable, num_arrays: int, rule, partition) -> Callable:
  """kernels under a custom_partitioning with this rule and partition
  callback (call static)."""
  partitioned = custom_partitioning(kernels, static_argnums=(num_arrays + len(_OPERANDS),))
  partitioned.def_partition(partition=partition, sharding_rule=rule)
  return partitioned


def _operand_rule(call: Call, operand_types, num_arrays: int, ring: bool = False) -> tuple[dict[str, str], list[str]]:
  """(the factors, the rule entries of the optional operands a call has);
  the rule callback's operand types leave the absent ones out."""
  shapes = [_shape(t) for t in operand_types]
  present = _present(call.problem)
  f = _factors(shapes[0], shapes[1], dict(zip(present, shapes[num_arrays:])), ring)
  return f, [f[name] for name in present]


def _arg_plan(mesh, arg_shapes, num_arrays: int, ring: bool = False) -> _ShardPlan:
  """The shard plan from the partition callback's argument shapes (which
  hold None for absent operands)."""
  return _shard_plan(mesh, arg_shapes[0], arg_shapes[1], dict(zip(_OPERANDS, arg_shapes[num_arrays:])), ring)


def _operand_shardings(plan: _ShardPlan) -> tuple:
  return tuple(plan.operands[name] for name in _OPERANDS)


# ---------------------------------------------------------------- forward


def _forward_kernels(q, k, v, *args):
  *operands, call = args
  call = _local(call, q, k)
  forward = call.plan.forward
  return backends.kernels(forward.backend).forward(q, k, v, Operands(*operands), call.problem, forward.config,
                                                   interpret=call.interpret)


_forward_kernels = _one_lowering(_forward_kernels, 3)


def _forward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  ring = rides_ring(call.problem)
  f, operands = _operand_rule(call, operand_types, 3, ring)
  return _rule([f["qo"], f["kv"], f["kv"], *operands], [f["qo"], f["rows"]], ring)


def _forward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _arg_plan(mesh, arg_shapes, 3, rides_ring(call.problem))
  if plan.seq is not None:
    # The sequence stays split: K/V travel round the devices along it.
    def lower(q, k, v, *operands):
      return ring_steps.sharded_forward(q, k, v, Operands(*operands), _local(call, q, k), plan.seq, LOCAL_PARTS)
  else:
    # Every shard is a set of whole (batch, head) problems: the same kernels
    # run it on shard-shaped operands, with no communication.
    lower = lambda *args: _forward_kernels(*args, call)
  return mesh, lower, (plan.qo, plan.rows), (plan.qo, plan.kv, plan.kv, *_operand_shardings(plan))


_forward_partitioned = _partitioned(_forward_kernels, 3, _forward_rule, _forward_partition)


# ---------------------------------------------------------------- backward


def _backward_kernels(q, k, v, out, lse, do, dlse, *args):
  *operands, call = args
  call = _local(call, q, k)
  backward = call.plan.backward
  return backends.kernels(backward.backend).backward(q, k, v, out, lse, do, dlse, Operands(*operands),
                                                     call.problem, backward.config, interpret=call.interpret)


def _bias_gradient_kernels(q, k, v, out, lse, do, dlse, *args):
  *operands, call = args
  call = _local(call, q, k)
  backward = call.plan.backward
  return backends.kernels(backward.backend).bias_gradient(q, k, v, out, lse, do, dlse, Operands(*operands),
                                                          call.problem, backward.config, interpret=call.interpret)


_backward_kernels = _one_lowering(_backward_kernels, 7)
_bias_gradient_kernels = _one_lowering(_bias_gradient_kernels, 7)


def local_forward(q, k, v, operands: Operands, call: Call) -> tuple[jax.Array, jax.Array]:
  """The forward kernels on arrays already split (inside a partition
  callback, where every mesh axis is manual): no partitioning, no vmap rule."""
  return _forward_kernels(q, k, v, *operands, call)


def local_backward(q, k, v, out, lse, do, dlse, operands: Operands, call: Call):
  """The backward kernels on arrays already split (see local_forward)."""
  return _backward_kernels(q, k, v, out, lse, do, dlse, *operands, call)


# Inside a partition callback a ring's steps call the kernels on the shards
# as they are (jax_flash2.ring_steps).
LOCAL_PARTS = ring_steps.Parts(local_forward, local_backward)


def _backward_rule_operands(call, operand_types, ring: bool = False) -> tuple[dict[str, str], list[str]]:
  f, operands = _operand_rule(call, operand_types, 7, ring)
  qo, kv, rows = f["qo"], f["kv"], f["rows"]
  return f, [qo, kv, kv, qo, rows, qo, rows, *operands]


def _backward_shardings(plan: _ShardPlan) -> tuple:
  qo, kv, rows = plan.qo, plan.kv, plan.rows
  return (qo, kv, kv, qo, rows, qo, rows, *_operand_shardings(plan))


def _backward_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  ring = rides_ring(call.problem)
  f, operands = _backward_rule_operands(call, operand_types, ring)
  return _rule(operands, [f["qo"], f["kv"], f["kv"]], ring)


def _backward_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _arg_plan(mesh, arg_shapes, 7, rides_ring(call.problem))

  def lower(*args):
    if plan.seq is not None:
      q, k, v, out, lse, do, dlse, *operands = args
      dq, dk, dv = ring_steps.sharded_backward(q, k, v, out, lse, do, dlse, Operands(*operands),
                                               _local(call, q, k), plan.seq, LOCAL_PARTS)
    else:
      dq, dk, dv = _backward_kernels(*args, call)
    if plan.kv_partial_over is not None:
      # MQA with the query heads split: the K/V head's gradient sums over
      # query heads held by several shards.
      dk, dv = jax.lax.psum((dk, dv), plan.kv_partial_over)
    return dq, dk, dv

  return mesh, lower, (plan.qo, plan.kv, plan.kv), _backward_shardings(plan)


_backward_partitioned = _partitioned(_backward_kernels, 7, _backward_rule, _backward_partition)


def _bias_gradient_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  f, operands = _backward_rule_operands(call, operand_types)
  return _rule(operands, [f["scores"]])


def _bias_gradient_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _arg_plan(mesh, arg_shapes, 7)
  # dS of each (batch, head) is computed where its problem lives; the sum
  # over the bias's broadcast axes happens outside, in plain JAX.
  lower = lambda *args: _bias_gradient_kernels(*args, call)
  return mesh, lower, plan.scores, _backward_shardings(plan)


_bias_gradient_partitioned = _partitioned(_bias_gradient_kernels, 7, _bias_gradient_rule, _bias_gradient_partition)


# ---------------------------------------------------------------- vmap


def _fold(x: jax.Array, axis_size: int, batched: bool) -> jax.Array:
  """[axis_size, batch, ...] (or [batch, ...] when not batched) -> [axis_size * batch, ...]."""
  if not batched:
    x = jnp.broadcast_to(x, (axis_size, *x.shape))
  return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def _fold_mask(mask: jax.Array | None, axis_size: int, batched: bool, batch: int) -> jax.Array | None:
  """Folds a mask (or the ALiBi slopes, the sinks: any array with batch on
  axis 0) like _fold, keeping a batch axis that is broadcast over everything
  at size 1."""
  if mask is None or (not batched and mask.shape[0] == 1):
    return mask
  if not batched:
    mask = jnp.broadcast_to(mask, (axis_size, *mask.shape))
  elif mask.shape[1] != batch:  # broadcast over batch, not over the vmapped axis
    mask = jnp.broadcast_to(mask, (axis_size, batch, *mask.shape[2:]))
  return mask.reshape(axis_size * mask.shape[1], *mask.shape[2:])


def _unfold(x: jax.Array, axis_size: int) -> jax.Array:
  return x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])


def _with_vmap(partitioned: Callable, num_arrays: int, call: Call) -> Callable:
  """partitioned(*arrays, *operands, call) under a custom_vmap that folds
  the vmapped axis into batch. arrays all carry batch on axis 0; the
  optional operands may keep a broadcast batch axis of size 1; the dropout
  seed has no batch axis and is shared."""

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
    # mask, segment ids, slopes, bias, sinks: batch on axis 0, possibly
    # broadcast; the seed has no batch axis and is shared.
    optional = [
        x if i == _SEED else _fold_mask(x, axis_size, b, batch)
        for i, (x, b) in enumerate(zip(optional, in_batched[num_arrays:]))
    ]
    # Dropout's hash keeps the batch indices of one instance (b mod batch),
    # so that each mapped element draws the mask an unbatched call draws.
    problem = call.problem
    if problem.has_dropout and problem.dropout_batch is None:
      problem = dataclasses.replace(problem, dropout_batch=batch)
    # Under vmap again, not partitioned: under nested vmaps this runs inside
    # the outer one, whose axis is folded in turn.
    outs = _with_vmap(partitioned, num_arrays, dataclasses.replace(call, problem=problem))(*folded, *optional)
    if not isinstance(outs, tuple):
      return _unfold(outs, axis_size), True
    return tuple(_unfold(x, axis_size) for x in outs), (True,) * len(outs)

  return fn


def check_auto_sharded(q, k, v, operands: Operands) -> None:
  """Refuses inputs sharded over explicit mesh axes (sharding in types,
  jax.sharding.AxisType.Explicit): the kernels' custom_partitioning rules
  speak to the partitioner of Auto axes only."""
  check_auto_axes((("q", q), ("k", k), ("v", v), *zip(Operands._fields, operands)))


def check_auto_axes(named) -> None:
  """check_auto_sharded over (name, array or None) pairs."""
  for name, x in named:
    sharding = None if x is None else getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    used = {a for entry in getattr(sharding, "spec", ()) if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))}
    explicit = sorted(a for a in used if types.get(a) == jax.sharding.AxisType.Explicit)
    if explicit:
      raise NotImplementedError(
          f"jax_flash2: {name} is sharded over explicit mesh axes {explicit} (jax.sharding.AxisType.Explicit, "
          "jax.make_mesh's default); the kernels are partitioned over Auto axes only: build the mesh with "
          "axis_types=(jax.sharding.AxisType.Auto, ...), or pass backend='xla'"
      )


def _unpartitioned(pass_plan, interpret: bool) -> bool:
  """Whether a pass's kernels are called directly (unsharded), their
  family being one that custom_partitioning cannot wrap in this mode."""
  return not backends.kernels(pass_plan.backend).partitionable(interpret)


def forward(q, k, v, operands: Operands, call: Call) -> tuple[jax.Array, jax.Array]:
  """(out, lse): out like q, lse float32 [batch, heads, seq_q].

  q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim]
  (kv_heads divides heads); operands: the call's optional arrays, None where
  absent: mask int8 and bias float [batch or 1, heads or 1, seq_q, seq_k];
  segment ids int32 [batch, seq_q] and [batch, seq_k]; ALiBi slopes float32
  [batch or 1, heads]; the dropout seed int32 [2].
  """
  partitioned = _forward_kernels if _unpartitioned(call.plan.forward, call.interpret) else _forward_partitioned
  return _with_vmap(partitioned, 3, call)(q, k, v, *operands)


def backward(q, k, v, out, lse, do, dlse, operands: Operands, call: Call) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv), each like its primal; lse, dlse float32 [batch, heads, seq_q]."""
  partitioned = _backward_kernels if _unpartitioned(call.plan.backward, call.interpret) else _backward_partitioned
  return _with_vmap(partitioned, 7, call)(q, k, v, out, lse, do, dlse, *operands)


def bias_gradient(q, k, v, out, lse, do, dlse, operands: Operands, call: Call) -> jax.Array:
  """dS, float32 [batch, heads, seq_q, seq_k]: the bias's gradient before the
  sum over its broadcast axes."""
  return _with_vmap(_bias_gradient_partitioned, 7, call)(q, k, v, out, lse, do, dlse, *operands)


# ---------------------------------------------------------------- decoding (flash_decode)
#
# The split-KV kernel and its combine are per (batch, K/V head) too, so they
# get the same treatment: a custom_partitioning whose rule passes batch and
# heads through, under a custom_vmap that folds a vmapped axis into batch.
# A paged cache's page pool is indexed by the block table, not by batch: it
# is replicated over the batch shards (each holds the pages its sequences
# name) and split with the K/V heads only. The cache's sequence axis is
# replicated: splitting it would need the combine across devices.

DECODE_ARGS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "alibi_slopes", "sinks")


def _decode_factors(call: DecodeCall, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
  """Shardy factors of flash_decode's operands (the present ones, by name)
  and of its results "qo" and "rows".

  b batch, i seq_q, d head_dim, h heads (qh / kh under GQA, as in _factors);
  j the contiguous cache's max_seq; n, p the paged cache's pages and page
  rows; t the block table's pages per sequence; ab, sb a broadcast (size 1)
  batch axis of the slopes and sinks.
  """
  q, k = shapes["q"], shapes["k_cache"]
  heads, kv_heads = ("h", "h") if q[2] == k[2] else ("qh", "kh")
  cache = f"n p {kv_heads} d" if call.problem.paged else f"b j {kv_heads} d"
  names = {"q": f"b i {heads} d", "k_cache": cache, "v_cache": cache, "cache_seqlens": "b", "block_table": "b t",
           "qo": f"b i {heads} d", "rows": f"b {heads} i"}
  if "alibi_slopes" in shapes:
    names["alibi_slopes"] = f"{'b' if shapes['alibi_slopes'][0] > 1 else 'ab'} {heads}"
  if "sinks" in shapes:
    sinks = shapes["sinks"]
    names["sinks"] = heads if len(sinks) == 1 else f"{'b' if sinks[0] > 1 else 'sb'} {heads}"
  return names


def _decode_present(call: DecodeCall) -> tuple[str, ...]:
  has = {"block_table": call.problem.paged, "alibi_slopes": call.problem.has_alibi, "sinks": call.has_sinks}
  return tuple(name for name in DECODE_ARGS if has.get(name, True))


def _decode_rule(call, mesh, operand_types, result_types):
  del mesh, result_types
  present = _decode_present(call)
  f = _decode_factors(call, dict(zip(present, (_shape(t) for t in operand_types))))
  return _rule([f[name] for name in present], [f["qo"], f["rows"]])


def _decode_partition(call, mesh, arg_shapes, result_shape):
  del result_shape
  args = dict(zip(DECODE_ARGS, arg_shapes))
  q, k = args["q"], args["k_cache"]
  spec = lambda x: tuple(x.sharding.spec) + (None,) * (4 - len(x.sharding.spec))
  q_spec, k_spec = spec(q), spec(k)
  # The cache is what a decode step reads and q a row per sequence: where
  # the cache is split (a contiguous one over batch, any over its K/V heads)
  # q follows it, rather than the cache being gathered to q's sharding.
  batch = (None if call.problem.paged else k_spec[0]) or q_spec[0]
  heads = kv_heads = k_spec[2]
  if heads is None:
    # Else q's head split decides (the forward needs no sum over MQA's
    # replicated K/V head).
    heads, kv_heads, _ = _group_split(mesh, q_spec[2], q.shape[2], k.shape[2])
  axes = lambda entry: set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))
  if axes(batch) & axes(heads):  # one mesh axis cannot split both
    heads = kv_heads = None
  sharded = lambda *spec: NamedSharding(mesh, P(*spec))
  qo = sharded(batch, None, heads, None)
  cache = sharded(None if call.problem.paged else batch, None, kv_heads, None)

  def of(name, x):
    if x is None:
      return None
    if name == "cache_seqlens":
      return sharded(batch)
    if name == "block_table":
      return sharded(batch, None)
    if x.ndim == 1:  # per-head sinks
      return sharded(heads)
    return sharded(batch if x.shape[0] > 1 else None, heads)  # slopes, per-batch sinks

  shardings = (qo, cache, cache, *(of(name, args[name]) for name in DECODE_ARGS[3:]))
  # Every shard holds whole (sequence, K/V group) problems: the kernel and
  # combine run on them as they are, with no communication.
  lower = lambda *args: _decode_kernels(*args, call)
  return mesh, lower, (qo, sharded(batch, heads, None)), shardings


def _decode_kernels(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks, call: DecodeCall):
  # One shard's call: the GQA group shrinks when the query heads are split
  # and a single K/V head is not.
  group = q.shape[2] // k_cache.shape[2]
  if call.problem.group != group:
    call = dataclasses.replace(call, problem=dataclasses.replace(call.problem, group=group))
  return backends.decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks, call)


# One lowering shared by identical calls (a model's layers), as _one_lowering.
_decode_kernels = jax.jit(_decode_kernels, static_argnums=(len(DECODE_ARGS),))
_decode_partitioned = custom_partitioning(_decode_kernels, static_argnums=(len(DECODE_ARGS),))
_decode_partitioned.def_partition(partition=_decode_partition, sharding_rule=_decode_rule)


def _decode_with_vmap(call: DecodeCall) -> Callable:
  """The partitioned decode under a custom_vmap that folds the vmapped axis
  into batch. Under a paged cache mapped with the calls, instance v's pages
  are renumbered after instances 0..v-1's; a shared pool keeps its numbers."""

  @jax.custom_batching.custom_vmap
  def fn(*args):
    return _decode_partitioned(*args, call)

  @fn.def_vmap
  def rule(axis_size, in_batched, q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks):
    in_q, in_k, in_v, in_lens, in_table, in_slopes, in_sinks = in_batched
    batch = q.shape[1] if in_q else q.shape[0]
    problem = call.problem
    if not problem.paged:
      k_cache, v_cache = _fold(k_cache, axis_size, in_k), _fold(v_cache, axis_size, in_v)
    elif in_k or in_v:
      pages = problem.num_pages
      k_cache, v_cache = _fold(k_cache, axis_size, in_k), _fold(v_cache, axis_size, in_v)
      # Clipped first, as the kernel clips a page number: an instance's bad
      # entry reads its own last page, as the unbatched call does, not a
      # page of the next instance.
      offsets = jnp.arange(axis_size, dtype=jnp.int32)[:, None, None] * pages
      block_table = jnp.clip(block_table.astype(jnp.int32), 0, pages - 1) + offsets
      in_table = True
      problem = dataclasses.replace(problem, num_pages=axis_size * pages)
    if problem.paged:
      block_table = _fold(block_table, axis_size, in_table)
    q, cache_seqlens = _fold(q, axis_size, in_q), _fold(cache_seqlens, axis_size, in_lens)
    slopes = _fold_mask(slopes, axis_size, in_slopes, batch)
    if sinks is not None:
      # An instance's [heads] as [1, heads] ([batch or 1, heads] stays), then
      # folded like the slopes: [axis_size * batch, heads], or [1, heads]
      # when shared.
      per_instance = (-1, sinks.shape[-1])
      sinks = sinks.reshape((axis_size, *per_instance) if in_sinks else per_instance)
      sinks = _fold_mask(sinks, axis_size, in_sinks, batch)
    # Under vmap again, not partitioned: nested vmaps fold in turn.
    out, lse = _decode_with_vmap(dataclasses.replace(call, problem=problem))(
        q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks)
    return (_unfold(out, axis_size), _unfold(lse, axis_size)), (True, True)

  return fn


def decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks, call: DecodeCall):
  """flash_decode's (out like q, lse float32 [batch, heads, seq_q]): the
  kernel per shard under jit with batch/head sharding, a vmapped axis folded
  into batch (see backends.decode for the arguments). The XLA path is plain
  JAX, which the partitioner and vmap handle themselves."""
  if call.plan.backend == backends.XLA.name:
    return backends.decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks, call)
  return _decode_with_vmap(call)(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks)
