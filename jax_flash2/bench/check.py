"""Accuracy of each implementation against the float32 jnp reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash2 import reference
from jax_flash2.bench.impls import segment_ids, sink_logits, varlen_segment_ids
from jax_flash2.bench.spec import Shape, Window

# Largest float32 score tensor [batch, heads, seq, seq] the reference may build;
# the check shape gives up batch (then sequence length) to stay under it.
_REFERENCE_SCORE_BYTES = 1 << 30


def check_shape(shape: Shape) -> Shape:
  """`shape` with batch (and if need be seqlen) cut so the reference stays small.

  The window and the number of segments stay; seqlen is only halved while it
  remains a multiple of the segments (so they stay equal). A varlen row
  halves every length instead (rounding up), keeping the number of sequences.
  """
  if shape.varlen is not None:
    lens = shape.varlen
    while shape.heads * sum(lens) ** 2 * 4 > _REFERENCE_SCORE_BYTES and sum(lens) > 128:
      half = tuple(-(-n // 2) for n in lens)
      if half == lens:
        break
      lens = half
    return dataclasses.replace(shape, seqlen=sum(lens), varlen=lens)
  per_batch = shape.heads * shape.seqlen * shape.seqlen * 4
  batch = max(1, min(shape.batch, _REFERENCE_SCORE_BYTES // per_batch))
  seqlen = shape.seqlen
  while (batch == 1 and shape.heads * seqlen * seqlen * 4 > _REFERENCE_SCORE_BYTES and seqlen > 128
         and (seqlen // 2) % shape.segments == 0):
    seqlen //= 2
  return dataclasses.replace(shape, batch=batch, seqlen=seqlen)


def reference_fwd_bwd(
    q, k, v, dout, *, causal: bool, window: Window | None = None, segments: int = 1, sinks: bool = False,
    softcap: float | None = None, varlen: tuple[int, ...] | None = None,
) -> tuple[jax.Array, ...]:
  """(out, dq, dk, dv) of `reference.attention` in float32; k/v heads are
  repeated for grouped-query attention (query head n uses kv head n // group).
  `window`, `segments`, `softcap` and `varlen` mean what they mean in
  spec.Shape (a varlen row: its lengths as segment ids, which is
  self-attention within each sequence); sinks: with impls.sink_logits, as a
  --sinks run's implementations have them."""
  group = q.shape[2] // k.shape[2]
  ids = varlen_segment_ids(varlen) if varlen is not None else segment_ids(q.shape[0], q.shape[1], segments)

  def f(q, k, v):
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    out, _ = reference.attention(
        q, k, v, causal=causal, window_size=window if window is not None else (None, None),
        softcap=softcap, q_segment_ids=ids, kv_segment_ids=ids, sinks=sink_logits(q.shape[2]) if sinks else None,
        compute_dtype=jnp.float32,
    )
    return out

  args = [x.astype(jnp.float32) for x in (q, k, v)]
  out, vjp = jax.vjp(f, *args)
  return (out, *vjp(dout.astype(jnp.float32)))


@jax.jit
def relative_errors(got: tuple[jax.Array, ...], want: tuple[jax.Array, ...]) -> jax.Array:
  """||x - ref|| / ||ref|| for each pair, in float32."""
  errs = []
  for x, ref in zip(got, want):
    x = x.astype(jnp.float32)
    ref = ref.astype(jnp.float32)
    errs.append(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
  return jnp.stack(errs)


reference_fwd_bwd_jit = jax.jit(
    reference_fwd_bwd, static_argnames=("causal", "window", "segments", "sinks", "softcap", "varlen"))
