"""Imports follow the data flow, for every part of the package, the root included.

core → stats → store → probes → analyses → importers → dashboard → integrations → checkpoints, report, demo, cli:
each part imports only parts before it, and only those its contract names. Every import in the package
counts, wherever it sits: module level, inside a function (the lazy imports that keep start-up fast), under
``TYPE_CHECKING``, relative imports, and ``importlib.import_module`` / ``__import__`` calls with a literal
name. A part is a top-level subpackage or module of ``dynascope`` (``dynascope.store.reader`` belongs to
``store``; ``dynascope`` itself is ``<root>``, and ``import dynascope`` for ``dynascope.watch`` imports it).
Every part must have a contract, so a new one cannot slip past the check.

The root is special: importing any part runs ``dynascope/__init__.py`` first, so at module level it may
import only ``core``; ``open_store`` and ``watch`` are imported when first used.

``stats`` (the statistics' declarations) sits below the store, which builds its tables from them, and
``dynascope diff`` (importers) computes through it, never through the trainer-side probes. The store, the
declarations and the dashboard's queries load no torch: a kernel imports it when it runs.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dynascope"

# The flow, bottom first: a part may import only parts before it (its contract says which of them).
ORDER = ("core", "stats", "store", "probes", "analyses", "alerts", "<root>", "importers", "dashboard", "integrations", "checkpoints",
         "report", "cli_output", "demo", "cli_fleet", "cli_alerts", "cli")
# part → the parts it may import (every part above the store may use the declarations it is built from)
CONTRACTS: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "stats": frozenset({"core"}),
    "store": frozenset({"core", "stats"}),
    "probes": frozenset({"core", "stats", "store"}),
    "analyses": frozenset({"core", "stats", "store"}),
    # live rules over what the store holds: the analyses' detectors, and the scope they stop
    "alerts": frozenset({"core", "stats", "store", "probes", "analyses"}),
    # the public API: open_store, watch (the probes, with the alerts' monitor), Scope, WatchSettings
    "<root>": frozenset({"core", "stats", "store", "probes", "alerts"}),
    "importers": frozenset({"core", "stats", "store"}),  # dynascope diff: statistics, not the probes
    "dashboard": frozenset({"core", "stats", "store", "analyses"}),
    "integrations": frozenset({"<root>", "core", "stats", "store", "probes"}),
    "checkpoints": frozenset({"core", "stats", "store", "analyses"}),
    "report": frozenset({"core", "stats", "store", "analyses"}),
    "cli_output": frozenset({"core", "stats", "store", "analyses", "importers"}),
    "demo": frozenset({"<root>", "core", "stats", "store", "probes", "analyses", "importers", "integrations", "checkpoints",
                       "report"}),
    "cli_fleet": frozenset({"core", "stats", "store", "analyses", "cli_output"}),  # `dynascope files` and `fleet`
    "cli_alerts": frozenset({"core", "stats", "store", "analyses", "alerts"}),  # `dynascope watch-run`
    "cli": frozenset(ORDER[:-1]),
}
ROOT_AT_IMPORT = frozenset({"core"})  # what dynascope/__init__.py may import at module level


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_package: bool, package: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree`` that names the package."""
    top = package.name
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # ``from dynascope import store`` imports the subpackage; other names come from ``name`` itself
            for a in node.names:
                sub = package.parent.joinpath(*f"{name}.{a.name}".split("."))
                is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                out.append((node.lineno, f"{name}.{a.name}" if is_module else name))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in out if name == top or name.startswith(top + ".")]


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def violations(package: Path, contracts: dict[str, frozenset[str]] = CONTRACTS) -> list[str]:
    """Every import in ``package`` that a contract forbids, as ``file:line: A imports B (rule)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        src = _layer(module)
        if src not in contracts:
            found.append(f"{path.relative_to(package.parent)}: part {src!r} has no contract in CONTRACTS")
            continue
        allowed = contracts[src]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported(tree, module, path.name == "__init__.py", package):
            dst = _layer(name)
            if dst != src and dst not in allowed:
                rule = f"{src} may import only {sorted(allowed)}" if allowed else f"{src} imports nothing of it"
                found.append(f"{path.relative_to(package.parent)}:{line}: {src} imports {name} ({rule})")
    return found


def _eager_imports(tree: ast.Module) -> list[ast.AST]:
    """The import statements a module runs when it is imported: not in functions, not under TYPE_CHECKING."""
    out: list[ast.AST] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if getattr(node.test, "id", None) != "TYPE_CHECKING":
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def test_imports_follow_the_flow():
    found = violations(PACKAGE)
    assert not found, "imports against the flow:\n" + "\n".join(found)


def private_imports(package: Path) -> list[str]:
    """Imports of a private module (``_name``) of another part, as ``file:line: A imports B``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported(tree, module, path.name == "__init__.py", package):
            private = any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])
            if private and _layer(name) != _layer(module):
                found.append(f"{path.relative_to(package.parent)}:{line}: {_layer(module)} imports {name}")
    return found


