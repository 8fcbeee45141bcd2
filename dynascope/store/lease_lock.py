"""A lock for file systems without ``flock``: a lease file created exclusively, with an expiry.

Lustre mounted without ``-o flock`` (or ``-o localflock`` across nodes) answers ``flock`` with ENOSYS or
ENOLCK; some FUSE and object-store mounts do the same. There compaction's lock falls back to
``<run>/_compact.lease``: created with ``O_CREAT | O_EXCL`` (atomic on POSIX file systems and NFSv3+),
holding its owner and an expiry. A lease whose expiry has passed (its holder crashed) is taken over: the
new holder writes its own lease beside it and renames it over, then reads it back, and holds the lock only
if the file names it (of two that took over at once, one wins). ``release`` removes the file if it is
still its own.

``exclusive`` is the lock both kinds of compactor take: ``flock`` on a lock file, this lease where the file
system has none. The run's (``<run>/_compact.lock``) keeps one ``dynascope compact`` per run; a writer's
(``<run>/_writers/<id>.fold.lock``) keeps a writer folding its own directories and a ``compact`` merging in
them from writing overlapping merges, without making the writers of a run take turns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from dynascope.core.clock import now_us

__all__ = ["LEASE_FILE", "LEASE_TTL_S", "RUN_LOCK", "acquire", "exclusive", "release", "run_lock", "writer_lock"]

LEASE_FILE = "_compact.lease"
LEASE_TTL_S = 600.0  # far beyond one run's compaction pass; a crashed holder's lease frees after it
RUN_LOCK = ".compact.lock"  # <run>/.compact.lock: one compactor of a run at a time


def _read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def acquire(run_dir: Path, ttl_s: float = LEASE_TTL_S, name: str = LEASE_FILE) -> str | None:
    """Take the lease ``run_dir / name``; returns its owner token, or None when another holder's is current."""
    path = run_dir / name
    token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"owner": token, "expires_us": now_us() + int(ttl_s * 1e6)})
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        held = _read(path)
        if held is not None and int(held.get("expires_us", 0)) > now_us():
            return None
        tmp = path.with_name(f".{name}.{token}.tmp")  # expired (or unreadable): take it over
        tmp.write_text(body)
        os.replace(tmp, path)
        return token if (_read(path) or {}).get("owner") == token else None
    except OSError:
        return None
    with os.fdopen(fd, "w") as fh:
        fh.write(body)
    return token


def release(run_dir: Path, token: str, name: str = LEASE_FILE) -> None:
    """Drop the lease if it is still ``token``'s (an expired one another holder took over is theirs)."""
    path = run_dir / name
    if (_read(path) or {}).get("owner") == token:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(lock_path: Path, lease_name: str = LEASE_FILE) -> Iterator[bool]:
    """An exclusive, non-blocking lock on ``lock_path``; yields whether it was taken. Where the file system
    has no ``flock`` (ENOSYS, ENOLCK, EOPNOTSUPP), the lease ``lock_path.parent / lease_name`` instead."""
    try:
        fh = open(lock_path, "a+b")  # held for the with-block
    except OSError:
        yield True  # a read-only store cannot be compacted anyway; the merge reports why
        return
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # held by another compactor
                yield False
                return
            token = acquire(lock_path.parent, name=lease_name)
            try:
                yield token is not None
            finally:
                if token is not None:
                    release(lock_path.parent, token, name=lease_name)
            return
        yield True
    finally:
        fh.close()


def run_lock(run_dir: Path) -> contextlib.AbstractContextManager[bool]:
    """The run's compaction lock (``<run>/.compact.lock``): ``dynascope compact`` and the fold that puts a
    finished run at rest (``at_rest``) take it, so one of them at a time merges across the run's writers."""
    return exclusive(run_dir / RUN_LOCK)


def writer_lock(run_dir: Path, writer_id: str) -> contextlib.AbstractContextManager[bool]:
    """The lock on one writer's directories (``<run>/_writers/<id>.fold.lock``): its own fold and a
    ``compact`` merging in them take it, so their merges never overlap."""
    from dynascope.store.layout import HEARTBEATS

    beats = run_dir / HEARTBEATS
    if not beats.is_dir():  # a writer made it at its start; a run copied without it has no live writer
        return contextlib.nullcontext(True)
    return exclusive(beats / f"{writer_id}.fold.lock", f"{writer_id}.fold.lease")
