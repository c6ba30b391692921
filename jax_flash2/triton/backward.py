"""FlashAttention-2 backward pass as Pallas kernels (Triton lowering).

Three kernels, none with atomics, so gradients are bitwise reproducible:

1. `_delta_kernel`: delta = rowsum(dO * O), one value per query row. It is
   the rowsum of P * dP that every dS tile needs (dS = P * (dP - delta)).
2. `_dkv_kernel`: grid over K/V blocks (and K/V heads). A program owns dK
   and dV of one K/V block and streams the Q blocks that can see it, for each
   query head of its GQA group, recomputing P from Q, K and the forward's
   log-sum-exp.
3. `_dq_kernel`: grid over Q blocks. A program owns dQ of one Q block and
   streams the K/V blocks it can see.

The probabilities are recomputed as P = exp2(S * scale * log2(e) - lse *
log2(e)) (with the softcap and ALiBi applied to S as in the forward), never
stored: memory stays linear in sequence length. Blocks outside the causal or
window band or the segments, and tiles a dense mask hides, are skipped as in
the forward.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flash2.config import BlockSizes, KernelConfig
from jax_flash2.problem import Operands, Problem
from jax_flash2.triton import common
from jax_flash2.triton.common import LOG2_E

_DELTA_BLOCK_Q = 64


def _delta_kernel(o_ref, do_ref, delta_ref, *, problem: Problem, block_q: int):
  q_idx = common.indices(pl.program_id(0) * block_q, block_q)
  rows = q_idx < problem.seq_q if problem.seq_q % block_q else None
  o = common.load_tile(o_ref, rows, common.head_mask(problem)).astype(jnp.float32)
  do = common.load_tile(do_ref, rows, common.head_mask(problem)).astype(jnp.float32)
  common.store(delta_ref, jnp.sum(o * do, axis=1), rows)


def _lse_log2(lse_ref, rows) -> jax.Array:
  """Loads the forward's base-2 lse. Rows that saw no key (lse = -inf) and
  rows past seq_q read +inf, so that their recomputed P is exp2(s - inf) = 0."""
  lse = common.load(lse_ref, rows, other=jnp.inf)
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def _probabilities(qk: jax.Array, lse_log2: jax.Array, problem: Problem, q_idx, k_idx, slope, bias=None):
  """P recomputed from raw scores and the forward's lse (log2 domain), and
  the softcap's derivative (None without a softcap) that dS picks up.
  q_idx, k_idx and the bias tile broadcast to the tile (see common.scores_log2)."""
  if not problem.modifies_scores:
    return jnp.exp2(qk * (problem.softmax_scale * LOG2_E) - lse_log2), None
  s, dcap = common.scores_log2(qk, problem, q_idx, k_idx, slope, bias)
  return jnp.exp2(s - lse_log2), dcap


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, problem: Problem, block_q: int, block_k: int,
    mask_grouped: bool = False, bias_grouped: bool = False,
):
  # k_ref, v_ref, dk_ref, dv_ref: [block_k, D] of one K/V head. The query
  # heads that read it (its GQA group; one head without GQA) come whole:
  # q_ref, do_ref: [seq_q, group, D]; lse_ref, delta_ref: [group, seq_q], the
  # group axis left out when group is 1. opt (common.OptionalRefs): the dense
  # mask [(group,) seq_q, seq_k] and tile flags [(group,) Q blocks, K blocks],
  # the group axis there only when the mask has one per head (mask_grouped);
  # the segment bounds [K blocks, 4] (over Q blocks, one per K/V block);
  # segment ids [seq_q] and [seq_k]; ALiBi slopes [(group,)]; dropout seed [2];
  # the bias [(group,) seq_q, seq_k] (bias_grouped as mask_grouped).
  opt, dk_ref, dv_ref = common.split_refs(refs, problem)
  grouped = problem.group > 1
  cols = common.head_mask(problem)
  k_block, batch_index, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k_start = k_block * block_k
  k_idx = common.indices(k_start, block_k)
  k_rows = k_idx < problem.seq_k if problem.seq_k % block_k else None
  k = common.load_tile(k_ref, k_rows, cols)
  v = common.load_tile(v_ref, k_rows, cols)
  ragged_q = problem.seq_q % block_q != 0

  def step_for_head(g):
    """The loop step over Q blocks for query head g of the group."""
    mask_head = g if mask_grouped else None
    slope = None if opt.slopes is None else (opt.slopes[g] if grouped else opt.slopes[...])
    query_head = kv_head * problem.group + g if grouped else kv_head
    head = common.dropout_head(problem, batch_index, query_head, pl.num_programs(2) * problem.group)

    def step(qb, carry, masked: bool):
      dk, dv = carry
      q_start = qb * block_q
      q_idx = common.indices(q_start, block_q)
      rows = q_idx < problem.seq_q if (masked and ragged_q) else None
      q_slice = pl.ds(q_start, block_q)
      # One indexer per ref: the Triton lowering takes no chained .at[].
      tile = (q_slice, g, slice(None)) if grouped else (q_slice, slice(None))
      vec = (g, q_slice) if grouped else (q_slice,)
      q = common.load_tile(q_ref.at[tile], rows, cols)
      do = common.load_tile(do_ref.at[tile], rows, cols)
      lse = _lse_log2(lse_ref.at[vec], rows)
      delta = common.load(delta_ref.at[vec], rows, other=0.0)
      # Work on the transposed [block_k, block_q] tile: dV = P^T dO and
      # dK = dS^T Q then take P^T and dS^T as they come out of the dot, and
      # only the Q and dO tiles (which pass through shared memory anyway) are
      # transposed, instead of the register-resident P and dS.
      qk_t = common.dot(k, q, problem, trans_b=True)
      bias = common.bias_tile(opt, problem, q_start, k_start, block_q, block_k, g if bias_grouped else None)
      bias_t = None if bias is None else bias.T
      p_t, dcap_t = _probabilities(qk_t, lse[None, :], problem, q_idx[None, :], k_idx[:, None], slope, bias_t)
      if masked:
        visible_t = common.visible(problem, q_idx[None, :], k_idx[:, None])
        extra = common.extra_visible(opt, problem, q_start, k_start, block_q, block_k, mask_head)
        if extra is not None:
          visible_t &= extra.T
        p_t = jnp.where(visible_t, p_t, 0.0)
      # Under dropout the output read the thinned Z * P: dV takes Z * P, and
      # dP (the gradient of P itself) is Z * dO V^T; delta = rowsum(dO * O)
      # is already the rowsum of P * dP.
      drop_t = common.dropout_multiplier(opt, problem, head, q_idx[None, :], k_idx[:, None])
      p_v = p_t if drop_t is None else p_t * drop_t
      dv += common.dot(p_v.astype(do.dtype), do, problem)
      dp_t = common.dot(v, do, problem, trans_b=True)
      if drop_t is not None:
        dp_t *= drop_t
      ds_t = p_t * (dp_t - delta[None, :])
      if dcap_t is not None:
        ds_t *= dcap_t
      dk += common.dot(ds_t.astype(q.dtype), q, problem)
      return dk, dv

    if common.has_tile_flags(problem):
      flag = (lambda qb: opt.flags[g, qb, k_block]) if mask_grouped else (lambda qb: opt.flags[qb, k_block])
      return common.skip_hidden_blocks(step, lambda qb: flag(qb) != 0)
    return step

  band = common.q_block_range(problem, k_start, block_q, block_k)
  lo, full_lo, full_hi, hi = common.within_segments(opt, k_block, band)
  if common.has_tile_flags(problem):
    full_lo = full_hi = lo  # every visited tile takes the element mask

  def accumulate_head(g, carry):
    return common.split_loop(step_for_head(g), carry, lo, full_lo, full_hi, hi)

  zeros = jnp.zeros((block_k, problem.head_dim_padded), jnp.float32)
  # dK and dV of a shared K/V head are sums over the query heads of its group:
  # accumulated here, so K and V are never repeated in memory.
  if grouped:
    dk, dv = lax.fori_loop(0, problem.group, accumulate_head, (zeros, zeros))
  else:
    dk, dv = accumulate_head(None, (zeros, zeros))
  # S = scale * Q K^T, so the scale comes back once on dK.
  common.store_tile(dk_ref, (dk * problem.softmax_scale).astype(dk_ref.dtype), k_rows, cols)
  common.store_tile(dv_ref, dv.astype(dv_ref.dtype), k_rows, cols)


class _QBlock(NamedTuple):
  """What a Q-outer backward program (dQ, dBias) holds of its Q block."""

  index: Any  # which Q block
  start: Any
  idx: jax.Array  # [block_q] query positions
  rows: jax.Array | None  # [block_q] validity, None when no ragged end cuts the block
  q: jax.Array
  do: jax.Array
  lse: jax.Array  # log2 domain
  delta: jax.Array
  slope: Any  # this head's ALiBi slope, or None
  head: Any  # dropout's flat (batch, head) index


def _load_q_block(q_ref, do_ref, lse_ref, delta_ref, opt, problem: Problem, block_q: int) -> _QBlock:
  index = common.q_block_of_program(pl.program_id(0), problem.seq_q, block_q)
  start = index * block_q
  idx = common.indices(start, block_q)
  rows = idx < problem.seq_q if problem.seq_q % block_q else None
  cols = common.head_mask(problem)
  return _QBlock(
      index=index,
      start=start,
      idx=idx,
      rows=rows,
      q=common.load_tile(q_ref, rows, cols),
      do=common.load_tile(do_ref, rows, cols),
      lse=_lse_log2(lse_ref, rows),
      delta=common.load(delta_ref, rows, other=0.0),
      slope=opt.slopes[...] if opt.slopes is not None else None,
      head=common.dropout_head(problem, pl.program_id(1), pl.program_id(2), pl.num_programs(2)),
  )


def _score_gradient(blk: _QBlock, k_ref, v_ref, kb, masked: bool, opt, problem: Problem, block_q: int, block_k: int):
  """(dS, the softcap's derivative or None, the K tile) of K/V block kb: dS
  is the gradient of the scores after softcap, ALiBi and bias, which is
  dBias itself; dQ takes dS times the softcap's derivative."""
  cols = common.head_mask(problem)
  k_start = kb * block_k
  k_idx = common.indices(k_start, block_k)
  k_rows = k_idx < problem.seq_k if (masked and problem.seq_k % block_k) else None
  k_slice = pl.ds(k_start, block_k)
  k = common.load_tile(k_ref.at[k_slice, :], k_rows, cols)
  v = common.load_tile(v_ref.at[k_slice, :], k_rows, cols)
  qk = common.dot(blk.q, k, problem, trans_b=True)
  bias = common.bias_tile(opt, problem, blk.start, k_start, block_q, block_k)
  p, dcap = _probabilities(qk, blk.lse[:, None], problem, blk.idx[:, None], k_idx[None, :], blk.slope, bias)
  if masked:
    visible = common.visible(problem, blk.idx[:, None], k_idx[None, :])
    extra = common.extra_visible(opt, problem, blk.start, k_start, block_q, block_k)
    if extra is not None:
      visible &= extra
    p = jnp.where(visible, p, 0.0)
  dp = common.dot(blk.do, v, problem, trans_b=True)
  drop = common.dropout_multiplier(opt, problem, blk.head, blk.idx[:, None], k_idx[None, :])
  if drop is not None:
    dp *= drop  # see _dkv_kernel
  return p * (dp - blk.delta[:, None]), dcap, k


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, problem: Problem, block_q: int, block_k: int
):
  # q_ref, do_ref, dq_ref: [block_q, D]; lse_ref, delta_ref: [block_q];
  # k_ref, v_ref: [seq_k, D];
  # opt (common.OptionalRefs): as in the forward kernel.
  opt, dq_ref = common.split_refs(refs, problem)
  blk = _load_q_block(q_ref, do_ref, lse_ref, delta_ref, opt, problem, block_q)

  def step(kb, dq, masked: bool):
    ds, dcap, k = _score_gradient(blk, k_ref, v_ref, kb, masked, opt, problem, block_q, block_k)
    if dcap is not None:
      ds *= dcap
    return dq + common.dot(ds.astype(k.dtype), k, problem)

  band = common.kv_block_range(problem, blk.start, block_q, block_k)
  lo, full_lo, full_hi, hi = common.within_segments(opt, blk.index, band)
  if common.has_tile_flags(problem):
    step = common.skip_hidden_blocks(step, lambda kb: opt.flags[blk.index, kb] != 0)
    full_lo = full_hi = lo  # every visited tile takes the element mask
  zeros = jnp.zeros((block_q, problem.head_dim_padded), jnp.float32)
  dq = common.split_loop(step, zeros, lo, full_lo, full_hi, hi)
  common.store_tile(dq_ref, (dq * problem.softmax_scale).astype(dq_ref.dtype), blk.rows, common.head_mask(problem))


