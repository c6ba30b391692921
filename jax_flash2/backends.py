"""The backends: which kernels serve a problem on a device, and how each runs.

A backend says, for each pass, whether it serves a `Problem` on a `Device`
and, if not, why (a sentence). `choose` is the one place that decides what
runs: "auto" takes, pass by pass, the first backend that serves, in the
measured order (the Mosaic GPU kernels, then the Triton-lowering kernels,
then plain XLA); an explicit backend runs where it serves. `plan()` and
`flash_attention` both go through it, so what a plan says is what runs.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_flash2 import defaults, merge, reference
from jax_flash2.config import BlockSizes, DecodeConfig, MosaicBackwardConfig, MosaicConfig, MosaicForwardConfig
from jax_flash2.mosaic import backward as mosaic_backward
from jax_flash2.mosaic import backward_fused as mosaic_backward_fused
from jax_flash2.mosaic import backward_wide as mosaic_backward_wide
from jax_flash2.mosaic import common as mosaic_common
from jax_flash2.mosaic import forward as mosaic_forward
from jax_flash2.problem import DecodeProblem, Operands, Problem, cache_capacity
from jax_flash2.triton import backward as triton_backward
from jax_flash2.triton import decode as triton_decode
from jax_flash2.triton import forward as triton_forward

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# The Pallas Triton lowering supports NVIDIA GPUs from this compute capability on.
MIN_COMPUTE_CAPABILITY = (8, 0)


class Backend(enum.Enum):
  """What runs the attention: `AUTO` picks per pass (see `choose`)."""

  AUTO = "auto"
  MOSAIC = "mosaic"
  TRITON = "triton"
  XLA = "xla"


@dataclasses.dataclass(frozen=True)
class Device:
  """Where a call runs, as the backends see it.

  compute_capability: the NVIDIA GPU's (major, minor), None off such GPUs.
  interpret: the Pallas kernels run in interpret mode (any platform).
  """

  compute_capability: tuple[int, int] | None
  interpret: bool = False

  def describe(self) -> str:
    if self.compute_capability is None:
      return f"the default device is {jax.devices()[0].platform}, not an NVIDIA GPU"
    return "the GPU has compute capability {}.{}".format(*self.compute_capability)


def default_sm_count() -> int | None:
  """The default device's SM count when it is a GPU (132 on an H200), else None."""
  device = jax.devices()[0]
  return getattr(device, "core_count", None) if device.platform == "gpu" else None


def default_compute_capability() -> tuple[int, int] | None:
  """The default device's compute capability when it is an NVIDIA GPU."""
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or capability is None:
    return None
  major, minor = (int(x) for x in str(capability).split(".")[:2])
  return major, minor


@dataclasses.dataclass(frozen=True)
class PassPlan:
  """How one pass runs.

  backend: "mosaic", "triton" or "xla".
  config: the kernels' tiling (a MosaicForwardConfig or MosaicBackwardConfig,
    the Triton kernels' BlockSizes), None for XLA.
  reason: why a backend ahead of this one in the order does not serve the
    pass (None when the first one does).
  """

  backend: str
  config: Any = None
  reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which backend runs each pass of a call (see `jax_flash2.plan`)."""

  forward: PassPlan
  backward: PassPlan
  interpret: bool = False

  @property
  def kernels(self) -> bool:
    """Whether the passes run Pallas kernels (joined by a custom_vjp), not XLA."""
    return self.forward.backend != Backend.XLA.value


@dataclasses.dataclass(frozen=True)
class Call:
  """Everything static about one kernel call: hashable, so jit caches on it."""

  problem: Problem
  plan: Plan

  @property
  def interpret(self) -> bool:
    return self.plan.interpret

  @property
  def lse_log2(self) -> bool:
    """Whether the forward kernels write their lse in base 2 (else natural)."""
    return kernels(self.plan.forward.backend).lse_log2

  def natural_lse(self, lse: jax.Array) -> jax.Array:
    """The forward kernels' lse in natural log, as flash_attention returns it."""
    return lse * LN_2 if self.lse_log2 else lse

  def backward_lse(self, lse: jax.Array) -> jax.Array:
    """The forward kernels' lse in the base the backward kernels read."""
    forward, backward = (kernels(p.backend).lse_log2 for p in (self.plan.forward, self.plan.backward))
    if forward == backward:
      return lse
    return lse * LN_2 if forward else lse * LOG2_E

  def backward_lse_of_natural(self, lse: jax.Array) -> jax.Array:
    """A natural lse (a merged one: jax_flash2.ring) in the base the
    backward kernels read."""
    return lse * LOG2_E if kernels(self.plan.backward.backend).lse_log2 else lse

  def natural_backward_lse(self, lse: jax.Array) -> jax.Array:
    """An lse in the base the backward kernels read, as natural log."""
    return lse * LN_2 if kernels(self.plan.backward.backend).lse_log2 else lse


