"""Train a small character-level GPT with Flax + optax, attention by jax_flash2
or by Flax's default, and compare the loss curves. Needs jax_flash2 importable
(`pip install -e '.[test]'`, or PYTHONPATH=. from the repository root).

    # one run per attention choice (same seed => same init and same batches)
    python examples/train_gpt.py --attention flash --out runs
    python examples/train_gpt.py --attention xla --out runs --plot   # also plots every JSON in runs/

    # CPU: run the Pallas kernels in interpret mode (slow; tiny configs only)
    python examples/train_gpt.py --attention flash --interpret --steps 5 --seq-len 64

    # compare any runs
    python examples/train_gpt.py plot runs/a.json runs/b.json --out loss.png

The corpus comes from `char_corpus.generate` (a fixed-seed stochastic grammar,
~400 KB, built at startup). `--attention flash` passes
`jax_flash2.flax.make_attention_fn(causal=True)` to every
`nn.MultiHeadDotProductAttention` (backend "auto": the Pallas kernels on an
NVIDIA GPU of compute capability >= 8.0, else XLA with a warning) and no mask
array; `--flash-causal mask` passes Flax's causal mask array instead.
`--attention xla` keeps Flax's `dot_product_attention` with
`nn.make_causal_mask`.

Defaults are a tiny model (2 layers, d_model 128, 4 heads, seq 128, batch 16,
50 steps; dtype bf16 on a GPU, f32 elsewhere) that runs in seconds on a CPU.

--out DIR writes DIR/gpt_<attention>_<dtype>_seed<seed>.json: config, device,
per-step loss, per-step times and their median without the first steps
(compilation), tokens/s and the validation loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import importlib
import json
import os
import statistics
import sys
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import char_corpus
from jax_flash2.flax import make_attention_fn
from gpt import GPT

CORPUS_CHARS = 400_000
CORPUS_SEED = 0
VAL_FRACTION = 0.1
TIMING_SKIP = 2  # steps left out of the median step time (compilation, first run)
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


# ---------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Data:
  """The encoded corpus: train/val token ids and the vocabulary."""

  train: np.ndarray
  val: np.ndarray
  vocab: str


def load_data() -> Data:
  text = char_corpus.generate(CORPUS_CHARS, seed=CORPUS_SEED)
  vocab = "".join(sorted(set(text)))
  index = {c: i for i, c in enumerate(vocab)}
  ids = np.fromiter((index[c] for c in text), np.int32, len(text))
  split = int(len(ids) * (1 - VAL_FRACTION))
  return Data(train=ids[:split], val=ids[split:], vocab=vocab)


def sample_batch(ids: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Random windows: inputs [batch, seq_len] and next-character targets."""
  starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
  window = ids[starts[:, None] + np.arange(seq_len + 1)]
  return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------- model and steps


def float32_dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                                  dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                                  precision=None):
  """Flax's attention with scores, softmax and P V all in float32, cast back
  to the input dtype: the math jax_flash2 approximates (float32 scores and
  softmax; only P is rounded to bf16 for its P V product). Plain
  `nn.dot_product_attention` in bf16 rounds the scores and computes the
  softmax in bf16, which is the control this choice gives."""
  del dtype, precision  # float32 at the highest precision instead
  f32 = lambda x: x.astype(jnp.float32)
  out = nn.dot_product_attention(
      f32(query), f32(key), f32(value), bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
      dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic, dtype=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
  )
  return out.astype(query.dtype)


def build_model(args: argparse.Namespace, vocab_size: int, attention: str) -> GPT:
  if attention == "flash":
    causal_flag = args.flash_causal == "flag"
    attention_fn = make_attention_fn(causal=causal_flag, interpret=args.interpret)
    causal_mask = not causal_flag
  elif attention == "xla-f32":
    attention_fn, causal_mask = float32_dot_product_attention, True
  else:
    attention_fn, causal_mask = nn.dot_product_attention, True
  return GPT(vocab_size=vocab_size, max_len=args.seq_len, d_model=args.d_model, layers=args.layers,
             heads=args.heads, dtype=DTYPES[args.dtype], attention_fn=attention_fn, causal_mask=causal_mask)


def init_params(args: argparse.Namespace, vocab_size: int) -> Any:
  """Float32 params from --seed. Built with Flax's default attention: the
  parameters do not depend on attention_fn, so both choices start equal."""
  model = build_model(args, vocab_size, "xla")
  tokens = jnp.zeros((1, args.seq_len), jnp.int32)
  return jax.jit(model.init)(jax.random.PRNGKey(args.seed), tokens)["params"]


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
  warmup = max(1, min(100, args.steps // 10))
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))


def make_steps(model: GPT, optimizer: optax.GradientTransformation):
  """(train_step, eval_loss), both jitted; train_step donates params and state."""

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step, jax.jit(loss_fn)


# ---------------------------------------------------------------- training


def device_info() -> dict[str, Any]:
  device = jax.devices()[0]
  return {
      "platform": device.platform,
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "optax": optax.__version__,
  }


