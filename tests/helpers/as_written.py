"""Runs kept as their writers wrote them: no writer folds its own segments, no last close or open folds a
finished run (``DYNASCOPE_FOLD=0``, ``store.at_rest.auto_fold``), so the tests of ``dynascope compact`` find
the files compaction exists for (one segment per flush, one directory per writer), as in runs written
before writers folded on their own. Use with ``pytestmark = pytest.mark.usefixtures("as_written")``, or import
``module_as_written`` where module-scoped fixtures write runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNASCOPE_FOLD", "0")  # forked and spawned writers inherit it


@pytest.fixture(scope="module", autouse=True)
def module_as_written() -> Iterator[None]:
    """The same for a whole module, module-scoped fixtures included: importing it into a test module is
    enough (it is autouse there)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DYNASCOPE_FOLD", "0")
        yield
