"""Where things live on disk.

    <root>/<run>/dynascope.json                          marker: schema version, run id (the run appears
                                                         with it, whole: see ``create_run``)
    <root>/<run>/<table>/writer=<writer_id>/<lo>-<hi>.parquet   immutable segments
    <root>/<run>/<table>/writer=_merged/<n>-<n>.v<t>.parquet     rows of finished writers, folded together
    <root>/<run>/<table>/writer=<writer_id>/<n>.jsonl    a writer's journal: rows since its last seal (``journal``)
    <root>/<run>/_writers/<writer_id>.json                writer heartbeat (mtime = last sign of life)

A writer numbers its segments 0, 1, 2, … and names each ``<seq>-<seq>.parquet``. Compaction merges a
writer's segments lo..hi into ``<lo>-<hi>.parquet``; readers ignore any segment whose [lo, hi] range is
covered by another segment of the same writer, so a merged file and its sources are never both read.
Segments are written to a ``.tmp`` name and renamed, so a reader never sees a half-written file.

A merged segment is named ``<lo>-<hi>.v<valid_from_us>.parquet``: it counts (and covers its sources) only
for queries that start at or after ``valid_from_us``, a few seconds after it was written. DuckDB lists the
files of a query twice (binding ``read_parquet``, then running ``glob``), so a merged file that took effect
the instant it appeared could cover sources for a query whose first listing missed it; with a future
``valid_from`` every query that honours the file also listed it. Nothing is renamed or deleted while a
reader may still open it (see ``compact``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynascope.core.errors import StoreError
from dynascope.store.schema import SCHEMA_VERSION

MARKER = "dynascope.json"
HEARTBEATS = "_writers"  # <run>/_writers/<writer_id>.json; not a table, so no view globs it
COMMITS = "_commits"  # <run>/_commits/writer=<writer_id>/<lo>-<hi>.v<t>.json: one record per flush (``live``)
MERGED = "writer=_merged"  # <run>/<table>/writer=_merged/: rows of finished writers folded together (``compact_across``)
SEGMENT_RE = re.compile(r"^(\d{12})-(\d{12})(?:\.v(\d{1,20}))?\.parquet$")
JOURNAL = ".jsonl"
JOURNAL_RE = re.compile(r"^(\d{12})" + re.escape(JOURNAL) + "$")
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]+")


class SchemaVersionError(StoreError):
    """The run was written by a newer dynascope whose schema this version cannot read."""


def safe_id(text: str) -> str:
    """A file-name-safe form of ``text`` (writer ids, run ids derived from paths)."""
    return _SAFE_ID.sub("_", text).strip("._") or "run"


def is_temp(name: str) -> bool:
    """Whether a file name is a temp file's (``.<name>.tmp``): a write in progress, renamed into place once
    whole, or one left by a process that died mid-write. Never data."""
    return name.startswith(".") and name.endswith(".tmp")


def is_writer_dir(name: str) -> bool:
    """Whether a directory name is a writing process's (``writer=<id>``), not the toolkit's own
    (``writer=_schema``, ``writer=_merged``): writer ids never start with ``_`` (``safe_id``)."""
    return name.startswith("writer=") and not name.startswith("writer=_")


def segment_name(lo: int, hi: int, valid_from_us: int | None = None) -> str:
    """A segment's file name; merged segments carry the wall-clock µs from which they count."""
    valid = "" if valid_from_us is None else f".v{valid_from_us}"
    return f"{lo:012d}-{hi:012d}{valid}.parquet"


def valid_from_us(path: Path) -> int:
    """When a segment starts to count (0 for a writer's own segments, which count at once)."""
    m = SEGMENT_RE.match(path.name)
    return int(m.group(3)) if m and m.group(3) else 0


def journal_name(n: int) -> str:
    """A journal's file name: the number its seal's segment takes (``journal``)."""
    return f"{n:012d}{JOURNAL}"


def schema_journal(run_dir: Path, table: str) -> Path:
    """The run's empty journal of ``table``: readers of a run that has one read its writers' journals."""
    return run_dir / table / "writer=_schema" / journal_name(0)


def writer_dir(run_dir: Path, table: str, writer_id: str) -> Path:
    return run_dir / table / f"writer={writer_id}"


def heartbeat_path(run_dir: Path, writer_id: str) -> Path:
    """A writer's heartbeat file: created at start, touched every flush interval, describes the writer."""
    return run_dir / HEARTBEATS / f"{writer_id}.json"


def touch_heartbeat(path: Path, describe: dict) -> None:
    """Touch a writer's heartbeat file (created with ``describe`` if missing); never raises: the run dir may
    be gone or read-only, which the writer's next segment write reports."""
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(describe), encoding="utf-8")
        except OSError:
            pass
    except OSError:
        pass


