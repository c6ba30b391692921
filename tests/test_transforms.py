"""Composition with JAX transformations other than sharding (test_sharding.py):
jax.checkpoint policies (the output and lse carry checkpoint names), vmap with
mixed batching and masks, and second-order differentiation, which is refused
with a clear error.

Kernels run in interpret mode on CPU; each numeric test has a `gpu`-marked
variant that runs the compiled kernels instead.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from conftest import random_inputs, reference_with_grads, rel_err
from jax_flash2 import BlockSizes, KernelConfig, flash_attention

SMALL = BlockSizes(fwd=KernelConfig(16, 16), dkv=KernelConfig(16, 16), dq=KernelConfig(16, 16))
MODES = [
    pytest.param(dict(interpret=True, block_sizes=SMALL), id="interpret"),
    pytest.param(dict(backend="triton"), id="gpu", marks=pytest.mark.gpu),
]


def _kernel_calls(jaxpr: jax_core.Jaxpr, name: str) -> int:
  """How many pallas_calls named `name` a jaxpr holds, nested jaxprs included."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call" and eqn.params.get("name") == name:
      count += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          count += _kernel_calls(sub.jaxpr, name)
        elif isinstance(sub, jax_core.Jaxpr):
          count += _kernel_calls(sub, name)
  return count


# ---------------------------------------------------------------- checkpoint

_policies = jax.checkpoint_policies
# policy -> how many times the forward kernel runs in a grad: 2 where the
# backward pass recomputes it. dots_saveable saves nothing of ours (a
# pallas_call is not a dot).
POLICIES = {
    "nothing_saveable": (_policies.nothing_saveable, 2),
    "dots_saveable": (_policies.dots_saveable, 2),
    "everything_saveable": (_policies.everything_saveable, 1),
    "save_out_and_lse": (_policies.save_only_these_names("flash2_out", "flash2_lse"), 1),
    "save_out_only": (_policies.save_only_these_names("flash2_out"), 2),  # lse is recomputed
    "save_all_but_out": (_policies.save_any_names_but_these("flash2_out"), 2),
}


@pytest.fixture(scope="module")
def checkpoint_problem():
  q, k, v, dout = random_inputs(0, 2, 16, 16, 2, 16)
  return q, k, v, dout, reference_with_grads(q, k, v, dout, causal=True)[2:]


@pytest.mark.parametrize("kernel", MODES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpoint_policy(policy, kernel, checkpoint_problem):
  q, k, v, dout, want = checkpoint_problem
  policy_fn, forward_runs = POLICIES[policy]
  attend = jax.checkpoint(lambda q, k, v: flash_attention(q, k, v, causal=True, **kernel), policy=policy_fn)
  grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * dout), argnums=(0, 1, 2))

  assert _kernel_calls(jax.make_jaxpr(grad)(q, k, v).jaxpr, "flash2_fwd") == forward_runs
  for name, got, ref in zip(("dq", "dk", "dv"), jax.jit(grad)(q, k, v), want):
    assert rel_err(got, ref) < 1e-5, name


def test_checkpoint_names_reach_the_saved_residuals():
  q, k, v, dout = random_inputs(0, 1, 16, 16, 1, 16)
  policy = jax.checkpoint_policies.save_only_these_names("flash2_out", "flash2_lse")
  attend = jax.checkpoint(lambda q, k, v: flash_attention(q, k, v, interpret=True, block_sizes=SMALL), policy=policy)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(lambda q, k, v: jnp.sum(attend(q, k, v) * dout), q, k, v)
  assert "named 'flash2_out'" in printed.getvalue()
  assert "named 'flash2_lse'" in printed.getvalue()


@pytest.mark.parametrize("policy, forward_runs", [("save_out_and_lse", 1), ("nothing_saveable", 2)])
def test_checkpoint_policies_with_sinks(policy, forward_runs):
  """With sinks too, saving the named out and lse (the joined ones, which
  the backward reads) keeps the forward kernel from running again."""
  q, k, v, dout = random_inputs(0, 1, 16, 16, 2, 16)
  sinks = jnp.ones((2,), jnp.float32)
  attend = jax.checkpoint(lambda q, sinks: flash_attention(q, k, v, sinks=sinks, interpret=True, block_sizes=SMALL),
                          policy=POLICIES[policy][0])
  grad = jax.grad(lambda q, sinks: jnp.sum(attend(q, sinks) * dout), argnums=(0, 1))
  assert _kernel_calls(jax.make_jaxpr(grad)(q, sinks).jaxpr, "flash2_fwd") == forward_runs


# ---------------------------------------------------------------- vmap