def test_no_part_imports_another_parts_private_module():
    found = private_imports(PACKAGE)
    assert not found, "make what is shared public, or move it:\n" + "\n".join(found)


def test_a_private_import_across_parts_is_reported(tmp_path):
    pkg = _fake_package(tmp_path)
    (pkg / "analyses" / "_common.py").write_text("")
    (pkg / "analyses" / "mod.py").write_text("from dynascope.analyses._common import frame\n")  # its own part
    (pkg / "report.py").write_text("def f():\n    from dynascope.analyses._common import frame\n")
    assert private_imports(pkg) == ["dynascope/report.py:2: report imports dynascope.analyses._common"]


def test_every_part_has_a_contract_and_the_contracts_follow_the_flow():
    present = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert present | {"<root>"} == set(CONTRACTS) == set(ORDER), "a part without a contract, or a contract for a part that is gone"
    for part, allowed in CONTRACTS.items():
        later = [dst for dst in allowed if ORDER.index(dst) >= ORDER.index(part)]
        assert not later, f"{part}'s contract lets it import {later}, which come after it in the flow"


def test_the_root_imports_only_core_when_imported():
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    eager = _imported(ast.Module(body=_eager_imports(tree), type_ignores=[]), "dynascope", True, PACKAGE)
    assert eager and {_layer(name) for _, name in eager} <= ROOT_AT_IMPORT, eager


