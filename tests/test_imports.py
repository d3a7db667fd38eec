"""The library's modules import one another without a cycle.

A module's imports that run when it is imported (module level, class bodies,
``if``/``try`` blocks; not function bodies, not ``if TYPE_CHECKING``) make the
edges; a second check adds the imports inside functions, which defer a cycle
rather than break it. ``from lowmem_jax.pkg import x`` is an edge to the module
``lowmem_jax.pkg.x`` where there is one, else to ``lowmem_jax.pkg`` (its
``__init__``). A submodule's implicit import of its parent packages is no edge:
the parent is already being imported, and only a name the submodule takes
from the parent's ``__init__`` (an edge of its own) can find it half done.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowmem_jax"
# Every package of the repository: the library, the console script's and the kernels'.
PACKAGES = (PACKAGE, ROOT / "lowmem_jax_cli", ROOT / "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(nodes):
  """The import statements among ``nodes`` and their children that run when the
  module is imported."""
  for node in nodes:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
      yield from _import_time_imports(node.orelse)
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      yield from _import_time_imports(ast.iter_child_nodes(node))


def _edges(name: str, path: pathlib.Path, modules: dict, deferred: bool) -> set[str]:
  """The library modules that importing module ``name`` (at ``path``) imports, and
  with ``deferred`` those its functions import too."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  tree = ast.parse(path.read_text(), str(path))
  nodes = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if deferred
           else _import_time_imports(tree.body))
  out = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    else:
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    for target in targets:
      while target and target not in modules:  # import a.b.c: the deepest library module named
        target = target.rpartition(".")[0]
      if target:
        out.add(target)
  return out


