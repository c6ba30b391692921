"""``jax-flash2-bench``: time jax_flash2 against cuDNN, XLA and tokamax attention.

On a GPU the default sweep is batch x seq = 16384 tokens, hidden 2048
(heads = 2048 / head_dim), seq 512..16384, head_dim 64 and 128, causal and
non-causal, modes fwd, bwd and fwd+bwd, bf16. Each cell reports the wall
clock per call and the GPU's kernel time per call from a profiler trace,
and TFLOP/s from each. Without a GPU it runs a tiny sweep through the Pallas
interpret mode and XLA, to show the bench works; those figures say nothing
about GPU speed, and there are no kernel times. Implementations that cannot
run on the machine are left out. Results (JSON, CSV, plots) go to
bench_results/<UTC date-time>/ unless --out or --no-save says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
from typing import Sequence

from jax_flash2.decode import PAGE_MULTIPLE

from jax_flash2.bench import decode as decode_lib
from jax_flash2.bench import impls as impls_lib
from jax_flash2.bench.decode import DecodeSweepConfig
from jax_flash2.bench.spec import (DTYPE_ALIASES, MODES, LeftOut, SweepConfig, Window, softcap_text, varlen_text,
                                   window_text)

GPU_DEFAULTS = dict(
    seqlens=(512, 1024, 2048, 4096, 8192, 16384),
    head_dims=(64, 128),
    batch=None,
    heads=None,
    warmup=3,
    iters=20,
)
CPU_DEFAULTS = dict(seqlens=(64, 128), head_dims=(64,), batch=1, heads=2, warmup=1, iters=3)
# Where results go without --out: one folder per run beneath it, named by its UTC start.
RESULTS_DIR = "bench_results"

CPU_NOTICE = (
    "NOTE: no GPU found (jax backend: {backend}). These are CPU / Pallas-interpret figures, "
    "NOT GPU figures: they show that the bench runs, nothing about kernel speed."
)


class UsageError(ValueError):
  """A bad combination of flags."""


def _split(values: Sequence[str] | None) -> list[str] | None:
  """Accepts both ``--x 1 2`` and ``--x 1,2``."""
  if values is None:
    return None
  return [part.strip() for v in values for part in v.split(",") if part.strip()]


def _ints(values: Sequence[str] | None, flag: str) -> tuple[int, ...] | None:
  parts = _split(values)
  if parts is None:
    return None
  out = []
  for p in parts:
    mult = 1
    if p.lower().endswith("k"):
      p, mult = p[:-1], 1024
    try:
      n = int(p) * mult
    except ValueError:
      raise UsageError(f"{flag}: not an integer: {p!r}") from None
    if n < 1:
      raise UsageError(f"{flag}: must be positive, got {n}")
    out.append(n)
  return tuple(out)


def _window_side(text: str, item: str) -> int | None:
  """One side of a --window value: an int >= 0 ('1k' ok) or none (unbounded)."""
  text = text.strip().lower()
  if text == "none":
    return None
  mult = 1024 if text.endswith("k") else 1
  try:
    n = int(text[:-1] if mult > 1 else text) * mult
  except ValueError:
    raise UsageError(f"--window {item!r}: {text!r} is neither an integer nor none") from None
  if n < 0:
    raise UsageError(f"--window {item!r}: sides must be >= 0 (or none), got {n}")
  return n


def _windows(values: Sequence[str] | None) -> tuple[Window | None, ...]:
  """`--window` values: none, LEFT (meaning LEFT,0), LEFT,RIGHT or LEFT:RIGHT.

  A comma inside one word joins LEFT and RIGHT, so several windows are
  separate words (`--window none 1024,0`), or LEFT:RIGHT pairs joined by
  commas (`--window 1024:0,256:0`). A side may be `none` (unbounded);
  none,none is no window.
  """
  items: list[str] = []
  for word in values or ["none"]:
    items.extend(word.split(",") if ":" in word else [word])
  out: list[Window | None] = []
  for item in (i.strip() for i in items):
    if not item:
      continue
    if item.lower() == "none":
      window = None
    else:
      sides = item.replace(":", ",").split(",")
      if len(sides) > 2:
        raise UsageError(f"--window: expected LEFT[,RIGHT] or LEFT:RIGHT, got {item!r}")
      left = _window_side(sides[0], item)
      right = _window_side(sides[1], item) if len(sides) == 2 else 0
      window = None if left is None and right is None else (left, right)
    if window not in out:
      out.append(window)
  if not out:
    raise UsageError("--window: no value given")
  return tuple(out)


def _softcaps(values: Sequence[str] | None) -> tuple[float | None, ...]:
  """`--softcap` values: none (no softcap) or a positive, finite number."""
  out: list[float | None] = []
  for p in _split(values) or ["none"]:
    if p.lower() == "none":
      cap = None
    else:
      try:
        cap = float(p)
      except ValueError:
        raise UsageError(f"--softcap: neither a number nor none: {p!r}") from None
      if not (math.isfinite(cap) and cap > 0):
        raise UsageError(f"--softcap: must be positive and finite (or none), got {p!r}")
    if cap not in out:
      out.append(cap)
  return tuple(out)


def _varlens(values: Sequence[Sequence[str]] | None) -> tuple[tuple[int, ...], ...]:
  """`--varlen` packings: each occurrence one list of sequence lengths ('1k' ok), each >= 1."""
  out: list[tuple[int, ...]] = []
  for words in values or []:
    lens = _ints(words, "--varlen")
    if not lens:
      raise UsageError(f"--varlen: no lengths in {' '.join(words)!r}")
    if lens not in out:
      out.append(lens)
  return tuple(out)


def _dtypes(values: Sequence[str] | None) -> tuple[str, ...]:
  dtypes: list[str] = []
  for name in _split(values) or []:
    if name.lower() not in DTYPE_ALIASES:
      raise UsageError(f"--dtype: unknown {name!r}; choose bf16, fp16 or fp32")
    if DTYPE_ALIASES[name.lower()] not in dtypes:
      dtypes.append(DTYPE_ALIASES[name.lower()])
  return tuple(dtypes)


def _timing(ns: argparse.Namespace, defaults: dict) -> tuple[int, int]:
  """(warmup, iters) of `ns` or the platform's `defaults`; checks them and the output flags."""
  warmup = ns.warmup if ns.warmup is not None else defaults["warmup"]
  iters = ns.iters if ns.iters is not None else defaults["iters"]
  if warmup < 0 or iters < 1 or ns.input_sets < 1:
    raise UsageError("--warmup must be >= 0, --iters and --input-sets >= 1")
  if ns.no_save and ns.out:
    raise UsageError("--no-save writes nothing; --out names where to write")
  return warmup, iters


