"""The one way the toolkit warns from code that runs inside a user's training process.

A warning filter set to "error" (``python -W error``, pytest's ``filterwarnings = error``,
``warnings.simplefilter("error")``) turns ``warnings.warn`` into a raise at the call site, which for the
probes is inside ``optimizer.step()`` or on a background thread. ``warn`` keeps every other filter's effect
(``ignore``, ``once``, recording by ``catch_warnings``) and, where a filter would raise, prints the same line
to stderr instead, so no filter can turn a probe's notice into an exception in the user's loop.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn"]


def warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """Warn like ``warnings.warn``, but never raise, whatever the warning filters say."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        # a filter escalated it: say it anyway, where warnings go
        try:
            sys.stderr.write(f"{category.__name__}: {message}\n")
        except Exception:  # noqa: BLE001 - a closed stderr must not raise either
            pass
    except Exception:  # noqa: BLE001 - a broken showwarning hook must not raise into training
        pass