def read_marker(run_dir: Path) -> dict:
    """The run's marker, checked for a schema this version can read."""
    path = Path(run_dir) / MARKER
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{run_dir}: not a dynascope run (no {MARKER})") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: unreadable run marker ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("schema_version"), int):
        raise StoreError(f"{path}: run marker has no integer schema_version")
    if meta["schema_version"] > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{run_dir}: written with store schema v{meta['schema_version']}, this dynascope reads up to "
            f"v{SCHEMA_VERSION}; upgrade dynascope"
        )
    return meta


def create_marker(run_dir: Path, meta: dict) -> bool:
    """Create the run marker atomically; returns False when another process created it first."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{MARKER}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    try:
        os.link(tmp, run_dir / MARKER)  # atomic and fails if it exists: exactly one creator wins
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def create_run(run_dir: Path, meta: dict, populate: Callable[[Path], None]) -> bool:
    """Create ``run_dir`` with its marker and what ``populate(dir)`` writes; False if another process won.

    A reader sees nothing or a run, never table directories without a marker: where ``run_dir`` does not
    exist yet, the run is built in a private directory beside it and renamed into place whole (``rename``
    fails on a non-empty target, so of many processes starting at once exactly one wins). The staging
    directory sits one level deeper than a run, so a store root's globs (``root/*/<table>/...``) never
    reach it. Where ``run_dir`` already exists (made by a launcher, or holding other files), the marker is
    created first and the tables after it: a reader in between sees a run whose tables are still empty.
    """
    parent = run_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(run_dir):
        stage = parent / f".dynascope-new-{uuid.uuid4().hex[:12]}"
        staged = stage / run_dir.name
        try:
            staged.mkdir(parents=True)
            populate(staged)
            (staged / MARKER).write_text(json.dumps(meta, indent=1), encoding="utf-8")
            try:
                os.rename(staged, run_dir)
                return True
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    if (run_dir / MARKER).exists():
        return False
    if not create_marker(run_dir, meta):
        return False
    populate(run_dir)
    return True


@dataclass(frozen=True)
class StoreLocation:
    """A run directory or a store root, resolved."""

    path: Path
    is_root: bool
    run_dirs: tuple[Path, ...]
    columns: frozenset[str | None] = frozenset()  # the runs' markers' ``columns`` (None: a marker without one)

    def table_glob(self, table: str) -> str:
        return str(self._runs() / table / "*" / "*.parquet")

    def journal_glob(self, table: str) -> str:
        """The writers' journals of ``table`` (``journal``), the runs' empty schema journals among them."""
        return str(self._runs() / table / "*" / "*.jsonl")

    def schema_glob(self, table: str, suffix: str = ".parquet") -> str:
        """The runs' empty segments of ``table``, written with their creator's full schema (``suffix``
        ``JOURNAL``: their empty journals, which say the runs' writers may keep journals)."""
        return str(self._runs() / table / "writer=_schema" / f"*{suffix}")

    def commit_glob(self) -> str:
        """Every commit record (and begin record) of the runs here."""
        return str(self._runs() / COMMITS / "*" / "*.json")

    def _runs(self) -> Path:
        return self.path / "*" if self.is_root else self.path


def locate(path: str | os.PathLike) -> StoreLocation:
    """Resolve ``path`` to a run directory (has a marker) or a root (sub-directories with markers)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise StoreError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise StoreError(f"{p}: not a directory (expected a run directory or a store root)")
    p = p.resolve()
    _check_utf8(p)
    if (p / MARKER).exists():
        return StoreLocation(p, False, (p,), frozenset({_columns(read_marker(p))}))
    runs = tuple(sorted(d for d in p.iterdir() if d.is_dir() and (d / MARKER).exists()))
    if not runs:
        raise StoreError(f"{p}: not a dynascope run directory or store root (no {MARKER} found)")
    for d in runs:
        _check_utf8(d)
    return StoreLocation(p, True, runs, frozenset(_columns(read_marker(d)) for d in runs))


def _columns(meta: dict) -> str | None:
    c = meta.get("columns")
    return c if isinstance(c, str) else None


def printable(path: os.PathLike | str) -> str:
    """``path`` as text safe to print or store: undecodable bytes shown as escapes."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def _check_utf8(path: Path) -> None:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise StoreError(f"{printable(path)}: path is not valid UTF-8, which DuckDB cannot open; rename it") from None


def list_segments(run_dir: Path, table: str) -> dict[Path, list[tuple[int, int, Path]]]:
    """Segments per writer directory, as (lo, hi, path), sorted; temp files are ignored."""
    out: dict[Path, list[tuple[int, int, Path]]] = {}
    tdir = run_dir / table
    if not tdir.is_dir():
        return out
    for wdir in sorted(tdir.iterdir()):
        if not wdir.is_dir():
            continue
        segs = []
        for f in wdir.iterdir():
            m = SEGMENT_RE.match(f.name)
            if m:
                segs.append((int(m.group(1)), int(m.group(2)), f))
        out[wdir] = sorted(segs)
    return out