def _impl_names(values: Sequence[str] | None, defaults: Sequence[str], known: Sequence[str], what: str) -> list[str]:
  """--impls (or `defaults` without it), each in `known`, without repeats."""
  names: list[str] = []
  for name in _split(values) if values is not None else defaults:
    if name not in known:
      raise UsageError(f"--impls: unknown {what}{name!r}; known: {', '.join(known)}")
    if name not in names:
      names.append(name)
  return names


def _kept(selected: tuple[tuple[str, ...], tuple[LeftOut, ...]]) -> tuple[tuple[str, ...], tuple[LeftOut, ...]]:
  """`selected` (kept, left out) as it is, unless nothing is kept: a usage error saying why."""
  impls, left_out = selected
  if not impls:
    raise UsageError("--impls: none can run here: " + "; ".join(f"{lo.impl}: {lo.reason}" for lo in left_out))
  return impls, left_out


def _causal(values: Sequence[str]) -> tuple[bool, ...]:
  table = {"both": (False, True), "true": (True,), "false": (False,), "causal": (True,), "none": (False,)}
  out: list[bool] = []
  for p in _split(values) or ["both"]:
    if p.lower() not in table:
      raise UsageError(f"--causal: expected both, true or false, got {p!r}")
    out.extend(c for c in table[p.lower()] if c not in out)
  return tuple(out)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jax-flash2-bench",
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  g = p.add_argument_group("sweep (lists take spaces or commas; defaults depend on GPU vs no GPU)")
  g.add_argument("--seqlens", nargs="+", metavar="N", help="sequence lengths (default 512..16384; 64,128 on CPU); '4k' ok")
  g.add_argument("--head-dims", nargs="+", metavar="D", help="head dims (default 64 128; 256 on request; 64 on CPU)")
  g.add_argument("--batch", type=int, help="batch size (default: tokens // seqlen; 1 on CPU)")
  g.add_argument("--tokens", type=int, default=16384, help="batch x seq when --batch is not given (default 16384)")
  g.add_argument("--heads", type=int, help="query heads (default: hidden // head_dim; 2 on CPU)")
  g.add_argument("--hidden", type=int, default=2048, help="heads x head_dim when --heads is not given (default 2048)")
  g.add_argument("--kv-heads", type=int, help="key/value heads (default = heads); != heads is grouped-query attention")
  g.add_argument("--causal", nargs="+", default=["both"], metavar="both|true|false", help="masks (default both)")
  g.add_argument(
      "--window",
      nargs="+",
      metavar="LEFT[,RIGHT]",
      help="local-attention windows, each none, LEFT,RIGHT or LEFT:RIGHT (a lone LEFT means LEFT,0; a side may be "
      "none = unbounded); key j visible to query i iff i-LEFT <= j <= i+RIGHT, combined with --causal "
      "(default none)",
  )
  g.add_argument(
      "--segments",
      nargs="+",
      metavar="N",
      help="packed sequences: each row split into N equal contiguous segments, attention within a segment only "
      "(default 1 = no segment ids); every seqlen must be a multiple of N",
  )
  g.add_argument(
      "--softcap",
      nargs="+",
      metavar="CAP",
      help="softcaps, each a positive number or none: scores become CAP*tanh(scores/CAP) (Gemma 2); FLOPs "
      "unchanged; cuDNN and XLA (jax.nn) have none (default none)",
  )
  g.add_argument(
      "--varlen",
      nargs="+",
      action="append",
      metavar="LENS",
      help="sequence lengths packed end to end (1024,3072,512): the cell is one flash_attention_varlen call of "
      "their sum (batch 1) in place of --seqlens, beside flash2-segids (the same lengths as segment ids); FLOPs "
      "over visible pairs; repeat for more packings; cuDNN, XLA and tokamax have no packing",
  )
  g.add_argument("--sinks", action="store_true",
                 help="attention sinks (gpt-oss): one random logit per head in every softmax denominator; runs the "
                 "jax_flash2 implementations only (the others have none)")
  g.add_argument("--decode", action="store_true",
                 help="decoding mode: q_len queries per sequence over a KV cache (flash_decode vs XLA, cuDNN, "
                 "tokamax), timed as bandwidth (bytes read / time, and / the measured copy bandwidth)")
  g.add_argument("--cache-lens", nargs="+", metavar="N",
                 help="with --decode: cache lengths (default 8k 16k 32k; 64 128 on CPU); '32k' ok")
  g.add_argument("--q-len", type=int, help="with --decode: queries per sequence (default 1)")
  g.add_argument("--page-size", nargs="+", metavar="P",
                 help="with --decode: paged caches of P-token pages (a multiple of 16) in shuffled order through a "
                 "block_table; none = contiguous; several values compare them (default none)")
  g.add_argument("--dtype", nargs="+", default=["bf16"], metavar="bf16|fp16|fp32", help="dtypes (default bf16)")
  g.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE", help="fwd, bwd, fwd+bwd (default all)")
  g.add_argument(
      "--impls",
      nargs="+",
      metavar="IMPL",
      help=f"implementations (default {' '.join(impls_lib.DEFAULT_IMPLS)}, those of them that can run here; "
      f"known: {', '.join(impls_lib.REGISTRY)}; --list-impls describes them)",
  )
  t = p.add_argument_group("timing and checks")
  t.add_argument("--warmup", type=int, help="untimed runs per cell (default 3; 1 on CPU)")
  t.add_argument("--iters", type=int, help="timed runs per cell, median reported (default 20; 3 on CPU)")
  t.add_argument("--input-sets", type=int, default=2, help="random input sets the runs rotate over (default 2)")
  t.add_argument("--no-check", action="store_true", help="skip the accuracy check against the float32 reference")
  t.add_argument("--interpret", action="store_true", help="run Pallas kernels in interpret mode (automatic without a GPU)")
  t.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs (default 0)")
  t.add_argument("--no-kernel-time", action="store_true",
                 help="skip the profiler trace that reads each cell's GPU kernel time (none without a GPU anyway)")
  o = p.add_argument_group("output")
  o.add_argument("--out", metavar="DIR",
                 help=f"write results.json, results.csv and plots here (default {RESULTS_DIR}/<UTC date-time>/ under the "
                 "current directory)")
  o.add_argument("--no-save", action="store_true", help="write no files, only print")
  o.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                 help="with the results, TFLOP/s plots (PNG; needs matplotlib; default on)")
  o.add_argument("--memory", action="store_true", help="after the sweep, probe the longest fwd+bwd sequence per impl")
  o.add_argument("--memory-only", action="store_true", help="run only the --memory probe, no sweep")
  o.add_argument("--memory-max-seqlen", metavar="N", help="longest sequence the probe tries (default 128k; 256 on CPU)")
  o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  o.add_argument("--list-impls", action="store_true", help="list the registered implementations and exit")
  return p


