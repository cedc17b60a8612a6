"""Arrows point down: the library imports neither experiments, benchmarks nor configs, and no two of its modules
import each other (directly or through a longer cycle); the model and the drafters reach platform kernels only
through specjax.ops; the decode loop is the library's top floor; configs are data.

The library's floors, each importing from its own floor and those below only: config, sampling, tokenizer,
compilation, control, stats, ops (and backends/), verify, leviathan; model; loading, sharding and the drafter
interface (drafters/__init__.py); decoding, distributed, adaptive, calibration, train, export, roofline, data/ (ShareGPT,
sequences, feature caches) and the drafters (drafters/*.py, train_drafter); speculative (the loop); generate (its
public entry). Nothing in the library imports the top floor but the package's __init__ (the public API): what needs
the loop to run (regenerated training data, the layer-skip search, benchmarks) is in experiments/ or benchmarks/.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = ("experiments", "benchmarks", "configs")
BACKENDS = "specjax.backends"
TOP_FLOOR = ("specjax.generate", "specjax.speculative")


def imports(path: pathlib.Path) -> set[str]:
  """Every module an import statement in the file names (also in functions): `from a import b` names a and a.b."""
  targets = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return targets


def library_imports(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """Module -> the library modules and outside packages it imports (any import statement, also in functions).
  Package __init__ files are left out: a package importing its own submodules is how packages work."""
  modules = {}
  for path in sorted((root / "specjax").rglob("*.py")):
    modules[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
  graph = {}
  for module, path in modules.items():
    if path.name == "__init__.py":
      continue
    graph[module] = {t for t in imports(path) if t != module and (
        (t in modules and modules[t].name != "__init__.py") or t.split(".")[0] in OUTSIDE)}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  state: dict[str, int] = {}
  found = []

  def visit(node, stack):
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        found.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  return found


def test_library_never_imports_experiments_benchmarks_or_configs():
  offenders = {m: sorted(t for t in ts if t.split(".")[0] in OUTSIDE) for m, ts in library_imports().items()}
  assert not {m: ts for m, ts in offenders.items() if ts}


def test_no_two_library_modules_import_each_other():
  assert not cycles(library_imports())


def backend_imports(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
  """The model's and the drafters' imports of specjax.backends (they call specjax.ops, which chooses a kernel by
  the platform a program is compiled for)."""
  paths = [root / "specjax" / "model.py", *sorted((root / "specjax" / "drafters").glob("*.py"))]
  found = {str(p.relative_to(root)): sorted(t for t in imports(p) if t == BACKENDS or t.startswith(BACKENDS + "."))
           for p in paths if p.exists()}
  return {p: ts for p, ts in found.items() if ts}


def test_the_model_and_the_drafters_reach_the_kernels_only_through_ops():
  assert (ROOT / "specjax" / "model.py").exists()
  assert not backend_imports()


def top_floor_importers(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
  """Library files that import the decode loop (`TOP_FLOOR`), other than the package's __init__ and the loop's own
  modules (generate is speculative's public entry)."""
  found = {}
  for path in sorted((root / "specjax").rglob("*.py")):
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    if module in TOP_FLOOR or path.relative_to(root) == pathlib.Path("specjax", "__init__.py"):
      continue
    above = sorted(t for t in imports(path) if t in TOP_FLOOR)
    if above:
      found[str(path.relative_to(root))] = above
  return found


def test_the_decode_loop_is_the_library_top_floor():
  assert (ROOT / "specjax" / "generate.py").exists() and (ROOT / "specjax" / "speculative.py").exists()
  assert not top_floor_importers()


# Configs are data: each imports ml_collections and configs/common.py (the shared fields, the method list) only, and
# opens no file.
CONFIG_IMPORTS = ("__future__", "ml_collections", "configs", "configs.common")


def config_violations(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
  """{config file: what it imports beyond `CONFIG_IMPORTS`, and the files it opens}."""
  found = {}
  for path in sorted((root / "configs").glob("*.py")):
    tree = ast.parse(path.read_text())
    bad = sorted(t for t in imports(path)
                 if t not in CONFIG_IMPORTS and not t.startswith(("ml_collections.", "__future__.")))
    bad += ["open()" for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("open", "__import__")]
    if bad:
      found[str(path.relative_to(root))] = bad
  return found


def test_configs_are_data():
  assert (ROOT / "configs" / "common.py").exists()
  assert not config_violations()


def test_the_checks_see_a_cycle_an_upward_import_a_loop_import_and_a_config_doing_io(tmp_path):
  package = tmp_path / "specjax"
  package.mkdir()
  (package / "__init__.py").write_text("from specjax import a, generate\n")
  (package / "a.py").write_text("from specjax import b\n")
  (package / "b.py").write_text("def f():\n  import specjax.a\n  from experiments import run\n")
  (package / "c.py").write_text("from configs import common\n")
  (package / "model.py").write_text("def f():\n  from specjax import backends\n")
  (package / "generate.py").write_text("from specjax import speculative\n")
  (package / "speculative.py").write_text("")
  (package / "data").mkdir()
  (package / "data" / "features.py").write_text("def f():\n  from specjax.generate import generate\n")
  configs = tmp_path / "configs"
  configs.mkdir()
  (configs / "common.py").write_text("import ml_collections\n")
  (configs / "run.py").write_text("from configs import common\nimport ml_collections.config_dict\n")
  (configs / "io.py").write_text("import os\nfrom configs import common, run\nfrom specjax import loading\n")
  (configs / "reads.py").write_text("def get_config():\n  return open('skip.json').read()\n")
  graph = library_imports(tmp_path)
  assert cycles(graph) == [["specjax.a", "specjax.b", "specjax.a"]]
  assert "experiments" in graph["specjax.b"] and "configs" in graph["specjax.c"]
  assert backend_imports(tmp_path) == {"specjax/model.py": ["specjax.backends"]}
  assert top_floor_importers(tmp_path) == {"specjax/data/features.py": ["specjax.generate"]}
  assert config_violations(tmp_path) == {"configs/io.py": ["configs.run", "os", "specjax", "specjax.loading"],
                                         "configs/reads.py": ["open()"]}


# ------------------------------------------------------------------------------------------- the fast tier

COVERED = ("specjax", "experiments")  # every module of these must be imported by the fast tier


def _marks_slow(decorators) -> bool:
  return any("mark.slow" in ast.unparse(d) for d in decorators)


def _imports(tree: ast.AST) -> set[str]:
  """Modules an AST imports (any import statement, and `importlib.import_module("<module>")`), and the modules of
  the drafters it builds by name (`make_drafter("<name>", ...)`: a drafter named x is specjax/drafters/x.py)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
      if function == "import_module":
        names.add(str(node.args[0].value))
      elif function == "make_drafter":
        names.add(f"specjax.drafters.{node.args[0].value}")
  return names


def fast_tier_imports(root: pathlib.Path = ROOT) -> set[str]:
  """The modules of the repository that the fast tier (`pytest -m "not slow"`) imports: those a test file imports
  outside its slow tests (a file marked slow as a whole, `pytestmark`, counts for nothing; a test or fixture marked
  slow neither), and then every module those import, on and on."""
  modules = {}
  for path in root.rglob("*.py"):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] in COVERED + ("configs", "tests", "benchmarks"):
      modules[".".join(parts).removesuffix(".__init__")] = path
  seen = set()
  for path in sorted((root / "tests").glob("test_*.py")):
    tree = ast.parse(path.read_text())
    if any(isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node.targets[0]) and "mark.slow" in
           ast.unparse(node.value) for node in tree.body):
      continue
    for node in tree.body:
      if not (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _marks_slow(node.decorator_list)):
        seen |= _imports(node)
  pending = [m for m in seen if m in modules]
  reached = set()
  while pending:
    module = pending.pop()
    if module not in reached:
      reached.add(module)
      pending += [m for m in _imports(ast.parse(modules[module].read_text())) if m in modules]
  return reached


def test_the_fast_tier_imports_every_module_of_the_library_and_the_experiments():
  expected = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
              for package in COVERED for path in (ROOT / package).rglob("*.py")}
  assert not sorted(expected - fast_tier_imports())


def test_the_fast_tier_check_leaves_out_slow_tests(tmp_path):
  (tmp_path / "tests").mkdir()
  (tmp_path / "specjax").mkdir()
  for name in ("a", "b", "c", "d"):
    (tmp_path / "specjax" / f"{name}.py").write_text("")
  (tmp_path / "specjax" / "a.py").write_text("def f():\n  from specjax import b\n")
  (tmp_path / "tests" / "test_one.py").write_text(
      "import pytest\nfrom specjax import a\n\n@pytest.mark.slow\ndef test_c():\n  import specjax.c\n")
  (tmp_path / "tests" / "test_two.py").write_text("import pytest\nimport specjax.d\npytestmark = pytest.mark.slow\n")
  assert fast_tier_imports(tmp_path) == {"specjax.a", "specjax.b"}


def import_time_flags(path: pathlib.Path) -> list[str]:
  """The flags a module defines when it is imported: `flags.DEFINE_*("name", ...)` calls in its top-level statements
  and in the functions those call at import time (`cli.define_*`); a command's `main` defining its own flags when it
  runs is not an import."""
  tree = ast.parse(path.read_text())
  names = []
  for statement in tree.body:
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
      continue
    for node in ast.walk(statement):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("DEFINE_")
          and node.args and isinstance(node.args[0], ast.Constant)):
        names.append(node.args[0].value)
  return names


def test_the_experiment_commands_define_their_flags_once_in_one_process():
  """The commands' modules import side by side (the test suite does, in one process), and absl refuses a flag
  defined twice: a flag two of them share (--config, --workdir) is defined once, by `experiments.cli`, and no other
  flag name is defined by two modules."""
  defined: dict[str, list[str]] = {}
  for path in sorted([*(ROOT / "experiments").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
    # experiments.cli defines the shared flags in functions the commands call (once per process, guarded).
    names = re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", path.read_text()) if path.stem == "cli" else \
        import_time_flags(path)
    for name in names:
      defined.setdefault(name, []).append(path.stem)
  shared = {"config", "workdir"}
  # Benchmarks are scripts run one per process and may share names among themselves, not with the experiments
  # (tests import both; benchmarks/bench_costs.py imports experiments.run).
  experiments = {path.stem for path in (ROOT / "experiments").glob("*.py")}
  twice = {name: modules for name, modules in defined.items()
           if len(set(modules) & experiments) and len(modules) > 1 or (name in shared and modules != ["cli"])}
  assert twice == {} and shared <= set(defined)
  for module in ("run", "compile_for", "train", "prepare_data"):
    importlib.import_module(f"experiments.{module}")