def _dbias_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, problem: Problem, block_q: int, block_k: int
):
  # As _dq_kernel, but the program writes dS itself: ds_ref is its
  # [block_q, K blocks * block_k] float32 row of the padded dBias. Every tile
  # is written, hidden ones (outside the band or the segments, or skipped by
  # the tile flags) with zeros.
  opt, ds_ref = common.split_refs(refs, problem)
  blk = _load_q_block(q_ref, do_ref, lse_ref, delta_ref, opt, problem, block_q)
  zeros = jnp.zeros((block_q, block_k), jnp.float32)

  def write(kb, tile):
    ds_ref[:, pl.ds(kb * block_k, block_k)] = tile

  def step(kb, carry, masked: bool):
    write(kb, _score_gradient(blk, k_ref, v_ref, kb, masked, opt, problem, block_q, block_k)[0])
    return carry

  def clear(kb, carry):
    write(kb, zeros)
    return carry

  band = common.kv_block_range(problem, blk.start, block_q, block_k)
  lo, full_lo, full_hi, hi = common.within_segments(opt, blk.index, band)
  if common.has_tile_flags(problem):
    visit = step
    step = lambda kb, carry, masked: lax.cond(
        opt.flags[blk.index, kb] != 0, lambda c: visit(kb, c, True), lambda c: clear(kb, c), carry
    )
    full_lo = full_hi = lo
  lax.fori_loop(0, lo, clear, 0)
  common.split_loop(step, 0, lo, full_lo, full_hi, hi)
  lax.fori_loop(hi, pl.cdiv(problem.seq_k, block_k), clear, 0)