def config_from_args(ns: argparse.Namespace, platform: str) -> SweepConfig:
  """The sweep `ns` asks for on `platform` (jax.default_backend())."""
  tiny = platform != "gpu"
  d = CPU_DEFAULTS if tiny else GPU_DEFAULTS
  seqlens = _ints(ns.seqlens, "--seqlens") or d["seqlens"]
  head_dims = _ints(ns.head_dims, "--head-dims") or d["head_dims"]
  batch = ns.batch if ns.batch is not None else d["batch"]
  heads = ns.heads if ns.heads is not None else d["heads"]
  for hd in head_dims:
    if hd % 8 or hd > 256:
      raise UsageError(f"--head-dims: {hd} is not a multiple of 8 in [8, 256]")
    if heads is None and ns.hidden % hd:
      raise UsageError(f"--hidden {ns.hidden} is not a multiple of head_dim {hd}; pass --heads")
  for flag, value in (("--batch", batch), ("--heads", heads), ("--kv-heads", ns.kv_heads), ("--tokens", ns.tokens),
                      ("--hidden", ns.hidden)):
    if value is not None and value < 1:
      raise UsageError(f"{flag} must be positive, got {value}")
  if ns.kv_heads is not None:
    for hd in head_dims:
      h = heads if heads is not None else ns.hidden // hd
      if h % ns.kv_heads:
        raise UsageError(f"--kv-heads {ns.kv_heads} does not divide heads {h} (head_dim {hd})")
  windows = _windows(ns.window)
  softcaps = _softcaps(ns.softcap)
  varlens = _varlens(ns.varlen)
  if varlens:
    for flag, given in (("--seqlens", ns.seqlens), ("--segments", ns.segments), ("--batch", ns.batch)):
      if given is not None:
        raise UsageError(f"--varlen packs its lengths into one row (batch 1) of their sum: drop {flag}")
    if ns.memory or ns.memory_only:
      raise UsageError("--memory probes unpacked sequences: run it without --varlen")
    seqlens = tuple(sum(lens) for lens in varlens)
  segments = tuple(dict.fromkeys(_ints(ns.segments, "--segments") or (1,)))
  for n in segments:
    for seqlen in seqlens:
      if seqlen % n:
        raise UsageError(f"--segments {n} does not divide seqlen {seqlen}")
  dtypes = _dtypes(ns.dtype)
  modes = []
  for m in _split(ns.modes) or []:
    m = {"fwdbwd": "fwd+bwd", "fwd_bwd": "fwd+bwd", "both": "fwd+bwd"}.get(m.lower(), m.lower())
    if m not in MODES:
      raise UsageError(f"--modes: unknown {m!r}; choose from {', '.join(MODES)}")
    if m not in modes:
      modes.append(m)
  interpret = bool(ns.interpret or tiny)
  opts = impls_lib.Options(platform=platform, interpret=interpret, sinks=ns.sinks, varlen=bool(varlens))
  requested = ns.impls is not None
  names = _impl_names(ns.impls, impls_lib.default_impls(opts), impls_lib.REGISTRY, "")
  impls, left_out = _kept(impls_lib.select(names, opts, requested=requested))
  warmup, iters = _timing(ns, d)
  max_seq = _ints([ns.memory_max_seqlen], "--memory-max-seqlen")[0] if ns.memory_max_seqlen else None
  return SweepConfig(
      seqlens=seqlens,
      head_dims=head_dims,
      causal=_causal(ns.causal),
      dtypes=dtypes,
      modes=tuple(modes),
      impls=impls,
      tokens=ns.tokens,
      hidden=ns.hidden,
      batch=batch,
      heads=heads,
      kv_heads=ns.kv_heads,
      windows=windows,
      segments=segments,
      softcaps=softcaps,
      varlens=varlens,
      sinks=ns.sinks,
      warmup=warmup,
      iters=iters,
      input_sets=ns.input_sets,
      check=not ns.no_check,
      interpret=interpret,
      platform=platform,
      left_out=left_out,
      kernel_time=not (ns.no_kernel_time or tiny),
      save=not ns.no_save,
      out=ns.out,
      plot=ns.plot,
      memory=bool(ns.memory or ns.memory_only),
      memory_only=ns.memory_only,
      memory_max_seqlen=max_seq,
      seed=ns.seed,
  )


