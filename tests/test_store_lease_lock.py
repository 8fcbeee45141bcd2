"""Compaction on a file system without ``flock`` (Lustre without ``-o flock``): the lease file stands in,
one compactor per run at a time, and a crashed holder's expired lease is taken over."""

from __future__ import annotations

import errno
import fcntl
import json
from pathlib import Path

import pytest

from dynascope.store import RunWriter, lease_lock, open_store
from dynascope.store.compact import compact_store

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fh, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lease_lock.fcntl, "flock", refuse)
    assert lease_lock.fcntl is fcntl


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    w = RunWriter(run, flush_secs=3600)
    for step in range(6):  # six flushes: six segments to merge
        w.append("scalars", {"step": step, "key": "loss", "value": 1.0, "time_us": 1})
        w.flush()
    w.close()
    return run


def test_compaction_runs_without_flock_and_leaves_no_lease(tmp_path: Path, no_flock: None) -> None:
    run = _run(tmp_path)
    stats = compact_store(run, grace_s=0, settle_s=0.05, repair_after_s=0)
    assert not stats.skipped and stats.merged_segments >= 6
    assert not (run / lease_lock.LEASE_FILE).exists()
    with open_store(run) as store:
        assert store.rows("SELECT count(*) FROM scalars") == [(6,)]


def test_a_current_lease_refuses_and_an_expired_one_is_taken_over(tmp_path: Path, no_flock: None) -> None:
    run = _run(tmp_path)
    held = lease_lock.acquire(run)
    assert held is not None and lease_lock.acquire(run) is None  # one holder at a time
    stats = compact_store(run, grace_s=0, settle_s=0.05, repair_after_s=0)
    assert stats.skipped == [f"{run}: another compaction is running"]
    # The holder crashed: its lease expires and the next compactor takes it over.
    (run / lease_lock.LEASE_FILE).write_text(json.dumps({"owner": held, "expires_us": 1}))
    stats = compact_store(run, grace_s=0, settle_s=0.05, repair_after_s=0)
    assert not stats.skipped and stats.merged_segments >= 6
    lease_lock.release(run, held)  # the crashed holder's token no longer owns anything
    assert not (run / lease_lock.LEASE_FILE).exists()
