"""One writer per node: the ranks of a node hand their flushes to one of them, which writes them with its own.

A run writes files per writer, so a node of 8 ranks has 8 writers' files, commit records and metadata
operations, and a query of a live run opens them all. With a node writer (``RunWriter(node=True)``,
``watch(node_writer=True)`` or ``DYNASCOPE_NODE_WRITER=1``) the first writer of the run on a node to start
listens on a local socket and the others send it their flushes: the node has one writer's files.

- **Where.** A Linux abstract socket named by the run directory and the node (``key``: the host name by
  default), so it creates no file and needs no shared directory. The listener accepts only processes of
  its own user (``SO_PEERCRED``) and reads Arrow IPC, never pickle.
- **Off the training thread.** A rank's ``append`` is unchanged; its writer thread converts each flush to
  Arrow as before and sends it instead of writing it. The node writer appends what it receives to its own
  buffers, stamped with the sender's rank, role and generation, and writes them at its next flush.
- **Handing over.** A flush is sent whole (``B``), the node writer answers that it has read it (``G``),
  or refuses it while closing (``R``), and the sender then commits it (``C``); the node writer buffers it
  only on ``C``. A sender that gets no ``G`` within ``TIMEOUT_S`` writes the flush itself: a flush is never
  written twice. The rows a node writer has buffered are as safe as its own process's: a crash loses what
  it had not flushed.
- **Taking over.** A node writer that closes (its rank finished first) or dies frees the socket's name; the
  first sender to find it so binds it and is the node writer from then on (an ``events`` row
  ``node_takeover``), and the others hand their flushes to it.
- **Falling back.** A sender whose node writer does not answer in ``TIMEOUT_S`` (busy, or stopped), or that
  finds no node writer to take over from within ``TAKEOVER_S``, writes that flush itself, and its own files
  for ``RETRY_S`` (doubling while it keeps failing), then tries it again. An ``events`` row
  ``node_fallback`` says so each time; training never waits on another rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from dynascope.store.buffer import ARROW
from dynascope.store.flush import Flushed, Group

if TYPE_CHECKING:
    from dynascope.store.writer import RunWriter

__all__ = ["TIMEOUT_S", "Node", "NodeLink", "NodeServer", "attach", "node_key"]

TIMEOUT_S = 10.0  # a sender's wait for the node writer's answer, on its writer thread (a flush interval of watch())
RETRY_S, RETRY_MAX_S = 60.0, 3600.0  # after a failed hand-over, the sender writes its own files this long
TAKEOVER_S = 2.0  # a node writer that closed frees its name within this (its listener's wake-up: 0.5 s)
_HEADER = struct.Struct("!I")
_MAX_HEADER = 1 << 20


def node_key(node: bool | str | None) -> str | None:
    """The node a writer shares: ``node`` itself when a string, the host name when True; None: off
    (``DYNASCOPE_NODE_WRITER``: ``1`` for the host name, or a key; unset or ``0``: off); off but on Linux."""
    if node is None:
        env = os.environ.get("DYNASCOPE_NODE_WRITER", "0")
        node = False if env in ("", "0") else (True if env == "1" else env)
    if node is False or not sys.platform.startswith("linux"):  # abstract sockets are Linux's
        return None
    return socket.gethostname() if node is True else str(node)


def address(run_dir: os.PathLike, key: str) -> str:
    """The abstract socket of a run's node writer on node ``key``."""
    digest = hashlib.sha1(f"{os.fspath(run_dir)}\0{key}".encode()).hexdigest()[:24]
    return f"\0dynascope-node-{digest}"


class Node(Protocol):
    """What a writer asks of its place on the node (``RunWriter.node``)."""

    @property
    def alive(self) -> bool:
        """Whether the next flush goes to the node writer (``forward``), not to this writer's own files."""
        ...
    def forward(self, groups: list[Group]) -> Flushed | None: ...
    def before_close(self, timeout_s: float) -> None: ...
    def after_close(self) -> None: ...
    def forget(self) -> None: ...