def compute_delta(out: jax.Array, do: jax.Array, problem: Problem, *, interpret: bool = False) -> jax.Array:
  """delta = rowsum(dO * O): float32 [batch, heads, seq_q]."""
  batch, seq_q, heads, _ = out.shape
  d, block = problem.head_dim_padded, _DELTA_BLOCK_Q
  return pl.pallas_call(
      functools.partial(_delta_kernel, problem=problem, block_q=block),
      grid=(pl.cdiv(seq_q, block), batch, heads),
      in_specs=[common.rows_spec(block, d), common.rows_spec(block, d)],
      out_specs=common.row_vector_spec(block),
      out_shape=common.out_struct((batch, heads, seq_q), jnp.float32, out, do),
      compiler_params=common.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="flash2_bwd_delta",
  )(out, do)


def compute_dkv(
    q, k, v, do, lse, delta, operands: Operands, problem: Problem, config: KernelConfig, *,
    interpret: bool = False, ranges=None,
):
  """(dK, dV), each like k; lse and delta are float32 [batch, heads, seq_q].

  The grid runs over K/V heads; each program also owns the sum over the query
  heads of its GQA group.
  """
  batch, seq_q, d, group = q.shape[0], q.shape[1], problem.head_dim_padded, problem.group
  bq, bk = config.block_q, config.block_k
  in_specs, args = common.with_optional_inputs(
      [
          common.group_seq_spec(seq_q, bq, d, group),
          common.rows_spec(bk, d),
          common.rows_spec(bk, d),
          common.group_seq_spec(seq_q, bq, d, group),
          common.group_row_vector_spec(seq_q, bq, group),
          common.group_row_vector_spec(seq_q, bq, group),
      ],
      [q, k, v, do, lse, delta],
      operands,
      bq,
      bk,
      heads_per_program=group,
      kv_outer=True,
      ranges=ranges,
  )
  grouped = lambda x: x is not None and common.has_group_axis(x, group)
  kernel = functools.partial(
      _dkv_kernel, problem=problem, block_q=bq, block_k=bk,
      mask_grouped=grouped(operands.mask), bias_grouped=grouped(operands.bias),
  )
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(k.shape[1], bk), batch, k.shape[2]),
      in_specs=in_specs,
      out_specs=[common.rows_spec(bk, d), common.rows_spec(bk, d)],
      out_shape=[common.out_struct(k.shape, k.dtype, *args), common.out_struct(v.shape, v.dtype, *args)],
      compiler_params=common.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name="flash2_bwd_dkv",
  )(*args)