@pytest.mark.parametrize("kernel", MODES)
def test_vmap_of_grad_with_shared_kv_and_broadcast_mask(kernel):
  """q and dout mapped, k, v and a [1, 1, seq_q, seq_k] mask shared: the
  custom_vmap rule broadcasts what is not mapped and folds the axis into batch."""
  q, k, v, dout = random_inputs(5, 2, 16, 24, 2, 16)
  qs = jnp.stack([q, q[::-1] * 0.5, -q])  # [3, batch, seq_q, heads, d]
  douts = jnp.stack([dout, -dout, dout * 2])
  mask = jax.random.bernoulli(jax.random.PRNGKey(1), 0.8, (1, 1, 16, 24))

  def out_and_grads(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, mask=mask, causal=True, **kernel), q, k, v)
    return (out, *vjp(dout))

  got = jax.jit(jax.vmap(out_and_grads, in_axes=(0, None, None, 0)))(qs, k, v, douts)
  for i in range(3):
    ref = reference_with_grads(qs[i], k, v, douts[i], mask=mask, causal=True)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, (ref[0], *ref[2:])):
      assert rel_err(x[i], r) < 1e-5, (i, name)


@pytest.mark.parametrize("kernel", MODES)
def test_nested_vmap_with_a_mapped_mask(kernel):
  """Two vmaps, the mask mapped by the outer one and broadcast over batch."""
  q, k, v, _ = random_inputs(6, 2 * 2 * 2, 16, 16, 2, 16)
  q, k, v = (x.reshape(2, 2, 2, *x.shape[1:]) for x in (q, k, v))  # [2, 2, batch 2, seq, heads, d]
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (2, 1, 1, 16, 16))  # [outer, 1, 1, seq, seq]
  attend = lambda q, k, v, mask: flash_attention(q, k, v, mask=mask, **kernel)
  got = jax.jit(jax.vmap(jax.vmap(attend, in_axes=(0, 0, 0, None))))(q, k, v, mask)
  for i in range(2):
    for j in range(2):
      want = reference_with_grads(q[i, j], k[i, j], v[i, j], q[i, j], mask=mask[i])[0]
      assert rel_err(got[i, j], want) < 1e-5, (i, j)


# ---------------------------------------------------------------- second order


def _second_order_cases():
  first = lambda f, q: jax.grad(f)(q)
  yield "grad_of_grad", lambda f, q: jax.grad(lambda q: jnp.sum(first(f, q)))(q)
  yield "hessian", lambda f, q: jax.hessian(f)(q)
  yield "jit_hessian", lambda f, q: jax.jit(jax.hessian(f))(q)
  yield "jacfwd_of_grad", lambda f, q: jax.jacfwd(jax.grad(f))(q)
  yield "jvp_of_vjp", lambda f, q: jax.jvp(lambda q: jax.vjp(f, q)[1](jnp.float32(1.0))[0], (q,), (q,))
  # Differentiating only the backward pass (through the output cotangent).
  yield "vjp_of_the_backward", lambda f, q: jax.grad(lambda t: jnp.sum(jax.vjp(f, q)[1](t)[0]))(jnp.float32(1.0))


@pytest.mark.parametrize("case", [c[1] for c in _second_order_cases()], ids=[c[0] for c in _second_order_cases()])
def test_second_order_derivatives_raise_a_clear_error(case):
  q, k, v, _ = random_inputs(0, 1, 16, 16, 1, 16)
  f = lambda q: jnp.sum(flash_attention(q, k, v, causal=True, interpret=True, block_sizes=SMALL) ** 2)
  with pytest.raises(NotImplementedError, match=r"jax_flash2: second-order gradients .* not supported.*backend='xla'"):
    case(f, q)


@pytest.mark.parametrize("case", [
    lambda f, q: jax.jvp(f, (q,), (q,)),
    lambda f, q: jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q),
    lambda f, q: jax.jacfwd(f)(q),
], ids=["jvp", "jit_jvp", "jacfwd"])
def test_forward_mode_raises_a_clear_error(case):
  """First-order forward mode (jax.jvp, jacfwd) is refused with the same
  advice, eagerly and under jit (where JAX's own custom_vjp error would come
  only at lowering); reverse mode still works."""
  q, k, v, _ = random_inputs(0, 1, 16, 16, 1, 16)
  f = lambda q: flash_attention(q, k, v, interpret=True, block_sizes=SMALL)
  with pytest.raises(NotImplementedError, match=r"forward-mode differentiation .* not supported.*backend='xla'"):
    case(f, q)
  assert jax.grad(lambda q: jnp.sum(f(q)))(q).shape == q.shape


def test_xla_backend_has_second_order_derivatives():
  """What the error message recommends works."""
  q, k, v, _ = random_inputs(0, 1, 4, 4, 1, 8)
  f = lambda q: jnp.sum(flash_attention(q, k, v, causal=True, backend="xla") ** 2)
  hessian = jax.jit(jax.hessian(f))(q)
  assert hessian.shape == q.shape * 2 and np.all(np.isfinite(hessian))
