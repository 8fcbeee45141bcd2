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
from rich.text import Text

TABLE_ROWS = 1000  # a terminal table beyond this is unreadable: the rest goes to a file format
_STATUS_COLOUR = {"live": "green", "finished": "blue", "crashed": "red"}


def print_runs(runs: pl.DataFrame, console: Console, fmt: str = "auto") -> None:
    """The catalog (``catalog.list_runs``): a table on a terminal (``fmt`` auto or table), then one warning
    per run that could not be read; tab-separated values of every catalog column through a pipe (auto or
    tsv), the times as µs since the epoch and the problem in its own column."""
    if _tsv(console, fmt):
        write_tsv(console, runs.columns, runs.rows())
        return
    columns = ("run_id", "name", "status", "steps", "ranks", "restarts", "size", "last write", "started")
    rows = [(escape(r["run_id"]), escape(r["name"]), f"[{_STATUS_COLOUR[r['status']]}]{r['status']}[/]",
             "" if r["steps"] is None else str(r["steps"]), str(r["ranks"]),
             "" if r["restarts"] is None else str(r["restarts"]), _size(r["size_bytes"]),
             _ago(r["last_write_us"]), _when(r["start_us"])) for r in runs.iter_rows(named=True)]
    print_table(console, columns, rows, right=("steps", "ranks", "restarts", "size"))
    for r in runs.filter(pl.col("problem").is_not_null()).iter_rows(named=True):
        console.print(f"[yellow]warning:[/] {escape(r['run_id'])}: {escape(r['problem'])}", highlight=False)


def _tsv(console: Console, fmt: str) -> bool:
    """Whether ``fmt`` (auto, table or tsv) means tab-separated values: asked for, or auto off a terminal."""
    return fmt == "tsv" or (fmt == "auto" and not console.is_terminal)


def _tsv_cell(v: Any) -> str:
    """One TSV field: NULL is empty; backslash, tab, newline and carriage return are escaped (\\, \t, \n, \r),
    as PostgreSQL's text COPY format writes them, so every row stays one line of tab-separated fields."""
    if v is None:
        return ""
    return str(v).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def write_tsv(console: Console, columns: list[str], rows: Any) -> None:
    """A header line of column names, then one line per row of tab-separated fields (``_tsv_cell``)."""
    out = console.file
    out.write("\t".join(_tsv_cell(c) for c in columns) + "\n")
    for row in rows:
        out.write("\t".join(_tsv_cell(v) for v in row) + "\n")


def print_table(console: Console, columns: Any, rows: list[Any], right: tuple[str, ...] = ()) -> None:
    """A table that never cuts a value: as one table when it fits the console's width, else one block per
    row (column name, value), values folded onto as many lines as they need. Off a terminal (an explicit
    table format through a pipe) the table is printed at its full width."""
    table = Table(show_lines=False)
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    need = console.measure(table, options=console.options.update_width(100_000)).maximum  # its natural width
    if need <= console.width:
        console.print(table)
    elif not console.is_terminal:  # print caps a width at the console's own: a console as wide as the table
        Console(file=console.file, width=need, color_system=None).print(table)
    else:
        for i, row in enumerate(rows, 1):
            console.rule(f"row {i}", align="left", style="dim")
            block = Table.grid(padding=(0, 2))
            block.add_column(style="bold", no_wrap=True)
            block.add_column(overflow="fold")
            for col, value in zip(columns, row, strict=True):
                block.add_row(col, value)
            console.print(block)


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


# what `--out FILE` writes, by the file's extension
OUT_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
               ".tsv": "tsv", ".tab": "tsv", ".txt": "table"}


def out_format(fmt: str, out: Path) -> str:
    """The format a result saved to ``out`` is written in: the extension's with ``auto``, else ``fmt``, which
    must not contradict a known extension (a file named .parquet always holds Parquet)."""
    from dynascope.core.errors import UserError

    by_ext = OUT_FORMATS.get(out.suffix.lower())
    if fmt == "auto":
        if by_ext is None:
            raise UserError(f"cannot tell a format from the name {out.name!r}: end it in "
                            f"{', '.join(OUT_FORMATS)}, or pass --format")
        return by_ext
    if by_ext is not None and by_ext != fmt:
        raise UserError(f"--format {fmt} does not match {out.name!r}, whose extension means {by_ext}")
    return fmt


def write_result(result: pa.Table, fmt: str, out: Path | None, console: Console) -> None:
    """Print or save a query result as a table (on a terminal), tab-separated values (through a pipe), CSV,
    JSON lines or Parquet; ``fmt`` auto picks table or TSV by whether stdout is a terminal."""
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
    if out is not None:  # a file: TSV when asked, else the whole table at its full width
        with open(out, "w") as fh:
            file_console = Console(file=fh, width=10_000)
            if fmt == "tsv":
                write_tsv(file_console, result.column_names, (r.values() for r in result.to_pylist()))
            else:
                print_table(file_console, result.column_names, _cells(result.to_pylist()))
        return
    if _tsv(console, fmt):
        write_tsv(console, result.column_names, (r.values() for r in result.to_pylist()))
        return
    print_table(console, result.column_names, _cells(result.slice(0, TABLE_ROWS).to_pylist()))
    if result.num_rows > TABLE_ROWS:
        console.print(f"… {result.num_rows - TABLE_ROWS} more rows (use --format tsv/csv/json/parquet --out FILE)")


def _cells(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Query rows as table cells: NULL empty, the rest as text without markup."""
    return [[Text("" if v is None else str(v)) for v in row.values()] for row in rows]


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
