"""Benchmarks of jax_flash2 against cuDNN, XLA and (where installed) tokamax attention.

Run ``jax-flash2-bench --help`` or ``python -m jax_flash2.bench --help``.
Modules: `spec` (sweep config and result records), `flops` (FLOP and byte
counts), `impls` (the registry of implementations), `timing` (compiling and
timing one cell), `kernel_trace` (GPU kernel time from a profiler trace),
`check` (accuracy against a float32 reference), `sweep` (running the grid),
`memory` (the longest-sequence probe), `decode` (--decode: KV-cache
bandwidth), `report` (table, JSON, CSV, plots,
the results folder) and `cli` (argument parsing and `main`).
"""
