"""Benchmarks of jax_flash2 against cuDNN and XLA attention.

Run ``jax-flash2-bench --help`` or ``python -m jax_flash2.bench --help``.
Modules: `spec` (sweep config and result records), `flops` (FLOP and byte
counts), `impls` (the registry of implementations), `timing` (compiling and
timing one cell), `check` (accuracy against a float32 reference), `sweep`
(running the grid), `memory` (the longest-sequence probe), `report` (table,
JSON, CSV, plots) and `cli` (argument parsing and `main`).
"""
