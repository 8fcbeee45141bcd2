"""The ``dynascope`` command line: demo, runs, sql, report, diff, dashboard, import, export, compact, files, fleet.

Every command turns a user error into one line on stderr and a non-zero exit; ``--debug`` shows the
traceback instead. Heavy modules are imported inside each command so ``dynascope --help`` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dynascope.core.errors import UserError


def _flags_without_a_type() -> None:
    """Help shows an on/off flag bare (``--quick``): typer 0.29's help labels every flag ``<bool>``, as if it
    took a value (``--quick <bool>``), which it does not."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_bare", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_bare = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_a_type()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="dynascope: parameter-update dynamics and cluster bottlenecks of LLM training.")
import_app = typer.Typer(no_args_is_help=True, help="Import external data (profiler traces, wandb runs) into a run.")
app.add_typer(import_app, name="import")

console = Console()
err_console = Console(stderr=True)
# Tables never cut a value: on a terminal one that is too wide for it becomes one block per row; through a
# pipe, auto writes tab-separated values (docs/cli.md).
FORMAT_HELP = "auto (a table on a terminal, tab-separated values through a pipe) | table | tsv"
_state = {"debug": False}


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn known errors into one clear line on stderr and exit 2 (tracebacks only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:
            if _state["debug"]:  # the whole traceback, and still the user-error exit status
                import traceback

                traceback.print_exc(file=sys.stderr)
                raise typer.Exit(2) from None
            from rich.text import Text

            from dynascope.core.errors import StoreError, first_line
            from dynascope.core.extras import MissingExtraError

            known = isinstance(exc, (UserError, StoreError, FileNotFoundError, ValueError, PermissionError,
                                     MissingExtraError))
            msg = first_line(exc)
            # User data (paths, names) may hold invalid UTF-8 (surrogate escapes) or rich markup: print it inert.
            msg = msg.encode("utf-8", "backslashreplace").decode("utf-8")
            prefix = "error" if known else f"error ({type(exc).__name__})"
            err_console.print(Text.assemble((f"{prefix}: ", "bold red"), msg), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False) -> None:
    _state["debug"] = debug


@app.command()
@guarded
def sql(
    path: Annotated[Path, typer.Argument(help="Run directory or store root.")],
    query: Annotated[str, typer.Argument(help="A read-only SQL query over the store's tables.")],
    format: Annotated[str, typer.Option("--format", "-f", help=FORMAT_HELP + " | csv | json | parquet")] = "auto",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the result to this file, in the format its extension names (.parquet, .csv, .json, .tsv, .txt) unless --format says it.")] = None,
    max_rows: Annotated[int, typer.Option("--max-rows", help="Row cap for the result.")] = 100_000,
) -> None:
    """Run read-only SQL over a run (tables: tensor_stats_global, one row per tensor and step: start there;
    runs, tensor_stats, tensor_stats_by_kind, tensor_stats_by_layer, tensor_stats_by_tensor, spectra,
    timings, samples, scalars, events, system)."""
    from dynascope.cli_output import out_format, write_result
    from dynascope.store import open_store, run_sql

    if format not in ("auto", "table", "tsv", "csv", "json", "parquet"):
        raise UserError(f"unknown --format {format!r} (auto, table, tsv, csv, json or parquet)")
    if format == "parquet" and out is None:
        raise UserError("--format parquet needs --out FILE")
    if max_rows < 1:
        raise UserError("--max-rows must be at least 1")
    if out is not None:
        format = out_format(format, out)
    with open_store(path) as store:
        result = run_sql(store, query, max_rows=max_rows + 1)  # one extra row tells us the cap was hit
    if result.num_rows > max_rows:
        result = result.slice(0, max_rows)
        err_console.print(f"note: result capped at {max_rows} rows (--max-rows)", highlight=False)
    write_result(result, format, out, console)


@app.command()
@guarded
def runs(
    root: Annotated[Path, typer.Argument(help="Store root or run directory.")],
    format: Annotated[str, typer.Option("--format", "-f", help=FORMAT_HELP)] = "auto",
) -> None:
    """List runs with status, steps, ranks, size and last write."""
    from dynascope.cli_output import print_runs
    from dynascope.store.catalog import list_runs

    if format not in ("auto", "table", "tsv"):
        raise UserError(f"unknown --format {format!r} (auto, table or tsv)")
    print_runs(list_runs(root), console, format)


@app.command()
@guarded
def export(
    run: Annotated[Path, typer.Argument(help="Run directory (or store root).")],
    out: Annotated[Path | None, typer.Argument(help="Output .duckdb file.")] = None,
    parquet: Annotated[Path | None, typer.Option("--parquet", help="Write one Parquet file per table here instead.")] = None,
    perfetto: Annotated[Path | None, typer.Option("--perfetto", help="Write the timings and events as a Chrome-trace "
                                                  "JSON file for Perfetto instead.")] = None,
) -> None:
    """Write a self-contained DuckDB file (or Parquet files, or a Perfetto timeline) for sharing."""
    from dynascope.store.export import export_store

    if sum(x is not None for x in (out, parquet, perfetto)) != 1:
        raise UserError("give exactly one of OUT.duckdb, --parquet DIR or --perfetto FILE.json")
    if perfetto is not None:
        from dynascope.store.perfetto import export_perfetto

        written = export_perfetto(run, perfetto)
        console.print(f"wrote {perfetto}: " + ", ".join(f"{n} {k}" for k, n in written.items()), highlight=False)
        return
    counts = export_store(run, duckdb_path=out, parquet_dir=parquet)
    console.print(f"wrote {out or parquet}: " + ", ".join(f"{t} {n}" for t, n in counts.items() if n), highlight=False)


@app.command()
@guarded
def compact(
    path: Annotated[Path, typer.Argument(help="Run directory or store root.")],
    grace_s: Annotated[float, typer.Option(help="Keep merged-away segments this long for open readers.")] = 60.0,
    settle_s: Annotated[float, typer.Option(help="A merged segment takes effect this long after it is written.")] = 2.0,
    wait: Annotated[bool, typer.Option("--wait", help="Wait out the grace period and delete merged-away segments now.")] = False,
) -> None:
    """Merge small segments; never loses or duplicates a row and is safe while readers are open.

    Merged-away segments are deleted once the merged file has been in effect for --grace-s: by a later
    `compact`, or by this one with --wait.
    """
    from dynascope.store.compact import compact_store

    if grace_s < 0 or settle_s < 0:
        raise UserError("--grace-s and --settle-s must be >= 0")
    stats = compact_store(path, grace_s=grace_s, settle_s=settle_s, wait=wait)
    console.print(f"merged {stats.merged_segments} segments ({stats.rows_merged} rows) into {stats.new_segments}; "
                  f"removed {stats.removed_segments} merged-away or stale files; "
                  f"repaired {stats.repaired_segments} missing rollup segments", highlight=False)
    if stats.writers_folded:
        console.print(f"folded the directories of {stats.writers_folded} finished writers together", highlight=False)
    for line in stats.skipped:
        err_console.print(f"warning: skipped {line}", highlight=False, markup=False, soft_wrap=True)


def _register_alert_commands() -> None:
    """`watch-run` and `metrics` (dynascope/cli_alerts.py): alert rules and /metrics over a live run."""
    from dynascope import cli_alerts

    app.command("watch-run")(guarded(cli_alerts.watch_run))
    app.command("metrics")(guarded(cli_alerts.metrics))


_register_alert_commands()


def _register_fleet_commands() -> None:
    """`files` and `fleet` (dynascope/cli_fleet.py): the store for other engines."""
    from dynascope import cli_fleet

    app.command("files")(guarded(cli_fleet.files))
    app.command("fleet")(guarded(cli_fleet.fleet))


_register_fleet_commands()


@app.command()
@guarded
def report(
    run: Annotated[Path, typer.Argument(help="Run directory or store root.")],
    format: Annotated[str, typer.Option("--format", "-f", help="text | markdown | html")] = "text",
    out: Annotated[Path | None, typer.Option("--out", "-o")] = None,
    peak_tflops: Annotated[float | None, typer.Option(
        "--peak-tflops", help="Dense peak TFLOP/s per device for MFU: needed on CPU or an unknown device, "
                              "overrides the looked-up peak otherwise.")] = None,
    write_events: Annotated[bool, typer.Option(
        "--write-events", help="Also append the detected instability events to the run's events table.")] = False,
) -> None:
    """Findings in plain sentences, ranked by time at stake, each with its numbers and SQL."""
    from dynascope.report import render_run

    text = render_run(run, format, peak_tflops=peak_tflops)
    if out is None:
        console.print(text, markup=False, highlight=False, soft_wrap=True, end="")
    else:
        out.write_text(text, encoding="utf-8")
        console.print(f"wrote {out}", markup=False, highlight=False)
    if write_events:
        _write_instability_events(run)


def _write_instability_events(run: Path) -> None:
    """Append the detected instability events to the run's events table (analyses never write)."""
    from dynascope.analyses.instability import DETECTOR, detect_instability
    from dynascope.store import open_store
    from dynascope.store.events import write_detected_events

    with open_store(run) as con:
        detected = detect_instability(con)
    written = sum(write_detected_events(Path(d), g, DETECTOR) for d, g in _by_run_dir(run, detected))
    err_console.print(f"wrote {written} new instability event(s) to {run}", markup=False, highlight=False)


def _by_run_dir(path: Path, detected: Any) -> list[tuple[Path, Any]]:
    """Split detected events by run: each goes into its own run directory under a store root."""
    from dynascope.store.catalog import list_runs

    dirs = {r["run_id"]: Path(r["path"]) for r in list_runs(path).iter_rows(named=True)}
    out = []
    for (run_id,), g in detected.group_by(["run_id"], maintain_order=True):
        if run_id not in dirs:
            raise UserError(f"run {run_id!r} has no directory under {path}")
        out.append((dirs[run_id], g))
    return out


@app.command()
@guarded
def diff(
    base: Annotated[Path, typer.Argument(help="Base checkpoint (θ₀): safetensors, sharded HF folder, .pt/.bin.")],
    checkpoints: Annotated[list[Path], typer.Argument(help="Checkpoints to compare against BASE (in the step order their names give, else as listed).")],
    run: Annotated[Path, typer.Option("--run", help="Run directory to write.")],
    tensors: Annotated[str | None, typer.Option("--tensors", help="Only tensors whose name matches this regex.")] = None,
    allow_missing: Annotated[bool, typer.Option("--allow-missing", help="Skip (and list) names missing on one side.")] = False,
    spectral_k: Annotated[int, typer.Option("--k", help="Top-k for the randomized SVD of ΔW (0: no spectra).")] = 8,
    stage: Annotated[str | None, typer.Option("--stage", help="Stage label for the rows (e.g. sft, rl).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where to compute: auto (GPU if any), cpu, cuda:N.")] = "auto",
    bf16_k: Annotated[int | None, typer.Option("--bf16-k", help="PULSE S_k: also compare bf16 casts against the checkpoint this many steps back.")] = None,
) -> None:
    """Offline checkpoint diff: parameter-update statistics of each checkpoint against BASE, into a run."""
    from dynascope.cli_output import run_diff

    run_diff(base, checkpoints, run, console, tensors=tensors, allow_missing=allow_missing, k=spectral_k, stage=stage,
             device=device, bf16_k=bf16_k)


@app.command()
@guarded
def dashboard(
    path: Annotated[Path, typer.Argument(help="Run directory or store root.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8501,
    host: Annotated[str, typer.Option(help="Interface to bind; anything but loopback exposes an unauthenticated app.")] = "127.0.0.1",
) -> None:
    """Start the Streamlit dashboard over a run or a store root."""
    from dynascope.dashboard import launch

    launch(path, host=host, port=port)


@import_app.command("trace")
@guarded
def import_trace(
    paths: Annotated[list[Path], typer.Argument(help="Kineto/PyTorch-profiler trace files (.json or .json.gz) or directories.")],
    run: Annotated[Path, typer.Option("--run", help="Run directory to write.")],
) -> None:
    """Import PyTorch-profiler (Kineto) traces, one file per rank, as timing rows."""
    from dynascope.cli_output import print_trace_import
    from dynascope.importers.trace import import_traces

    print_trace_import(import_traces(list(paths), run), console)


@import_app.command("wandb")
@guarded
def import_wandb(
    path: Annotated[Path, typer.Argument(help="Offline wandb run directory (run-*.wandb inside) or an exported history file.")],
    run: Annotated[Path, typer.Option("--run", help="Run directory to write.")],
    step_key: Annotated[str, typer.Option("--step-key", help="Logged key to use as the step (e.g. train/global_step).")] = "_step",
) -> None:
    """Import a wandb run's history into the run's scalars."""
    from dynascope.cli_output import print_wandb_import
    from dynascope.importers.wandb_history import import_history

    print_wandb_import(import_history(path, run, step_key=step_key), run, console)


@app.command()
@guarded
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="A < 60 s version for tests.")] = False,
    run: Annotated[Path | None, typer.Option("--run", help="Run directory to write (default: runs/demo; runs/demo-Nranks with --ranks N, runs/demo-async with --async, runs/demo-smollm2 with --model smollm2).")] = None,
    ranks: Annotated[int, typer.Option("--ranks", help="Train (SFT and RL) under torchrun with this many gloo data-parallel ranks.")] = 1,
    slow_rank: Annotated[int | None, typer.Option("--slow-rank", help="Make this rank slower by real extra compute.")] = None,
    slow_factor: Annotated[float, typer.Option("--slow-factor", help="How much slower the slow rank is.")] = 2.0,
    long_tail: Annotated[bool, typer.Option("--long-tail", help="Skew response lengths for a long rollout tail.")] = False,
    async_: Annotated[bool, typer.Option("--async", help="Asynchronous RL on Ray: rollout actors + trainer actor.")] = False,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    model: Annotated[str, typer.Option("--model", help="tiny (from scratch, seconds) or smollm2 (pretrained SmolLM2-135M, the papers' regime).")] = "tiny",
    steps: Annotated[int | None, typer.Option("--steps", help="RL steps (--model smollm2).")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda (--model smollm2).")] = "cpu",
    alerts: Annotated[bool, typer.Option("--alerts", help="Judge the default alert rules while the run trains (rank 0).")] = False,
    spike_step: Annotated[int | None, typer.Option("--spike-step", help="Plant a gradient spike: this RL step's gradients ×10⁴.")] = None,
) -> None:
    """A real RL post-training run (SFT then GRPO) on CPU, probed end to end, then a short report."""
    from dynascope.demo import run_demo

    run_demo(run_dir=run, quick=quick, ranks=ranks, slow_rank=slow_rank, slow_factor=slow_factor,
             long_tail=long_tail, use_async=async_, seed=seed, console=console, model=model, steps=steps,
             device=device, alerts=alerts, spike_step=spike_step)


def entry() -> None:  # pragma: no cover - console script shim
    app()
    sys.exit(0)


if __name__ == "__main__":  # python -m dynascope.cli, as the console script
    entry()
