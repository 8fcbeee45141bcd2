"""``dynascope files`` and ``dynascope fleet``: a store for other engines, and a summary of a fleet of runs.

Registered on the main app by ``cli.py``; heavy modules are imported inside each command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from dynascope.core.errors import UserError

if TYPE_CHECKING:
    from dynascope.store.snapshot import Snapshot

_err = Console(stderr=True)
PROGRESS_FROM_RUNS = 50  # a listing of fewer runs takes well under a second: no bar
JAVA_HINT = ("dynascope fleet --engine spark needs a Java 17 runtime, which Spark could not start; install one "
             "(e.g. apt-get install openjdk-17-jre-headless) or point JAVA_HOME at it")


def files(
    path: Annotated[Path, typer.Argument(help="Run directory or store root.")],
    table: Annotated[str, typer.Argument(help="Table: runs, tensor_stats, timings, ... (see `dynascope sql --help`).")],
    at_us: Annotated[int | None, typer.Option("--at-us", help="The files live at this moment (µs since the epoch).")] = None,
) -> None:
    """Print the segment files a query of TABLE reads now, one path per line (for Spark, Trino, any reader)."""
    from dynascope.store.live import live_files
    from dynascope.store.schema import TABLES

    if table not in TABLES:
        raise UserError(f"unknown table {table!r} (tables: {', '.join(TABLES)})")
    out = sys.stdout
    for f in live_files(path, table, at_us):
        out.write(f + "\n")


def fleet(
    root: Annotated[Path, typer.Argument(help="Store root (or one run directory).")],
    engine: Annotated[str, typer.Option("--engine", help="duckdb (in this process) or spark (local[2]).")] = "duckdb",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the summary to this Parquet file.")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table (one block per run) | csv | json")] = "table",
    lease_s: Annotated[float, typer.Option("--lease-s", help="Pin the files read against compaction this long.")] = 3600.0,
) -> None:
    """One row per run: status, steps, step time, stragglers, update ratios, PULSE S₁, sparsity, rank-1 energy."""
    from rich.markup import escape
    from rich.progress import Progress

    from dynascope.analyses.fleet import ENGINES
    from dynascope.cli_output import write_result
    from dynascope.store.snapshot import snapshot

    if engine not in ENGINES:
        raise UserError(f"unknown --engine {engine!r} (duckdb or spark)")
    if format not in ("table", "csv", "json"):
        raise UserError(f"unknown --format {format!r} (table, csv or json)")
    if lease_s <= 0:
        raise UserError("--lease-s must be > 0")
    if engine == "spark":
        from dynascope.core.extras import check_installed

        check_installed(["pyspark"], "dynascope fleet --engine spark")
    # A bar only on a terminal: through a pipe even a transient one leaves a blank line on stderr.
    with Progress(console=_err, transient=True, disable=not _err.is_terminal) as bar:
        task = None

        def progress(done: int, total: int) -> None:
            nonlocal task
            if total >= PROGRESS_FROM_RUNS:
                if task is None:
                    task = bar.add_task("listing runs", total=total)
                bar.update(task, completed=done)

        with snapshot(root, lease_ttl_s=lease_s, holder="dynascope-fleet", progress=progress) as snap:
            summary = _summary(snap, engine)
    if out is not None:
        summary.write_parquet(out)
        _err.print(f"wrote {out}: {summary.height} runs", highlight=False, markup=False)
        return
    if format != "table":
        write_result(summary.to_arrow(), format, None, Console())
        return
    console = Console()
    for row in summary.iter_rows(named=True):  # a run per block: seventeen columns fit no terminal
        console.print(f"[bold]{escape(str(row['run_id']))}[/]")
        for key, value in row.items():
            if key != "run_id":
                text = "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
                console.print(f"  {key:<32} {escape(text)}", highlight=False, soft_wrap=True)


def _summary(snap: Snapshot, engine: str) -> Any:
    """``fleet_summary``, with Spark's failure to start its JVM said as what to install."""
    from dynascope.analyses.fleet import fleet_summary

    try:
        return fleet_summary(snap, engine)
    except Exception as exc:
        if engine == "spark" and ("JAVA_GATEWAY_EXITED" in str(exc) or "Java gateway process exited" in str(exc)):
            raise UserError(JAVA_HINT) from exc
        raise