def _q_outer_call(kernel, name: str, out_spec, out_shape, q, k, v, do, lse, delta, operands, problem, config,
                  interpret, ranges=None):
  # out_shape: (shape, dtype) of the one output.
  """A Q-outer backward kernel (dQ, dBias) over the grid (Q blocks, batch, heads)."""
  batch, seq_q, heads, d = *q.shape[:3], problem.head_dim_padded
  bq, bk = config.block_q, config.block_k
  kv_spec = common.whole_seq_spec(k.shape[1], bk, d, head_divisor=problem.group)
  in_specs, args = common.with_optional_inputs(
      [
          common.rows_spec(bq, d, seq_q),
          kv_spec,
          kv_spec,
          common.rows_spec(bq, d, seq_q),
          common.row_vector_spec(bq, seq_q),
          common.row_vector_spec(bq, seq_q),
      ],
      [q, k, v, do, lse, delta],
      operands,
      bq,
      bk,
      ranges=ranges,
  )
  return pl.pallas_call(
      functools.partial(kernel, problem=problem, block_q=bq, block_k=bk),
      grid=(pl.cdiv(seq_q, bq), batch, heads),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=common.out_struct(*out_shape, *args),
      compiler_params=common.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name=name,
  )(*args)


def compute_dq(
    q, k, v, do, lse, delta, operands: Operands, problem: Problem, config: KernelConfig, *,
    interpret: bool = False, ranges=None,
):
  """dQ, like q; lse and delta are float32 [batch, heads, seq_q]. ranges:
  segment ranges shared with the pass's other kernel (derived if None)."""
  out_spec = common.rows_spec(config.block_q, problem.head_dim_padded, q.shape[1])
  out_shape = (q.shape, q.dtype)
  return _q_outer_call(_dq_kernel, "flash2_bwd_dq", out_spec, out_shape, q, k, v, do, lse, delta, operands,
                       problem, config, interpret, ranges)


