"""What differs between the jax versions jax_flash2 supports, in one place."""

from __future__ import annotations

import jax
from jax._src.interpreters import ad as _ad


def is_forward_mode(*args) -> bool:
  """Whether any array of args carries a forward-mode (jax.jvp) tangent.
  Reverse mode (grad, vjp, linearize) traces with another tracer."""
  return any(isinstance(x, _ad.JVPTracer) for x in jax.tree.leaves(args))
