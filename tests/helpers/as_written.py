"""Runs kept as their writers wrote them: no writer folds its own segments, no last close or open folds a
finished run (``DYNASCOPE_FOLD=0``, ``store.at_rest.auto_fold``), so the tests of ``dynascope compact`` find
the files compaction exists for (one segment per flush, one directory per writer), as in runs written
before writers folded on their own. Use with ``pytestmark = pytest.mark.usefixtures("as_written")``."""

from __future__ import annotations

import pytest


@pytest.fixture
def as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNASCOPE_FOLD", "0")  # forked and spawned writers inherit it
