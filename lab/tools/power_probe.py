"""Runs forward+backward back to back for a few seconds per implementation, for a clock and power log taken beside it.

  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit --format=csv -lms 100 > smi.csv &
  PYTHONPATH=. python lab/tools/power_probe.py --impls cudnn flash2-mosaic --seconds 4
  PYTHONPATH=. python lab/tools/power_probe.py --impls --bwd two=kernels=2 --bwd fused=fused_dq=1 --head-dim 64

Prints, per implementation, the wall-clock window (time.time(), to match the
log's timestamps) in which its jitted forward+backward ran back to back, and
its mean time per call. Implementations are the bench CLI's
(jax_flash2.bench.impls) and Mosaic config variants named as in
lab/tools/cli_ab.py (`--fwd` / `--bwd NAME=SPEC`, registered as
`flash2:NAME`), each built as lab/tools/kernel_anatomy.py builds the bench's
problem. Whether a kernel is held back by the GPU's power limit (a lower SM
clock while it runs) is read from the log, not from here. (Its earlier form
also ran the Mosaic backward kernels alone and without their element-wise
work, through entry points and a measurement switch the product no longer
has: lab/variants.md.)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cli_ab  # noqa: E402  (lab/tools/: Mosaic config variants as bench implementations)
import kernel_anatomy  # noqa: E402  (lab/tools/: the bench implementations' forward+backward)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="*", default=["flash2-mosaic", "cudnn"],
                      help="bench implementations (jax_flash2.bench.impls), run after the variants")
  parser.add_argument("--fwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--bwd", action="append", default=[], metavar="NAME=SPEC")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--seconds", type=float, default=4.0)
  args = parser.parse_args()
  fwd, bwd = cli_ab._specs(args.fwd, "--fwd"), cli_ab._specs(args.bwd, "--bwd")
  names = [cli_ab._register(name, fwd.get(name), bwd.get(name)) for name in dict.fromkeys([*fwd, *bwd])]
  print(jax.devices()[0].device_kind, f"seq {args.seq}, head_dim {args.head_dim}",
        "causal" if args.causal else "non-causal", flush=True)
  for name in [*names, *args.impls]:
    fn, fn_args = kernel_anatomy.fwd_bwd_step(name, args.seq, args.head_dim, args.causal)
    jax.block_until_ready(fn(*fn_args))
    _run_back_to_back(f"{name} fwd+bwd", fn, fn_args, args.seconds)


def _run_back_to_back(label: str, fn, args, seconds: float) -> None:
  """Calls fn(*args) in batches of 20 for `seconds`; prints the window."""
  time.sleep(1.0)  # a gap in the log between runs
  start, calls = time.time(), 0
  while time.time() - start < seconds:
    jax.block_until_ready([fn(*args) for _ in range(20)])
    calls += 20
  end = time.time()
  print(f"{label:>24}: {start:.3f} .. {end:.3f}  {1e3 * (end - start) / calls:.3f} ms per call", flush=True)


if __name__ == "__main__":
  main()
