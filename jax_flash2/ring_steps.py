"""Ring attention's machinery: the static ring, its schedule of steps, and
the forward and backward rings (jax_flash2.ring is the API over them).

Called inside `shard_map` on the local shards of a sequence split over the
mesh axis `axis_name` (P devices). Each device keeps its queries; the keys
and values travel round the ring by `ppermute`, one hop per step, and each
step's partial attention is merged into the running output by its lse
(jax_flash2.merge), so after P steps every device holds the exact attention
of its queries over the whole sequence, with memory O(S / P) per device.
The next K/V shard's `ppermute` is issued before a step's attention, so the
scheduler can hide it behind the compute.

Layouts (`RingLayout`): CONTIGUOUS puts positions [r S/P, (r+1) S/P) on
device r; ZIGZAG cuts the sequence into 2P chunks and puts chunks r and
2P-1-r on device r (`zigzag_order` permutes a sequence into it), so that
under a causal mask every device has the same work at every step.

A step pairs the local query chunks with the K/V chunks held then (a
contiguous shard is one chunk, a zigzag shard two). The chunks' true
positions make the mask of each pair (`pair_mask`): nothing visible (the
pair is skipped), everything visible under the band (it runs unmasked, and
such pairs join into one call over whole shards where they can), or a band
cut through it, whose sides are the global window's shifted by the chunks'
distance (with equal lengths the kernels' bottom-right alignment is the
diagonal: query i sees key j iff i - left' <= j <= i + right', sides that
may be negative). Pairs of one mask run as one call, stacked along batch.
The device index is traced under shard_map, so a step whose set of calls
differs between devices is a `lax.switch` over its few static kinds, indexed
by a per-device table; every call is a static `Problem`, planned once.

The backward is a ring too: the K/V shards travel again, with their dK/dV
accumulators (float32) one step behind them, while dQ stays home. Each
step runs the backward kernels with the merged output and lse, from which
they recompute the step's probabilities exactly (backends.Kernels.backward;
XlaAttention.backward for plain XLA). Summation orders are fixed, so the
gradients are deterministic.

RingStrategy.ALLGATHER gathers K/V once instead (for GQA with few K/V heads,
where the gathered K/V are small) and runs the same steps on slices of the
gathered arrays; its backward sums dK/dV back to their owners with one
reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash2 import backends, compat, merge
from jax_flash2.backends import LOG2_E, Backend, Call, Device
from jax_flash2.config import BlockSizes
from jax_flash2.mask import Mask
from jax_flash2.problem import Operands, Problem


class RingLayout(enum.Enum):
  """Which positions of the sequence each device of the ring holds."""

  CONTIGUOUS = "contiguous"
  ZIGZAG = "zigzag"


class RingStrategy(enum.Enum):
  """How K/V reach every device: round the ring, or gathered once."""

  RING = "ring"
  ALLGATHER = "allgather"



class Parts(NamedTuple):
  """How a step runs its attentions on the kernels: forward(q, k, v,
  operands, call) -> (out, lse in the call's base) and backward(q, k, v,
  out, lse, do, dlse, operands, call) -> (dq, dk, dv). Under shard_map,
  sharding's partitioned calls (jax_flash2.ring); inside a partition
  callback, the kernels on the shards as they are (jax_flash2.sharding).
  The caller gives them, so this module sits below both."""

  forward: Callable
  backward: Callable


# ---------------------------------------------------------------- the static ring


@dataclasses.dataclass(frozen=True)
class Ring:
  """Everything static about one ring_attention call: hashable, so the
  schedule is built once per distinct call.

  problem: the checked problem of the local shards (seq_q = seq_k = the
    local length); its mask's sides are the global band's, over true
    positions, and its segments flag says whether ids take part.
  parts: how the steps run their attentions (`Parts`).
  local: inside a partition callback (every mesh axis already split): no
    shard_map types to meet.
  block_sizes: the Triton kernels' tiles for every step (None: defaults).
  """

  axis_name: Hashable
  num_devices: int
  layout: RingLayout
  strategy: RingStrategy
  problem: Problem
  device: Device
  backend: Backend
  parts: Parts
  local: bool = False
  block_sizes: BlockSizes | None = None

  @property
  def num_chunks(self) -> int:
    """Contiguous chunks of the sequence in each local shard."""
    return 2 if self.layout is RingLayout.ZIGZAG else 1

  @property
  def chunk(self) -> int:
    return self.problem.seq_q // self.num_chunks

  def starts(self, device: int) -> tuple[int, ...]:
    """The true positions where the chunks of this device's shard start."""
    if self.layout is RingLayout.ZIGZAG:
      return device * self.chunk, (2 * self.num_devices - 1 - device) * self.chunk
    return (device * self.chunk,)