class Implementation(abc.ABC):
  """One backend: where it runs, which problems it serves, and its tiling."""

  name: str

  @abc.abstractmethod
  def runs_on(self, device: Device, *, auto: bool) -> str | None:
    """None if the backend runs on `device`, else why not (a sentence)."""

  @abc.abstractmethod
  def serves(self, problem: Problem, *, backward: bool, auto: bool) -> str | None:
    """None if the backend serves the forward (or the backward) pass of
    `problem`, else why not. auto: "auto" asks, which also weighs whether
    it is the faster choice."""

  def config(self, problem: Problem, *, backward: bool, block_sizes: BlockSizes | None,
             mosaic_config: MosaicConfig | None):
    """The tiling a pass runs with: the caller's config for this backend if
    given, else the measured default (None for a backend without one)."""
    return None


class Kernels(Implementation):
  """A family of Pallas kernels, joined by vjp's custom_vjp.

  lse_log2: the base of the lse its forward writes and its backward reads:
  base 2 (True) or natural (False)."""

  lse_log2: bool

  @abc.abstractmethod
  def forward(self, q, k, v, operands: Operands, problem: Problem, config, *, interpret: bool):
    """(out like q, lse float32 [batch, heads, seq_q])."""

  @abc.abstractmethod
  def backward(self, q, k, v, out, lse, do, dlse, operands: Operands, problem: Problem, config, *,
               interpret: bool):
    """(dq, dk, dv), each like its primal."""

  def bias_gradient(self, q, k, v, out, lse, do, dlse, operands: Operands, problem: Problem, config, *,
                    interpret: bool):
    """dS, float32 [batch, heads, seq_q, seq_k]: the bias's gradient before
    the sum over its broadcast axes (for families that serve a bias)."""
    raise NotImplementedError(f"the {self.name} kernels take no bias")

  def partitionable(self, interpret: bool) -> bool:
    """Whether the kernels may be wrapped in a custom_partitioning."""
    return True


class TritonKernels(Kernels):
  """The Pallas Triton-lowering kernels: every option, any NVIDIA GPU from
  Ampere on, and Pallas interpret mode anywhere."""

  name = Backend.TRITON.value
  lse_log2 = True

  def runs_on(self, device, *, auto):
    capability = device.compute_capability
    if device.interpret or (capability is not None and capability >= MIN_COMPUTE_CAPABILITY):
      return None
    return (f"the Triton kernels need an NVIDIA GPU of compute capability {MIN_COMPUTE_CAPABILITY[0]}.0 or "
            f"newer, or interpret=True: {device.describe()}")

  def serves(self, problem, *, backward, auto):
    return None

  def config(self, problem, *, backward, block_sizes, mosaic_config):
    del backward  # one BlockSizes tiles both passes
    if block_sizes is None:
      block_sizes = defaults.block_sizes(problem.head_dim_padded, problem.causal, has_bias=problem.has_bias,
                                           itemsize=jnp.dtype(problem.dtype).itemsize)
    return block_sizes.fit(problem.seq_q, problem.seq_k)

  def forward(self, q, k, v, operands, problem, config, *, interpret):
    return triton_forward.forward(q, k, v, operands, problem, config.fwd, interpret=interpret)

  def backward(self, q, k, v, out, lse, do, dlse, operands, problem, config, *, interpret):
    return triton_backward.backward(q, k, v, out, lse, do, dlse, operands, problem, config, interpret=interpret)

  def bias_gradient(self, q, k, v, out, lse, do, dlse, operands, problem, config, *, interpret):
    return triton_backward.bias_gradient(q, k, v, out, lse, do, dlse, operands, problem, config,
                                         interpret=interpret)


