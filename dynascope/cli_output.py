"""What the ``dynascope`` commands print: the run catalog, query results and import summaries.

The store, importers and report return data; only the CLI (``cli.py`` and this module) prints it.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
from rich.console import Console
from rich.markup import escape
from rich.table import Table

TABLE_ROWS = 1000  # a terminal table beyond this is unreadable: the rest goes to a file format
_STATUS_COLOUR = {"live": "green", "finished": "blue", "crashed": "red"}


def print_runs(runs: pl.DataFrame, console: Console) -> None:
    """The catalog (``catalog.list_runs``) as a table, then one warning per run that could not be read."""
    table = Table(show_lines=False)
    for col in ("run_id", "name", "status", "steps", "ranks", "size", "last write", "started"):
        table.add_column(col, justify="right" if col in ("steps", "ranks", "size") else "left")
    for r in runs.iter_rows(named=True):
        table.add_row(
            escape(r["run_id"]), escape(r["name"]), f"[{_STATUS_COLOUR[r['status']]}]{r['status']}[/]",
            "" if r["steps"] is None else str(r["steps"]), str(r["ranks"]), _size(r["size_bytes"]),
            _ago(r["last_write_us"]), _when(r["start_us"]),
        )
    console.print(table)
    for r in runs.filter(pl.col("problem").is_not_null()).iter_rows(named=True):
        console.print(f"[yellow]warning:[/] {escape(r['run_id'])}: {escape(r['problem'])}", highlight=False)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ago(us: int | None) -> str:
    if us is None:
        return "never"
    s = max(0.0, time.time() - us / 1e6)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _when(us: int | None) -> str:
    return "" if us is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(us / 1e6))


def write_result(result: pa.Table, fmt: str, out: Path | None, console: Console) -> None:
    """Print or save a query result as a rich table, CSV, JSON lines or Parquet."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(result, out)
        return
    if fmt == "csv":
        import pyarrow.csv as pacsv

        if out is not None:
            pacsv.write_csv(result, out)
            return
        buf = io.BytesIO()
        pacsv.write_csv(result, buf)
        console.file.write(buf.getvalue().decode())
        return
    if fmt == "json":
        text = "\n".join(json.dumps(row, default=str) for row in result.to_pylist()) + "\n"
        if out is not None:
            Path(out).write_text(text)
        else:
            console.file.write(text)
        return
    table = Table(show_lines=False)
    for name in result.column_names:
        table.add_column(name)
    for row in result.slice(0, TABLE_ROWS).to_pylist():
        table.add_row(*["" if v is None else str(v) for v in row.values()])
    if out is not None:
        with open(out, "w") as fh:
            Console(file=fh, width=200).print(table)
        return
    console.print(table)
    if result.num_rows > TABLE_ROWS:
        console.print(f"… {result.num_rows - TABLE_ROWS} more rows (use --format csv/json/parquet --out FILE)")


def plain(console: Console, text: str) -> None:
    """A line of user data (paths, names): no markup, no highlighting."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def print_trace_import(result: Any, console: Console) -> None:
    """``dynascope import trace``: one line per rank's file, then the totals."""
    for rank, path in sorted(result.files.items()):
        plain(console, f"rank {rank}: {path}")
    rows = ", ".join(f"{n} {cat}" for cat, n in sorted(result.rows.items())) or "no rows"
    plain(console, f"imported {len(result.files)} file(s), {result.bytes_read / 1e6:.1f} MB of events "
                   f"in {result.seconds:.2f} s: {rows} → {result.run_dir}")


def print_wandb_import(hist: Any, run: Path, console: Console) -> None:
    """``dynascope import wandb``: what was imported, and what the log lacked."""
    plain(console, f"imported {len(hist.key)} values ({len(set(hist.key))} keys, {hist.rows} history rows) into {run}"
                   + (f"; skipped {hist.skipped} non-numeric values" if hist.skipped else ""))
    if hist.warning:
        plain(console, f"warning: {hist.warning}")
    if not hist.complete:
        plain(console, "note: the wandb log has no exit record yet (run still running, crashed, or not flushed)")


def run_diff(base: Path, checkpoints: list[Path], run: Path, console: Console, **options: Any) -> None:
    """``dynascope diff``: the checkpoint diff under a progress bar, then a summary line."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from dynascope.importers.checkpoint_diff import diff_checkpoints

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("diffing", total=None)

        def plan(total: int, skipped: list[str]) -> None:
            bar.update(task, total=total)
            if skipped:
                plain(console, f"skipping {len(skipped)} tensor(s) not in every checkpoint: {', '.join(skipped)}")

        s = diff_checkpoints(base, checkpoints, run, progress=lambda n: bar.advance(task, n), on_plan=plan, **options)
    steps = ", ".join(map(str, s.steps[:8])) + (" …" if len(s.steps) > 8 else "")
    plain(console, f"wrote {s.tensor_stats_rows} tensor_stats and {s.spectra_rows} spectra rows ({s.tensors} tensors × "
                   f"{len(s.steps)} checkpoints, steps {steps}) to {run} in {s.seconds:.1f} s "
                   f"({s.bytes_read / 1e9 / max(s.seconds, 1e-9):.2f} GB/s read)")
