"""Snapshots: a set of segment files pinned against compaction for as long as a reader holds a lease.

A query that lists its files and reads them later (Spark plans a job, then runs it) may outlive
compaction's grace period, after which merged-away segments are deleted. A *lease* is a small JSON file
that any engine's driver can write::

    <root or run>/_leases/<name>.json    {"snapshot_us": 1767225600000000, "expires_us": 1767229200000000}

(µs since the epoch; written to a temporary name and renamed, like every file of the store). Until
``expires_us``, compaction deletes no segment that was live at ``snapshot_us`` in the runs the lease covers:
a lease in a run directory covers that run, one in a store root every run directly under it. An expired or
deleted lease frees them. ``snapshot()`` takes a lease, lists the store once and answers ``files(table)``
from that listing at ``snapshot_us``, so every table of one job sees one moment of the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dynascope.store.layout import JOURNAL, StoreLocation, locate, safe_id
from dynascope.store.live import Entry, list_run, live_files_in, live_sets
from dynascope.store.schema import TABLES
from dynascope.store.snapshot_journals import ROWS, Vanished, copy_journals

LEASES = "_leases"
DEFAULT_TTL_S = 3600.0
LEASE_SLACK_S = 0.25  # a lease exists this soon after its moment (under compaction's shortest grace, 1 s)


@dataclass(frozen=True)
class Lease:
    """A held lease: its file, the moment it pins and when it expires (µs since the epoch)."""

    path: Path
    snapshot_us: int
    expires_us: int


def take_lease(directory: Path, snapshot_us: int, ttl_s: float, holder: str = "dynascope") -> Path:
    """Write a lease in ``directory/_leases``; returns its path."""
    d = Path(directory) / LEASES
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{safe_id(holder)}-{uuid.uuid4().hex[:12]}.json"
    _write_lease(path, snapshot_us, ttl_s, holder)
    return path


def _write_lease(path: Path, snapshot_us: int, ttl_s: float, holder: str) -> None:
    body = {"snapshot_us": int(snapshot_us), "expires_us": time.time_ns() // 1000 + int(ttl_s * 1e6),
            "holder": holder, "host": socket.gethostname(), "pid": os.getpid()}
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Held(NamedTuple):
    """What one listing of a run's lease directories finds: the unexpired leases, one line per lease file
    that cannot be read (left alone, not honoured: a lease is written whole by a rename), and the journal
    rows copied for snapshots (``snapshot_journals.ROWS``), whose leases may be gone."""

    leases: list[Lease]
    problems: list[str]
    rows: list[Path]


def held_leases(run_dir: Path, now_us: int | None = None) -> Held:
    """The leases covering ``run_dir`` (its own and its store root's), from one listing of each directory:
    a fold pass reads them all, and on a shared file system every listing is a metadata operation."""
    now = time.time_ns() // 1000 if now_us is None else now_us
    out = Held([], [], [])
    for d in (run_dir / LEASES, run_dir.parent / LEASES):
        try:
            found = sorted(d.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        out.rows.extend(p for p in found if p.name.endswith(ROWS))
        for p in found:
            if p.suffix != ".json" or p.name.startswith("."):
                continue
            try:
                body = json.loads(p.read_text(encoding="utf-8"))
                lease = Lease(p, int(body["snapshot_us"]), int(body["expires_us"]))
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
                out.problems.append(f"{p}: unreadable lease ({type(exc).__name__}); not honoured")
                continue
            if lease.expires_us > now:
                out.leases.append(lease)
    return out


def list_location(loc: StoreLocation, tables: tuple[str, ...] = tuple(TABLES),
                  progress: Callable[[int, int], None] | None = None, journals: bool = False) -> list[Entry]:
    """Every segment of ``tables`` and every commit record of the runs at ``loc`` (``journals``: and every
    journal); ``progress(done, total)`` is called after each run."""
    out: list[Entry] = []
    for i, run_dir in enumerate(loc.run_dirs):
        out += list_run(run_dir, tables, journals)
        if progress is not None:
            progress(i + 1, len(loc.run_dirs))
    return out


@dataclass
class Snapshot:
    """The store at one moment: ``files(table)`` are the segments live at ``at_us``, and the Parquet copy of
    the journal rows that count then (``snapshot_journals``)."""

    location: StoreLocation
    at_us: int
    listing: list[Entry]
    lease: Path | None = None
    holder: str = "dynascope"
    rows: dict[str, str] = field(default_factory=dict)  # table -> the Parquet file of its journal rows
    rows_dir: Path | None = None
    _files: dict[str, list[str]] = field(default_factory=dict, repr=False)

    @property
    def path(self) -> Path:
        return self.location.path

    def files(self, table: str) -> list[str]:
        """The segment files of ``table`` live at ``at_us`` (from the snapshot's own listing), then the file of
        its journal rows, if any."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r} (tables: {', '.join(TABLES)})")
        if not self._files:  # the rule over the whole listing once, then split by table
            self._files = {t: [] for t in TABLES}
            for e in live_files_in(self.listing, None, self.at_us):
                self._files.setdefault(e.path.rsplit("/", 3)[-3], []).append(e.path)
        return self._files[table] + ([self.rows[table]] if table in self.rows else [])

    def renew(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        """Extend the lease to ``ttl_s`` from now (a job that runs longer than it expected)."""
        if self.lease is not None:
            _write_lease(self.lease, self.at_us, ttl_s, self.holder)

    def release(self) -> None:
        """Delete the lease and the journal rows: compaction may delete the pinned files again."""
        if self.lease is not None:
            self.lease.unlink(missing_ok=True)
            self.lease = None
        if self.rows_dir is not None:
            shutil.rmtree(self.rows_dir, ignore_errors=True)
            self.rows_dir = None


def open_snapshot(path: str | os.PathLike, *, lease_ttl_s: float | None = DEFAULT_TTL_S, holder: str = "dynascope",
                  progress: Callable[[int, int], None] | None = None, journals: bool = True) -> Snapshot:
    """A snapshot of the store at ``path`` now, with a lease of ``lease_ttl_s`` (None: no lease; only safe
    for reads that finish within compaction's grace period). ``journals``: copy the rows live writers hold
    in journals (``snapshot_journals``; False: segments only). Call ``release()`` when done."""
    loc = locate(path)
    lease = None
    rows_dir = loc.path / LEASES / f"{safe_id(holder)}-{uuid.uuid4().hex[:12]}{ROWS}"
    try:
        for attempt in range(3):
            at = time.time_ns() // 1000
            # The lease goes first, then the listing. A compaction that deletes before it sees the lease took its
            # clock before the lease existed (``merge.remove_merged``), and deletes only what a merge had covered
            # for its grace (1 s at least) by then, so nothing live at ``at`` -- as long as the lease exists within
            # LEASE_SLACK_S of ``at``. A process stalled for longer between the two (a loaded machine) takes a
            # later moment and writes the lease again.
            if lease_ttl_s is not None:
                if lease is None:
                    lease = take_lease(loc.path, at, lease_ttl_s, holder)
                    rows_dir = lease.with_name(lease.name.removesuffix(".json") + ROWS)
                else:
                    _write_lease(lease, at, lease_ttl_s, holder)
                for _ in range(5):
                    if time.time_ns() // 1000 - at <= LEASE_SLACK_S * 1e6:
                        break
                    at = time.time_ns() // 1000
                    _write_lease(lease, at, lease_ttl_s, holder)
            listing = list_location(loc, progress=progress, journals=journals)
            segments = [e for e in listing if not e.path.endswith(JOURNAL)]
            snap = Snapshot(loc, at, segments, lease, holder, rows_dir=rows_dir)
            if not journals:
                return snap
            counted = live_sets([e.path for e in listing], at, at)[1]
            try:
                snap.rows = copy_journals([e for e in listing if e.path in counted], rows_dir)
                return snap
            except Vanished:  # stalled past a seal's settle and grace: a new moment
                shutil.rmtree(rows_dir, ignore_errors=True)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")
    except BaseException:
        shutil.rmtree(rows_dir, ignore_errors=True)
        if lease is not None:
            lease.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def snapshot(path: str | os.PathLike, *, lease_ttl_s: float | None = DEFAULT_TTL_S, holder: str = "dynascope",
             progress: Callable[[int, int], None] | None = None, journals: bool = True) -> Iterator[Snapshot]:
    """``with snapshot(root) as snap:`` the store at one moment, its files pinned until the block ends."""
    snap = open_snapshot(path, lease_ttl_s=lease_ttl_s, holder=holder, progress=progress, journals=journals)
    try:
        yield snap
    finally:
        snap.release()
