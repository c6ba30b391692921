"""Split-KV decoding over a KV cache (flash-decoding) as Pallas kernels
(Triton lowering).

Split kernel, grid (batch, K/V heads, splits). The few new queries of one
sequence and the query heads of one K/V group are packed into the rows of
one tile (row r is query r // group of head h * group + r % group),
gathered from q in place, so each program reads its slice of K/V once for
the whole group. A program owns split s of its sequence's cache: the K/V
blocks of [0, cache_seqlens[b]) inside the causal or window band, cut into
`splits` near-equal runs. The loop bound follows the sequence's own length,
so a short sequence costs what it reads and the blocks past it are never
loaded. Each program keeps the running row max `m_i`, row sum `l_i` and
unnormalised output `acc`, as the forward kernel does, and writes its
normalised partial output and its rows' lse (base 2), float32. Only the
blocks crossing an edge of the band or the sequence's end take the element
mask (`_band`'s full stretch runs without it, as in the forward kernel).

Combine kernel, grid (batch, heads, queries): merges one row's splits
exactly by their lse, joins the sink and writes the output and lse in the
caller's layouts, so a decoding step is two kernels and no XLA around
them.

A paged cache ([num_pages, page_size, kv_heads, D]) is read through the
block table: K/V block j of a sequence lies in page block_table[b, j *
block_k // page_size] (block_k divides page_size), looked up in the loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flash2.config import DecodeConfig
from jax_flash2.problem import DecodeProblem, cache_capacity
from jax_flash2.triton import common
from jax_flash2.triton.common import LN_2, LOG2_E


def _band(p: DecodeProblem, length, block_k: int):
  """(lo, full_lo, full_hi, hi) over the K/V blocks of a sequence of
  `length` keys: no visible key outside blocks [lo, hi); blocks in [full_lo,
  full_hi) are visible whole to every query (no element mask). Query i is
  level with key length - seq_q + i."""
  div = lambda a: lax.div(a, jnp.int32(block_k))
  offset = length - p.seq_q
  hi = div(length + (block_k - 1))
  right = p.window_right
  last_full = length if right is None else jnp.minimum(length, jnp.maximum(offset + (right + 1), 0))
  full_hi = div(last_full)
  if p.window_left is None:
    lo = full_lo = jnp.int32(0)
  else:
    lo = div(jnp.maximum(offset - p.window_left, 0))
    full_lo = div(jnp.maximum(offset + (p.seq_q - 1 - p.window_left), 0) + (block_k - 1))
  full_lo = jnp.minimum(full_lo, hi)
  full_hi = jnp.maximum(jnp.minimum(full_hi, hi), full_lo)
  return lo, full_lo, full_hi, hi


def _group_rows(p: DecodeProblem, kv_head, rows: int):
  """(query, head) [rows] of the packed rows of K/V head `kv_head`: row r is
  query r // group of head kv_head * group + r % group. Rows past seq_q *
  group repeat the last real row, so that every gather stays in bounds and
  a padding row computes a copy of a real one."""
  r = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), p.seq_q * p.group - 1)
  g = jnp.int32(p.group)
  return lax.div(r, g), kv_head * g + lax.rem(r, g)


def _decode_kernel(lens_ref, q_ref, k_ref, v_ref, *refs, p: DecodeProblem, rows: int, block_k: int, splits: int,
                   capacity: int):
  # lens_ref: [batch] int32; q_ref: [seq_q, heads, head_dim]; k_ref, v_ref:
  # [seq, D] (contiguous) or [num_pages, page_size, D] (paged); then the
  # block table's row [max_pages] when paged and the ALiBi slopes [heads]
  # with ALiBi; o_ref: [rows, D]; lse_ref: [rows].
  refs = list(refs)
  table_ref = refs.pop(0) if p.paged else None
  slopes_ref = refs.pop(0) if p.has_alibi else None
  o_ref, lse_ref = refs
  b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = jnp.clip(lens_ref[b], 0, capacity)
  cols = common.head_mask(p)
  query, head = _group_rows(p, kv_head, rows)
  # The cache position each row's query is level with.
  q_pos = length - p.seq_q + query
  d_idx = jnp.arange(p.head_dim_padded, dtype=jnp.int32)
  if cols is not None:  # padding columns read the last real one, then zero
    d_idx = jnp.minimum(d_idx, p.head_dim - 1)
  q = q_ref[query[:, None], head[:, None], d_idx[None, :]]
  if cols is not None:
    q = jnp.where(cols[None, :], q, 0)
  qk_scale = p.softmax_scale * LOG2_E
  slope = None if slopes_ref is None else slopes_ref[head] * LOG2_E

  def tile(ref, kb):
    if not p.paged:
      return ref.at[pl.ds(kb * block_k, block_k), :]
    k_start = kb * block_k
    page = jnp.clip(table_ref[lax.div(k_start, jnp.int32(p.page_size))], 0, p.num_pages - 1)
    return ref.at[page, pl.ds(lax.rem(k_start, jnp.int32(p.page_size)), block_k), :]

  def step(kb, carry, masked: bool):
    acc, m_i, l_i = carry
    k_idx = common.indices(kb * block_k, block_k)
    k_rows = k_idx < length if masked else None
    k = common.load_tile(tile(k_ref, kb), k_rows, cols)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=common.precision(p),
                        preferred_element_type=jnp.float32)  # [rows, block_k]
    if p.softcap is not None:
      s = jnp.tanh(s * (p.softmax_scale / p.softcap)) * (p.softcap * LOG2_E)
    else:
      s = s * qk_scale
    if slope is not None:
      s = s - slope[:, None] * jnp.abs(q_pos[:, None] - k_idx[None, :]).astype(jnp.float32)
    if masked:
      visible = k_idx[None, :] < length
      if p.window_right is not None:
        visible &= k_idx[None, :] <= q_pos[:, None] + p.window_right
      if p.window_left is not None:
        visible &= k_idx[None, :] >= q_pos[:, None] - p.window_left
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    # A row that has seen only hidden keys keeps m = -inf: shift it by 0.
    m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_new)
    prob = jnp.exp2(s - m_new[:, None])
    l_i = l_i * alpha + jnp.sum(prob, axis=1)
    v = common.load_tile(tile(v_ref, kb), k_rows, cols)
    acc = acc * alpha[:, None] + lax.dot_general(
        prob.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=common.precision(p),
        preferred_element_type=jnp.float32)
    return acc, m_new, l_i

  lo, full_lo, full_hi, hi = _band(p, length, block_k)
  # This program's run of the band's blocks: near-equal runs, the first
  # ones a block longer.
  per = lax.div(hi - lo + (splits - 1), jnp.int32(splits))
  s_lo = jnp.minimum(lo + split * per, hi)
  s_hi = jnp.minimum(s_lo + per, hi)
  full_lo = jnp.clip(full_lo, s_lo, s_hi)
  full_hi = jnp.clip(full_hi, full_lo, s_hi)
  state = common.softmax_state(rows, p.head_dim_padded)
  acc, m_i, l_i = common.split_loop(step, state, s_lo, full_lo, full_hi, s_hi)

  # A split that saw no key (empty, or outside every row's band) writes
  # zeros and lse = -inf, which weigh nothing in the combine.
  seen = l_i != 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  common.store_tile(o_ref, acc / l_safe[:, None], None, cols)
  lse_ref[...] = jnp.where(seen, m_i + jnp.log2(l_safe), -jnp.inf)


def decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, p: DecodeProblem, config: DecodeConfig, *,
           interpret: bool = False):
  """Runs the split kernel.

  Args:
    q: [batch, seq_q, heads, head_dim].
    k_cache, v_cache: [batch, max_seq, kv_heads, head_dim], or paged
      [num_pages, page_size, kv_heads, head_dim] with block_table int32
      [batch, max_pages] (None when contiguous).
    cache_seqlens: int32 [batch], clipped to [0, capacity] here.
    slopes: float32 [batch or 1, heads] ALiBi slopes, or None.
    config: block_k (dividing page_size when paged), num_splits, warps, stages.

  Returns:
    parts: float32 [batch, kv_heads, num_splits, rows, head_dim_padded],
      each split's normalised output, rows packing (query, head in group).
    lse: float32 [batch, kv_heads, num_splits, rows], base 2; -inf for a
      split that saw no key.
  """
  batch, seq_q, heads, head_dim = q.shape
  kv_heads = k_cache.shape[2]
  d = p.head_dim_padded
  block_k, num_splits = config.block_k, config.num_splits
  rows = _rows(p)
  in_specs = [
      pl.BlockSpec((batch,), lambda b, h, s: (0,)),
      pl.BlockSpec((None, seq_q, heads, head_dim), lambda b, h, s: (b, 0, 0, 0)),
  ]
  if p.paged:
    kv_spec = pl.BlockSpec((k_cache.shape[0], p.page_size, None, d), lambda b, h, s: (0, 0, h, 0))
  else:
    kv_spec = pl.BlockSpec((None, common.round_up(k_cache.shape[1], block_k), None, d),
                           lambda b, h, s: (b, 0, h, 0))
  in_specs += [kv_spec, kv_spec]
  args = [cache_seqlens.astype(jnp.int32), q, k_cache, v_cache]
  if p.paged:
    in_specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda b, h, s: (b, 0)))
    args.append(block_table.astype(jnp.int32))
  if p.has_alibi:
    batched = slopes.shape[0] > 1
    in_specs.append(pl.BlockSpec((None, heads), lambda b, h, s: (b if batched else 0, 0)))
    args.append(slopes.astype(jnp.float32))
  kernel = functools.partial(_decode_kernel, p=p, rows=rows, block_k=block_k, splits=num_splits,
                             capacity=cache_capacity(k_cache, block_table))
  return pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_splits),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, d), lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          common.out_struct((batch, kv_heads, num_splits, rows, d), jnp.float32, *args),
          common.out_struct((batch, kv_heads, num_splits, rows), jnp.float32, *args),
      ],
      compiler_params=common.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name="flash2_decode",
  )(*args)


def _rows(p: DecodeProblem) -> int:
  """Rows of the split kernel's tile: seq_q * group, rounded up to a power
  of two >= 16 (the tensor cores' smallest M)."""
  return max(16, 1 << (p.seq_q * p.group - 1).bit_length())


def _combine_kernel(parts_ref, lse_ref, *refs, p: DecodeProblem, splits: int, has_sinks: bool):
  # One output row (head, query) a program. parts_ref: [splits, rows, D];
  # lse_ref: [splits, rows] (base 2); then the head's sink [] with sinks;
  # o_ref: [D]; lse_out_ref: [].
  refs = list(refs)
  sink_ref = refs.pop(0) if has_sinks else None
  o_ref, lse_out_ref = refs
  head, query = pl.program_id(1), pl.program_id(2)
  row = query * p.group + lax.rem(head, jnp.int32(p.group))
  d_idx = jnp.arange(p.head_dim_padded, dtype=jnp.int32)
  # The splits in chunks of a power of two (what loads take); a chunk's
  # slots past the last split repeat it and weigh nothing.
  chunk = min(16, 1 << (splits - 1).bit_length())
  chunks = -(-splits // chunk)

  def load(c):
    s = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    clamped = jnp.minimum(s, splits - 1)
    lse = jnp.where(s < splits, lse_ref[clamped, row], -jnp.inf)
    return lse, clamped

  def chunk_max(c, m):
    return jnp.maximum(m, jnp.max(load(c)[0]))

  m = lax.fori_loop(0, chunks, chunk_max, jnp.float32(-jnp.inf))
  if sink_ref is not None:
    sink = sink_ref[...] * LOG2_E
    m = jnp.maximum(m, sink)
  # A row no split saw (and no sink): weigh everything by exp2(-inf) = 0.
  m = jnp.where(m == -jnp.inf, 0.0, m)

  def add(c, carry):
    acc, total = carry
    lse, s = load(c)
    w = jnp.exp2(lse - m)
    part = parts_ref[s[:, None], row, d_idx[None, :]]
    return acc + jnp.sum(w[:, None] * part, axis=0), total + jnp.sum(w)

  acc, total = lax.fori_loop(0, chunks, add, (jnp.zeros(d_idx.shape, jnp.float32), jnp.float32(0.0)))
  if sink_ref is not None:
    total = total + jnp.exp2(sink - m)
  seen = total != 0.0
  total_safe = jnp.where(seen, total, 1.0)
  o_ref[...] = (acc / total_safe).astype(o_ref.dtype)
  lse_out_ref[...] = jnp.where(seen, (m + jnp.log2(total_safe)) * LN_2, -jnp.inf)


def combine(parts, lse, sinks, p: DecodeProblem, *, heads: int, dtype, interpret: bool = False):
  """Merges the splits of `decode` exactly by their lse and joins the sinks
  (one logit per head in each row's denominator; float32 [heads] or [batch
  or 1, heads]).

  Returns out [batch, seq_q, heads, head_dim] in dtype and lse float32
  [batch, heads, seq_q], natural log: -inf (the sink with sinks) for a row
  that saw no key, whose output is zeros."""
  batch, kv_heads, num_splits, rows, d = parts.shape
  seq_q, g = p.seq_q, p.group
  in_specs = [
      pl.BlockSpec((None, None, num_splits, rows, d), lambda b, h, i: (b, h // g, 0, 0, 0)),
      pl.BlockSpec((None, None, num_splits, rows), lambda b, h, i: (b, h // g, 0, 0)),
  ]
  args = [parts, lse]
  if sinks is not None:
    sinks = jnp.asarray(sinks, jnp.float32).reshape(-1, heads)
    batched = sinks.shape[0] > 1
    in_specs.append(pl.BlockSpec((None, None), lambda b, h, i: (b if batched else 0, h)))
    args.append(sinks)
  kernel = functools.partial(_combine_kernel, p=p, splits=num_splits, has_sinks=sinks is not None)
  out, lse = pl.pallas_call(
      kernel,
      grid=(batch, heads, seq_q),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, d), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, None, None), lambda b, h, i: (b, h, i)),
      ],
      out_shape=[
          common.out_struct((batch, seq_q, heads, d), dtype, *args),
          common.out_struct((batch, heads, seq_q), jnp.float32, *args),
      ],
      compiler_params=common.compiler_params(num_warps=4, num_stages=2),
      interpret=interpret,
      name="flash2_decode_combine",
  )(*args)
  # A head_dim that is no power of two is padded in the kernels (the
  # padding columns are zeros).
  return (out if d == p.head_dim else out[..., :p.head_dim]), lse
