"""Optional dependencies: import them on use and fail with an error that names the extra to install.

``import dynascope`` never imports transformers, lightning, wandb or ray; each integration (and the wandb
history importer) imports its framework only when used, through ``require``, so a missing extra surfaces as
one clear ImportError.
"""

from __future__ import annotations

import importlib
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
}


class MissingExtraError(ImportError):
    """A dynascope integration was used without its optional dependency installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ``MissingExtraError`` naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra = EXTRAS.get(top, top)
        raise MissingExtraError(
            f"{feature} needs the '{top}' package, which is not installed ({exc}); "
            f"install it with: pip install 'dynascope[{extra}]'"
        ) from exc
