"""Variable-length attention over sequences packed end to end, in the manner
of FlashAttention-2's `flash_attn_varlen_func`.

Sequence s holds rows cu_seqlens[s]:cu_seqlens[s + 1] of q (and of k, v by
cu_seqlens_k); causal masks and windows align bottom-right within each
sequence. The call becomes one `flash_attention` over a single packed row
with segment ids, so every backend and option serves it:

- With the same cu_seqlens array for queries and keys (self-attention, the
  usual packing) the rows stay where they are: global causal alignment is
  each sequence's own, since each is as long for queries as for keys.
- Otherwise each sequence gets a slot of max(len_q, len_k) rows, in which
  its query rows and its key rows both end at the slot's end: positions
  inside a slot then give every sequence its own bottom-right alignment
  (and ALiBi's distances). Rows of a slot that hold no query or no key get
  an id no other row has, so they see and are seen by nothing; blocks of
  them are skipped by the segment ranges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2.api import check_backend, check_flag, check_problem, flash_attention
from jax_flash2.backends import Backend

# jnp.searchsorted's default method is a while loop, each of whose steps is a
# host round trip on a GPU; unrolled, its log2(num_seqs) steps fuse into one
# kernel.
_SEARCH = "scan_unrolled"


def flash_attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Backend | str = "auto",
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention within each of several sequences packed end to end.

  Args:
    q: [total_q, heads, head_dim], the sequences' queries one after another.
    k, v: [total_k, kv_heads, head_dim] (heads a multiple of kv_heads).
    cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] (other integer dtypes
      are cast), starting at 0, non-decreasing and ending at most at the
      rows given: sequence s is rows cu_seqlens[s]:cu_seqlens[s + 1].
      Empty sequences are allowed. Rows past cu_seqlens[-1] see no key.
      Passing the same array for both (self-attention) keeps the rows in
      place; otherwise they are gathered into per-sequence slots and back.
      Their values are checked when concrete; traced (under jit) only their
      shapes and dtypes are, and bad values give wrong results silently.
    max_seqlen_q, max_seqlen_k: optional bounds on the lengths; given, they
      can shrink the slot layout (a longer sequence would lose rows: it is
      an error when the lengths are concrete).
    causal, window_size, softcap, softmax_scale: as in `flash_attention`,
      aligned bottom-right within each sequence.
    alibi_slopes: float32 [heads]; distances within each sequence.
    sinks: float [heads], as in `flash_attention` (differentiable).
    return_lse, backend, interpret: as in `flash_attention`.

  Returns:
    out like q; with return_lse, (out, lse) with lse float32 [heads,
    total_q] (a row that sees no key: -inf, or its head's sink).
  """
  if (not all(hasattr(x, "ndim") for x in (q, k, v)) or not q.ndim == k.ndim == v.ndim == 3 or k.shape != v.shape
      or q.shape[2] != k.shape[2] or k.shape[1] < 1 or q.shape[1] % k.shape[1]):
    raise ValueError(
        "flash_attention_varlen takes q [total_q, heads, head_dim] and k, v [total_k, kv_heads, head_dim] (heads a "
        f"multiple of kv_heads), got {[getattr(x, 'shape', type(x).__name__) for x in (q, k, v)]}")
  if alibi_slopes is not None and jnp.shape(alibi_slopes) != (q.shape[1],):
    raise ValueError(f"alibi_slopes must have shape [heads] = ({q.shape[1]},), got {jnp.shape(alibi_slopes)}")
  # Every option checked before any work, also where no sequence calls flash_attention (rows may be 0).
  batch_of_one = [jax.ShapeDtypeStruct((1, max(x.shape[0], 1), *x.shape[1:]), x.dtype) for x in (q, k, v)]
  check_problem(*batch_of_one, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                sinks=sinks, softmax_scale=softmax_scale)
  check_backend(backend)
  check_flag("interpret", interpret)
  return_lse = check_flag("return_lse", return_lse)
  same = cu_seqlens_q is cu_seqlens_k
  cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
  # The same array still bounds k's rows where k has fewer.
  cu_k = cu_q if same and k.shape[0] >= q.shape[0] else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
  if cu_q.shape != cu_k.shape:
    raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got shapes "
                     f"{cu_q.shape} and {cu_k.shape}")
  max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q)
  max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k)
  options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                 softmax_scale=softmax_scale, return_lse=True, backend=backend, interpret=interpret)

  if cu_q.shape[0] == 1 or q.shape[0] == 0 or k.shape[0] == 0:  # no sequence, query or key: every row sees nothing
    out = jnp.zeros_like(q)
    lse = jnp.full((q.shape[1], q.shape[0]), -jnp.inf, jnp.float32)
    if sinks is not None:
      lse = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[:, None], lse.shape)
    return (out, lse) if return_lse else out
  if same and q.shape[0] == k.shape[0]:
    ids = _row_ids(cu_q, q.shape[0])
    n = cu_q.shape[0] - 1
    # Rows past the last sequence: ids above every sequence's, apart for
    # queries and keys, so that they stay sorted and see nothing.
    q_ids, kv_ids = jnp.where(ids < n, ids, n), jnp.where(ids < n, ids, n + 1)
    out, lse = flash_attention(q[None], k[None], v[None], q_segment_ids=q_ids[None], kv_segment_ids=kv_ids[None],
                               **options)
    out, lse = out[0], lse[0]
  else:
    layout = _SlotLayout(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    q_slots, k_slots, v_slots = layout.queries.gather(q), layout.keys.gather(k), layout.keys.gather(v)
    out, lse = flash_attention(q_slots[None], k_slots[None], v_slots[None], q_segment_ids=layout.queries.ids[None],
                               kv_segment_ids=layout.keys.ids[None], **options)
    rows = layout.query_rows
    unseen = jnp.full((q.shape[1],), -jnp.inf, jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    out = jnp.take(out[0], rows, axis=0, mode="fill", fill_value=0)
    lse = jnp.take(lse[0], rows, axis=1, mode="fill", fill_value=0)
    lse = jnp.where((rows < layout.length)[None, :], lse, unseen[:, None])
  return (out, lse) if return_lse else out


class _SlotLayout:
  """Per-sequence slots of max(len_q, len_k) rows, queries and keys each
  ending at their slot's end; the buffers hold `length` rows. `queries` and
  `keys` say which packed row fills each slot row, and its segment id;
  `query_rows` where each packed query landed."""

  def __init__(self, cu_q, cu_k, total_q: int, total_k: int, max_q: int | None, max_k: int | None):
    num_seqs = cu_q.shape[0] - 1
    len_q, len_k = jnp.diff(cu_q), jnp.diff(cu_k)
    end = jnp.cumsum(jnp.maximum(len_q, len_k))
    length = total_q + total_k
    if max_q is not None and max_k is not None:
      length = min(length, num_seqs * max(max_q, max_k))
    self.length = max(length, 1)
    # Each slot row's sequence, shared by both sides.
    p = jnp.arange(self.length, dtype=jnp.int32)
    seq = jnp.searchsorted(end, p, side="right", method=_SEARCH).astype(jnp.int32)
    q_start, k_start = end - len_q, end - len_k  # where sequence s's first query / key lands
    self.queries = _Side(p, seq, num_seqs, cu_q, q_start, pad_tail=0)
    self.keys = _Side(p, seq, num_seqs, cu_k, k_start, pad_tail=1)
    t = jnp.arange(total_q, dtype=jnp.int32)
    s = _row_ids(cu_q, total_q)
    s_in = jnp.minimum(s, num_seqs - 1)
    self.query_rows = jnp.where(s < num_seqs, q_start[s_in] + (t - cu_q[s_in]), self.length)


class _Side:
  """One side (queries or keys) of a slot layout: `source`, the packed row
  that fills each slot row (where `real`), and int32 segment ids: 2s + 1 on
  sequence s's rows, 2s on its slot's empty rows, 2 num_seqs + pad_tail
  after the last slot (sorted, and no empty row matches a row of the other
  side)."""

  def __init__(self, p, seq, num_seqs: int, cu, start, *, pad_tail: int):
    inside = seq < num_seqs
    s_in = jnp.minimum(seq, num_seqs - 1)
    self.real = inside & (p >= start[s_in])
    self.source = jnp.where(self.real, cu[s_in] + (p - start[s_in]), 0)
    self.ids = jnp.where(inside, 2 * s_in + self.real.astype(jnp.int32), 2 * num_seqs + pad_tail)

  def gather(self, x) -> jax.Array:
    """x [total, heads, dim] into the slots; empty rows zero."""
    return jnp.where(self.real[:, None, None], jnp.take(x, self.source, axis=0), jnp.zeros((), x.dtype))


def _row_ids(cu, total: int) -> jax.Array:
  """int32 [total]: the sequence of each packed row (num_seqs past the end)."""
  return (jnp.searchsorted(cu, jnp.arange(total, dtype=jnp.int32), side="right", method=_SEARCH) - 1).astype(jnp.int32)


def _check_cu_seqlens(name: str, cu, total: int) -> jax.Array:
  if not hasattr(cu, "shape") or len(cu.shape) != 1 or cu.shape[0] < 1:
    raise ValueError(f"{name} must be an int32 [num_seqs + 1] array, got {getattr(cu, 'shape', type(cu).__name__)}")
  if not jnp.issubdtype(cu.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integers, got {cu.dtype}")
  values = _concrete(cu)
  if values is not None:
    if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] > total:
      raise ValueError(f"{name} must start at 0, never decrease and end at most at {total} (the rows given), "
                       f"got {values.tolist()}")
  return jnp.asarray(cu, jnp.int32)


def _check_max_seqlen(name: str, value, cu) -> int | None:
  if value is None:
    return None
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise TypeError(f"{name} must be a non-negative int or None, got {value!r}")
  if value < 0:
    raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
  values = _concrete(cu)
  if values is not None and values.shape[0] > 1:
    longest = int(np.max(np.diff(values)))
    if longest > value:
      raise ValueError(f"{name}={value} is less than the longest sequence ({longest})")
  return int(value)


def _concrete(x) -> np.ndarray | None:
  """x's values, or None under a trace (where they are checked by nobody)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None
