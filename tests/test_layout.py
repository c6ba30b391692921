"""The package's structure: imports flow one way (no cycle, counting imports
inside functions and under TYPE_CHECKING), no module takes another's private
names, and no module keeps mutable state of its own (no `global`)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_flash2"


def _modules() -> dict[str, ast.Module]:
  modules = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules[name] = ast.parse(path.read_text(), filename=str(path))
  return modules


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
  """(module imported, names taken from it) for every import in the module,
  wherever it stands; relative to the package only."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(alias.name, []) for alias in node.names if alias.name.startswith("jax_flash2")]
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_flash2"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        if sub in known:  # `from jax_flash2.mosaic import common`: the module itself
          found.append((sub, []))
        else:
          found.append((node.module, [alias.name]))
  return found


def _edges() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  edges = {name: set() for name in modules}
  for name, tree in modules.items():
    for target, _ in _imports(name, tree, known):
      if target in known and target != name and not name.startswith(target + "."):
        # A package's __init__ importing its own submodules is not a cycle of theirs.
        if not (name in ("jax_flash2", "jax_flash2.mosaic", "jax_flash2.triton", "jax_flash2.bench")
                and target.startswith(name + ".")):
          edges[name].add(target)
  return edges


def test_no_import_cycle():
  edges = _edges()
  edges = {name: {t for t in targets if t != "jax_flash2"} for name, targets in edges.items()}
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for target in sorted(edges.get(node, ())):
      if state.get(target) == 1:
        cycle = stack[stack.index(target):] + [target]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if target not in state:
        visit(target)
    stack.pop()
    state[node] = 2

  for node in sorted(edges):
    if node not in state:
      visit(node)


def test_layers_import_downwards():
  """api above backends above the kernel families above their common code;
  the API, vjp and sharding layers name no kernel family."""
  edges = _edges()
  kernels = ("jax_flash2.triton", "jax_flash2.mosaic")
  for layer in ("jax_flash2.api", "jax_flash2.vjp", "jax_flash2.sharding"):
    assert not [t for t in edges[layer] if t.startswith(kernels)], layer
  for module, targets in edges.items():
    if module.startswith(kernels):
      assert not {"jax_flash2.api", "jax_flash2.backends", "jax_flash2.vjp", "jax_flash2.sharding"} & targets, module
  mosaic = [m for m in edges if m.startswith("jax_flash2.mosaic.") and m != "jax_flash2.mosaic.common"]
  for module in mosaic:
    siblings = {t for t in edges[module] if t.startswith("jax_flash2.mosaic.") and t != "jax_flash2.mosaic.common"}
    assert not siblings, (module, siblings)


def test_no_private_names_across_modules():
  modules = _modules()
  known = set(modules)
  for name, tree in modules.items():
    for target, names in _imports(name, tree, known):
      private = [n for n in names if n.startswith("_") and not n.startswith("__")]
      assert not private, f"{name} imports {private} from {target}"


def test_no_global_statements():
  for name, tree in _modules().items():
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], name
