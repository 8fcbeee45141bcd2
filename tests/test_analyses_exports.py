"""``dynascope.analyses`` lists its public names: the union of its public submodules' ``__all__``, no more, no less."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import dynascope.analyses as analyses

PACKAGE = Path(analyses.__file__).parent


def _literal_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _submodules_all() -> dict[str, list[str]]:
    """Each public submodule's literal ``__all__`` (a module without one exports nothing)."""
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if not path.name.startswith("_") and (names := _literal_all(path)) is not None:
            out[path.stem] = names
    return out


def _type_checking_imports() -> dict[str, str]:
    """name → submodule of the ``if TYPE_CHECKING:`` imports in ``analyses/__init__.py``."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {a.name: node.module.rsplit(".", 1)[1] for node in block.body if isinstance(node, ast.ImportFrom)
            for a in node.names}


def test_the_listed_names_are_the_union_of_the_submodules_all() -> None:
    declared = _submodules_all()
    where: dict[str, str] = {}
    for module, names in declared.items():
        for name in names:
            assert name not in where, f"{name} is in the __all__ of both {where[name]} and {module}"
            where[name] = module
    assert sorted(analyses.__all__) == sorted(where), "analyses.__all__ differs from the submodules' __all__"
    assert len(set(analyses.__all__)) == len(analyses.__all__)
    assert analyses._MODULE_OF == where, "analyses._EXPORTS names a name under another submodule"
    assert _type_checking_imports() == where, "the TYPE_CHECKING imports differ from the submodules' __all__"


def test_every_listed_name_is_the_submodules_object() -> None:
    for name, module in analyses._MODULE_OF.items():
        assert getattr(analyses, name) is getattr(importlib.import_module(f"dynascope.analyses.{module}"), name)
    assert set(analyses.__all__) <= set(dir(analyses))


def test_importing_the_package_imports_no_analysis() -> None:
    code = ("import sys, dynascope.analyses as a\n"
            "assert not [m for m in sys.modules if m.startswith('dynascope.analyses.')]\n"
            "assert 'straggler_scores' in dir(a)\n"
            "a.straggler_scores\n"
            "assert 'dynascope.analyses.stragglers' in sys.modules and 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(PACKAGE.parents[1]), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
