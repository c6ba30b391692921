"""The one custom_vjp joining the forward and backward Pallas kernels.

Residuals are q, k, v, the output and the log-sum-exp (and the caller's dense
mask, if any): memory linear in the sequence length. The backward recomputes the probabilities from them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_flash2.config import BlockSizes
from jax_flash2.triton import backward as triton_backward
from jax_flash2.triton import forward as triton_forward
from jax_flash2.triton.tiles import Problem


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """Everything static about one call: hashable, so jit caches on it."""

  problem: Problem
  block_sizes: BlockSizes
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, call: KernelCall
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of attention through the Pallas kernels; see api.flash_attention.

  mask: None, or int8 [batch or 1, heads or 1, seq_q, seq_k] (nonzero = visible).
  """
  return triton_forward.forward(q, k, v, mask, call.problem, call.block_sizes.fwd, interpret=call.interpret)


def _flash_fwd(q, k, v, mask, call: KernelCall):
  out, lse = flash(q, k, v, mask, call)
  return (out, lse), (q, k, v, mask, out, lse)


def _flash_bwd(call: KernelCall, residuals, cotangents):
  q, k, v, mask, out, lse = residuals
  do, dlse = cotangents
  dq, dk, dv = triton_backward.backward(
      q, k, v, out, lse, do, dlse, mask, call.problem, call.block_sizes, interpret=call.interpret
  )
  return dq, dk, dv, None  # the mask takes no gradient


flash.defvjp(_flash_fwd, _flash_bwd)