def _page_sizes(values: Sequence[str] | None) -> tuple[int | None, ...]:
  out: list[int | None] = []
  for p in _split(values) or ["none"]:
    size = None if p.lower() == "none" else _ints([p], "--page-size")[0]
    if size is not None and size % PAGE_MULTIPLE:
      raise UsageError(f"--page-size: {size} is not a multiple of {PAGE_MULTIPLE}")
    if size not in out:
      out.append(size)
  return tuple(out)


def decode_config_from_args(ns: argparse.Namespace, platform: str) -> DecodeSweepConfig:
  """The --decode run `ns` asks for on `platform`."""
  tiny = platform != "gpu"
  d = decode_lib.CPU_DECODE_DEFAULTS if tiny else decode_lib.GPU_DECODE_DEFAULTS
  for flag, given in (("--seqlens", ns.seqlens), ("--varlen", ns.varlen), ("--segments", ns.segments),
                      ("--window", ns.window), ("--softcap", ns.softcap), ("--sinks", ns.sinks or None),
                      ("--memory", ns.memory or ns.memory_only or None), ("--memory-max-seqlen", ns.memory_max_seqlen)):
    if given is not None:
      raise UsageError(f"--decode times one step over a KV cache (--cache-lens): drop {flag}")
  cache_lens = _ints(ns.cache_lens, "--cache-lens") or d["cache_lens"]
  head_dims = _ints(ns.head_dims, "--head-dims") or d["head_dims"]
  batch = ns.batch if ns.batch is not None else d["batch"]
  heads = ns.heads if ns.heads is not None else d["heads"]
  kv_heads = ns.kv_heads if ns.kv_heads is not None else (d["kv_heads"] if ns.heads is None else heads)
  q_len = ns.q_len if ns.q_len is not None else 1
  for flag, value in (("--batch", batch), ("--heads", heads), ("--kv-heads", kv_heads), ("--q-len", q_len)):
    if value < 1:
      raise UsageError(f"{flag} must be positive, got {value}")
  if heads % kv_heads:
    raise UsageError(f"--kv-heads {kv_heads} does not divide heads {heads}")
  for hd in head_dims:
    if hd % 8 or hd > 256:
      raise UsageError(f"--head-dims: {hd} is not a multiple of 8 in [8, 256]")
  page_sizes = _page_sizes(ns.page_size)
  for size in page_sizes:
    for n in cache_lens:
      if size is not None and n % size:
        raise UsageError(f"--page-size {size} does not divide cache length {n}")
  for n in cache_lens:
    if q_len > n:
      raise UsageError(f"--q-len {q_len} exceeds cache length {n}")
  dtypes = _dtypes(ns.dtype)
  requested = ns.impls is not None
  names = _impl_names(ns.impls, decode_lib.DECODE_IMPLS, decode_lib.DECODE_REGISTRY, "decode implementation ")
  impls, left_out = _kept(decode_lib.select(names, platform, requested=requested))
  warmup, iters = _timing(ns, d)
  return DecodeSweepConfig(
      cache_lens=cache_lens, page_sizes=page_sizes, head_dims=head_dims, dtypes=dtypes, batch=batch,
      heads=heads, kv_heads=kv_heads, q_len=q_len, impls=impls, left_out=left_out, warmup=warmup, iters=iters,
      input_sets=ns.input_sets, check=not ns.no_check, interpret=bool(ns.interpret or tiny), platform=platform,
      kernel_time=not (ns.no_kernel_time or tiny), save=not ns.no_save, out=ns.out, seed=ns.seed,
  )