@dataclasses.dataclass(frozen=True)
class _Block:
  """One attention of a step, under call: for each part (query chunks, K/V
  chunks), those query chunks (all of the shard's, or one) against those
  K/V chunks; parts of one mask run together, stacked along batch."""

  parts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
  call: Call


@dataclasses.dataclass(frozen=True)
class _Step:
  """The attentions of one step: kinds holds the distinct sets of blocks the
  devices run (an empty set: the step sees nothing there) and table, per
  device index, which."""

  table: tuple[int, ...]
  kinds: tuple[tuple[_Block, ...], ...]

  @property
  def calls(self) -> tuple[Call, ...]:
    return tuple(block.call for kind in self.kinds for block in kind)


def pair_mask(distance: int, chunk: int, left: int | None, right: int | None, segments: bool) -> Mask | None:
  """The mask between a query chunk and a key chunk of `chunk` positions
  each, the queries' first true position `distance` past the keys', under
  the band (left, right) over true positions; None if no pair is visible.

  Query i sees key j iff i + distance - left <= j <= i + distance + right:
  with equal lengths the Mask's offset is 0, so its sides are left - distance
  and right + distance, dropped where every pair satisfies them."""
  last = chunk - 1
  mask_left = mask_right = None
  if right is not None:
    if distance + right < -last:  # the last query is before the first key
      return None
    if distance + right < last:
      mask_right = distance + right
  if left is not None:
    if distance - left > last:  # the first query's window starts past the last key
      return None
    if distance - left > -last:
      mask_left = left - distance
  return Mask(chunk, chunk, window_left=mask_left, window_right=mask_right, segments=segments)


def _blocks(masks: dict[tuple[int, int], Mask | None], ring: Ring, own: bool) -> list[tuple[tuple, tuple, Mask]]:
  """The pairs of chunks a device sees at one step, as few attentions: pairs
  seen whole under the band join into one over whole shards, or over one
  chunk's row or column of them; the rest run one by one. own: the K/V are
  the device's own, whose chunks, like its queries', are in true order, so a
  band that only compares order (full or causal attention) holds over the
  whole shard by local index."""
  n, c, band = ring.num_chunks, ring.chunk, ring.problem.mask
  every = tuple(range(n))
  whole = lambda rows, cols, right=None: (rows, cols, Mask(len(rows) * c, len(cols) * c, window_right=right,
                                                           segments=band.segments))
  if own and band.left is None and band.right in (None, 0):
    return [whole(every, every, band.right)]
  full = {pair for pair, m in masks.items() if m is not None and not m.has_band}
  if n > 1 and len(full) == n * n:
    return [whole(every, every)]
  blocks, done = [], set()
  for i in range(n):
    if n > 1 and all((i, j) in full for j in every):
      blocks.append(whole((i,), every))
      done |= {(i, j) for j in every}
  for j in range(n):
    if n > 1 and all((i, j) in full and (i, j) not in done for i in every):
      blocks.append(whole(every, (j,)))
      done |= {(i, j) for i in every}
  blocks += [((i, ), (j, ), m) for (i, j), m in masks.items() if m is not None and (i, j) not in done]
  return blocks


