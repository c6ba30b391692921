"""Ring attention: exact attention over a sequence split across devices.

`ring_attention`, called inside `shard_map` on the local shards of a
sequence split over mesh axis `axis_name`, keeps each device's queries and
sends the keys and values round the ring, merging each step's partial
attention by its lse; its backward is a ring too. `zigzag_order` puts a
sequence into the zigzag layout. The steps, their schedule and the rings
themselves are jax_flash2.ring_steps; here a call is checked and its steps
run sharding's partitioned kernels.
"""

from __future__ import annotations

import enum
import functools
import warnings
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_flash2 import backends, compat, merge, sharding, vjp
from jax_flash2.api import check_backend, check_flag, check_problem
from jax_flash2.backends import Backend, Device
from jax_flash2.ring_steps import Parts, Ring, RingLayout, RingStrategy, backward_ring, forward_ring, schedule

__all__ = ["RingLayout", "RingStrategy", "ring_attention", "zigzag_order"]


def _forward_part(q, k, v, operands, call):
  forward = vjp.first_order_only(lambda *args: sharding.forward(*args[:3], args[3], call), "forward pass")
  return forward(q, k, v, operands)


def _backward_part(q, k, v, out, lse, do, dlse, operands, call):
  backward = vjp.first_order_only(lambda *args: sharding.backward(*args[:7], args[7], call), "backward pass")
  return backward(q, k, v, out, lse, do, dlse, operands)