def parse(argv: Sequence[str] | None, platform: str) -> SweepConfig | DecodeSweepConfig:
  """Parses `argv` into a config for `platform`; bad flags exit with status 2."""
  parser = build_parser()
  ns = parser.parse_args(argv)
  try:
    if ns.decode:
      return decode_config_from_args(ns, platform)
    for flag, given in (("--cache-lens", ns.cache_lens), ("--q-len", ns.q_len), ("--page-size", ns.page_size)):
      if given is not None:
        raise UsageError(f"{flag} belongs to --decode")
    return config_from_args(ns, platform)
  except UsageError as exc:
    parser.error(str(exc))
    raise  # unreachable: parser.error exits


def _describe(cfg: SweepConfig) -> str:
  batch = f"{cfg.batch}" if cfg.batch is not None else f"{cfg.tokens} tokens / seq"
  heads = f"{cfg.heads}" if cfg.heads is not None else f"{cfg.hidden} / head_dim"
  kv = f", kv_heads {cfg.kv_heads}" if cfg.kv_heads is not None else ""
  masks = ""
  lengths = f"seqlens {list(cfg.seqlens)}"
  if cfg.varlens:
    lengths = f"varlen {[varlen_text(lens) for lens in cfg.varlens]} (batch 1)"
    batch = "1"
  if cfg.windows != (None,):
    masks += f", windows {[window_text(w) for w in cfg.windows]}"
  if cfg.segments != (1,):
    masks += f", segments {list(cfg.segments)}"
  if cfg.softcaps != (None,):
    masks += f", softcaps {[softcap_text(cap) for cap in cfg.softcaps]}"
  if cfg.sinks:
    masks += ", attention sinks"
  return (
      f"{lengths}, head_dims {list(cfg.head_dims)}, batch {batch}, heads {heads}{kv}, "
      f"causal {list(cfg.causal)}{masks}, dtypes {list(cfg.dtypes)}, modes {list(cfg.modes)}, impls {list(cfg.impls)}, "
      f"warmup {cfg.warmup}, iters {cfg.iters} (median), input sets {cfg.input_sets}"
      + (", Pallas interpret mode" if cfg.interpret else "")
      + (", kernel times from a profiler trace" if cfg.kernel_time else "")
  )


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the bench; returns 0 (failed cells are reported, not fatal)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  ns = build_parser().parse_args(argv)
  if ns.list_impls:
    width = max(len(name) for name in impls_lib.REGISTRY)
    for impl in impls_lib.REGISTRY.values():
      default = " (default)" if impl.name in impls_lib.DEFAULT_IMPLS else ""
      default = " (default with --varlen)" if impl.name in impls_lib.VARLEN_DEFAULT_IMPLS else default
      print(f"{impl.name:<{width}} {impl.description}{default}")
    print("with --decode:")
    for impl in decode_lib.DECODE_REGISTRY.values():
      print(f"{impl.name:<{width}} {impl.description}")
    return 0

  import jax

  from jax_flash2.bench import memory, report, sweep
  from jax_flash2.bench.progress import Progress

  started = datetime.datetime.now(datetime.timezone.utc)
  backend = jax.default_backend()
  cfg = parse(argv, backend)
  device = jax.devices()[0]
  print(f"jax-flash2-bench: {device.device_kind} ({backend}), jax {jax.__version__}")
  if cfg.tiny:
    print(CPU_NOTICE.format(backend=backend))
  for lo in cfg.left_out:
    if lo.requested:
      print(f"left out {lo.impl}: {lo.reason}")
  if isinstance(cfg, DecodeSweepConfig):
    return _main_decode(cfg, argv, started, backend, show_progress=not ns.no_progress)
  if not cfg.memory_only:
    print("sweep: " + _describe(cfg))
  sys.stdout.flush()
  meta = report.metadata(argv, started)
  show_progress = not ns.no_progress

  cells, checks = [], []
  if not cfg.memory_only:
    progress = Progress(sweep.num_steps(cfg), desc="sweep", enabled=show_progress)
    cells, checks = sweep.run_sweep(cfg, progress)
    progress.close()
    print()
    if checks:
      print(report.format_checks(checks))
    print(report.format_table(cells, cfg.impls))
    mem = report.format_memory_table(cells, cfg.impls)
    if mem:
      print(mem)

  steps = []
  if cfg.memory:
    seqs = memory.probe_seqlens(cfg)
    if cfg.tiny:
      print(f"memory probe: no GPU, so a tiny CPU version (seq {seqs[0]}..{seqs[-1]}); "
            "its bytes are host bytes, not GPU memory figures.")
    progress = Progress(len(seqs) * len(cfg.impls), desc="memory", enabled=show_progress)
    steps = memory.run_memory_probe(cfg, progress)
    progress.close()
    print(report.format_memory_probe(steps))

  if cfg.save:
    # The folder chosen here goes into the JSON's config too.
    cfg = dataclasses.replace(cfg, out=cfg.out or report.make_dated_dir(RESULTS_DIR, started))
    written, no_plots = report.write_results(cfg.out, meta, cfg, cells, checks, steps)
    if no_plots:
      print(f"plots: {no_plots}")
    print(f"results in {cfg.out}{os.sep}: " + ", ".join(os.path.basename(path) for path in written))
  if cfg.tiny:
    print(CPU_NOTICE.format(backend=backend))
  return 0


