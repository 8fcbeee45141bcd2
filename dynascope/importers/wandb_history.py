"""Import a wandb run's history into a run's ``scalars`` table.

Two sources:

* an offline (or synced) run directory holding ``run-<id>.wandb``: wandb's append-only transaction log.
  wandb ≥ 0.19 no longer ships a Python reader for it (the Go ``wandb-core`` writes and replays it), so
  ``read_transaction_log`` below decodes the framing itself — LevelDB-log style: a 7-byte file header
  ``":W&B" 0xBEE1 v0``, 32 KiB blocks, records ``crc32 u32 | length u16 | type u8`` split FULL / FIRST /
  MIDDLE / LAST across blocks, crc = zlib.crc32(data, seeded with crc32(type byte)) — and parses each
  payload with wandb's own protobuf classes (``wandb.proto.wandb_internal_pb2.Record``).
* an exported history file: CSV, JSON lines (e.g. ``wandb-history.jsonl``) or Parquet, one row per
  history step with ``_step`` / ``_timestamp`` columns and one column per metric.

Every finite-or-not numeric value becomes one ``scalars`` row (NaN/Inf are kept: a NaN loss is data).
Keys starting with ``_`` (wandb's bookkeeping) and non-numeric values (tables, media, text) are skipped
and counted. The step is wandb's ``_step`` unless ``step_key`` names another logged key, e.g.
``train/global_step`` for HF runs; a row without that key inherits the last value seen.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynascope.core.errors import StoreError, first_line
from dynascope.store import RunWriter

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_RECORD = struct.Struct("<IHB")   # crc32, length, type
_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_TABLE_SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class History:
    """Long-format history: parallel lists, one entry per (row, key)."""

    step: list[int | None] = field(default_factory=list)
    time_us: list[int | None] = field(default_factory=list)
    key: list[str] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    skipped: int = 0  # non-numeric values left out
    rows: int = 0     # history rows (wandb.log calls) read
    config: dict[str, Any] = field(default_factory=dict)
    warning: str | None = None  # e.g. a torn tail on a crashed run
    complete: bool = True       # a .wandb log ends with an exit record once wandb-core has flushed it all
    stepped: int = 0            # rows that logged the step key themselves

    def add_row(self, items: dict[str, Any], step_key: str, last_step: int | None) -> int | None:
        """Append one history row; returns the step it used (carried forward to the next row)."""
        self.rows += 1
        step = _as_int(items.get(step_key))
        self.stepped += step is not None
        step = last_step if step is None else step
        ts = _as_number(items.get("_timestamp"))
        time_us = int(ts * 1e6) if ts is not None and math.isfinite(ts) else None
        for k, v in items.items():
            if k.startswith("_"):
                continue
            number = _as_number(v)
            if number is None:
                self.skipped += 1
                continue
            self.step.append(step)
            self.time_us.append(time_us)
            self.key.append(k)
            self.value.append(number)
        return step


# ---- the .wandb transaction log -------------------------------------------------------------------------
def read_transaction_log(path: Path) -> Iterator[bytes]:
    """Yield each record payload of a ``.wandb`` file; stops (with ``TornLog``) at a torn or corrupt tail."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise StoreError(f"{path}: too short to be a wandb transaction log")
    ident, magic, version = _HEADER.unpack_from(data, 0)
    if ident != _IDENT or magic != _MAGIC:
        raise StoreError(f"{path}: not a wandb transaction log (bad header)")
    if version != _VERSION:
        raise StoreError(f"{path}: wandb transaction log version {version} is not supported (expected {_VERSION})")
    pos, pending = _HEADER.size, bytearray()
    while pos < len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD.size:  # the writer pads a block tail too short for a header
            pos += left_in_block
            continue
        if pos + _RECORD.size > len(data):
            raise TornLog(pos, "truncated record header")
        crc, length, kind = _RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero fill: end of written data
            return
        payload = data[pos + _RECORD.size: pos + _RECORD.size + length]
        if len(payload) < length:
            raise TornLog(pos, "truncated record")
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise TornLog(pos, "checksum mismatch")
        pos += _RECORD.size + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = bytearray(payload)
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield bytes(pending + payload)
            pending = bytearray()
        else:
            raise TornLog(pos, f"unknown record type {kind}")


class TornLog(Exception):
    """The log ends in a partial or corrupt record (a crashed or still-running writer)."""

    def __init__(self, offset: int, why: str) -> None:
        super().__init__(f"stopped at byte {offset}: {why}")


def read_wandb_file(path: Path, step_key: str = "_step") -> History:
    """History rows and config of one ``.wandb`` transaction log, decoded with wandb's protobuf classes."""
    from dynascope.core.extras import require

    pb = require("wandb.proto.wandb_internal_pb2", "dynascope import wandb (for .wandb files)")
    hist, last_step = History(complete=False), None
    try:
        for payload in read_transaction_log(path):
            record = pb.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {_item_key(i): _json_value(i.value_json) for i in record.history.item}
                if "_step" not in items and record.history.HasField("step"):
                    items["_step"] = record.history.step.num
                last_step = hist.add_row(items, step_key, last_step)
            elif kind == "exit":
                hist.complete = True
            elif kind in ("run", "config"):  # the run record carries the init-time config
                updates = record.run.config.update if kind == "run" else record.config.update
                for item in updates:
                    if not _item_key(item).startswith("_"):
                        hist.config[_item_key(item)] = _json_value(item.value_json)
    except TornLog as exc:
        hist.warning = f"{path.name}: {exc}; kept the {hist.rows} history rows before it"
    return hist


