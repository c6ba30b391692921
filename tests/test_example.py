"""examples/train_gpt.py on CPU: a few steps per attention choice (flash in
Pallas interpret mode), its JSON record and the plot subcommand."""

from __future__ import annotations

import importlib
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TINY = ["--steps", "3", "--batch", "2", "--seq-len", "32", "--d-model", "32", "--heads", "2", "--layers", "1",
        "--dtype", "f32", "--eval-batches", "1", "--interpret"]


@pytest.fixture(scope="module")
def train_gpt():
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(EXAMPLES))
    yield importlib.import_module("train_gpt")


@pytest.fixture(scope="module")
def runs(train_gpt, tmp_path_factory):
  """{attention: (returned record, path of the JSON written)} for both choices."""
  out = tmp_path_factory.mktemp("runs")
  result = {}
  for attention in ("flash", "xla"):
    record = train_gpt.main(["--attention", attention, "--out", str(out), *TINY])
    name = f"gpt_{attention}{'-interpret' if attention == 'flash' else ''}_f32_seed0.json"
    result[attention] = (record, out / name)
  return result


@pytest.mark.parametrize("attention", ["flash", "xla"])
def test_json_record(runs, attention):
  record, path = runs[attention]
  saved = json.loads(path.read_text())
  assert saved == json.loads(json.dumps(record))
  assert saved["config"]["attention"] == attention and saved["config"]["steps"] == 3
  assert len(saved["losses"]) == len(saved["step_times_s"]) == 3
  assert all(math.isfinite(x) for x in saved["losses"])
  assert math.isfinite(saved["final_val_loss"])
  assert saved["timing_skipped_steps"] == 2 and saved["median_step_time_s"] == saved["step_times_s"][2]
  assert saved["device"]["platform"] == "cpu"
  assert ("interpret" in saved["attention_impl"]) == (attention == "flash")


def test_same_seed_same_losses_for_both_attentions(runs):
  """Same init and batches: the flash kernels (interpret) and Flax's attention
  give the same loss curve to float32 rounding."""
  flash, xla = runs["flash"][0]["losses"], runs["xla"][0]["losses"]
  assert flash == pytest.approx(xla, rel=1e-4)


def test_plot_subcommand(train_gpt, runs, tmp_path):
  png = tmp_path / "loss.png"
  train_gpt.main(["plot", str(runs["flash"][1]), str(runs["xla"][1]), "--out", str(png)])
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_seeds(train_gpt, tmp_path):
  """The flash-vs-XLA table: per-seed final validation losses, their
  differences' mean and spread, from hand-made records."""
  paths = []
  for seed, (flash, xla) in enumerate([(1.0, 1.5), (2.0, 1.5), (1.25, 1.0)]):
    for attention, loss in (("flash", flash), ("xla", xla)):
      path = tmp_path / f"{attention}{seed}.json"
      record = dict(config=dict(seed=seed, attention=attention), evals=[dict(step=9, val_loss=loss)],
                    median_step_time_s=0.002 if attention == "flash" else 0.003)
      path.write_text(json.dumps(record))
      paths.append(str(path))
  # A float32-attention control for two of the seeds gets its own table.
  for seed, loss in ((0, 0.75), (1, 2.5)):
    path = tmp_path / f"xla-f32{seed}.json"
    record = dict(config=dict(seed=seed, attention="xla-f32"), evals=[dict(step=9, val_loss=loss)],
                  median_step_time_s=0.004)
    path.write_text(json.dumps(record))
    paths.append(str(path))
  table = train_gpt.summarise_runs(paths)
  assert "| 1 | 2.0000 | 1.5000 | +0.5000 | 2.0 / 3.0 |" in table
  # Differences -0.5, +0.5, +0.25: mean 0.0833, sample standard deviation 0.5204.
  assert "flash - XLA over 3 seeds: mean +0.0833, standard deviation 0.5204" in table
  assert "| 1 | 2.0000 | 2.5000 | -0.5000 | 2.0 / 4.0 |" in table
  # Differences +0.25, -0.5: mean -0.125, sample standard deviation 0.5303.
  assert "flash - XLA f32 over 2 seeds: mean -0.1250, standard deviation 0.5303" in table


def test_float32_control_attention(train_gpt):
  """The xla-f32 control: Flax's attention in float32, returned in the input
  dtype, against the float64 reference."""
  from jax_flash2 import reference
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (2, 16, 2, 8), jnp.bfloat16) for key in keys)
  mask = jnp.tril(jnp.ones((16, 16), bool))[None, None]
  out = train_gpt.float32_dot_product_attention(q, k, v, mask=mask, deterministic=True)
  assert out.dtype == jnp.bfloat16
  expected, _ = reference.attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-2)


def test_corpus_is_deterministic():
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(EXAMPLES))
    char_corpus = importlib.import_module("char_corpus")
  text = char_corpus.generate(20_000, seed=0)
  assert len(text) == 20_000 and text == char_corpus.generate(20_000, seed=0)
  assert text != char_corpus.generate(20_000, seed=1)