def _main_decode(cfg: DecodeSweepConfig, argv: list[str], started: datetime.datetime, backend: str,
                 show_progress: bool) -> int:
  from jax_flash2.bench import report
  from jax_flash2.bench.progress import Progress

  pages = ["none" if p is None else p for p in cfg.page_sizes]
  for lo in cfg.left_out:
    if not lo.requested:
      print(f"left out {lo.impl}: {lo.reason}")
  print(f"decode: cache_lens {list(cfg.cache_lens)}, page sizes {pages}, q_len {cfg.q_len}, batch {cfg.batch}, "
        f"heads {cfg.heads}/{cfg.kv_heads} kv, head_dims {list(cfg.head_dims)}, dtypes {list(cfg.dtypes)}, "
        f"impls {list(cfg.impls)}, warmup {cfg.warmup}, iters {cfg.iters} (median)"
        + (", Pallas interpret mode" if cfg.interpret else "")
        + (", kernel times from a profiler trace" if cfg.kernel_time else ""))
  sys.stdout.flush()
  meta = report.metadata(argv, started)
  meta.update(decode_lib.copy_bandwidth(backend, cfg.kernel_time))
  progress = Progress(cfg.num_cells(), desc="decode", enabled=show_progress)
  cells = decode_lib.run_decode(cfg, meta, progress)
  progress.close()
  print()
  print(decode_lib.format_table(cells, meta, cfg.tiny))
  if cfg.save:
    cfg = dataclasses.replace(cfg, out=cfg.out or report.make_dated_dir(RESULTS_DIR, started))
    written = decode_lib.write_results(cfg.out, meta, cfg, cells)
    print(f"results in {cfg.out}{os.sep}: " + ", ".join(os.path.basename(path) for path in written)
          + " (no plots in --decode mode)")
  if cfg.tiny:
    print(CPU_NOTICE.format(backend=backend))
  return 0


if __name__ == "__main__":
  sys.exit(main())
