"""The shape of the code: no import circles, no oversized files, and the layers of the commands.

The import graph is read from the source (every ``import`` statement, also those inside
functions, resolved to the project's own modules in ``fedpriv/``, ``clients/``,
``strategies/`` and ``fedpriv_flwr/``), as ``../shared/tools/import_cycles.py`` reads it, so
this test needs nothing beside the repository. ``CHECKED`` names the modules held to the rules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedpriv", "clients", "strategies", "fedpriv_flwr")
MAX_LINES = 500

CHECKED: tuple[str, ...] | None = None
"""The modules (a name covers its sub-modules) that must be in no import circle and no longer
than MAX_LINES lines. ``None`` holds every module of PACKAGES to both rules."""


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name an import statement of the module mentions (``from a import b``: ``a``
    and ``a.b``, since ``b`` may be a module), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the project modules it imports. Importing a package one is inside (its own
    ``__init__``) is no edge: Python has loaded it before the module anyway."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imported in _imported_names(name, path):
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = frozenset(targets)
    return graph


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _checked(name: str) -> bool:
    return CHECKED is None or any(name == c or name.startswith(c + ".") for c in CHECKED)


def _imports(name: str) -> set[str]:
    """Every dotted name the module's import statements mention, outside modules included."""
    return _imported_names(name, modules()[name])


def _mentions(names: set[str], module: str) -> bool:
    return any(n == module or n.startswith(module + ".") for n in names)


# -- the checker itself -------------------------------------------------------------------------
def test_the_circle_finder_finds_circles_and_only_circles():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}),
             "d": frozenset({"a", "e"}), "e": frozenset({"d"}), "f": frozenset()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_the_graph_resolves_from_imports_and_relative_imports(tmp_path):
    pkg = tmp_path / "fedpriv"
    (pkg / "deploy").mkdir(parents=True)
    (pkg / "deploy" / "__init__.py").write_text("from .cli import add_parser\n")
    (pkg / "deploy" / "cli.py").write_text("def f():\n    from ..config_files import x\n")
    (pkg / "deploy" / "commands.py").write_text("from fedpriv.deploy import cli\n")
    names = _imported_names("fedpriv.deploy.cli", pkg / "deploy" / "cli.py")
    assert "fedpriv.config_files" in names  # an import inside a function counts
    names = _imported_names("fedpriv.deploy", pkg / "deploy" / "__init__.py")
    assert "fedpriv.deploy.cli" in names
    names = _imported_names("fedpriv.deploy.commands", pkg / "deploy" / "commands.py")
    assert {"fedpriv.deploy", "fedpriv.deploy.cli"} <= names


# -- the rules ----------------------------------------------------------------------------------
def test_no_import_circle():
    graph = import_graph()
    assert CHECKED is None or all(any(m == c or m.startswith(c + ".") for m in graph)
                                  for c in CHECKED), "a CHECKED module does not exist"
    bad = [c for c in circles(graph) if any(_checked(m) for m in c)]
    assert not bad, "import circles: " + "; ".join(" <-> ".join(c) for c in bad)


def test_no_file_over_the_line_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    big = {name: n for name, n in sizes.items() if n > MAX_LINES and _checked(name)}
    assert not big, f"over {MAX_LINES} lines: {big}"


def test_nothing_below_the_command_line_imports_it():
    importers = [m for m in modules() if m != "fedpriv.cli" and _mentions(_imports(m),
                                                                            "fedpriv.cli")]
    assert importers == []


@pytest.mark.parametrize("name", [m for m in sorted(modules()) if m.startswith("fedpriv.deploy")]
                         + ["fedpriv.launcher", "fedpriv.config_files"])
def test_commands_and_launchers_stay_below_the_command_line(name):
    names = _imports(name)
    assert not _mentions(names, "fedpriv.cli") and not _mentions(names, "fedpriv.sweep")
    if name.startswith("fedpriv.deploy") or name == "fedpriv.config_files":
        assert not _mentions(names, "flwr")  # builds commands and files; runs flwr as processes
        assert not _mentions(names, "fedpriv.launcher")
    if name == "fedpriv.config_files":  # below every command: of fedpriv, only the keys
        assert {n for n in names if _mentions({n}, "fedpriv")} <= {
            "fedpriv.config", "fedpriv.config.ConfigError", "fedpriv.config.default_mapping",
            "fedpriv.config.PLUGIN_CONFIG", "fedpriv.configure", "fedpriv.configure.select_keys"}


def test_the_core_imports_no_flower_package():
    """fedpriv is the Flower-free core: no module of it imports flwr, or Flower's other
    packages (flwr_datasets: the partitions are recomputed in NumPy)."""
    flower = {name: sorted(n for n in _imports(name) if n.split(".")[0].startswith("flwr"))
              for name in modules() if name == "fedpriv" or name.startswith("fedpriv.")}
    assert not {k: v for k, v in flower.items() if v}


