"""What every trainer callback shares: it runs on the training thread, so a probe problem becomes one
warning, never an exception in the user's fit."""

from __future__ import annotations

from typing import Any

from dynascope.core.warn import warn


class GuardedCallback:
    """Mixin for framework callbacks that own a ``scope`` (and possibly a shared ``_writer``)."""

    framework = "trainer"
    scope: Any = None
    _writer: Any = None
    _warned = False

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            if not self._warned:
                self._warned = True
                warn(f"dynascope: {self.framework} callback problem ({type(exc).__name__}: {exc}); "
                     "continuing", RuntimeWarning, stacklevel=3)
            return None

    def _stop_asked(self) -> bool:
        """Whether an alert rule asked training to stop (``Scope.should_stop``); never raises."""
        return bool(self.scope is not None and self._guard(lambda: self.scope.should_stop))

    def _close_scope(self) -> None:
        """Close the scope, then the writer this callback made for it (scope first: it flushes rows)."""
        if self.scope is not None:
            self._guard(self.scope.close)
            self.scope = None
        if self._writer is not None:
            self._guard(self._writer.close)
            self._writer = None