class MosaicKernels(Kernels):
  """The Pallas Mosaic GPU kernels for Hopper: bf16/fp16, head_dim 64, 128
  and 256, full or causal attention, sliding windows, softcap and ALiBi,
  alone or together, with GQA and any lengths (ragged ones padded to whole
  blocks inside), and segment ids. A dense mask, a bias and dropout run on
  the Triton kernels.

  The backward at head_dim 64 fuses dQ into the dK/dV kernel for full and
  causal attention only; windows, softcap and ALiBi take the two kernels
  (dK/dV, then dQ) there, as at 128: the fused kernel's order of additions
  models the causal schedule, and Mosaic's interpreter cannot run the
  semaphores and TMA reduce-adds that keep it on the GPU, so a banded
  fused kernel could not be checked on a CPU."""

  name = Backend.MOSAIC.value
  lse_log2 = False

  def runs_on(self, device, *, auto):
    if device.interpret:
      return "interpret=True runs the Triton kernels unless backend='mosaic' asks for Mosaic's interpreter" if auto else None
    if (device.compute_capability or (0, 0))[0] != 9:
      # wgmma, TMA and setmaxnreg are sm_90a instructions.
      return f"the Mosaic kernels need a Hopper GPU (compute capability 9.x): {device.describe()}"
    return None

  def serves(self, problem, *, backward, auto):
    if jnp.dtype(problem.dtype) not in mosaic_common.SUPPORTED_DTYPES:
      return f"the Mosaic kernels take bfloat16 and float16, not {problem.dtype}"
    if problem.head_dim not in mosaic_common.SUPPORTED_HEAD_DIMS:
      return f"the Mosaic kernels take head_dim 64, 128 or 256, not {problem.head_dim}"
    if any(side is not None and side < 0 for side in (problem.mask.left, problem.mask.right)):
      return ("the Mosaic kernels take band sides >= 0, not the negative ones of ring attention's steps "
              "between offset chunks")
    if unserved := _options(problem, MOSAIC_UNSERVED):
      return (f"the Mosaic kernels serve full and causal attention, windows, softcap, ALiBi and segment ids, "
              f"not {unserved}")
    if auto and not defaults.mosaic_pays_for_padding(problem.seq_q, problem.seq_k):
      return (f"ragged lengths under {defaults.HOPPER_RAGGED_MIN_SEQ} run faster on the Triton kernels "
              f"(padding to whole {defaults.MOSAIC_BLOCK_ROWS}-row blocks costs more than the Mosaic kernels gain)")
    return None

  def config(self, problem, *, backward, block_sizes, mosaic_config):
    given = None if mosaic_config is None else (mosaic_config.backward if backward else mosaic_config.forward)
    if given is not None and backward and given.fused_dq and not problem.is_plain:
      raise ValueError(f"{given}: the fused Mosaic backward (fused_dq) serves full and causal attention only, not "
                       f"{_options(problem)}; pass fused_dq=False")
    config = given
    if config is None:
      segments = problem.mask.segments
      if backward:
        config = defaults.mosaic_backward(problem.head_dim, fused=problem.is_plain, segments=segments)
      else:
        config = defaults.mosaic_forward(problem.head_dim, seq_q=problem.seq_q, causal=problem.causal,
                                         segments=segments)
    # The kernels' own checks (shared memory, the wide kernels' tiles), here
    # so that plan() refuses what the call would.
    kernels = _mosaic_backward_kernels(problem, config) if backward else mosaic_forward
    kernels.check_config(config, problem.head_dim, problem.dtype)
    return config

  def forward(self, q, k, v, operands, problem, config: MosaicForwardConfig, *, interpret):
    return mosaic_forward.forward(q, k, v, **_mosaic_options(operands, problem), sinks=operands.sinks,
                                  config=config, interpret=interpret)

  def backward(self, q, k, v, out, lse, do, dlse, operands, problem, config: MosaicBackwardConfig, *, interpret):
    # delta = rowsum(dO * O) - dlse comes from the Triton kernels' small delta kernel.
    delta = triton_backward.backward_delta(out, do, dlse, problem, interpret=interpret)
    kernels = _mosaic_backward_kernels(problem, config)
    if kernels is mosaic_backward_fused:  # full or causal attention only (see `config`)
      return kernels.backward(q, k, v, do, lse, delta, causal=problem.causal, softmax_scale=problem.softmax_scale,
                              config=config, interpret=interpret)
    return kernels.backward(q, k, v, do, lse, delta, **_mosaic_options(operands, problem), config=config,
                            interpret=interpret)

  def partitionable(self, interpret):
    # Mosaic's interpreter steps a kernel through ordered io_callbacks, which
    # custom_partitioning cannot lower under jit.
    return not interpret