def test_the_deploy_package_loads_no_flower():
    """Also transitively: importing the ``fedpriv deploy`` commands loads no flwr module."""
    code = ("import sys, fedpriv.deploy.cli; "
            "flwr = sorted(m for m in sys.modules if m.split('.')[0] == 'flwr'); "
            "sys.exit(f'flwr loaded: {flwr}' if flwr else None)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_flower_app_package_builds_on_the_privacy_layer_only():
    """fedpriv_flwr (for any Flower app) uses fedpriv's accounting, mechanisms, seeded noise and
    checkpoint file format, never fedpriv's own runtime (its server, nodes, engines, apps)."""
    allowed = {"fedpriv.privacy", "fedpriv.randomness", "fedpriv.checkpoint", "fedpriv.config",
               "fedpriv.params",
               # the head-fitting rule of the deep algorithms (plain torch, imports nothing of
               # fedpriv): a Flower node's head is fitted as fedpriv fits each user's
               "fedpriv.algorithms.deep.head_fit"}
    for name in import_graph():
        if name.startswith("fedpriv_flwr"):
            used = sorted(m for m in _reached(name) if m.startswith("fedpriv.")
                          and not any(m == a or m.startswith(a + ".") for a in allowed))
            assert not used, f"{name} reaches {used}"


KEYS_LAYER = ("fedpriv.params", "fedpriv.config", "fedpriv.algorithms.shared_params",
              *(f"fedpriv.algorithms.{family}.params"
                for family in ("personalization", "meta", "exp_mech", "deep")))
"""The keys layer: the key declarations and the typed config classes (core and families)."""

BELOW_THE_RUNTIME = ("fedpriv.algorithms", "fedpriv.data", "fedpriv.privacy", "fedpriv.randomness",
                     "fedpriv.params", "fedpriv.config")
"""What algorithms are made of; every other module of PACKAGES is the runtime (the registry and
parsing, the server, the nodes, the engines, the commands, the Flower apps)."""


def _reached(name: str) -> set[str]:
    """The project modules ``name`` imports, directly or through others."""
    graph, seen, todo = import_graph(), set(), [name]
    while todo:
        for child in graph[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _runtime(name: str) -> bool:
    return name != "fedpriv" and not any(name == b or name.startswith(b + ".")
                                         for b in BELOW_THE_RUNTIME)


def test_the_keys_layer_imports_nothing_above_it():
    """The core config imports only the key declarations; a family's keys import only other
    keys and the data layer (the choices a key allows: datasets, partitions, task losses) with
    its seeded randomness: never an algorithm, the registry, the evaluation, the faults or any
    other part of the runtime."""
    assert all(k in modules() for k in KEYS_LAYER)
    assert _reached("fedpriv.params") == set()
    assert _reached("fedpriv.config") == {"fedpriv.params"}
    for name in KEYS_LAYER:
        above = sorted(m for m in _reached(name) if m not in KEYS_LAYER and m != "fedpriv.data"
                       and not m.startswith("fedpriv.data.") and m != "fedpriv.randomness")
        assert not above, f"{name} imports {above}"


def test_no_algorithm_module_imports_the_runtime():
    """Algorithms are listed by the catalogue and receive their typed config: no module of
    fedpriv/algorithms/ imports the registry, parsing, the server, the nodes or any other part
    of the runtime, directly or through another module."""
    for name in import_graph():
        if name.startswith("fedpriv.algorithms"):
            runtime = sorted(m for m in _reached(name) if _runtime(m))
            assert not runtime, f"{name} reaches {runtime}"


def test_config_classes_have_no_getattr_and_no_config_is_untyped():
    """Every key is a declared field a type checker follows: no config class answers unknown
    attributes (``__getattr__``), and no function takes ``config: Any``."""
    import fedpriv.algorithms.catalogue  # noqa: F401  (every built-in config class)
    from fedpriv.config import RunConfig

    classes, todo = [], [RunConfig]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    assert len(classes) > 20
    for cls in classes:
        for hook in ("__getattr__", "__getattribute__"):
            assert hook not in cls.__dict__, f"{cls.__qualname__} defines {hook}"
    untyped = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                untyped += [f"{name}.{node.name}({a.arg})" for a in args
                            if "config" in a.arg and (a.annotation is None or
                                                      ast.unparse(a.annotation) == "Any")]
    assert not untyped, untyped


def test_family_file_names_say_math_or_algorithm():
    """In a family package, batched math lives in ``*_math.py``; those never define a
    registered algorithm (an ``Algorithm`` subclass with a name)."""
    for family in ("personalization", "meta", "exp_mech"):
        folder = ROOT / "fedpriv" / "algorithms" / family
        assert (folder / "params.py").is_file(), f"{family}: its keys belong in params.py"
        math_files = sorted(folder.glob("*_math.py"))
        assert math_files, family
        for path in math_files:
            tree = ast.parse(path.read_text())
            classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
                       and any(getattr(b, "id", "").endswith("Algorithm") or
                               getattr(b, "attr", "").endswith("Algorithm") for b in n.bases)]
            assert not classes, f"{path.name} defines algorithm classes {classes}"