@functools.cache
def schedule(ring: Ring) -> tuple[_Step, ...]:
  """The steps: at step t, device r attends its chunks to those of device
  (r - t) mod P, the K/V it holds then."""
  band, p, n = ring.problem.mask, ring.num_devices, ring.num_chunks
  calls: dict[Mask, Call] = {}

  def call_of(m: Mask) -> Call:
    if m not in calls:
      # The steps' kernels take no sinks: a ring joins them to its merged output.
      problem = dataclasses.replace(ring.problem, mask=m, has_sinks=False)
      calls[m] = Call(problem, backends.choose(problem, ring.device, ring.backend, block_sizes=ring.block_sizes))
    return calls[m]

  steps = []
  for t in range(p):
    kinds = []
    for r in range(p):
      masks = {(i, j): pair_mask(ring.starts(r)[i] - ring.starts((r - t) % p)[j], ring.chunk, band.left, band.right,
                                 band.segments) for i in range(n) for j in range(n)}
      parts: dict[Mask, list] = {}
      for rows, cols, m in _blocks(masks, ring, own=t == 0):
        parts.setdefault(m, []).append((rows, cols))
      kinds.append(tuple(_Block(tuple(ps), call_of(m)) for m, ps in parts.items()))
    distinct = list(dict.fromkeys(kinds))
    steps.append(_Step(tuple(distinct.index(kind) for kind in kinds), tuple(distinct)))
  return tuple(steps)


def _run(step: _Step, device, run_kind, carry, inputs):
  """carry after `run_kind(blocks, carry, inputs)` with this device's kind
  of the step: static where all devices share it, else a switch."""
  branches = [functools.partial(run_kind, kind) for kind in step.kinds]
  if len(branches) == 1:
    return branches[0](carry, inputs)
  return lax.switch(jnp.asarray(step.table, jnp.int32)[device], branches, carry, inputs)


# ---------------------------------------------------------------- one part


def _part_forward(q, k, v, operands: Operands, call: Call, parts: Parts):
  """(out, natural lse) of one step's attention."""
  if not call.plan.kernels:
    return backends.XLA.attention(q, k, v, operands, call.problem)
  out, lse = parts.forward(q, k, v, operands, call)
  return out, call.natural_lse(lse)


def _part_backward(q, k, v, out, lse, do, dlse, operands: Operands, call: Call, parts: Parts):
  """(dq, dk, dv) of one step, from the merged out and natural lse."""
  if not call.plan.kernels:
    return backends.XLA.backward(q, k, v, out, lse, do, dlse, operands, call.problem)
  return parts.backward(q, k, v, out, call.backward_lse_of_natural(lse), do, dlse, operands, call)


def _take(chunks: list, parts, axis: int = 1):
  """For each part, the chunks of a shard cut into `chunks` it names, joined
  along `axis`; the parts stacked along batch (None stays None)."""
  if chunks[0] is None:
    return None
  joined = [jnp.concatenate([chunks[i] for i in which], axis=axis) if len(which) > 1 else chunks[which[0]]
            for which in parts]
  return joined[0] if len(joined) == 1 else jnp.concatenate(joined, axis=0)


def _split(x, parts, axis: int = 1):
  """(chunk index, its piece of x) for a result of parts stacked by `_take`."""
  for which, piece in zip(parts, jnp.split(x, len(parts), axis=0)):
    yield from zip(which, jnp.split(piece, len(which), axis=axis))


def _forward_kind(parts: Parts, blocks: tuple[_Block, ...], acc, inputs):
  """The running (out, lse) of each query chunk, with the step's blocks
  merged in."""
  q, q_ids, k, v, kv_ids = inputs  # each a list of chunks
  acc = list(acc)
  for block in blocks:
    rows, cols = [r for r, _ in block.parts], [c for _, c in block.parts]
    operands = Operands(q_segment_ids=_take(q_ids, rows), kv_segment_ids=_take(kv_ids, cols))
    out, lse = _part_forward(_take(q, rows), _take(k, cols), _take(v, cols), operands, block.call, parts)
    for (i, out_i), (_, lse_i) in zip(_split(out, rows), _split(lse, rows, axis=2)):
      acc[i] = merge.merge(*acc[i], out_i, lse_i)
  return acc


