"""examples/train_gpt.py on CPU: a few steps per attention choice (flash in
Pallas interpret mode), its JSON record and the plot subcommand."""

from __future__ import annotations

import importlib
import json
import math
import pathlib

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
  table = train_gpt.summarise_runs(paths)
  assert "| 1 | 2.0000 | 1.5000 | +0.5000 | 2.0 / 3.0 |" in table
  # Differences -0.5, +0.5, +0.25: mean 0.0833, sample standard deviation 0.5204.
  assert "over 3 seeds: mean +0.0833, standard deviation 0.5204" in table


def test_corpus_is_deterministic():
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(EXAMPLES))
    char_corpus = importlib.import_module("char_corpus")
  text = char_corpus.generate(20_000, seed=0)
  assert len(text) == 20_000 and text == char_corpus.generate(20_000, seed=0)
  assert text != char_corpus.generate(20_000, seed=1)
