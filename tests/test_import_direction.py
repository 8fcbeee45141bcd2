"""Imports follow the data flow: core at the bottom, then store, probes → store → analyses → dashboard.

Every import in the package counts, wherever it sits: module level, inside a function (the lazy imports
that keep start-up fast), under ``TYPE_CHECKING``, relative imports, and ``importlib.import_module`` /
``__import__`` calls with a literal name. A layer is a top-level subpackage or module of ``dynascope``
(``dynascope.store.reader`` belongs to ``store``; ``dynascope`` itself is ``<root>``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dynascope"

ALL = frozenset({"<root>", "core", "store", "probes", "analyses", "dashboard", "importers", "integrations",
                 "demo", "cli", "report"})
# layer → (the layers it may import, or None for "any but the forbidden ones"), forbidden layers
CONTRACTS: dict[str, tuple[frozenset[str] | None, frozenset[str]]] = {
    "core": (frozenset(), frozenset()),
    "store": (frozenset({"core"}), frozenset()),
    "probes": (None, frozenset({"importers", "analyses", "integrations", "dashboard"})),
    "analyses": (None, frozenset({"dashboard", "probes", "integrations", "importers"})),
    "importers": (None, frozenset({"analyses", "dashboard", "integrations"})),
    "dashboard": (frozenset({"core", "store", "analyses"}), frozenset()),
}


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


def violations(package: Path, contracts=CONTRACTS) -> list[str]:
    """Every import in ``package`` that a contract forbids, as ``file:line: A imports B (rule)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        src = _layer(module)
        if src not in contracts:
            continue
        allowed, forbidden = contracts[src]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported(tree, module, path.name == "__init__.py", package):
            dst = _layer(name)
            if dst == src:
                continue
            if dst in forbidden or (allowed is not None and dst not in allowed):
                rule = f"{src} may import only {sorted(allowed) or 'nothing of ' + package.name}" \
                    if allowed is not None else f"{src} never imports {sorted(forbidden)}"
                found.append(f"{path.relative_to(package.parent)}:{line}: {src} imports {name} ({rule})")
    return found


def test_imports_follow_the_flow():
    found = violations(PACKAGE)
    assert not found, "imports against the flow:\n" + "\n".join(found)


def test_every_layer_named_by_a_contract_exists():
    present = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    named = set(CONTRACTS) | {d for a, f in CONTRACTS.values() for d in (a or set()) | f}
    assert named <= ALL
    assert named - {"<root>"} <= present, "a contract names a layer that is gone: update CONTRACTS"


@pytest.mark.parametrize(("layer", "source", "bad"), [
    ("core", "def f():\n    from dynascope.store import open_store\n", "dynascope.store"),  # lazy import
    ("store", "from ..probes import scope\n", "dynascope.probes"),  # relative
    ("store", "from dynascope import core, probes\n", "dynascope.probes"),  # subpackage by name
    ("store", "def v():\n    from dynascope import __version__\n", "dynascope"),  # the root's __init__
    ("probes", "import importlib\nimportlib.import_module('dynascope.integrations.wandb')\n",
     "dynascope.integrations.wandb"),
    ("analyses", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dynascope.dashboard.data\n",
     "dynascope.dashboard.data"),
    ("dashboard", "import dynascope.probes.scope as s\n", "dynascope.probes.scope"),
])
def test_a_backwards_import_is_reported(tmp_path, layer, source, bad):
    pkg = tmp_path / "dynascope"
    for sub in ("core", "store", "probes", "integrations", "analyses", "dashboard"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / layer / "mod.py").write_text(source)
    found = violations(pkg)
    assert len(found) == 1 and f"{layer} imports {bad} (" in found[0] and f"{layer}/mod.py:" in found[0]
    (pkg / layer / "mod.py").write_text("from dynascope.core import errors\nimport os\n")  # allowed everywhere
    assert violations(pkg) == []