def _backward_kind(parts: Parts, blocks: tuple[_Block, ...], grads, inputs):
  """The running float32 dq of each query chunk and the step's dk, dv of
  each K/V chunk, with the step's blocks' gradients added."""
  q, out, do, lse, dlse, q_ids, k, v, kv_ids = inputs  # each a list of chunks
  dq, dk, dv = (list(x) for x in grads)
  for block in blocks:
    rows, cols = [r for r, _ in block.parts], [c for _, c in block.parts]
    operands = Operands(q_segment_ids=_take(q_ids, rows), kv_segment_ids=_take(kv_ids, cols))
    got = _part_backward(_take(q, rows), _take(k, cols), _take(v, cols), _take(out, rows), _take(lse, rows, 2),
                         _take(do, rows), _take(dlse, rows, 2), operands, block.call, parts)
    for acc, chunks, g in ((dq, rows, got[0]), (dk, cols, got[1]), (dv, cols, got[2])):
      for i, piece in _split(g, chunks):
        acc[i] = acc[i] + piece.astype(jnp.float32)
  return dq, dk, dv


# ---------------------------------------------------------------- the ring


def _chunks(x, ring: Ring, axis: int = 1) -> list:
  """A local shard cut into its contiguous chunks along `axis` (None stays None)."""
  if x is None:
    return [None] * ring.num_chunks
  return jnp.split(x, ring.num_chunks, axis=axis)


def _joined(parts, axis: int = 1):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


class _Travel:
  """The K/V (and their ids) each step sees: round the ring, the next hop
  issued as a step's K/V are handed out (before the step's attention), or
  sliced from one all-gather."""

  def __init__(self, kv, ring: Ring):
    self.ring = ring
    if ring.strategy is RingStrategy.ALLGATHER:
      self.gathered = lax.all_gather(kv, ring.axis_name)  # [P, ...] each
    else:
      self.current = kv

  def step(self, t: int, device):
    ring = self.ring
    if ring.strategy is RingStrategy.ALLGATHER:
      source = (device - t) % ring.num_devices
      return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, source, keepdims=False), self.gathered)
    here = self.current
    if t + 1 < ring.num_devices:
      self.current = _hop(here, ring)
    return here


def _hop(x, ring: Ring):
  """x sent one device along the ring (device r's to device r + 1)."""
  p = ring.num_devices
  return lax.ppermute(x, ring.axis_name, [(r, (r + 1) % p) for r in range(p)])


def _varying(x, ring: Ring):
  """A fresh accumulator typed as varying over the ring's axis (shard_map's
  check_vma), like the step results merged into it."""
  if ring.local:  # a partition callback: no shard_map types to meet
    return x
  return compat.pvary(x, ring.axis_name)


def forward_ring(q, k, v, q_ids, kv_ids, ring: Ring):
  """(out float32, natural lse) of the local queries over the whole sequence."""
  device = lax.axis_index(ring.axis_name)
  batch, _, heads, head_dim = q.shape
  c = ring.chunk
  queries = (_chunks(q, ring), _chunks(q_ids, ring))
  acc = [(_varying(jnp.zeros((batch, c, heads, head_dim), jnp.float32), ring),
          _varying(jnp.full((batch, heads, c), -jnp.inf, jnp.float32), ring)) for _ in range(ring.num_chunks)]
  travel = _Travel((k, v, kv_ids), ring)
  for t, step in enumerate(schedule(ring)):
    keys = tuple(_chunks(x, ring) for x in travel.step(t, device))
    acc = _run(step, device, functools.partial(_forward_kind, ring.parts), acc, (*queries, *keys))
  return _joined([o for o, _ in acc]), _joined([l for _, l in acc], axis=2)


