"""A lock for file systems without ``flock``: a lease file created exclusively, with an expiry.

Lustre mounted without ``-o flock`` (or ``-o localflock`` across nodes) answers ``flock`` with ENOSYS or
ENOLCK; some FUSE and object-store mounts do the same. There compaction's lock falls back to
``<run>/_compact.lease``: created with ``O_CREAT | O_EXCL`` (atomic on POSIX file systems and NFSv3+),
holding its owner and an expiry. A lease whose expiry has passed (its holder crashed) is taken over: the
new holder writes its own lease beside it and renames it over, then reads it back, and holds the lock only
if the file names it (of two that took over at once, one wins). ``release`` removes the file if it is
still its own.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

from dynascope.core.clock import now_us

__all__ = ["LEASE_FILE", "LEASE_TTL_S", "acquire", "release"]

LEASE_FILE = "_compact.lease"
LEASE_TTL_S = 600.0  # far beyond one run's compaction pass; a crashed holder's lease frees after it


def _read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def acquire(run_dir: Path, ttl_s: float = LEASE_TTL_S) -> str | None:
    """Take the run's lease; returns its owner token, or None when another holder's lease is current."""
    path = run_dir / LEASE_FILE
    token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"owner": token, "expires_us": now_us() + int(ttl_s * 1e6)})
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        held = _read(path)
        if held is not None and int(held.get("expires_us", 0)) > now_us():
            return None
        tmp = path.with_name(f".{LEASE_FILE}.{token}.tmp")  # expired (or unreadable): take it over
        tmp.write_text(body)
        os.replace(tmp, path)
        return token if (_read(path) or {}).get("owner") == token else None
    except OSError:
        return None
    with os.fdopen(fd, "w") as fh:
        fh.write(body)
    return token


def release(run_dir: Path, token: str) -> None:
    """Drop the lease if it is still ``token``'s (an expired one another holder took over is theirs)."""
    path = run_dir / LEASE_FILE
    if (_read(path) or {}).get("owner") == token:
        path.unlink(missing_ok=True)