@pytest.mark.parametrize("part", ["core", "stats", "store", "probes", "analyses"])
def test_importing_a_part_loads_only_the_parts_it_may_import(part):
    # at run time too: the root's and the subpackages' __init__ files run on every import of a part
    modules = sorted(_module_name(p, PACKAGE) for p in (PACKAGE / part).rglob("*.py"))
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('dynascope.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert loaded - {part} <= CONTRACTS[part], f"importing {part} loads {sorted(loaded - {part} - CONTRACTS[part])}"


def test_the_store_the_declarations_and_the_dashboard_queries_load_no_torch():
    """The Spark/DuckDB/dashboard side stays light: a statistic's declaration imports torch only when its
    kernel runs. Checked in a fresh interpreter, where nothing imported torch before."""
    code = ("import sys, dynascope.store, dynascope.stats, dynascope.store.rollup, dynascope.store.combine, "
            "dynascope.dashboard.queries.params; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)), cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout


def _fake_package(tmp_path: Path) -> Path:
    """An empty package with every part of the real one: subpackages as directories, modules as files."""
    pkg = tmp_path / "dynascope"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for p in PACKAGE.iterdir():
        if (p / "__init__.py").exists():
            (pkg / p.name).mkdir()
            (pkg / p.name / "__init__.py").write_text("")
        elif p.suffix == ".py" and p.name != "__init__.py":
            (pkg / p.name).write_text("")
    return pkg


@pytest.mark.parametrize(("file", "source", "bad"), [
    ("core/mod.py", "def f():\n    from dynascope.store import open_store\n", "core imports dynascope.store"),
    ("store/mod.py", "from ..probes import scope\n", "store imports dynascope.probes"),  # relative
    ("stats/mod.py", "from dynascope.store import schema\n", "stats imports dynascope.store"),  # below the store
    ("importers/mod.py", "from dynascope.probes.tensors import TensorStats\n", "importers imports dynascope.probes"),
    ("store/mod.py", "from dynascope import core, probes\n", "store imports dynascope.probes"),  # by name
    ("store/mod.py", "def v():\n    from dynascope import __version__\n", "store imports dynascope ("),  # the root
    ("probes/mod.py", "import importlib\nimportlib.import_module('dynascope.integrations.wandb')\n",
     "probes imports dynascope.integrations.wandb"),
    ("analyses/mod.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dynascope.dashboard.data\n",
     "analyses imports dynascope.dashboard.data"),
    ("dashboard/mod.py", "import dynascope.probes.scope as s\n", "dashboard imports dynascope.probes.scope"),
    # the root's public watch() reaching up to an integration, to register a listener
    ("__init__.py", "def watch(**kw):\n    if kw.get('wandb'):\n        import dynascope.integrations.wandb\n",
     "<root> imports dynascope.integrations.wandb"),
    ("integrations/mod.py", "from dynascope import cli\n", "integrations imports dynascope.cli"),
    ("report.py", "from dynascope.demo import settings\n", "report imports dynascope.demo"),
    ("checkpoints.py", "import dynascope\n", "checkpoints imports dynascope ("),  # the root is probes-level
    ("demo/mod.py", "from dynascope.cli_output import x\n", "demo imports dynascope.cli_output"),
    ("cli_output.py", "from .cli import app\n", "cli_output imports dynascope.cli"),
])
def test_a_backwards_import_is_reported(tmp_path, file, source, bad):
    pkg = _fake_package(tmp_path)
    (pkg / file).write_text(source)
    found = violations(pkg)
    assert len(found) == 1 and bad in found[0] and f"{file}:" in found[0], found
    (pkg / file).write_text("from dynascope.core import errors\nimport os\n")  # allowed everywhere
    assert violations(pkg) == []


def test_a_part_without_a_contract_is_reported(tmp_path):
    pkg = _fake_package(tmp_path)
    (pkg / "newpart.py").write_text("import os\n")
    assert violations(pkg) == ["dynascope/newpart.py: part 'newpart' has no contract in CONTRACTS"]


# --- the tests themselves: shared pieces live in tests/helpers/, never in a test module or a benchmark ---
TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"


def shared_through_tests(tests: Path = TESTS, benchmarks: Path = BENCHMARKS) -> list[str]:
    """Imports of a test module or a benchmark script by a test file, as ``file:line: imports name``."""
    benches = {p.stem for p in benchmarks.glob("*.py")}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                parts = name.split(".")
                top = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
                own_benchmark = path.stem == f"test_{top}"  # a benchmark's own test runs it
                if top.startswith("test_") or parts[0] == "benchmarks" or (top in benches and not own_benchmark):
                    found.append(f"{path.relative_to(tests.parent)}:{node.lineno}: imports {name}")
    return found


def test_no_test_imports_another_test_module_or_a_benchmark():
    found = shared_through_tests()
    assert not found, "move what is shared to tests/helpers/ (or the package):\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "bad"), [
    ("from test_b import x\n", "test_b"), ("from tests.test_b import x\n", "tests.test_b"),
    ("def f():\n    import test_b\n", "test_b"), ("from benchmarks.probe import x\n", "benchmarks.probe"),
    ("import probe\n", "probe"),  # a benchmark put on sys.path
])
def test_a_test_sharing_through_a_test_module_is_reported(tmp_path, source, bad):
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "probe.py").write_text("")
    (tmp_path / "tests" / "test_b.py").write_text("x = 1\n")
    (tmp_path / "tests" / "test_a.py").write_text(source)
    assert shared_through_tests(tmp_path / "tests", tmp_path / "benchmarks") == [f"tests/test_a.py:{source.count(chr(10))}: imports {bad}"]
    (tmp_path / "tests" / "test_a.py").write_text("from helpers.runs import x\nimport torch\n")
    (tmp_path / "tests" / "test_probe.py").write_text("import probe\n")  # the benchmark's own test
    assert shared_through_tests(tmp_path / "tests", tmp_path / "benchmarks") == []
