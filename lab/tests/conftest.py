"""Helpers of the lab tools' tests (lab/tests; not part of the product suite).

Run from the repository root: `python -m pytest lab/tests`. The product's
`python -m pytest` collects tests/ only (pyproject's testpaths).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture
def load_tool(monkeypatch):
  """load_tool(name): lab/tools/NAME.py as a fresh module, with lab/tools on
  sys.path for this test, where the tools import one another."""
  monkeypatch.syspath_prepend(str(TOOLS))

  def load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool

  return load