# Under shard_map, which may leave other mesh axes to the partitioner, the
# steps run sharding's partitioned wrappers (jax_flash2.ring_steps.Parts).
_PARTS = Parts(_forward_part, _backward_part)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Hashable,
    causal: bool = False,
    layout: RingLayout | str = "zigzag",
    strategy: RingStrategy | str = "ring",
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Backend | str = "auto",
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention over a sequence split across the devices of a mesh axis.

  Call it inside `jax.shard_map` whose in_specs split the sequence axis
  (axis 1) of q, k, v (and of the segment ids) over `axis_name`; the result
  equals `flash_attention` of the whole (unpermuted) sequence, split the same
  way. Batch and heads may be split over other mesh axes as well.

  Args:
    q: [batch, seq / P, heads, head_dim], this device's queries.
    k, v: [batch, seq / P, kv_heads, head_dim], this device's keys and
      values (the same positions as q: self-attention over one sequence).
    axis_name: the mesh axis the sequence is split over (P devices).
    causal, window_size, softcap, sinks, softmax_scale: as in
      flash_attention, over the true positions of the whole sequence.
    layout: a `RingLayout` or its name. "zigzag" (the default): the sequence
      is cut into 2P chunks and device r holds chunks r and 2P-1-r, which
      balances causal work; put a sequence (tokens, positions, labels) into
      that order once with `zigzag_order`. The local length must be even.
      "contiguous": device r holds positions [r seq/P, (r+1) seq/P).
    strategy: a `RingStrategy` or its name. "ring": K/V travel round the
      ring, one shard per step. "allgather": K/V are gathered once (memory
      O(seq) for them, worth it under GQA with few K/V heads).
    q_segment_ids, kv_segment_ids: int32 [batch, seq / P] each, both or
      neither, in the layout's order: query i sees key j only if their ids
      are equal.
    return_lse: also return lse, float32 [batch, heads, seq / P], natural log.
    backend, interpret: as in flash_attention, chosen for each step's
      problem (on Hopper a step between offset chunks whose band sides are
      negative runs on the Triton kernels).

  Returns:
    out like q (and lse); differentiable once, in reverse mode (the backward
    is a ring as well).

  Steps that see nothing under the causal mask or window are skipped and
  those that see everything run unmasked. Dense masks, a bias, ALiBi and
  dropout are not offered here.
  """
  ring = _check(q, k, v, axis_name=axis_name, causal=causal, layout=layout, strategy=strategy,
                window_size=window_size, softcap=softcap, sinks=sinks, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, backend=backend, interpret=interpret)
  return_lse = check_flag("return_lse", return_lse)  # before any work, not after it
  if ring.backend is Backend.AUTO and any(not call.plan.kernels
                                          for step in schedule(ring) for call in step.calls):
    warnings.warn(
        "jax_flash2: no NVIDIA GPU of compute capability 8.0 or newer here, so ring_attention's steps run the "
        "plain XLA attention (quadratic memory per step), not the flash kernels. Pass backend='xla' to silence "
        "this.",
        RuntimeWarning,
        stacklevel=2,
    )
  ids = (None, None) if q_segment_ids is None else (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32))
  sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
  if sinks is not None and ring.axis_name in compat.varying_axes(q) - compat.varying_axes(sinks):
    # Under check_vma, sinks shared by the ring's devices meet each device's
    # rows here: pvary's transpose sums their gradient over the ring, as for
    # any invariant array (without check_vma, shard_map's transpose does).
    sinks = compat.pvary(sinks, ring.axis_name)
  if compat.is_forward_mode(q, k, v, sinks):
    raise NotImplementedError(vjp.SECOND_ORDER.format(what="forward pass"))
  out, lse = _ring(q, k, v, *ids, sinks, ring)
  return (out, lse) if return_lse else out


def zigzag_order(seq_len: int, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
  """(perm, inverse), int32 [seq_len]: x[..., perm, ...] along the sequence
  axis is the zigzag layout (cut into 2 num_devices chunks, device r's shard
  holds chunks r and 2 num_devices - 1 - r, in that order), and
  y[..., inverse, ...] undoes it. Permute tokens, positions and labels
  alike, once at the input; attention and per-token layers need nothing
  else."""
  for name, value in (("seq_len", seq_len), ("num_devices", num_devices)):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if seq_len % (2 * num_devices):
    raise ValueError(f"seq_len must be divisible by 2 * num_devices = {2 * num_devices} (the zigzag layout's "
                     f"chunks), got seq_len {seq_len}")
  chunks = np.arange(seq_len).reshape(2 * num_devices, -1)
  perm = np.concatenate([np.concatenate([chunks[r], chunks[2 * num_devices - 1 - r]]) for r in range(num_devices)])
  return perm.astype(np.int32), np.argsort(perm).astype(np.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, k, v, q_ids, kv_ids, sinks, ring: Ring):
  return _ring_fwd(q, k, v, q_ids, kv_ids, sinks, ring)[0]


def _ring_fwd(q, k, v, q_ids, kv_ids, sinks, ring: Ring):
  out, lse = forward_ring(q, k, v, q_ids, kv_ids, ring)
  if sinks is not None:
    out, lse = merge.join_sinks(out, lse, sinks[None])
  out = checkpoint_name(out.astype(q.dtype), vjp.OUT_NAME)
  lse = checkpoint_name(lse, vjp.LSE_NAME)
  return (out, lse), (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _ring_bwd(ring: Ring, residuals, cotangents):
  q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
  do, dlse = cotangents
  # Without the barrier XLA merges the backward's K/V hops with the
  # forward's (the same ppermutes of the same arrays) and keeps every
  # shard's K/V alive from the forward to the backward: O(S) per device.
  # Through it with the cotangents, they wait for the backward.
  k, v, kv_ids, do, dlse = lax.optimization_barrier((k, v, kv_ids, do, dlse))
  dq, dk, dv = backward_ring(q, k, v, q_ids, kv_ids, out, lse, do, dlse, ring)
  # This device's share of dsinks; the caller's sinks, invariant over the
  # ring, sum the shares (see ring_attention).
  dsinks = None if sinks is None else merge.sinks_gradient(out, lse, do, dlse, sinks)
  # The segment ids take no gradient.
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------- checks


def _check(q, k, v, *, axis_name, causal, layout, strategy, window_size, softcap, sinks, q_segment_ids,
           kv_segment_ids, softmax_scale, backend, interpret) -> Ring:
  """The checked static description of a call."""
  layout = _check_option(RingLayout, "layout", layout)
  strategy = _check_option(RingStrategy, "strategy", strategy)
  problem = check_problem(q, k, v, causal=causal, window_size=window_size, softcap=softcap, sinks=sinks,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale)
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"ring_attention attends one sequence split over the ring: q's and k/v's local lengths "
                     f"(axis 1) must be equal, got q {tuple(q.shape)}, k {tuple(k.shape)}")
  if axis_name is None:
    raise ValueError("ring_attention needs axis_name, the mesh axis the sequence is split over (inside shard_map)")
  try:
    num_devices = lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(f"axis_name {axis_name!r} is not a mesh axis bound here: call ring_attention inside "
                     f"jax.shard_map over a mesh with that axis ({e})") from None
  seq = q.shape[1]
  if layout is RingLayout.ZIGZAG and seq % 2:
    raise ValueError(f"layout='zigzag' cuts the sequence into 2 x {num_devices} chunks: the local length (q axis 1) "
                     f"must be even, got {seq} (a sequence of {seq * num_devices} over {num_devices} devices); "
                     "pad the sequence to a multiple of 2P or use layout='contiguous'")
  device = Device(backends.default_compute_capability(), check_flag("interpret", interpret))
  return Ring(axis_name, num_devices, layout, strategy, problem, device, check_backend(backend), _PARTS)


def _check_option(kind: type[enum.Enum], name: str, value) -> enum.Enum:
  try:
    return kind(value)
  except ValueError:
    raise ValueError(f"{name} must be one of {[x.value for x in kind]}, got {value!r}") from None
