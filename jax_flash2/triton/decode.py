"""Split-KV decoding over a KV cache (flash-decoding) as a Pallas kernel
(Triton lowering).

Grid: (batch, K/V heads, splits). The few new queries of one sequence and
the query heads of one K/V group are packed into the rows of one tile (row
r is query r // group of head h * group + r % group), so each program reads
its slice of K/V once for the whole group. A program owns split s of its
sequence's cache: the K/V blocks of [0, cache_seqlens[b]) inside the causal
or window band, cut into `splits` near-equal runs. The loop bound follows
the sequence's own length, so a short sequence costs what it reads and the
blocks past it are never loaded. Each program keeps the running row max
`m_i`, row sum `l_i` and unnormalised output `acc`, as the forward kernel
does, and writes its normalised partial output and its rows' lse (base 2),
float32; `combine` merges the splits exactly by their lse. Only the blocks
crossing an edge of the band or the sequence's end take the element mask
(`_band`'s full stretch runs without it, as in the forward kernel).

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
from jax_flash2.problem import DecodeProblem
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


def _decode_kernel(lens_ref, q_ref, k_ref, v_ref, *refs, p: DecodeProblem, rows: int, block_k: int, splits: int):
  # lens_ref: [batch] int32; q_ref, o_ref: [rows, D]; lse_ref: [rows];
  # k_ref, v_ref: [seq, D] (contiguous) or [num_pages, page_size, D]
  # (paged); then the block table's row [max_pages] when paged and the
  # rows' ALiBi slopes [rows] with ALiBi.
  refs = list(refs)
  table_ref = refs.pop(0) if p.paged else None
  slopes_ref = refs.pop(0) if p.has_alibi else None
  o_ref, lse_ref = refs
  b, split = pl.program_id(0), pl.program_id(2)
  length = lens_ref[b]
  cols = common.head_mask(p)
  r_idx = jnp.arange(rows, dtype=jnp.int32)
  # The cache position each row's query is level with.
  q_pos = length - p.seq_q + lax.div(r_idx, jnp.int32(p.group))
  q = common.load_tile(q_ref, None, cols)
  qk_scale = p.softmax_scale * LOG2_E
  slope = None if slopes_ref is None else slopes_ref[...] * LOG2_E

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


def _per_row(per_head, kv_heads: int, seq_q: int) -> jax.Array:
  """A per-head value, [heads] or [batch or 1, heads], in the kernel's row
  packing, [batch or 1, kv_heads, seq_q * group]: row r of K/V head h holds
  query r // group of head h * group + r % group."""
  group = per_head.shape[-1] // kv_heads
  x = per_head.reshape(-1, kv_heads, 1, group)
  return jnp.broadcast_to(x, (x.shape[0], kv_heads, seq_q, group)).reshape(x.shape[0], kv_heads, seq_q * group)


def decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, p: DecodeProblem, config: DecodeConfig, *,
           interpret: bool = False):
  """Runs the split-KV kernel.

  Args:
    q: [batch, seq_q, heads, head_dim].
    k_cache, v_cache: [batch, max_seq, kv_heads, head_dim], or paged
      [num_pages, page_size, kv_heads, head_dim] with block_table int32
      [batch, max_pages] (None when contiguous).
    cache_seqlens: int32 [batch].
    slopes: float32 [batch or 1, heads] ALiBi slopes, or None.
    config: block_k (dividing page_size when paged), num_splits, warps, stages.

  Returns:
    out: float32 [batch, kv_heads, num_splits, rows, head_dim_padded], each
      split's normalised output, rows packing (query, head in group).
    lse: float32 [batch, kv_heads, num_splits, rows], natural log; -inf
      for a split that saw no key.
  """
  batch, seq_q, heads, head_dim = q.shape
  kv_heads, g = k_cache.shape[2], p.group
  d = p.head_dim_padded
  block_k, num_splits = config.block_k, config.num_splits
  rows = max(16, 1 << (seq_q * g - 1).bit_length())
  # [batch, kv_heads, rows, D]: the group's heads and queries as rows.
  packed = q.reshape(batch, seq_q, kv_heads, g, head_dim).transpose(0, 2, 1, 3, 4)
  packed = packed.reshape(batch, kv_heads, seq_q * g, head_dim)
  packed = jnp.pad(packed, ((0, 0), (0, 0), (0, rows - seq_q * g), (0, d - head_dim)))
  in_specs = [
      pl.BlockSpec((batch,), lambda b, h, s: (0,)),
      pl.BlockSpec((None, None, rows, d), lambda b, h, s: (b, h, 0, 0)),
  ]
  if p.paged:
    kv_spec = pl.BlockSpec((k_cache.shape[0], p.page_size, None, d), lambda b, h, s: (0, 0, h, 0))
  else:
    kv_spec = pl.BlockSpec((None, common.round_up(k_cache.shape[1], block_k), None, d),
                           lambda b, h, s: (b, 0, h, 0))
  in_specs += [kv_spec, kv_spec]
  args = [cache_seqlens.astype(jnp.int32), packed, k_cache, v_cache]
  if p.paged:
    in_specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda b, h, s: (b, 0)))
    args.append(block_table.astype(jnp.int32))
  if p.has_alibi:
    per_row = jnp.pad(_per_row(slopes.astype(jnp.float32), kv_heads, seq_q), ((0, 0), (0, 0), (0, rows - seq_q * g)))
    batched = per_row.shape[0] > 1
    in_specs.append(pl.BlockSpec((None, None, rows), lambda b, h, s: (b if batched else 0, h, 0)))
    args.append(per_row)
  kernel = functools.partial(_decode_kernel, p=p, rows=rows, block_k=block_k, splits=num_splits)
  out, lse = pl.pallas_call(
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
  return out, lse * LN_2


def combine(out, lse, sinks, *, seq_q: int, heads: int, head_dim: int, dtype):
  """Merges the splits of `decode` exactly by their lse, joins the sinks
  (one logit per head in each row's denominator; float32 [heads] or
  [batch or 1, heads]) and unpacks the rows.

  Returns out [batch, seq_q, heads, head_dim] in dtype and lse float32
  [batch, heads, seq_q]: -inf (the sink with sinks) for a row that saw no
  key, whose output is zeros."""
  batch, kv_heads = out.shape[:2]
  g = heads // kv_heads
  out = out[:, :, :, :seq_q * g, :head_dim]
  lse = lse[:, :, :, :seq_q * g]
  m = jnp.max(lse, axis=2)  # [batch, kv_heads, rows]
  if sinks is not None:
    sink = jnp.broadcast_to(_per_row(sinks.astype(jnp.float32), kv_heads, seq_q), m.shape)
    m = jnp.maximum(m, sink)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  weights = jnp.exp(lse - m[:, :, None])  # [batch, kv_heads, splits, rows]
  total = jnp.sum(weights, axis=2)
  if sinks is not None:
    total = total + jnp.exp(sink - m)
  seen = total != 0.0
  total_safe = jnp.where(seen, total, 1.0)
  # A weighted sum over the splits as one reduction, which XLA fuses with
  # the weights and the division (an einsum would be a dot of its own).
  merged = jnp.sum(weights[..., None] * out, axis=2) / total_safe[..., None]
  merged_lse = jnp.where(seen, m + jnp.log(total_safe), -jnp.inf)
  merged = merged.reshape(batch, kv_heads, seq_q, g, head_dim).transpose(0, 2, 1, 3, 4)
  merged_lse = merged_lse.reshape(batch, kv_heads, seq_q, g).transpose(0, 1, 3, 2)
  return merged.reshape(batch, seq_q, heads, head_dim).astype(dtype), merged_lse.reshape(batch, heads, seq_q)