def compute_dbias(
    q, k, v, do, lse, delta, operands: Operands, problem: Problem, config: KernelConfig, *,
    interpret: bool = False,
):
  """dS, float32 [batch, heads, seq_q, seq_k]: the gradient of the biased
  scores, which is dBias before the sum over the bias's broadcast axes."""
  batch, seq_q, heads = q.shape[:3]
  bq, bk = config.block_q, config.block_k
  padded = (common.round_up(seq_q, bq), common.round_up(problem.seq_k, bk))
  # Programs write whole tiles of a padded array (zeros past the ends), so
  # no store needs a mask; the padding is sliced off here.
  out_spec = pl.BlockSpec(
      (None, None, bq, padded[1]), lambda i, b, h: (b, h, common.q_block_of_program(i, seq_q, bq), 0)
  )
  out_shape = ((batch, heads, *padded), jnp.float32)
  ds = _q_outer_call(_dbias_kernel, "flash2_bwd_dbias", out_spec, out_shape, q, k, v, do, lse, delta, operands,
                     problem, config, interpret)
  return ds[:, :, :seq_q, : problem.seq_k]


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    dlse: jax.Array,
    operands: Operands,
    problem: Problem,
    block_sizes: BlockSizes,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradients of attention with respect to q, k and v.

  Args:
    q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, heads, head_dim].
    out, do: like q (the forward output and its cotangent).
    lse, dlse: float32 [batch, heads, seq_q]: the forward's log-sum-exp, in
      base 2 as `forward` writes it, and the cotangent of the natural one.
    operands: the mask, segment ids, ALiBi slopes, dropout seed and bias the
      problem has (see Operands).

  Returns:
    dq, dk, dv, each like its primal.
  """
  delta = backward_delta(out, do, dlse, problem, interpret=interpret)
  # One set of per-block segment ranges for both kernels.
  ranges = common.segment_ranges(operands)
  dk, dv = compute_dkv(q, k, v, do, lse, delta, operands, problem, block_sizes.dkv, interpret=interpret,
                       ranges=ranges)
  dq = compute_dq(q, k, v, do, lse, delta, operands, problem, block_sizes.dq, interpret=interpret, ranges=ranges)
  return dq, dk, dv


def bias_gradient(
    q, k, v, out, lse, do, dlse, operands: Operands, problem: Problem, block_sizes: BlockSizes, *,
    interpret: bool = False,
) -> jax.Array:
  """dS, float32 [batch, heads, seq_q, seq_k], for the gradient of the bias;
  arguments as `backward`. A call of its own, so that a caller who takes no
  gradient of the bias never runs it (jit drops the unused kernel)."""
  delta = backward_delta(out, do, dlse, problem, interpret=interpret)
  return compute_dbias(q, k, v, do, lse, delta, operands, problem, block_sizes.dq, interpret=interpret)


def backward_delta(out: jax.Array, do: jax.Array, dlse: jax.Array, problem: Problem, *, interpret: bool = False) -> jax.Array:
  """delta = rowsum(dO * O) - dlse: float32 [batch, heads, seq_q], what both
  backward kernels (these and the Mosaic ones) take beside the lse."""
  # d lse / d S = P, so a cotangent on lse adds P * dlse to
  # dS = P * (dP - delta): it folds into delta.
  return compute_delta(out, do, problem, interpret=interpret) - dlse