class XlaAttention(Implementation):
  """Plain XLA attention (reference.attention in float32), differentiated by
  JAX itself: every option, any device, any derivative order, quadratic
  memory. Never under a custom_vjp: it serves both passes or neither."""

  name = Backend.XLA.value

  def runs_on(self, device, *, auto):
    if device.interpret:
      return "interpret=True runs the Pallas kernels; it cannot be combined with backend='xla'"
    return None

  def serves(self, problem, *, backward, auto):
    return None

  def attention(self, q, k, v, operands: Operands, problem: Problem):
    """(out like q, lse float32 [batch, heads, seq_q])."""
    mask = problem.mask
    return reference.attention(
        q, k, v, mask=operands.mask, window_size=(mask.left, mask.right), softcap=problem.softcap,
        alibi_slopes=operands.alibi_slopes, q_segment_ids=operands.q_segment_ids,
        kv_segment_ids=operands.kv_segment_ids, softmax_scale=problem.softmax_scale,
        dropout_rate=problem.dropout_rate, dropout_seed=operands.dropout_seed,
        dropout_broadcast=problem.dropout_broadcast, bias=operands.bias, sinks=operands.sinks,
        compute_dtype=jnp.float32,
    )

  def backward(self, q, k, v, out, lse, do, dlse, operands: Operands, problem: Problem):
    """(dq, dk, dv) of this attention as a part of a larger one whose merged
    output and natural lse are out and lse: the kernels' backward contract
    (Kernels.backward), by JAX's vjp of `attention`. The part's own (out_p,
    lse_p) weigh w = exp(lse_p - lse) in the merge (jax_flash2.merge), so
    its cotangents are w * dO and w * (dlse + rowsum(dO * (out_p - out))),
    and the pullback's dS = P (dP - rowsum(dO * out) + dlse) with P the
    merged softmax's probabilities, as the kernels compute it."""
    (part_out, part_lse), pullback = jax.vjp(lambda q, k, v: self.attention(q, k, v, operands, problem), q, k, v)
    w = merge.weight(part_lse, lse)
    do = do.astype(jnp.float32)
    rows = jnp.swapaxes(jnp.sum(do * (part_out.astype(jnp.float32) - out.astype(jnp.float32)), axis=-1), 1, 2)
    d_out = do * jnp.swapaxes(w, 1, 2)[..., None]
    return pullback((d_out.astype(part_out.dtype), (w * (dlse + rows)).astype(part_lse.dtype)))