def attention_impl(args: argparse.Namespace) -> str:
  """What computes attention in this run, in words."""
  if args.attention == "xla":
    return "flax.linen.dot_product_attention + make_causal_mask"
  if args.attention == "xla-f32":
    return "flax.linen.dot_product_attention in float32 + make_causal_mask"
  causal = "causal flag" if args.flash_causal == "flag" else "causal mask array"
  if args.interpret:
    return f"jax_flash2 Pallas kernels, interpret mode ({causal})"
  where = "Pallas kernels" if jax.devices()[0].platform == "gpu" else "XLA fallback (no GPU)"
  return f"jax_flash2 backend=auto: {where} ({causal})"


def evaluate(eval_loss, params, data: Data, args: argparse.Namespace) -> float:
  """Mean loss over --eval-batches fixed validation batches."""
  rng = np.random.default_rng(args.seed + 1)
  losses = [float(eval_loss(params, *sample_batch(data.val, rng, args.batch, args.seq_len)))
            for _ in range(args.eval_batches)]
  return float(np.mean(losses))


def train(args: argparse.Namespace) -> dict[str, Any]:
  """Runs the training; returns (and with --out writes) the run record."""
  if args.attention == "flash" and args.interpret:
    # Pallas interpret mode registers a JAX config option on first use, which
    # changes the tracing context and retraces train_step once more; register
    # it up front instead.
    importlib.import_module("jax.experimental.pallas.fuser")
  data = load_data()
  model = build_model(args, len(data.vocab), args.attention)
  optimizer = make_optimizer(args)
  params = init_params(args, len(data.vocab))
  opt_state = optimizer.init(params)
  train_step, eval_loss = make_steps(model, optimizer)
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  print(f"attention: {attention_impl(args)}")
  print(f"device: {device_info()['device_kind']} ({jax.default_backend()}); params: {num_params:,}; "
        f"corpus: {len(data.train):,} train / {len(data.val):,} val chars, vocab {len(data.vocab)}")

  rng = np.random.default_rng(args.seed)
  losses, times, evals = [], [], []
  log_every = args.log_every or max(1, args.steps // 10)
  for step in range(args.steps):
    x, y = sample_batch(data.train, rng, args.batch, args.seq_len)
    start = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, x, y)
    loss = float(loss)  # waits for the step
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if not np.isfinite(loss):
      print(f"step {step}: loss is {loss}; stopping")
      break
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
      evals.append({"step": step + 1, "val_loss": evaluate(eval_loss, params, data, args)})
    if step % log_every == 0 or step == args.steps - 1:
      print(f"step {step:5d}  loss {loss:.4f}  {times[-1] * 1e3:8.1f} ms")
  evals.append({"step": len(losses), "val_loss": evaluate(eval_loss, params, data, args)})

  skip = min(TIMING_SKIP, max(len(times) - 1, 0))
  median = statistics.median(times[skip:]) if times else None
  record = {
      "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
      "attention_impl": attention_impl(args),
      "device": device_info(),
      "num_params": num_params,
      "losses": losses,
      "step_times_s": times,
      "timing_skipped_steps": skip,
      "median_step_time_s": median,
      "tokens_per_s": args.batch * args.seq_len / median if median else None,
      "evals": evals,
      "final_val_loss": evals[-1]["val_loss"],
  }
  print(f"final: train loss {np.mean(losses[-10:]):.4f} (mean of last {min(10, len(losses))}), "
        f"val loss {record['final_val_loss']:.4f}, median step {median * 1e3:.1f} ms "
        f"(first {skip} left out), {record['tokens_per_s']:,.0f} tokens/s")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, run_name(args) + ".json")
    with open(path, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {path}")
    if args.plot:
      png = os.path.join(args.out, "loss.png")
      plot_runs(sorted(glob.glob(os.path.join(args.out, "*.json"))), png)
      print(f"wrote {png}")
  return record


def run_name(args: argparse.Namespace) -> str:
  interpret = "-interpret" if args.attention == "flash" and args.interpret else ""
  return f"gpt_{args.attention}{interpret}_{args.dtype}_seed{args.seed}"


# ---------------------------------------------------------------- plot


def smoothed(values: np.ndarray) -> np.ndarray:
  """Bias-corrected exponential moving average, window ~ len / 20 steps."""
  decay = float(np.clip(1 - 20 / max(len(values), 1), 0.0, 0.98))
  out, avg = np.empty_like(values), 0.0
  for t, value in enumerate(values):
    avg = decay * avg + (1 - decay) * value
    out[t] = avg / (1 - decay ** (t + 1)) if decay else value
  return out


def _load_runs(paths: list[str]) -> list[dict[str, Any]]:
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  return runs


def plot_runs(paths: list[str], out: str) -> None:
  """One PNG: every run's per-step loss (faint), its moving average and its
  validation losses (crosses), labelled with the run and its step time; one
  panel per seed when the runs have several."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = _load_runs(paths)
  seeds = sorted({run["config"]["seed"] for run in runs})
  cols = min(len(seeds), 3)
  rows = -(-len(seeds) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols + 3 * (cols == 1), 4 * rows + (rows == 1)),
                           squeeze=False, sharey=True)
  for ax, seed in zip(axes.flat, seeds):
    for i, run in enumerate(r for r in runs if r["config"]["seed"] == seed):
      color, style = f"C{i}", ("-", "--", ":", "-.")[i % 4]  # styles keep identical curves visible
      losses = np.asarray(run["losses"], np.float64)
      steps = np.arange(1, len(losses) + 1)
      median = run["median_step_time_s"]
      label = f"{run_name(argparse.Namespace(**run['config']))}: {median * 1e3 if median else float('nan'):.1f} ms/step"
      ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
      ax.plot(steps, smoothed(losses), color=color, linestyle=style, label=label)
      ax.scatter([e["step"] for e in run["evals"]], [e["val_loss"] for e in run["evals"]], color=color, marker="x")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  for ax in axes.flat[len(seeds):]:
    ax.set_visible(False)
  for ax in axes[:, 0]:
    ax.set_ylabel("loss (nats / character); x = validation")
  fig.suptitle("character-level GPT: jax_flash2 vs Flax attention")
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


ATTENTION_NAMES = {"flash": "flash", "xla": "XLA", "xla-f32": "XLA f32"}


def summarise_runs(paths: list[str]) -> str:
  """Markdown tables of final validation losses per seed, flash against
  each Flax attention present (XLA in the run's dtype, XLA in float32), with
  the mean and spread of their differences: the question is whether the
  attention changes the loss by more than a change of seed does."""
  final = {}
  for run in _load_runs(paths):
    config = run["config"]
    final[config["seed"], config["attention"]] = (run["evals"][-1]["val_loss"], run["median_step_time_s"])
  tables = []
  for other in ("xla", "xla-f32"):
    seeds = sorted({seed for seed, _ in final if (seed, "flash") in final and (seed, other) in final})
    if not seeds:
      continue
    name = ATTENTION_NAMES[other]
    lines = [f"| seed | val loss flash | val loss {name} | flash - {name} | ms/step flash / {name} |",
             "|---|---|---|---|---|"]
    diffs = []
    for seed in seeds:
      (flash, t_flash), (base, t_base) = final[seed, "flash"], final[seed, other]
      diffs.append(flash - base)
      lines.append(f"| {seed} | {flash:.4f} | {base:.4f} | {flash - base:+.4f} | "
                   f"{t_flash * 1e3:.1f} / {t_base * 1e3:.1f} |")
    if len(diffs) > 1:
      spread = {a: np.std([final[s, a][0] for s in seeds], ddof=1) for a in ("flash", other)}
      mean, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1))
      lines.append("")
      lines.append(
          f"flash - {name} over {len(diffs)} seeds: mean {mean:+.4f}, standard deviation {sd:.4f} "
          f"(standard error {sd / np.sqrt(len(diffs)):.4f}); spread across seeds: flash "
          f"{spread['flash']:.4f}, {name} {spread[other]:.4f}"
      )
    tables.append("\n".join(lines))
  return "\n\n".join(tables)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--attention", choices=("flash", "xla", "xla-f32"), default="flash",
                 help="xla-f32: Flax's attention computed in float32 (a control for bf16 rounding)")
  p.add_argument("--flash-causal", choices=("flag", "mask"), default="flag",
                 help="flash only: causal=True without a mask (default) or Flax's causal mask array")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                 help="compute dtype (params stay float32); auto: bf16 on a GPU, f32 elsewhere")
  p.add_argument("--interpret", action="store_true", help="flash: Pallas interpret mode (CPU; slow)")
  p.add_argument("--eval-every", type=int, default=0, help="validation every N steps (0: only at the end)")
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--log-every", type=int, default=0, help="print every N steps (0: about 10 lines)")
  p.add_argument("--out", help="directory for the run's JSON")
  p.add_argument("--plot", action="store_true", help="with --out: plot every JSON in it to OUT/loss.png")
  args = p.parse_args(argv)
  if args.dtype == "auto":
    args.dtype = "bf16" if jax.default_backend() == "gpu" else "f32"
  if args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
  head_dim = args.d_model // args.heads
  if args.attention == "flash" and (head_dim % 8 or not 8 <= head_dim <= 256):
    p.error(f"head_dim = d_model / heads = {head_dim}; jax_flash2 needs a multiple of 8 in [8, 256]")
  if args.plot and not args.out:
    p.error("--plot needs --out")
  if args.steps < 1:
    p.error("--steps must be >= 1")
  return args


def parse_plot_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="train_gpt.py plot", description="Plot the loss curves of several runs.")
  p.add_argument("runs", nargs="+", help="JSON files written with --out")
  p.add_argument("--out", default="loss.png", help="PNG to write")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["plot"]:
    args = parse_plot_args(argv[1:])
    plot_runs(args.runs, args.out)
    print(summarise_runs(args.runs))
    print(f"wrote {args.out}")
    return None
  return train(parse_args(argv))


if __name__ == "__main__":
  main()
