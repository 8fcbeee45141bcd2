"""A run appears whole: a reader that polls while many processes create it sees nothing or a run.

Eight writer processes start at once on a run directory that does not exist yet; a reader in this process
polls the run and its store root as fast as it can. Whenever the run directory exists, it must open as a
run (never "no dynascope.json found" beside table directories), and the root must keep opening too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dynascope.core.errors import StoreError
from dynascope.store import RunWriter, open_store
from dynascope.store.layout import MARKER, create_run

WRITERS = 8

CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dynascope.store import RunWriter
    run, rank, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():  # all processes are up (imports done) before any creates the run
        time.sleep(0.001)
    w = RunWriter(run, rank=rank, world_size=8, flush_secs=0.05)
    w.append("scalars", {"step": [rank], "key": "x", "value": 1.0})
    w.close()
""")


def _poll(path: Path, deadline: float, stop) -> tuple[int, int, list[str]]:
    """Open ``path`` (and count its scalars) whenever it exists, until ``stop()``; (opened, seen, errors)."""
    opened = seen = 0
    errors: list[str] = []
    while not stop() and time.monotonic() < deadline:
        if not path.exists():
            continue
        seen += 1
        try:
            with open_store(path) as store:
                store.rows("SELECT count(*) FROM scalars")
            opened += 1
        except StoreError as exc:
            errors.append(str(exc))
    return opened, seen, errors


@pytest.mark.slow
def test_runs_created_by_eight_processes_at_once_appear_whole(tmp_path: Path) -> None:
    root = tmp_path / "root"
    RunWriter(root / "other").close()  # the root is a store before the new run exists
    go = tmp_path / "go"
    attempts = []
    for attempt in range(2):  # two races: the window the reader must never see is a few ms wide
        run = root / f"run{attempt}"
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(run), str(r), str(go)]) for r in range(WRITERS)]
        time.sleep(0.05)
        go.touch()
        deadline = time.monotonic() + 120
        opened, seen, errors = _poll(run, deadline, lambda procs=procs: all(p.poll() is not None for p in procs))
        root_opened, _, root_errors = _poll(root, time.monotonic() + 0.5, lambda: False)
        assert [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs] == [0] * WRITERS
        go.unlink()
        assert errors == [], errors[:3]
        assert root_errors == [] and root_opened > 0
        attempts.append((opened, seen))
        with open_store(run) as store:
            assert store.rows("SELECT count(*), count(DISTINCT step) FROM scalars") == [(WRITERS, WRITERS)]
            assert store.rows("SELECT count(*) FROM runs") == [(1,)]  # exactly one process created the run
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "a staging directory was left behind"
    assert sum(opened for opened, _ in attempts) > 0, "the reader never saw the run while it was being written"


def test_create_run_in_an_existing_directory_writes_the_marker_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("made by the launcher")
    order = []

    def populate(d: Path) -> None:
        order.append((d / MARKER).exists())
        (d / "scalars").mkdir()

    assert create_run(run, {"schema_version": 2, "run_id": "run"}, populate)
    assert order == [True]  # the tables came after the marker
    assert not create_run(run, {"schema_version": 2, "run_id": "run"}, populate)  # a second creator loses
    assert order == [True]


def test_create_run_where_nothing_exists_renames_a_finished_directory(tmp_path: Path) -> None:
    run = tmp_path / "a" / "run"
    seen = []

    def populate(d: Path) -> None:
        seen.append((d != run, run.exists()))
        (d / "scalars").mkdir()

    assert create_run(run, {"schema_version": 2, "run_id": "run"}, populate)
    assert seen == [(True, False)]  # populated elsewhere while the run did not exist
    assert (run / MARKER).exists() and (run / "scalars").is_dir()
    assert [p.name for p in run.parent.iterdir()] == ["run"]


@pytest.mark.parametrize("role", [None, ""])
def test_a_writer_given_no_role_records_the_default_not_the_word_none(tmp_path: Path, role) -> None:
    # ``watch(role=None)`` means the default role; the writer takes it the same way, not as the string "None"
    with RunWriter(tmp_path / "r", rank=0, role=role) as w:
        w.append("timings", {"phase": "step", "category": "step", "step": 0, "start_us": 1, "dur_us": 2})
    with open_store(tmp_path / "r") as con:
        assert con.execute("SELECT DISTINCT role FROM timings UNION ALL SELECT DISTINCT role FROM runs").fetchall() \
            == [("trainer",), ("trainer",)]