def _mosaic_backward_kernels(problem: Problem, config: MosaicBackwardConfig):
  """The module of the Mosaic backward kernels that run `config`: the wide
  ones at head_dim 256, else the fused kernel or the dK/dV and dQ pair."""
  if problem.head_dim in mosaic_common.WIDE_HEAD_DIMS:
    return mosaic_backward_wide
  return mosaic_backward_fused if config.fused_dq else mosaic_backward


def _mosaic_options(operands: Operands, problem: Problem) -> dict:
  """The Mosaic entry points' band and score arguments for `problem`:
  causal where the band stops each query at its level key (a window's
  right side of 0 included), the window's other sides, softcap, ALiBi,
  segment ids."""
  mask = problem.mask
  return dict(causal=problem.causal, window_size=(mask.left, None if problem.causal else mask.right),
              softcap=problem.softcap, alibi_slopes=operands.alibi_slopes, q_segment_ids=operands.q_segment_ids,
              kv_segment_ids=operands.kv_segment_ids, softmax_scale=problem.softmax_scale)


# The options the Mosaic kernels do not serve (yet): they run on the Triton kernels.
MOSAIC_UNSERVED = ("a dense mask", "dropout", "a bias")


def _options(problem: Problem, among: tuple[str, ...] | None = None) -> str:
  """The options of `problem` that make it more than full or causal
  attention (those named in `among`, where given)."""
  mask = problem.mask
  present = {
      "a window": mask.left is not None or mask.right not in (None, 0), "a dense mask": mask.dense,
      "segment ids": mask.segments, "a softcap": problem.softcap is not None, "ALiBi": problem.has_alibi,
      "dropout": problem.has_dropout, "a bias": problem.has_bias,
  }
  return ", ".join(name for name, here in present.items() if here and (among is None or name in among))


MOSAIC = MosaicKernels()
TRITON = TritonKernels()
XLA = XlaAttention()
# The measured order: the first that serves a pass runs it under "auto".
ORDER: tuple[Implementation, ...] = (MOSAIC, TRITON, XLA)
_KERNELS = {family.name: family for family in (MOSAIC, TRITON)}


def kernels(name: str) -> Kernels:
  """The kernel family of a PassPlan's backend name."""
  return _KERNELS[name]


def choose(problem: Problem, device: Device, backend: Backend, *, block_sizes: BlockSizes | None = None,
           mosaic_config: MosaicConfig | None = None) -> Plan:
  """The plan of one call: which backend runs each pass, with which config.

  "auto" takes, for each pass, the first backend in ORDER that runs on the
  device and serves the pass; where that is XLA for one pass, XLA runs both
  (it differentiates itself). "mosaic" takes the Mosaic kernels where they
  serve a pass and the Triton kernels for the rest; "triton" and "xla" run
  where they can.

  Raises ValueError when the requested backend cannot run on the device, or
  when a config is given for a kernel family that runs neither pass.
  """
  auto = backend is Backend.AUTO
  candidates = {Backend.AUTO: ORDER, Backend.MOSAIC: (MOSAIC, TRITON), Backend.TRITON: (TRITON,),
                Backend.XLA: (XLA,)}[backend]
  if not auto and (why := candidates[0].runs_on(device, auto=False)):
    raise ValueError(f"backend='{backend.value}': {why}" + ("" if backend is Backend.XLA else "; use backend='auto'"))
  passes = []
  for backward in (False, True):
    reasons = []
    for family in candidates:
      if why := family.runs_on(device, auto=auto) or family.serves(problem, backward=backward, auto=auto):
        reasons.append(why)
        continue
      config = family.config(problem, backward=backward, block_sizes=block_sizes, mosaic_config=mosaic_config)
      passes.append(PassPlan(family.name, config, "; ".join(reasons) or None))
      break
    else:
      raise ValueError(f"backend='{backend.value}': {'; '.join(reasons)}")
  if XLA.name in (passes[0].backend, passes[1].backend):
    passes = [next(p for p in passes if p.backend == XLA.name)] * 2
  plan = Plan(*passes, interpret=device.interpret)
  if plan.kernels:
    runs = {plan.forward.backend, plan.backward.backend}
    for given, family, name in ((block_sizes, TRITON, "block_sizes"), (mosaic_config, MOSAIC, "mosaic_config")):
      if given is not None and family.name not in runs:
        raise ValueError(
            f"{name} configures the {family.name.capitalize()} kernels, but neither pass runs them here (forward: "
            f"{plan.forward.backend}, backward: {plan.backward.backend}); pass backend='{family.name}' to run them"
        )
  return plan


