"""What differs between the jax versions jax_flash2 supports, in one place."""

from __future__ import annotations

import jax
from jax._src.interpreters import ad as _ad


def is_forward_mode(*args) -> bool:
  """Whether any array of args carries a forward-mode (jax.jvp) tangent.
  Reverse mode (grad, vjp, linearize) traces with another tracer."""
  return any(isinstance(x, _ad.JVPTracer) for x in jax.tree.leaves(args))


def pvary(x, axis_name):
  """x typed as varying over a shard_map axis or axes (check_vma), as it
  is if it already is: lax.pcast in newer jax, lax.pvary before it."""
  if set(axis_name if isinstance(axis_name, tuple) else (axis_name,)) <= varying_axes(x):
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axis_name, to="varying")
  return jax.lax.pvary(x, axis_name)


def varying_axes(x) -> frozenset:
  """The shard_map axes x varies over (empty outside shard_map, and under
  check_vma=False)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax 0.12
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))
