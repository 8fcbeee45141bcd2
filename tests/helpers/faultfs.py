"""A FUSE pass-through file system whose writes fail or stall on command, for the store's fault tests.

    python tests/helpers/faultfs.py BACKING MOUNTPOINT CONTROL

mounts BACKING at MOUNTPOINT (libfuse 2 through ``fusepy``, in the foreground). Reads always pass. What
writes do (create, write, truncate, rename, mkdir, unlink, fsync) is the word in the file CONTROL, read
at each call:

- ``ok``: pass through;
- ``enospc`` / ``eio``: fail with that errno, as a full disk or a dying one does;
- ``stall``: block until the word changes, as an NFS or Lustre server that stops answering does (and
  then pass through).

Every write-side call, and every ``readdir`` and ``getattr`` (the metadata reads a listing makes), is counted
in CONTROL + ".ops" (one line per call: its name), so a test or benchmark can say how many metadata
operations a writer made.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fuse import FUSE, FuseOSError, Operations  # fusepy

_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}
_STALL_LIMIT_S = 300.0  # a test that forgets to lift the stall does not hang the machine forever


class FaultFS(Operations):
    def __init__(self, root: str, control: str) -> None:
        self.root, self.control = os.path.realpath(root), control
        self.ops = open(control + ".ops", "a", buffering=1)
        self.oplock = threading.Lock()  # not "lock": that name is a FUSE operation

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _mode(self) -> str:
        try:
            with open(self.control) as fh:
                return fh.read().strip() or "ok"
        except OSError:
            return "ok"

    def _count(self, op: str) -> None:
        with self.oplock:
            self.ops.write(op + "\n")

    def _gate(self, op: str) -> None:
        self._count(op)
        deadline = time.monotonic() + _STALL_LIMIT_S
        while (mode := self._mode()) == "stall" and time.monotonic() < deadline:
            time.sleep(0.01)
        if mode in _ERRNO:
            raise FuseOSError(_ERRNO[mode])

    # --- reads pass through ------------------------------------------------------------------------
    def access(self, path, amode):
        if not os.access(self._p(path), amode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path, fh=None):
        self._count("getattr")
        st = os.lstat(self._p(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                            "st_size", "st_uid")}

    def readdir(self, path, fh):
        self._count("readdir")
        return [".", "..", *os.listdir(self._p(path))]

    def readlink(self, path):
        return os.readlink(self._p(path))

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
            self._gate("open_write")
        return os.open(self._p(path), flags)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        return os.close(fh)

    def flush(self, path, fh):
        return None

    # --- writes go through the gate ----------------------------------------------------------------
    def create(self, path, mode, fi=None):
        self._gate("create")
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def write(self, path, data, offset, fh):
        self._gate("write")
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._gate("truncate")
        with open(self._p(path), "r+b") as f:
            f.truncate(length)

    def fsync(self, path, datasync, fh):
        self._gate("fsync")
        return os.fsync(fh)

    def mkdir(self, path, mode):
        self._gate("mkdir")
        return os.mkdir(self._p(path), mode)

    def rmdir(self, path):
        self._gate("rmdir")
        return os.rmdir(self._p(path))

    def unlink(self, path):
        self._gate("unlink")
        return os.unlink(self._p(path))

    def rename(self, old, new):
        self._gate("rename")
        return os.rename(self._p(old), self._p(new))

    def link(self, target, source):
        self._gate("link")
        return os.link(self._p(source), self._p(target))

    def symlink(self, target, source):
        self._gate("symlink")
        return os.symlink(source, self._p(target))

    def chmod(self, path, mode):
        return os.chmod(self._p(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._p(path), uid, gid)

    def utimens(self, path, times=None):
        self._gate("utimens")
        return os.utime(self._p(path), times)


class Mount:
    """This file system mounted by a daemon of its own, for a test or a benchmark: ``backing`` (the real
    directory), ``path`` (the mount point), ``control`` (the word) and ``ops`` (the counted calls)."""

    def __init__(self, root: Path, timeout_s: float = 30.0) -> None:
        self.backing, self.path, self.control = root / "backing", root / "mnt", root / "control"
        self.ops = Path(str(self.control) + ".ops")
        self.backing.mkdir()
        self.path.mkdir()
        self.set("ok")
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.backing), str(self.path), str(self.control)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not os.path.ismount(self.path) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not os.path.ismount(self.path):
            err = self.proc.stderr.read().decode() if self.proc.poll() is not None and self.proc.stderr else ""
            self.close()
            raise RuntimeError(f"the FUSE mount did not come up within {timeout_s:g} s {err}".strip())

    def set(self, mode: str) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(mode)
        os.replace(tmp, self.control)  # the daemon reads a whole word, never half of one

    def close(self) -> None:
        self.set("ok")
        subprocess.run(["fusermount", "-u", "-z", str(self.path)], check=False, capture_output=True)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    backing, mountpoint, control = sys.argv[1:4]
    FUSE(FaultFS(backing, control), mountpoint, foreground=True, nothreads=False, allow_other=False)
