"""Plots bench CLI result files (results.json) with the bench's own plotting, jax_flash2.bench.report.

  PYTHONPATH=. python lab/tools/plot_results.py --out bench/results/h200-2026-12-01-d128/tflops_d128.png \\
      --title "H200, head_dim 128" bench/results/h200-2026-12-01-d128/*/results.json

Reads the cells of one or more results.json files of the same run (the
bench CLI writes one per invocation; a run of both masks is often two),
renames the implementations for the legend (--label NAME=TEXT; the bench's
names have defaults below), and writes report.write_plots's figure: TFLOP/s
against sequence length, one panel per head_dim x mask x mode, one line per
implementation. Only cells with status ok are drawn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

from jax_flash2.bench import report
from jax_flash2.bench.spec import CELL_FIELDS, CellResult

LABELS = {
    "flash2": "jax_flash2 (auto)",
    "flash2-mosaic": "jax_flash2 (Mosaic kernels)",
    "flash2-triton": "jax_flash2 (Triton kernels)",
    "cudnn": "cuDNN",
    "cudnn-deterministic": "cuDNN deterministic",
    "xla": "XLA",
}


def read_cells(paths: list[str]) -> list[CellResult]:
  """The cells of results.json files (schema 1 or 2; fields a file lacks take their defaults)."""
  cells = []
  for path in paths:
    with open(path) as f:
      doc = json.load(f)
    for record in doc["cells"]:
      cells.append(CellResult(**{k: v for k, v in record.items() if k in CELL_FIELDS}))
  return cells


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", nargs="+", help="results.json files of one run")
  parser.add_argument("--out", required=True, help="the PNG to write")
  parser.add_argument("--title", default="")
  parser.add_argument("--label", action="append", default=[], metavar="NAME=TEXT")
  parser.add_argument("--impls", nargs="*", default=None, help="implementations to draw, in this order (default: all)")
  args = parser.parse_args(argv)
  labels = dict(LABELS, **dict(item.split("=", 1) for item in args.label))
  cells = read_cells(args.results)
  impls = args.impls or list(dict.fromkeys(c.impl for c in cells))
  cells = [dataclasses.replace(c, impl=labels.get(c.impl, c.impl)) for c in cells if c.impl in impls]
  with tempfile.TemporaryDirectory() as tmp:
    [written] = report.write_plots(tmp, cells, [labels.get(i, i) for i in impls], title=args.title)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    shutil.copyfile(written, args.out)
  print(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
