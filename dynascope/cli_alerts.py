"""``dynascope watch-run`` and ``dynascope metrics``: follow a live run from any machine and evaluate alert rules over what it writes.

Registered on the main app by ``cli.py``. Firings are printed one per line, written to the run's
``events`` (by a writer of role ``monitor``) and acted on; a ``stop`` action writes the run's stop
request, which every rank of a run watched with ``alerts=`` follows.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from dynascope.core.errors import UserError

_out = Console(highlight=False)


def watch_run(
    run: Annotated[Path, typer.Argument(help="Run directory to follow.")],
    rules: Annotated[Path | None, typer.Option("--rules", help="YAML rules file (default: the built-in rules).")] = None,
    interval_s: Annotated[float, typer.Option("--interval-s", help="Seconds between passes.")] = 2.0,
    duration_s: Annotated[float | None, typer.Option("--duration-s", help="Follow this long, then stop.")] = None,
    once: Annotated[bool, typer.Option("--once/--follow", help="Judge everything written so far once, and exit.")] = False,
    world_size: Annotated[int, typer.Option("--world-size", help="Ranks of the run (sets how far ahead a stop lands).")] = 2,
) -> None:
    """Evaluate alert rules over a live (or finished) run; Ctrl-C stops following."""
    from dynascope.alerts import DEFAULT_RULES, Monitor, load_rules
    from dynascope.store import RunWriter, StoreError, open_store

    if interval_s <= 0 or (duration_s is not None and duration_s < 0):
        raise UserError("--interval-s must be > 0 and --duration-s >= 0")
    if not run.is_dir():
        raise UserError(f"{run}: no such run directory")
    open_store(run).close()  # a directory that is not a store: StoreError, one line
    try:
        chosen = load_rules(rules) if rules is not None else list(DEFAULT_RULES)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    writer = RunWriter(run, rank=0, role="monitor", flush_secs=1.0)
    monitor = Monitor(run, chosen, event=writer.event, interval_s=interval_s, world_size=world_size)
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    shown = 0
    try:
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while True:
            final = once or stop.is_set() or (deadline is not None and time.monotonic() >= deadline)
            try:
                monitor.poll(final=final)
            except StoreError as exc:
                raise UserError(str(exc)) from None
            for f in monitor.fired[shown:]:
                _out.print(f"[{f.rule.severity}] step {f.step}: {f.message}", markup=False, soft_wrap=True)
            shown = len(monitor.fired)
            if final:
                break
            stop.wait(interval_s if deadline is None else max(0.0, min(interval_s, deadline - time.monotonic())))
    finally:
        signal.signal(signal.SIGINT, previous)
        monitor.webhooks.close()
        writer.close(timeout_s=10.0)
    _out.print(f"{len(monitor.fired)} alerts from {len(chosen)} rules over {monitor.polls} passes "
               f"(slowest {monitor.slowest_s:.2f} s)")


def metrics(
    run: Annotated[Path, typer.Argument(help="Run directory (or store root) to serve.")],
    port: Annotated[int, typer.Option("--port", help="TCP port for /metrics.")] = 9464,
    addr: Annotated[str, typer.Option("--addr", help="Address to bind (127.0.0.1: this machine only).")] = "127.0.0.1",
    min_interval_s: Annotated[float, typer.Option("--min-interval-s", help="Read the store at most this often.")] = 5.0,
    duration_s: Annotated[float | None, typer.Option("--duration-s", help="Serve this long, then stop.")] = None,
) -> None:
    """Serve the run's newest figures at http://ADDR:PORT/metrics for Prometheus; Ctrl-C stops."""
    from dynascope.alerts.metrics import serve_metrics
    from dynascope.store import open_store

    open_store(run).close()  # a directory that is not a store: StoreError, one line
    try:
        server, _, _ = serve_metrics(run, port, addr, min_interval_s)
    except OSError as exc:
        raise UserError(f"cannot serve on {addr}:{port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    _out.print(f"serving http://{addr}:{server.server_port}/metrics", soft_wrap=True)
    try:
        stop.wait(duration_s)
    finally:
        signal.signal(signal.SIGINT, previous)
        server.shutdown()
        server.server_close()