def _graph(deferred: bool = False) -> dict[str, set[str]]:
  modules = _modules()
  return {name: _edges(name, path, modules, deferred) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (its modules, the first repeated at the end) in each strongly connected
  component of ``graph`` that has one (Tarjan's algorithm)."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1 or v in graph[v]:
        components.append(set(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """A path from the first module of ``component`` back to itself, inside it."""
  start = min(component)
  paths, seen = [[start]], set()
  while paths:
    path = paths.pop(0)
    for w in sorted(graph[path[-1]] & component):
      if w == start:
        return path + [start]
      if w not in seen:
        seen.add(w)
        paths.append(path + [w])
  raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_graph_sees_the_imports():
  graph = _graph()
  assert "lowmem_jax.transform" in graph["lowmem_jax"] and "lowmem_jax.compile.memory" in graph["lowmem_jax.compile.planner"]
  assert graph["lowmem_jax.compile.memory"] >= {"lowmem_jax.compile.memory.analysis", "lowmem_jax.compile.memory.breakdown"}
  assert graph["lowmem_jax.compile.memory.breakdown"] >= {
      "lowmem_jax.compile.memory._xla_dump", "lowmem_jax.compile.memory.analysis", "lowmem_jax._plots", "lowmem_jax.names"}
  assert graph["lowmem_jax._plots"] == set()


def test_cycles_are_found_and_named():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
  assert sorted(_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]


def test_no_import_cycles():
  cycles = _cycles(_graph())
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_cycles_hidden_in_functions():
  """An import inside a function breaks no cycle, it defers it: memory's plots once
  imported _plots inside methods, and _plots imported memory; the app's CLI once imported
  the console script's filter of CUDA's notes, whose main imports the CLI."""
  cycles = _cycles(_graph(deferred=True))
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_import_in_a_fresh_interpreter():
  result = subprocess.run(
      [sys.executable, "-c", "import lowmem_jax; print(lowmem_jax.__file__)"],
      cwd=ROOT, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == str(PACKAGE / "__init__.py")


def test_the_library_does_not_load_the_app_rich_or_flax():
  """``import lowmem_jax`` loads the library's functions: not the ``lowmem-jax``
  application, rich (its tables load with the first one printed), Flax's module
  systems or the Pallas kernels (each loads with its first use)."""
  loaded = subprocess.run(
      [sys.executable, "-c", "import sys, lowmem_jax; print(' '.join(sorted(sys.modules)))"],
      cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  for name in ("lowmem_jax.app", "lowmem_jax.app.cli", "lowmem_jax.app.techniques", "rich",
               "lowmem_jax.models", "flax.linen", "flax.nnx", "pallas_kernels"):
    assert name not in loaded, name


def test_the_library_does_not_import_the_app():
  """The data path runs one way: the application imports the library, never back."""
  graph = _graph(deferred=True)
  for module, imports in graph.items():
    if not module.startswith(("lowmem_jax.app", "lowmem_jax_cli")):  # the console script: above
      assert not {m for m in imports if m.startswith("lowmem_jax.app")}, module


def test_no_old_names():
  """Nothing was released, so no name is kept for one that moved: no import hook, no
  module ``__getattr__`` but the top level's, which imports the submodules."""
  import lowmem_jax as lm
  for old in ("fold", "sparsity", "techniques", "cli", "fold_norm"):
    with pytest.raises(AttributeError, match=f"no attribute {old!r}"):
      getattr(lm, old)
  with pytest.raises(ModuleNotFoundError):
    __import__("lowmem_jax.fold")


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
  """The library modules importing ``start`` imports, directly or not."""
  seen, todo = set(), [start]
  while todo:
    for w in graph[todo.pop()] - seen:
      seen.add(w)
      todo.append(w)
  return seen


# The folders are the layers, lowest first (lowmem_jax/__init__.py's docstring): a module imports
# only from its own layer and the ones below. The top level's own modules (names, the private
# helpers) are the ground; the kernels stand beside the ops' references they import; the
# package's face (lowmem_jax/__init__.py) imports the library; the app and the console script
# stand above all.
LAYERS = ("", "ops", "optim", "compile", "transform", "flax", "models", "face", "app", "console")


def _layer(module: str) -> int:
  if module.startswith("pallas_kernels"):
    return LAYERS.index("ops")
  if module == "lowmem_jax_cli":
    return LAYERS.index("console")
  if module == "lowmem_jax":
    return LAYERS.index("face")
  folder = module.split(".")[1]
  return LAYERS.index(folder if (PACKAGE / folder).is_dir() else "")


def test_every_module_stands_in_a_layer():
  """Each module of the repository's packages is in one of `LAYERS`: a new folder is placed."""
  for module in _graph():
    assert 0 <= _layer(module) < len(LAYERS), module


def test_no_import_runs_up_a_layer():
  """Imports run down the folders only, those inside functions included: the ops read the
  compile target from `dispatch` (which `compile.targets` sets from above), the optimizer
  pieces know no compile target, the library never imports the app."""
  upward = [f"{m} ({LAYERS[_layer(m)] or 'top level'}) -> {w} ({LAYERS[_layer(w)]})"
            for m, imports in _graph(deferred=True).items() for w in imports
            if _layer(w) > _layer(m)]
  assert not upward, "imports running up a layer:\n" + "\n".join(sorted(upward))


def test_the_references_import_no_kernel():
  """The kernels import their pure-JAX references from the library, not the other way."""
  for name in ("_activation_reference", "_norm_reference", "_packing"):
    tree = ast.parse((PACKAGE / "ops" / f"{name}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] == "pallas_kernels"}, (name, imported)


def test_each_kernel_module_imports_first_in_a_fresh_interpreter():
  """A kernel module imported before the library imports the library, which imports it."""
  for module in ("pallas_kernels", "pallas_kernels.activations", "pallas_kernels.norms",
                 "pallas_kernels.pack"):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, (module, result.stderr)


# The modules whose behaviour another test file asserts, by the file that does; every other
# module ``a/b/name.py`` has its own ``tests/test_name.py``.
TESTED_IN = {
    "lowmem_jax": "test_imports.py", "lowmem_jax.ops": "test_imports.py",
    "lowmem_jax.app": "test_techniques.py", "lowmem_jax.ops.attention": "test_attention_ops.py",
    "lowmem_jax.models.vit": "test_models.py", "lowmem_jax._checks": "test_optim.py",
    "lowmem_jax._plots": "test_cli.py", "lowmem_jax._sharding": "test_streamed_mesh.py",
    "lowmem_jax._static": "test_optim.py", "lowmem_jax._text": "test_cli.py",
    "lowmem_jax.app.fits": "test_techniques.py", "lowmem_jax.app.job": "test_techniques.py",
    "lowmem_jax.app.measurement": "test_techniques.py",
    "lowmem_jax.app.step_options": "test_techniques.py", "lowmem_jax.compile": "test_targets.py",
    "lowmem_jax.compile.gpu_speeds": "test_targets.py",
    "lowmem_jax._hlo": "test_step_time.py",
    "lowmem_jax.compile.memory.host_transfers": "test_step_time.py",
    "lowmem_jax.compile.memory._xla_dump": "test_xla_dump.py",
    "lowmem_jax.compile.memory.analysis": "test_memory.py",
    "lowmem_jax.compile.memory.breakdown": "test_memory.py",
    "lowmem_jax.flax": "test_linen.py", "lowmem_jax.models._common": "test_models.py",
    "lowmem_jax.names": "test_policies.py",
    "lowmem_jax.ops._activation_reference": "test_pallas_activations.py",
    "lowmem_jax.ops._layout": "test_layout.py", "lowmem_jax.ops._norm_reference": "test_pallas_norms.py",
    "lowmem_jax.ops._packing": "test_pack.py", "lowmem_jax.optim.accumulation": "test_optim.py",
    "lowmem_jax.ops._lowbit_reference": "test_pallas_adam8bit.py",
    "lowmem_jax.optim.rounding": "test_lowbit.py",
    "lowmem_jax.optim.steps": "test_optim.py",
    "lowmem_jax.optim.streamed_state": "test_streamed.py",
    "lowmem_jax.transform.api": "test_transform.py", "lowmem_jax.transform.rewrites": "test_transform.py",
    "lowmem_jax.transform.attention": "test_transform_attention_patterns.py",
}


def test_every_module_has_its_test_file():
  """``tests/test_<module>.py`` for each library module (the matchers' as
  ``test_transform_<name>_patterns.py``), or the file `TESTED_IN` names, which exists."""
  tests = pathlib.Path(__file__).parent
  missing = []
  for module in _modules():
    if not module.startswith("lowmem_jax.") and module != "lowmem_jax":
      continue
    name = module.rpartition(".")[2].lstrip("_")
    package = module.split(".")[1] if module.count(".") > 1 else ""
    own = [f"test_{name}.py", f"test_{package}_{name}.py", f"test_{package}_{name}_patterns.py"]
    if module.startswith("lowmem_jax.transform.attention."):
      own = [TESTED_IN["lowmem_jax.transform.attention"]]
    found = [f for f in [*own, TESTED_IN.get(module)] if f and (tests / f).exists()]
    if not found:
      missing.append(module)
  assert not missing, "modules with no test file: " + ", ".join(missing)
