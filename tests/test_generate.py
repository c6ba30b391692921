"""examples/generate.py on CPU: greedy tokens from the KV cache (the Triton
kernels in Pallas interpret mode, contiguous and paged) equal those of full
recomputation with XLA attention, on a tiny model."""

from __future__ import annotations

import importlib
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TINY = ["--batch", "3", "--prompt-len", "12", "--steps", "6", "--d-model", "32", "--heads", "2", "--layers", "2",
        "--interpret"]


@pytest.fixture(scope="module")
def generate():
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(EXAMPLES))
    yield importlib.import_module("generate")


@pytest.mark.parametrize("paged", [[], ["--paged", "16"]], ids=["contiguous", "paged"])
def test_tokens_equal_full_recomputation(generate, paged, capsys):
  result = generate.main([*TINY, *paged])
  assert result["tokens"].shape == (3, 6)
  np.testing.assert_array_equal(result["tokens"], result["expected"])
  out = capsys.readouterr().out
  assert "tokens identical to full recomputation (float32)" in out
  assert ("paged, 16 tokens a page" in out) == bool(paged)
  assert "3 prompts of [12, " in out  # ragged: the others are shorter