def attach(w: RunWriter, key: str) -> Node:
    """Listen for the node's other writers, or, if one already does, send to it."""
    try:
        return NodeServer(w, address(w.run_dir, key))
    except OSError:  # in use: another writer of this run on this node listens
        return NodeLink(w, address(w.run_dir, key))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _encode(groups: list[Group]) -> list[bytes]:
    """A flush's source tables (rollups are the node writer's to compute) as a header and Arrow IPC streams."""
    blobs, parts = [], []
    for g in groups:
        table, arrow = g.parts[0]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, arrow.schema) as out:
            out.write_table(arrow)
        blob = sink.getvalue().to_pybytes()
        parts.append([table, len(blob)])
        blobs.append(blob)
    header = json.dumps(parts).encode()
    return [b"B", _HEADER.pack(len(header)), header, *blobs]


class NodeLink:
    """A sender: ``forward`` hands a flush to the node writer, or returns None for the writer to write it."""

    def __init__(self, w: RunWriter, addr: str) -> None:
        self.w, self.addr = w, addr
        self.gone = False  # in a forked child: the parent's link, never used
        self.fallbacks = 0
        self.retry_at = 0.0  # after a failed hand-over, when to try the node writer again (time.monotonic())
        self.retry_s = RETRY_S
        self.rows_forwarded = 0
        self._sock: socket.socket | None = None

    @property
    def alive(self) -> bool:
        """Whether the next flush goes to the node writer."""
        return not self.gone and time.monotonic() >= self.retry_at

    def forward(self, groups: list[Group]) -> Flushed | None:
        """Hand ``groups`` to the node writer; None: this writer writes them (fallen back, or the node writer
        now)."""
        if not self.alive:
            return None
        try:
            self._send(groups)
        except TimeoutError as exc:  # busy or stopped, but there: not to be taken over
            self.fall_back(exc)
            return None
        except Exception as exc:  # closing or gone: this writer takes its place, or another sender did
            self.stop()
            if not self._rejoin(groups, exc):
                return None
        self.retry_s = RETRY_S
        self.rows_forwarded += sum(g.parts[0][1].num_rows for g in groups)
        return Flushed(next_seq=self.w._seq)  # nothing committed here: the node writer's flush commits it

    def _send(self, groups: list[Group]) -> None:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(TIMEOUT_S)
            self._sock.connect(self.addr)
        self._sock.sendall(b"".join(_encode(groups)))
        if _recv_exact(self._sock, 1) != b"G":
            raise ConnectionRefusedError("the node writer is closing")
        self._sock.sendall(b"C")

    def _rejoin(self, groups: list[Group], exc: Exception) -> bool:
        """After the node writer closed or died: bind its name and be the node writer (False: this writer
        writes ``groups``), or hand them to the sender that did (True). Within ``TAKEOVER_S``, else it falls
        back."""
        deadline = time.monotonic() + TAKEOVER_S
        while not self.w._closed:  # a closing writer takes nothing over: it writes its last flushes itself
            try:
                server = NodeServer(self.w, self.addr, before=self)
            except OSError:  # the name is held: the old node writer's, not yet released, or a new one's
                pass
            else:
                with self.w._lock:  # close_writer reads ``node`` under this lock when it marks the writer closed
                    took = not self.w._closed
                    if took:
                        self.w.node = server
                if not took:
                    server.stop(0.0)
                    break
                self.w._problem("node_takeover", f"the node writer went away ({type(exc).__name__}: {exc}); "
                                                 "this writer is the node writer from now on")
                return False
            try:
                self._send(groups)
                return True
            except (ConnectionError, FileNotFoundError) as again:  # between two node writers
                self.stop()
                exc = again
            except Exception as again:
                exc = again
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        self.fall_back(exc)
        return False

    def fall_back(self, exc: Exception) -> None:
        """This flush, and those of the next ``retry_s`` (doubling while it keeps failing), this writer writes
        itself; then it tries the node writer again. A node writer that did not answer may be busy (a
        checkpoint holding its process); one that is gone refuses the connection at once, at no cost."""
        self.stop()
        self.fallbacks += 1
        self.retry_at = time.monotonic() + self.retry_s
        self.w._problem("node_fallback", f"node writer unavailable ({type(exc).__name__}: {exc}); this writer "
                                         f"writes its own files for {self.retry_s:g} s, then tries it again")
        self.retry_s = min(self.retry_s * 2, RETRY_MAX_S)

    def forget(self) -> None:
        self.gone = True
        self.stop()

    def before_close(self, timeout_s: float) -> None:
        pass

    def after_close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class NodeServer:
    """The node writer's listener: a thread accepting senders, a thread per sender reading its flushes."""

    def __init__(self, w: RunWriter, addr: str, before: NodeLink | None = None) -> None:
        self.w, self.addr = w, addr
        self.before = before  # the sender this writer was, if it took the node writer's place
        self.rows_received = 0
        self.senders = 0
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._answered: set[threading.Thread] = set()  # answered a flush, waiting for its commit
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._seal_bytes = w.journal.seal_bytes if w.journal is not None else 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(addr)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(0.5)  # wakes to see that it is closing
        self._acceptor = threading.Thread(target=self._accept, name="dynascope-node-accept", daemon=True)
        self._acceptor.start()

    @property
    def alive(self) -> bool:
        return False  # it never forwards: its own flushes it writes

    def forward(self, groups: list[Group]) -> Flushed | None:
        return None

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():  # another user's process: not a rank of ours
                conn.close()
                continue
            conn.settimeout(0.5)
            t = threading.Thread(target=self._serve, args=(conn,), name="dynascope-node-recv", daemon=True)
            with self._lock:  # senders that left (one that fell back comes back on a new connection) are dropped
                kept = [(c, x) for c, x in zip(self._conns, self._threads, strict=True) if x.is_alive()]
                self._conns, self._threads = [c for c, _ in kept] + [conn], [x for _, x in kept] + [t]
                self.senders += 1
                ranks = 1 + len(self._threads)  # itself and its senders
            if self.w.journal is not None:  # a journal's size bound is per rank: it holds the node's rows
                self.w.journal.seal_bytes = max(self.w.journal.seal_bytes, self._seal_bytes * ranks)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    kind = conn.recv(1)
                except TimeoutError:
                    if self._closing.is_set():
                        return
                    continue
                if kind != b"B":
                    return  # closed by the sender (b"") or not our protocol
                conn.settimeout(TIMEOUT_S)
                (n,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if n > _MAX_HEADER:
                    return
                parts = json.loads(_recv_exact(conn, n))
                tables = [(str(t), pa.ipc.open_stream(_recv_exact(conn, int(size))).read_all()) for t, size in parts]
                if self._closing.is_set() or self.w._closed:
                    conn.sendall(b"R")
                    return
                me = threading.current_thread()
                self._answered.add(me)
                try:
                    conn.sendall(b"G")
                    if _recv_exact(conn, 1) != b"C":
                        return
                finally:
                    self._answered.discard(me)
                for table, arrow in tables:  # the sender's own columns (rank, role, generation) travel in it
                    self.w.append(table, {ARROW: arrow})
                    self.rows_received += arrow.num_rows
                conn.settimeout(0.5)
        except Exception:  # a sender that died or spoke garbage: its connection only
            return
        finally:
            conn.close()

    def before_close(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s``, for the senders to close first (the ranks of a node close together), then
        refuse further flushes and let those answered land within as long again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not any(t.is_alive() for t in self._threads):
                    break
            time.sleep(0.02)
        self.stop(timeout_s)

    def after_close(self) -> None:
        pass

    def forget(self) -> None:
        """In a forked child: close its copies of the sockets (the parent's stay open). No lock: a parent's
        thread may have held it at the fork."""
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass

    def stop(self, timeout_s: float = 2.0) -> None:
        """Refuse further flushes, free the name for a sender to take over, and let the flushes already
        answered land, within ``timeout_s``."""
        self._closing.set()
        deadline = time.monotonic() + timeout_s
        try:  # wakes the listener (Linux), whose socket then closes, releasing the name
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._acceptor.join(min(timeout_s, 1.0))
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        # A flush answered lands: its sender counts it written. Each such thread gives up by itself within
        # TIMEOUT_S of its answer (its wait for the sender's confirmation), so one shared deadline is enough.
        answered_by = time.monotonic() + TIMEOUT_S
        for t in list(self._answered):
            t.join(max(answered_by - time.monotonic(), 0.0))


def describe(link: Any) -> dict[str, Any]:
    """What a writer's node link did, for its ``run_end`` event."""
    if isinstance(link, NodeServer):
        took = {} if link.before is None else {"node_took_over": True, **describe(link.before)}
        return {**took, "node": "writer", "node_senders": link.senders, "node_rows_received": link.rows_received}
    if isinstance(link, NodeLink):
        return {"node": "sender", "node_rows_forwarded": link.rows_forwarded, "node_fallbacks": link.fallbacks}
    return {}
