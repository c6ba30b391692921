"""FlashAttention-2 forward pass as a Pallas kernel (Triton lowering).

Grid: (Q blocks, batch, heads). Each program owns one block of queries, keeps
it on chip together with the running row max `m_i`, the running row sum `l_i`
and the unnormalised output `acc`, and streams the K/V blocks of its (batch,
K/V head) past it. The output is divided by `l_i` once, at the end, and the
log-sum-exp of each row is written for the backward pass, in base 2: the
base the backward's exponentials take, so that no conversion rounds it.

The loop visits only the K/V blocks inside the causal or window band
(`common.kv_block_range`) and, with segment ids, inside the Q block's
segments (`common.within_segments`); of those, only the blocks crossing an
edge of the band, a segment boundary, a ragged end or a dense mask apply the
element mask, and tiles a dense mask hides entirely are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flash2 import merge
from jax_flash2.config import KernelConfig
from jax_flash2.problem import Operands, Problem
from jax_flash2.triton import common
from jax_flash2.triton.common import LOG2_E


def _forward_kernel(q_ref, k_ref, v_ref, *refs, problem: Problem, block_q: int, block_k: int):
  # q_ref, o_ref: [block_q, D]; k_ref, v_ref: [seq_k, D]; lse_ref: [block_q];
  # opt (common.OptionalRefs): the dense mask [seq_q, seq_k], the tile flags
  # [Q blocks, K blocks], the segment bounds [Q blocks, 4], segment ids
  # [seq_q] and [seq_k], this head's ALiBi slope [], the dropout seed [2],
  # the bias [seq_q, seq_k], each where the problem has it; then this head's
  # sink [] with sinks.
  opt, *refs = common.split_refs(refs, problem)
  sink_ref, o_ref, lse_ref = refs if problem.has_sinks else (None, *refs)
  seq_q, seq_k = problem.seq_q, problem.seq_k
  q_block = common.q_block_of_program(pl.program_id(0), seq_q, block_q)
  q_start = q_block * block_q
  q_idx = common.indices(q_start, block_q)
  cols = common.head_mask(problem)
  ragged_q = seq_q % block_q != 0
  q_rows = q_idx < seq_q if ragged_q else None

  q = common.load_tile(q_ref, q_rows, cols)
  # The softmax scale and the change to base 2 fold into one factor. Plain
  # scores stay unscaled, and so does the running max m_i: the factor applies
  # after the subtraction, so the row's largest score gives exactly exp2(0)
  # at any magnitude (scaling first, the rounding of s * qk_scale against an
  # exact fused multiply-add could put a row's terms at inf or 0). A softcap,
  # ALiBi or a bias needs the scaled score, so there the scores are taken to
  # base 2 up front.
  qk_scale = problem.softmax_scale * LOG2_E
  log2_domain = (lambda s: s) if problem.modifies_scores else (lambda s: s * qk_scale)
  slope = opt.slopes[...] if opt.slopes is not None else None
  head = common.dropout_head(problem, pl.program_id(1), pl.program_id(2), pl.num_programs(2))

  def step(kb, carry, masked: bool):
    acc, m_i, l_i = carry
    k_start = kb * block_k
    k_idx = common.indices(k_start, block_k)
    k_rows = k_idx < seq_k if (masked and seq_k % block_k) else None
    k = common.load_tile(k_ref.at[pl.ds(k_start, block_k), :], k_rows, cols)
    s = common.dot(q, k, problem, trans_b=True)  # [block_q, block_k]
    if problem.modifies_scores:
      bias = common.bias_tile(opt, problem, q_start, k_start, block_q, block_k)
      s = common.scores_log2(s, problem, q_idx[:, None], k_idx[None, :], slope, bias)[0]
    if masked:
      visible = common.visible(problem, q_idx[:, None], k_idx[None, :])
      extra = common.extra_visible(opt, problem, q_start, k_start, block_q, block_k)
      if extra is not None:
        visible &= extra
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    if masked or problem.has_bias:
      # A row that has seen only masked scores so far (or a bias of -inf)
      # keeps m = -inf; shift it by 0 so that exp2 gives 0 instead of
      # exp2(-inf + inf) = NaN.
      m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(log2_domain(m_i - m_new))  # rescales what was accumulated under the old max
    p = jnp.exp2(log2_domain(s - m_new[:, None]))
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    v = common.load_tile(v_ref.at[pl.ds(k_start, block_k), :], k_rows, cols)
    # Dropout thins what reaches the output, not the normaliser: l_i (and the
    # lse) stay those of the full softmax, as in dropout(softmax(s)) @ v.
    drop = common.dropout_multiplier(opt, problem, head, q_idx[:, None], k_idx[None, :])
    p_v = p if drop is None else p * drop
    acc = acc * alpha[:, None] + common.dot(p_v.astype(v.dtype), v, problem)
    return acc, m_new, l_i

  band = common.kv_block_range(problem, q_start, block_q, block_k)
  lo, full_lo, full_hi, hi = common.within_segments(opt, q_block, band)
  if common.has_tile_flags(problem):
    step = common.skip_hidden_blocks(step, lambda kb: opt.flags[q_block, kb] != 0)
    full_lo = full_hi = lo  # every visible tile takes the element mask
  acc = jnp.zeros((block_q, problem.head_dim_padded), jnp.float32)
  m_i = jnp.full((block_q,), -jnp.inf, jnp.float32)
  l_i = jnp.zeros((block_q,), jnp.float32)
  acc, m_i, l_i = common.split_loop(step, (acc, m_i, l_i), lo, full_lo, full_hi, hi)

  # The sink joins the denominator here, in base 2 (merge.join_sink_rows).
  # Rows that saw no key (outside the band, e.g. causal with seq_q > seq_k,
  # or under a dense mask) have l_i = 0: they get zeros and lse = -inf
  # rather than 0/0 (with a sink, zeros and lse = the sink). A row with a
  # NaN (or an infinite score) has l_i = NaN: its output and lse are NaN.
  m_i = log2_domain(m_i)
  if sink_ref is not None:
    m_i, l_i, scale = merge.join_sink_rows(m_i, l_i, sink_ref[...] * LOG2_E)
  seen = l_i != 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  out = acc / l_safe[:, None] if sink_ref is None else acc * (scale / l_safe)[:, None]
  common.store_tile(o_ref, out.astype(o_ref.dtype), q_rows, cols)
  lse = jnp.where(seen, m_i + jnp.log2(l_safe), -jnp.inf)  # base 2, as the backward reads it
  common.store(lse_ref, lse, q_rows)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    operands: Operands,
    problem: Problem,
    config: KernelConfig,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Runs the forward kernel.

  Args:
    q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, heads // group, head_dim].
    operands: the mask, segment ids, ALiBi slopes, dropout seed, bias and
      sinks ([batch or 1, heads], joined to every row's denominator) the
      problem has (see Operands).

  Returns:
    out: like q. lse: float32 [batch, heads, seq_q], base 2 (log2 of the sum
      of exp2 of the base-2 scores; natural log = lse * ln 2).
  """
  batch, seq_q, heads, _ = q.shape
  seq_k = k.shape[1]
  d = problem.head_dim_padded
  bq, bk = config.block_q, config.block_k
  kernel = functools.partial(_forward_kernel, problem=problem, block_q=bq, block_k=bk)
  # Q blocks are the fastest-varying grid axis, so programs running together
  # share one (batch, head) and hit the same K/V in L2.
  grid = (pl.cdiv(seq_q, bq), batch, heads)
  kv_spec = common.whole_seq_spec(seq_k, bk, d, head_divisor=problem.group)
  in_specs, args = common.with_optional_inputs(
      [common.rows_spec(bq, d, seq_q), kv_spec, kv_spec], [q, k, v], operands, bq, bk
  )
  if problem.has_sinks:  # [batch or 1, heads], one a program like the ALiBi slopes
    in_specs.append(common.alibi_spec(operands.sinks))
    args.append(operands.sinks)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=[common.rows_spec(bq, d, seq_q), common.row_vector_spec(bq, seq_q)],
      out_shape=[
          common.out_struct(q.shape, q.dtype, *args),
          common.out_struct((batch, heads, seq_q), jnp.float32, *args),
      ],
      compiler_params=common.compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name="flash2_fwd",
  )(*args)
