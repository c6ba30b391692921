"""Times Mosaic config variants through the bench CLI, cuDNN in the same run.

  PYTHONPATH=. python lab/tools/cli_ab.py --fwd two=default --fwd three=consumers=3+block_q=192 -- \\
      --seqlens 4k --head-dims 64 --causal true --modes fwd --out /tmp/ab
  PYTHONPATH=. python lab/tools/cli_ab.py --bwd two=kernels=2 --bwd fused=fused_dq=1 -- \\
      --head-dims 128 --modes fwd+bwd

A kernel bench (lab/tools/mosaic_bench.py) times one function on one input
set in rounds of 10 calls; the bench CLI times flash_attention as users call
it, rotating over input sets in rounds of 5, beside cuDNN. The two disagreed
by 3-5% on the same kernel (lab/NOTES.md, session 15), so a choice between
configs that differ by less is made here.

Each `--fwd NAME=SPEC` (`--bwd NAME=SPEC`) registers a bench implementation
`flash2:NAME`: flash_attention(..., backend="mosaic",
mosaic_config=MosaicConfig(forward=..., backward=...)) whose forward
(backward) config is the measured default for the cell's shape
(jax_flash2.defaults) with SPEC's fields set: MosaicForwardConfig
(MosaicBackwardConfig) field names, NAME=VALUE joined by '+', booleans 0/1,
'default' for none; --bwd also takes `kernels=2` (the dK/dV and dQ kernels:
fused_dq off) and `kernels=1` (the fused kernel). A side a variant does not
name is left None, the API's own default. A name given to both sets both.
Everything after `--` goes to the CLI; the variants are timed in the order
given, then the implementations of `--also` (default cudnn).

Only the public API is used, so a variant is exactly what a user passing
that MosaicConfig would run; where the Mosaic kernels do not serve a pass
(a mask they do not take, say), backend="mosaic" runs the Triton kernels
for it and the variant's config for that pass is not used.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from jax_flash2 import defaults, flash_attention
from jax_flash2.config import MosaicBackwardConfig, MosaicConfig, MosaicForwardConfig
from jax_flash2.bench import cli
from jax_flash2.bench import impls as impls_lib

# --bwd's own option: how many kernels the backward runs.
_KERNELS = {"kernels=1": {"fused_dq": True}, "kernels=2": {"fused_dq": False}}


def _variant(config, spec: str | None):
  """config (a MosaicForwardConfig or MosaicBackwardConfig) with the fields
  of spec set ('default' or None: config itself; else NAME=VALUE joined by
  '+', booleans 0/1; for a backward config also kernels=1 or kernels=2)."""
  if spec is None or spec == "default":
    return config
  fields = {f.name: f for f in dataclasses.fields(config)}
  values = {}
  for option in spec.split("+"):
    if isinstance(config, MosaicBackwardConfig) and option in _KERNELS:
      values.update(_KERNELS[option])
      continue
    name, sep, value = option.partition("=")
    if not sep or name not in fields:
      raise SystemExit(f"{option!r}: not a {type(config).__name__} field as NAME=VALUE "
                       f"(fields: {', '.join(fields)})")
    kind = type(getattr(config, name))
    values[name] = bool(int(value)) if kind is bool else kind(int(value))
  try:
    return dataclasses.replace(config, **values)
  except (TypeError, ValueError) as e:  # the config's own validation
    raise SystemExit(f"{spec!r}: {e}") from None


def mosaic_config(fwd_spec: str | None, bwd_spec: str | None, *, head_dim: int, seq_q: int,
                  causal: bool) -> MosaicConfig:
  """The MosaicConfig a variant passes for one cell: each side given a spec
  is the measured default for that shape with the spec's fields set; a side
  without one is None (the API's default)."""
  forward = backward = None
  if fwd_spec is not None:
    forward = _variant(defaults.mosaic_forward(head_dim, seq_q=seq_q, causal=causal), fwd_spec)
  if bwd_spec is not None:
    backward = _variant(defaults.mosaic_backward(head_dim), bwd_spec)
  return MosaicConfig(forward=forward, backward=backward)


def _check(fwd_spec: str | None, bwd_spec: str | None) -> None:
  """Fails at once (not in the middle of a run) on a spec that names no field."""
  if fwd_spec is not None:
    _variant(MosaicForwardConfig(), fwd_spec)
  if bwd_spec is not None:
    _variant(MosaicBackwardConfig(), bwd_spec)


def _register(name: str, fwd_spec: str | None, bwd_spec: str | None) -> str:
  _check(fwd_spec, bwd_spec)
  mosaic = impls_lib.get("flash2-mosaic")

  def factory(shape, opts):
    config = mosaic_config(fwd_spec, bwd_spec, head_dim=shape.head_dim, seq_q=shape.seqlen, causal=shape.causal)

    def attn(q, k, v):
      return flash_attention(q, k, v, causal=shape.causal, backend="mosaic", mosaic_config=config,
                             interpret=opts.interpret)

    return jax.jit(attn)

  impl_name = f"flash2:{name}"
  impls_lib.register(impls_lib.Impl(
      name=impl_name, description=f"flash_attention(backend='mosaic'), forward {fwd_spec or 'default'}, "
      f"backward {bwd_spec or 'default'}", factory=factory, supports=mosaic.supports))
  return impl_name


def _specs(values: list[str], flag: str) -> dict[str, str]:
  specs = {}
  for value in values:
    name, sep, spec = value.partition("=")
    if not sep or not name or not spec:
      raise SystemExit(f"{flag} takes NAME=SPEC, got {value!r}")
    specs[name] = spec
  return specs


def main(argv: list[str]) -> int:
  at = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--fwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--bwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--also", nargs="*", default=["cudnn"], help="implementations timed after the variants")
  args = parser.parse_args(argv[:at])
  fwd, bwd = _specs(args.fwd, "--fwd"), _specs(args.bwd, "--bwd")
  names = list(dict.fromkeys([*fwd, *bwd]))
  if not names:
    raise SystemExit("give at least one --fwd or --bwd variant")
  impls = [_register(name, fwd.get(name), bwd.get(name)) for name in names]
  return cli.main([*argv[at + 1:], "--impls", *impls, *args.also])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
