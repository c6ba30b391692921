"""Each Mosaic kernel's shared memory as Mosaic GPU counts it, against the
estimate `check_smem` refuses configs by (the modules' *smem_bytes, their
reserve included), on a CPU: the table behind
tests/test_mosaic.py::test_smem_estimates_hold_mosaics_count, whose cases
and counting it runs (lowering for CUDA runs Mosaic's Python half, which
sums each kernel's buffers, alignment and barriers included, and refuses a
kernel over 227 KiB).

  JAX_PLATFORMS=cpu PYTHONPATH=. python lab/tools/smem_count.py [--head-dims 64 128 256]

Lab equipment: not part of the product.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

from test_mosaic import _bwd_structs, _mosaic_smem_counts, _smem_cases  # noqa: E402

from jax_flash2.mosaic import common  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--head-dims", type=int, nargs="*", default=list(common.SUPPORTED_HEAD_DIMS))
  args = ap.parse_args()
  print(f"{'kernel':24s} {'Mosaic':>8s} {'estimate':>9s} {'estimate - Mosaic':>18s}  (limit {common.SMEM_LIMIT})")
  for head_dim in args.head_dims:
    structs = _bwd_structs(1, 1024, 1024, 2, head_dim)
    for kernel, fn, estimate in _smem_cases(head_dim):
      for count in _mosaic_smem_counts(fn, *structs):
        print(f"d{head_dim} {kernel:20s} {count:8d} {estimate:9d} {estimate - count:+18d}", flush=True)


if __name__ == "__main__":
  main()
