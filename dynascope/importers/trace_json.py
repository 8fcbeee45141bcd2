"""Streaming reader for Chrome-trace JSON (PyTorch profiler / Kineto): events out in chunks, never whole.

A trace is one JSON object whose ``traceEvents`` array holds the events; other top-level keys
(``distributedInfo``, ``baseTimeNanoseconds``, ...) may come before or after it. Parsing the whole document
into Python objects costs ~1 KB per event (HTA's approach, hundreds of GB for big jobs), so instead:

* the (gzip or plain) file is decompressed in ``block``-sized pieces, by zlib in a reader thread;
* the keys before the array are parsed with ``json`` (they are small);
* the array is cut into runs of whole events at a ``}`` ``,`` ``{`` boundary near the end of the buffer,
  and each run is handed to ``sink`` (DuckDB's JSON reader, in C++) as a view, not a copy. A cut that
  happens to fall inside a string or a nested object makes the sink's parse fail, and an earlier cut is
  tried: a prefix of the array's contents that parses as a list of values always ends on an element
  boundary, so a run the sink accepts is exactly a run of events;
* at the end of the file the array's closing ``]`` is the one after which the rest parses as the
  remainder of the top-level object (searched from the end, verified the same way).

Memory stays at a few blocks whatever the file size.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dynascope.core.errors import StoreError, first_line

BLOCK = 8 << 20              # bytes of events per parse: larger saves little time and costs memory
_MAX_BUFFER = 128 << 20      # no event boundary within this much data: the JSON is broken
_HEADER_LIMIT = 64 << 20     # traceEvents must start within this many bytes
_CUT = re.compile(rb"\}\s*,\s*\{")
_WS = re.compile(r"\s*")
_TAIL_WINDOW = 1 << 16
_READ = 1 << 20              # compressed bytes per read
_DECODE = json.JSONDecoder().raw_decode


Sink = Callable[[memoryview], None]  # takes a run of whole events (bytes ``{...}, {...}``), raises ChunkRejected


class TraceFormatError(StoreError):
    """The file is not a readable Chrome trace; the message is one line naming the file."""


class ChunkRejected(Exception):
    """Raised by a sink whose parser refused a run of events (the cut was not on an event boundary)."""


def _gunzip(fh: BinaryIO, block: int) -> Iterator[bytes]:
    """Decompressed pieces of at most ``block`` bytes. zlib directly, fed 1 MiB at a time: no per-8 KiB
    Python loop as in ``gzip.GzipFile``; the trailer's CRC and length are still checked, members that
    follow one another (concatenated gzip files) are read in turn."""
    d = zlib.decompressobj(wbits=31)
    data = b""
    while True:
        if not data:
            data = fh.read(_READ)
            if not data:
                if d.eof:
                    return
                raise EOFError("compressed file ended before the end-of-stream marker")
        if d.eof:  # one member ended and more bytes follow: the next member
            d = zlib.decompressobj(wbits=31)
        out = d.decompress(data, block)
        data = d.unused_data if d.eof else d.unconsumed_tail
        if out:
            yield out


def _plain(fh: BinaryIO, block: int) -> Iterator[bytes]:
    while data := fh.read(block):
        yield data


class _Source:
    """Decompressed bytes, read ahead by a thread (zlib releases the GIL, so gunzip overlaps parsing);
    codec errors become one-line TraceFormatErrors. A file that starts with the gzip magic is gunzipped,
    whatever its name says."""

    def __init__(self, path: Path, block: int) -> None:
        self.path = path
        self.fh = open(path, "rb")
        self.eof = False
        self.consumed = 0
        self._pieces = (_gunzip if self.fh.peek(2)[:2] == b"\x1f\x8b" else _plain)(self.fh, block)
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="dynascope-trace-read", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                item: bytes | BaseException = next(self._pieces, b"")
            except BaseException as exc:  # handed to the reading thread, which raises it
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not isinstance(item, bytes) or not item:
                return

    def read(self) -> bytes:
        """The next piece; b"" at the end of the file."""
        if self.eof:
            return b""
        item = self._queue.get()
        if isinstance(item, EOFError):
            raise TraceFormatError(f"{self.path}: truncated gzip stream (file ends mid-stream)")
        if isinstance(item, (OSError, zlib.error)):
            raise TraceFormatError(f"{self.path}: unreadable gzip data ({item})")
        if isinstance(item, BaseException):
            raise item
        if not item:
            self.eof = True
        self.consumed += len(item)
        return item

    def fill(self, buf: bytes, size: int) -> bytes:
        """``buf`` followed by the next pieces, until it holds ``size`` bytes or the file ends (one copy)."""
        pieces, n = [buf], len(buf)
        while n < size and not self.eof:
            pieces.append(self.read())
            n += len(pieces[-1])
        return b"".join(pieces)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.fh.close()


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _members(text: str, i: int, meta: dict[str, Any], stop_key: str | None) -> tuple[int, bool]:
    """Parse ``"key": value`` pairs of an object from ``text[i]`` (just after ``{`` or a ``,``).

    Returns (index, True) right after ``stop_key``'s ``:``, or (index after the closing ``}``, False).
    Raises ValueError (incl. JSONDecodeError) on anything else, IndexError when the text runs out.
    """
    i = _skip_ws(text, i)
    if text[i] == "}":
        return i + 1, False
    while True:
        key, i = _DECODE(text, i)
        if not isinstance(key, str):
            raise ValueError("object key is not a string")
        i = _skip_ws(text, i)
        if text[i] != ":":
            raise ValueError("expected ':'")
        i = _skip_ws(text, i + 1)
        if key == stop_key:
            return i, True
        meta[key], i = _DECODE(text, i)
        i = _skip_ws(text, i)
        if text[i] == "}":
            return i + 1, False
        if text[i] != ",":
            raise ValueError("expected ',' or '}'")
        i = _skip_ws(text, i + 1)


def _parse_header(src: _Source, meta: dict[str, Any]) -> bytes:
    """Read up to the start of ``traceEvents``; return the bytes that follow its ``[``."""
    buf = b""
    while True:
        data = src.read()
        buf += data
        start = buf.find(b"{")
        pos = buf.find(b'"traceEvents"')
        while pos >= 0:
            bracket = buf.find(b"[", pos)
            if bracket < 0:
                break
            try:
                # ASCII '[' never sits inside a multi-byte UTF-8 sequence, so this prefix decodes whole.
                text = buf[: bracket + 1].decode("utf-8")
                if start < 0 or text[:start].strip():
                    raise ValueError("not a JSON object")
                i, found = _members(text, start + 1, meta, "traceEvents")
            except (ValueError, IndexError, UnicodeDecodeError):
                found, i = False, -1
            if found and i == len(text) - 1:
                return buf[bracket + 1:]
            if found:  # "traceEvents" is there but its value is not an array
                raise TraceFormatError(f"{src.path}: 'traceEvents' is not an array; not a Chrome trace")
            pos = buf.find(b'"traceEvents"', pos + 1)  # that occurrence was inside some other value
        if not data or len(buf) > _HEADER_LIMIT:
            break
    _explain_missing_events(src.path, buf, src.eof)
    raise AssertionError("unreachable")


def _explain_missing_events(path: Path, buf: bytes, eof: bool) -> None:
    if not eof:
        raise TraceFormatError(f"{path}: no 'traceEvents' array in the first {_HEADER_LIMIT >> 20} MiB; "
                               "not a Chrome trace")
    try:
        doc = json.loads(buf)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({first_line(exc)})") from None
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{path}: JSON top level is a {type(doc).__name__}, not a Chrome trace object")
    if "traceEvents" in doc:
        raise TraceFormatError(f"{path}: 'traceEvents' is a {type(doc['traceEvents']).__name__}, not an array")
    raise TraceFormatError(f"{path}: JSON object has no 'traceEvents' key; not a Chrome trace")


def _trailer(buf: bytes, start: int) -> dict[str, Any] | None:
    """Members after the array's ``]`` (``, "k": v ... }`` or ``}``) when ``buf[start:]`` is exactly that."""
    for size in (_TAIL_WINDOW, len(buf) - start):
        text = buf[start:start + size].decode("utf-8", "replace")
        meta: dict[str, Any] = {}
        try:
            i = _skip_ws(text, 0)
            if text[i] == ",":
                i, _ = _members(text, i + 1, meta, None)
            elif text[i] == "}":
                i += 1
            else:
                return None
            return meta if not text[i:].strip() and start + size >= len(buf) else None
        except IndexError:  # ran past the window: only then decode the whole tail
            if size >= len(buf) - start:
                return None
        except ValueError:
            return None
    return None


def _plausible_end(buf: bytes, p: int) -> bool:
    """Cheap test before parsing: ``]`` preceded by ``}`` (or nothing) and followed by ``,`` or ``}``."""
    after = buf[p + 1:p + 256].lstrip()[:1]
    before = buf[max(0, p - 256):p].rstrip()[-1:]
    if after not in (b",", b"}"):
        return False
    return before == b"}" or (not before and not buf[:max(0, p - 256)].strip())


def _rstrip_end(buf: bytes, end: int) -> int:
    """The index just past the last non-whitespace byte before ``end``."""
    while end > 0 and buf[end - 1] in b" \t\r\n":
        end -= 1
    return end


def _finish(path: Path, buf: bytes, sink: Sink, meta: dict[str, Any]) -> None:
    """At end of file: find the array's closing bracket from the end, sink the last events, read the trailer."""
    end, tried = len(buf), 0
    while True:
        p = buf.rfind(b"]", 0, end)
        if p < 0 or tried > 64:
            raise TraceFormatError(f"{path}: truncated or malformed JSON in traceEvents (no parseable end of the array)")
        end = p
        if not _plausible_end(buf, p):
            continue
        trailer = _trailer(buf, p + 1)
        if trailer is None:
            continue
        tried += 1
        events = memoryview(buf)[:_rstrip_end(buf, p)]
        if events:
            try:
                sink(events)
            except ChunkRejected:
                continue
        meta.update(trailer)
        return


def stream_events(path: Path, sink: Sink, *, block: int = BLOCK) -> dict[str, Any]:
    """Feed ``path``'s trace events to ``sink`` as runs of whole events (``{...}, {...}`` bytes).

    ``sink`` raises ChunkRejected when its parser refuses a run. Returns the top-level keys other than
    ``traceEvents``. Raises TraceFormatError (one line) for truncated, non-trace or malformed files.
    """
    src = _Source(Path(path), block)
    meta: dict[str, Any] = {}
    try:
        buf = _parse_header(src, meta)
        while True:
            buf = src.fill(buf, block)
            if src.eof:
                _finish(src.path, buf, sink, meta)
                return meta
            rest = _sink_prefix(buf, sink)
            if len(rest) > _MAX_BUFFER:
                raise TraceFormatError(f"{src.path}: malformed JSON in traceEvents "
                                       f"(no parseable event boundary before byte {src.consumed})")
            # no cut worked: read at least one more piece before trying again
            buf = src.fill(rest, len(rest) + 1) if len(rest) == len(buf) else rest
    finally:
        src.close()


def _sink_prefix(buf: bytes, sink: Sink) -> bytes:
    """Sink the longest prefix of whole events the sink accepts among the last few cut candidates."""
    window = max(0, len(buf) - (1 << 20))
    cuts = list(_CUT.finditer(buf, window)) or list(_CUT.finditer(buf))
    for m in reversed(cuts[-8:]):
        try:
            sink(memoryview(buf)[: m.start() + 1])  # a view: the sink makes the one copy it needs
        except ChunkRejected:
            continue
        return buf[m.end() - 1:]
    return buf