# ---------------------------------------------------------------- decoding (flash_decode)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """Everything static about one flash_decode call: hashable, so jit caches
  on it, and a pytree without leaves, so it passes through the custom_vjp
  and custom_vmap that wrap the call as an argument.

  has_sinks: the call passes sinks (they join in `combine`, so the kernel's
  problem does not say)."""

  problem: DecodeProblem
  plan: PassPlan
  interpret: bool = False
  has_sinks: bool = False


jax.tree_util.register_static(DecodeCall)


def choose_decode(p: DecodeProblem, device: Device, backend: Backend, *, batch: int, kv_heads: int, max_seq: int,
                  num_splits: int | None, sm_count: int | None) -> PassPlan:
  """Which backend runs a flash_decode call, and with which DecodeConfig:
  "auto" takes the Triton kernel where it runs (NVIDIA GPUs of compute
  capability >= 8.0, or interpret=True), else XLA; "triton" and "xla" run
  where they can. There is no Mosaic decode kernel.

  Raises ValueError when the requested backend cannot run on the device."""
  if backend is Backend.MOSAIC:
    raise ValueError("backend='mosaic': flash_decode has no Mosaic kernel yet; use backend='auto' or 'triton'")
  if backend is Backend.XLA:
    if why := XLA.runs_on(device, auto=False):
      raise ValueError(f"backend='xla': {why}")
    return PassPlan(XLA.name)
  why = TRITON.runs_on(device, auto=backend is Backend.AUTO)
  if why is None:
    return PassPlan(TRITON.name, defaults.decode_config(p.page_size, None if device.interpret else sm_count,
                                                       batch=batch, kv_heads=kv_heads, max_seq=max_seq,
                                                       num_splits=num_splits))
  if backend is Backend.TRITON:
    raise ValueError(f"backend='triton': {why}; use backend='auto'")
  return PassPlan(XLA.name, reason=why)


def decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, sinks,
           call: DecodeCall) -> tuple[jax.Array, jax.Array]:
  """Runs a flash_decode call on its plan's backend: (out like q, lse float32
  [batch, heads, seq_q], natural log). slopes: float32 [batch or 1, heads];
  sinks: float32 [heads], or on the Triton path also [batch or 1, heads]
  (sharding.decode folds a vmapped call's sinks into batch)."""
  p, plan = call.problem, call.plan
  if plan.backend == XLA.name:
    # The split kernel clips the lengths itself; the reference takes them clipped.
    lens = jnp.clip(cache_seqlens, 0, cache_capacity(k_cache, block_table))
    out, lse = reference.decode_attention(
        q, k_cache, v_cache, lens, block_table=block_table, softmax_scale=p.softmax_scale,
        causal=False, window_size=(p.window_left, p.window_right), softcap=p.softcap, alibi_slopes=slopes,
        sinks=sinks, compute_dtype=jnp.float32)
    return out, lse
  config: DecodeConfig = plan.config
  parts, lse = triton_decode.decode(q, k_cache, v_cache, cache_seqlens, block_table, slopes, p, config,
                                    interpret=call.interpret)
  return triton_decode.combine(parts, lse, sinks, p, heads=q.shape[2], dtype=q.dtype, interpret=call.interpret)
