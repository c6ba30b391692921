"""Times Mosaic config variants through the bench CLI, cuDNN in the same run.

  PYTHONPATH=. python lab/tools/cli_ab.py --fwd two=default --fwd three=consumers=3+block_q=192 -- \\
      --seqlens 4k --head-dims 64 --causal true --modes fwd --out /tmp/ab
  PYTHONPATH=. python lab/tools/cli_ab.py --bwd two=default \\
      --bwd fused=fused_dq=1+dq_adder_warp=1+dq_adder_warps=2 -- --head-dims 128 --modes fwd+bwd

tools/mosaic_bench.py and tools/mosaic_bwd_bench.py time one kernel on one
input set in rounds of 10 calls; the bench CLI times flash_attention as users
call it, rotating over input sets in rounds of 5, beside cuDNN. The two
disagreed by 3-5% on the same kernel (bench/NOTES.md, session 15), so a
choice between configs that differ by less is made here.

Each `--fwd NAME=SPEC` (`--bwd NAME=SPEC`) registers an implementation
`flash2:NAME`: flash_attention(backend="mosaic") whose forward (backward)
Mosaic config is the API's own per-shape choice with SPEC's fields set
(tools/mosaic_bench.py's syntax, NAME=VALUE joined by '+', booleans 0/1,
'default' for none; --bwd also takes tools/mosaic_bwd_bench.py's
`kernels=2`, not its measurement switches). A name given to both sets both configs. Everything after `--`
goes to the CLI; the variants are timed in the order given, then the
implementations of `--also` (default cudnn).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import unittest.mock

import jax

from jax_flash2 import api, flash_attention
from jax_flash2.bench import cli
from jax_flash2.bench import impls as impls_lib

import mosaic_bench  # tools/
import mosaic_bwd_bench  # tools/


def _patched(fwd_spec: str | None, bwd_spec: str | None):
  """A context in which flash_attention takes the API's configs with the specs' fields set."""
  if bwd_spec is not None and any(o.startswith(mosaic_bwd_bench._EXPERIMENTS) for o in bwd_spec.split("+")):
    # Their switches act when the backward's kernels are traced, which
    # jax.vjp does after flash_attention has returned, outside this context.
    raise SystemExit(f"--bwd {bwd_spec!r}: the measurement switches of tools/mosaic_bwd_bench.py are not "
                     "available here, only BackwardConfig fields and kernels=2")
  choose_fwd, choose_bwd = api._mosaic_config, api._mosaic_backward_config

  def fwd_config(problem, q):
    config = choose_fwd(problem, q)
    return config if config is None or fwd_spec is None else mosaic_bench._variant(config, fwd_spec)

  def bwd_config(problem, q):
    config = choose_bwd(problem, q)
    return config if config is None or bwd_spec is None else mosaic_bwd_bench._variant(config, bwd_spec)[0]

  @contextlib.contextmanager
  def context():
    with unittest.mock.patch.object(api, "_mosaic_config", fwd_config), \
         unittest.mock.patch.object(api, "_mosaic_backward_config", bwd_config):
      yield

  return context


def _register(name: str, fwd_spec: str | None, bwd_spec: str | None) -> str:
  context = _patched(fwd_spec, bwd_spec)
  mosaic = impls_lib.get("flash2-mosaic")

  def factory(shape, opts):
    def attn(q, k, v):
      # Traced under jit; flash_attention picks both configs here, at trace time.
      with context():
        return flash_attention(q, k, v, causal=shape.causal, backend="mosaic", interpret=opts.interpret)

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