def backward_ring(q, k, v, q_ids, kv_ids, out, lse, do, dlse, ring: Ring):
  """(dq, dk, dv) float32, each of this device's shard."""
  device = lax.axis_index(ring.axis_name)
  queries = ([_chunks(x, ring) for x in (q, out, do)] + [_chunks(x, ring, axis=2) for x in (lse, dlse)]
             + [_chunks(q_ids, ring)])
  zeros = lambda x: [_varying(jnp.zeros(part.shape, jnp.float32), ring) for part in _chunks(x, ring)]
  dq = zeros(q)
  travel = _Travel((k, v, kv_ids), ring)
  arrived = None  # the dK/dV accumulators of the K/V shard held this step, one hop behind it
  gathered = None
  for t, step in enumerate(schedule(ring)):
    keys = [_chunks(x, ring) for x in travel.step(t, device)]
    dq, dk, dv = _run(step, device, functools.partial(_backward_kind, ring.parts), (dq, zeros(k), zeros(v)),
                      (*queries, *keys))
    here = (_joined(dk), _joined(dv))
    if ring.strategy is RingStrategy.ALLGATHER:
      if gathered is None:
        gathered = tuple(_varying(jnp.zeros((ring.num_devices, *x.shape), jnp.float32), ring) for x in here)
      source = (device - t) % ring.num_devices
      gathered = tuple(lax.dynamic_update_index_in_dim(g, x, source, 0) for g, x in zip(gathered, here))
    else:
      # Added after this step's attention: the accumulators' hop overlaps it.
      total = here if arrived is None else tuple(a + x for a, x in zip(arrived, here))
      arrived = _hop(total, ring)  # after the last step, back at their owner
  if ring.strategy is RingStrategy.ALLGATHER:
    arrived = tuple(lax.psum_scatter(g, ring.axis_name, scatter_dimension=0) for g in gathered)
  return (_joined(dq), *arrived)


# ---------------------------------------------------------------- under jit with a split sequence


def _partitioned_ring(call: Call, q, axis, parts: Parts) -> Ring:
  """The ring of a flash_attention call whose sequence the partitioner
  split over mesh axis (or axes) `axis`, contiguously: its steps run the
  call's kernel families (Mosaic where it serves a step), the Triton kernels
  with the call's tiles, the Mosaic ones with their defaults."""
  band = call.problem.mask
  local = Mask(q.shape[1], q.shape[1], window_left=band.left, window_right=band.right, segments=band.segments)
  backend = Backend.MOSAIC if Backend.MOSAIC.value in (call.plan.forward.backend, call.plan.backward.backend) \
      else Backend.TRITON
  device = Device(backends.default_compute_capability(), call.interpret)
  block_sizes = call.plan.forward.config if backend is Backend.TRITON else None
  return Ring(axis, lax.axis_size(axis), RingLayout.CONTIGUOUS, RingStrategy.RING,
              dataclasses.replace(call.problem, mask=local), device, backend, parts, local=True,
              block_sizes=block_sizes)


def sharded_forward(q, k, v, operands: Operands, call: Call, axis, parts: Parts) -> tuple[jax.Array, jax.Array]:
  """The forward kernels' contract (out like q, lse in their base) for the
  shards of a sequence split over `axis`, by the ring: what sharding.py's
  partitioned forward runs when a call rides_ring."""
  ring = _partitioned_ring(call, q, axis, parts)
  out, lse = forward_ring(q, k, v, operands.q_segment_ids, operands.kv_segment_ids, ring)
  if operands.sinks is not None:
    out, lse = merge.join_sinks(out, lse, operands.sinks)
  return out.astype(q.dtype), lse * LOG2_E if call.lse_log2 else lse


def sharded_backward(q, k, v, out, lse, do, dlse, operands: Operands, call: Call, axis, parts: Parts):
  """The backward kernels' contract ((dq, dk, dv) from out, lse in their
  base, dO and dlse) for the shards of a sequence split over `axis`, by the
  ring (see sharded_forward)."""
  ring = _partitioned_ring(call, q, axis, parts)
  # No barrier needed: the partitioned backward is a call of its own.
  dq, dk, dv = backward_ring(q, k, v, operands.q_segment_ids, operands.kv_segment_ids, out,
                         call.natural_backward_lse(lse), do, dlse, ring)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
