"""One run's files as compaction and repair see them: segments per writer directory, commit records per
writer, and which segments are live at a given moment (by ``live``'s rule, evaluated on this listing)."""

from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.core.errors import first_line
from dynascope.store.layout import SEGMENT_RE
from dynascope.store.live import FOREVER_US, Entry, list_run, live_paths

COMMIT_RE = re.compile(r"^(\d{12})-(\d{12})\.v(\d{1,20})\.json$")

Seg = tuple[int, int, Path]


@dataclass
class RunFiles:
    """A listing of one run (``live.list_run``), parsed."""

    run_dir: Path
    listing: list[Entry]
    segs: dict[Path, list[Seg]] = field(default_factory=dict)  # writer directory -> segments, sorted
    commits: dict[str, list[Seg]] = field(default_factory=dict)  # writer dir name -> commit records, sorted
    keeps: set[str] = field(default_factory=set)  # writer dir names that keep commit records
    _live: dict[int, frozenset[str]] = field(default_factory=dict, repr=False)
    _rows: dict[Path, int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, run_dir: Path) -> RunFiles:
        return cls.parse(run_dir, list_run(run_dir))

    @classmethod
    def parse(cls, run_dir: Path, listing: list[Entry]) -> RunFiles:
        """A listing made elsewhere (a writer's own directories: ``own_fold``), parsed as ``of`` parses."""
        files = cls(run_dir, listing)
        for e in files.listing:
            p = Path(e.path)
            if p.parent.parent.name == "_commits":
                files.keeps.add(p.parent.name)
                if m := COMMIT_RE.match(p.name):
                    files.commits.setdefault(p.parent.name, []).append((int(m.group(1)), int(m.group(2)), p))
            elif m := SEGMENT_RE.match(p.name):
                files.segs.setdefault(p.parent, []).append((int(m.group(1)), int(m.group(2)), p))
        for segs in (*files.segs.values(), *files.commits.values()):
            segs.sort()
        return files

    def live(self, at_us: int | None = None) -> frozenset[str]:
        """Paths of the segments live at ``at_us`` (default: now; ``FOREVER_US``: every merge in effect)."""
        at = time.time_ns() // 1000 if at_us is None else at_us
        if at not in self._live:
            self._live[at] = live_paths((e.path for e in self.listing), at)
        return self._live[at]

    def writer_dirs(self, schema_too: bool = False):
        """(writer directory, table, segments) of every table, the ``writer=_schema`` ones only if asked."""
        for wdir, segs in sorted(self.segs.items()):
            if schema_too or wdir.name != "writer=_schema":
                yield wdir, wdir.parent.name, segs

    def num_rows(self, path: Path) -> int:
        """A segment's row count (its footer, read once per listing); a corrupt file is an OSError naming it."""
        if path not in self._rows:
            self._rows[path] = num_rows(path)
        return self._rows[path]

    def is_cover(self, path: Path) -> bool:
        """A merged segment without rows: a fold across writers left it to hide the segments whose rows went
        into ``writer=_merged`` (``compact_across``)."""
        return ".v" in path.name and self.num_rows(path) == 0

    def uncommitted(self, wdir: Path, seg: Seg) -> bool:
        """A writer's own segment that no commit record covers, of a writer that keeps them."""
        lo, hi, path = seg
        if wdir.name not in self.keeps or ".v" in path.name:
            return False
        return not any(clo <= lo and hi <= chi for clo, chi, _ in self.commits.get(wdir.name, ()))

    def never_committed(self, wdir: Path, seg: Seg) -> bool:
        """Uncommitted, and a later flush of its writer is committed: a flush that failed, never data."""
        last = max((chi for _, chi, _ in self.commits.get(wdir.name, ())), default=-1)
        return self.uncommitted(wdir, seg) and seg[1] < last

    def spent_commits(self) -> list[Path]:
        """Commit records none of whose segments is left (all merged into ``.v`` files and deleted)."""
        raw: dict[str, list[int]] = {}
        for wdir, segs in self.segs.items():
            raw.setdefault(wdir.name, []).extend(lo for lo, hi, p in segs if lo == hi and ".v" not in p.name
                                                 and p.exists())
        out = []
        for w, commits in self.commits.items():
            left = sorted(raw.get(w, []))
            out += [p for lo, hi, p in commits if bisect.bisect_right(left, hi) == bisect.bisect_left(left, lo)]
        return out


def num_rows(path: Path) -> int:
    """A segment's row count from its footer; a corrupt file is an OSError naming it (the user has to move it away)."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise OSError(f"{path.name}: corrupt segment ({first_line(exc)})") from None


__all__ = ["FOREVER_US", "RunFiles", "Seg", "num_rows"]
