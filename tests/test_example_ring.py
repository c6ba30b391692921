"""examples/train_gpt_ring.py on CPU: the example GPT's sequence split over
conftest's 8 host devices (ring attention, zigzag, steps on XLA) trains
with the unsharded run's losses."""

from __future__ import annotations

import importlib
import pathlib

import jax
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_ring_training_matches_unsharded():
  """Three steps (the first at learning rate 0, so the third's loss is after
  a real update) of a 1-layer GPT over 32 tokens, 4 a device: every step's
  loss and gradients equal the unsharded run's to float32 rounding."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (conftest's host devices on CPU)")
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(EXAMPLES))
    train_gpt_ring = importlib.import_module("train_gpt_ring")
  record = train_gpt_ring.main(["--devices", "8", "--backend", "xla", "--steps", "3", "--batch", "2",
                                "--seq-len", "32", "--d-model", "32", "--heads", "2", "--layers", "1"])
  assert record["num_devices"] == 8 and len(record["losses_ring"]) == 3
  assert record["losses_ring"] == pytest.approx(record["losses_unsharded"], rel=1e-5)
  assert record["max_rel_grad_diff"] < 1e-5  # every step's gradients, before Adam rescales them
