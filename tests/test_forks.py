"""A process that used the store forks (a DataLoader's workers, a launcher's ranks): the child must not
die collecting a DuckDB connection its parent left in uncollected garbage (``core.forks``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import gc, os, sys
    import duckdb
    if sys.argv[1] == "store":
        import dynascope.store  # noqa: F401 - registers the fork hook
    gc.disable()  # the parent has not collected this garbage yet when it forks
    cycle = [duckdb.connect()]
    cycle.append(cycle)
    cycle[0].execute("SELECT 1").fetchall()
    del cycle
    pid = os.fork()
    if pid == 0:
        gc.enable()
        gc.collect()  # the child's first collection: the connection is the parent's
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    gc.enable()
    print(os.waitstatus_to_exitcode(status), gc.get_freeze_count())
""")


def _run(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code, frozen = out.stdout.split()
    return int(code), int(frozen)


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_forked_child_never_collects_its_parents_connection() -> None:
    assert _run("store") == (0, 0)  # the child lived; the parent's objects are not left frozen
    code, _ = _run("plain")  # the hazard itself: without the hook the same child dies of SIGSEGV
    assert code == -11