def _item_key(item: Any) -> str:
    # wandb stores nested dict keys as a path; its UI shows them joined with "."
    return item.key or ".".join(item.nested_key)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- exported history files -----------------------------------------------------------------------------
def read_table_file(path: Path, step_key: str = "_step") -> History:
    """History rows from an exported CSV / JSON lines / Parquet file (one row per step, one column per key)."""
    kind = _TABLE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise StoreError(f"{path}: unknown history file type (expected .wandb, .csv, .jsonl or .parquet)")
    hist, last_step = History(), None
    for row in _table_rows(path, kind):
        if step_key not in row and step_key == "_step":
            row.setdefault("_step", row.get("Step", row.get("step")))
        last_step = hist.add_row(row, step_key, last_step)
    return hist


def _table_rows(path: Path, kind: str) -> Iterator[dict[str, Any]]:
    if kind == "jsonl":
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise StoreError(f"{path}:{n}: not valid JSON") from None
                if isinstance(obj, dict):
                    yield _flatten(obj)
        return
    import polars as pl

    try:
        frame = pl.read_csv(path, infer_schema_length=None) if kind == "csv" else pl.read_parquet(path)
    except Exception as exc:
        raise StoreError(f"{path}: could not read {kind} ({type(exc).__name__}: {first_line(exc)})") from None
    yield from frame.iter_rows(named=True)


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and "_type" not in v:  # a nested metric dict, not a wandb media object
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


# ---- entry points ---------------------------------------------------------------------------------------
def find_source(path: Path) -> Path:
    """The ``.wandb`` file or history file that ``path`` names (a run directory must hold exactly one)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise StoreError(f"{p}: no such file or directory")
    if p.is_file():
        return p
    logs = sorted(p.glob("*.wandb")) or sorted(p.glob("*/*.wandb"))
    if len(logs) == 1:
        return logs[0]
    if len(logs) > 1:
        names = ", ".join(str(x.relative_to(p)) for x in logs[:4])
        raise StoreError(f"{p}: holds {len(logs)} wandb runs ({names}{', …' if len(logs) > 4 else ''}); pass one")
    tables = sorted(x for x in p.iterdir() if x.suffix.lower() in _TABLE_SUFFIXES)
    if len(tables) == 1:
        return tables[0]
    raise StoreError(f"{p}: no run-*.wandb file or single history file (.csv/.jsonl/.parquet) found")


def read_history(path: Path, step_key: str = "_step") -> History:
    """Read the history behind ``path`` (run directory, ``.wandb`` file or exported table)."""
    source = find_source(path)
    if source.suffix == ".wandb":
        return read_wandb_file(source, step_key)
    return read_table_file(source, step_key)


def import_history(path: Path, run: Path, step_key: str = "_step", chunk: int = 200_000) -> History:
    """Read ``path`` and append its numeric history to ``run``'s ``scalars`` (role ``wandb``).

    Refuses (``StoreError``, before writing anything) a ``step_key`` that no row logs, which would leave
    every step NULL, and a source that ``run`` already holds, whose rows a second import would double."""
    source = find_source(path).resolve()
    _check_not_imported(source, run)
    hist = read_history(path, step_key)
    if hist.rows and not hist.stepped:
        keys = sorted(set(hist.key))
        shown = ", ".join(keys[:8]) + (", …" if len(keys) > 8 else "")
        raise StoreError(f"{source}: no history row logs --step-key {step_key!r} (numeric keys logged: {shown or 'none'})")
    writer = RunWriter(run, role="wandb", framework="wandb", config=hist.config or None)
    try:
        for lo in range(0, len(hist.key), chunk):
            hi = lo + chunk
            writer.append("scalars", {"step": hist.step[lo:hi], "time_us": hist.time_us[lo:hi],
                                      "key": hist.key[lo:hi], "value": hist.value[lo:hi]})
        writer.event("import", f"wandb history from {Path(path).name}", source=str(source),
                     rows=hist.rows, values=len(hist.key), skipped=hist.skipped)
    finally:
        writer.close()
    return hist


def _check_not_imported(source: Path, run: Path) -> None:
    """Refuse a wandb source whose history ``run`` already holds (its import event names the source)."""
    from dynascope.store import open_store
    from dynascope.store.layout import MARKER

    if not (Path(run) / MARKER).exists():
        return
    with open_store(run) as con:
        prior = con.sql("SELECT fields_json FROM events WHERE event = 'import' AND role = 'wandb'").fetchall()
    for (fields,) in prior:
        earlier = json.loads(fields or "{}").get("source")
        if earlier and Path(earlier).resolve() == source:
            raise StoreError(f"{run}: already holds the wandb history of {source}; import into a new run")


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return None


def _as_int(value: Any) -> int | None:
    number = _as_number(value)
    return int(number) if number is not None and math.isfinite(number) else None
