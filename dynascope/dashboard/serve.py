"""Serving the dashboard: the one module that starts it, in the foreground or the background.

- ``launch(path)`` is ``dynascope dashboard PATH``: checks the path, warns off loopback, runs the server
  until interrupted.
- ``serving(path)`` runs it in the background for scripts, benchmarks and tests that drive a browser.
- ``python -m dynascope.dashboard.serve run app.py ...`` is the server process itself: ``streamlit run``
  with the pages' imports warmed beside the server's start-up, bound to 127.0.0.1 unless told otherwise.

Streamlit imports a page's modules inside the first browser session's script run, so the first visitor
would wait for plotly, pandas (``st.dataframe``), the analyses and plotly's lazily built trace validators:
about a second on 2 cores, on top of the JavaScript. ``warm`` imports them in a thread while the web
server starts. Python's import lock makes a race with the first script run safe: whichever thread imports
a module first, the other waits for it. pandas is the exception, imported before Streamlit starts: plotly
looks for it in ``sys.modules`` without the import lock (``get_module(..., should_load=False)``), so while
another thread was importing it, Streamlit's start-up (its plotly theme) or a page's figure got a
half-initialised module and the server died with "partially initialized module 'pandas'".
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dynascope.core.net import free_port

APP = Path(__file__).with_name("app.py")
DEFAULT_HOST = "127.0.0.1"
PAGE_MODULES = ("views.runs", "views.dynamics", "views.cluster", "views.cluster_ranks", "views.cluster_whatif",
                "views.rollouts", "views.events", "views.sql", "queries.params", "queries.cluster", "queries.ranks",
                "queries.rollouts", "queries.runs")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost' — the only binds that keep the dashboard private."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def command(path: str | os.PathLike, host: str = DEFAULT_HOST, port: int = 8501) -> list[str]:
    """The command line of the server process for ``path``."""
    return [sys.executable, "-m", __name__, "run", str(APP), "--server.address", host, "--server.port",
            str(int(port)), "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer",
            # No source watching: on every rerun Streamlit's watcher resolves the path of each loaded module
            # (thousands, with torch and polars), ~0.7 s of CPU per page on 2 cores. Users do not edit the app.
            "--server.fileWatcherType", "none", "--server.runOnSave", "false",
            # Streamlit runs gc.collect(2) after every script run: ~0.2 s over torch's and polars' objects,
            # holding the GIL while the event loop should be telling the browser the page is done.
            "--runner.postScriptGC", "false",
            "--", str(Path(path).expanduser().resolve())]


def launch(path: str | os.PathLike, host: str = DEFAULT_HOST, port: int = 8501) -> int:
    """Serve the dashboard until interrupted; returns Streamlit's exit code.

    The path is checked first so a typo fails with one line instead of a page of Streamlit errors.
    """
    from dynascope.core.extras import check_installed
    from dynascope.store.layout import locate

    check_installed(["streamlit", "plotly"], "dynascope dashboard")
    loc = locate(path)
    if not is_loopback(host):
        print(f"warning: binding the dashboard to {host}: it has no authentication, so anyone who can reach "
              f"{host}:{port} can read every run under {loc.path} and run SQL on it.", file=sys.stderr)
    print(f"dynascope dashboard: {loc.path} on http://{host}:{port}", file=sys.stderr)
    proc = subprocess.Popen(command(loc.path, host, port))
    # Forward a termination to the server so stopping `dynascope dashboard` never leaves it running.
    previous = signal.signal(signal.SIGTERM, lambda sig, _frame: proc.send_signal(sig))
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reaches both processes; give Streamlit time to shut down
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def serving(path: str | os.PathLike, port: int | None = None, log: Path | None = None,
            timeout_s: float = 120.0) -> Iterator[str]:
    """Start the server for ``path`` on a loopback port, wait for /_stcore/health, yield the base URL, and
    stop the whole process group on exit."""
    port = port or free_port()
    with serving_command(command(path, DEFAULT_HOST, port), port, log, timeout_s) as base:
        yield base


@contextlib.contextmanager
def serving_command(cmd: list[str], port: int, log: Path | None = None, timeout_s: float = 120.0) -> Iterator[str]:
    """``serving`` for any Streamlit command line that listens on 127.0.0.1:``port`` (benchmarks serve
    other apps with the dashboard's options)."""
    out = log.open("wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with code {proc.returncode}" + (f"; see {log}" if log else ""))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dashboard not healthy after {timeout_s:.0f} s") from None
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if log:
            out.close()


def warm() -> None:
    """Import what the pages import, and build one figure of each trace type the pages draw."""
    t0 = time.perf_counter()
    try:
        import plotly.graph_objects as go
        from streamlit import runtime

        import dynascope.analyses  # noqa: F401

        # data.py's @st.cache_data decorators check their parameters against the runtime's cache storage;
        # imported before the runtime exists, they log "No runtime found" (harmless, but noise in the log).
        deadline = time.monotonic() + 60
        while not runtime.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for name in PAGE_MODULES:
            importlib.import_module(f"dynascope.dashboard.{name}")
        # plotly creates each trace type's validators on first use, and Streamlit serialises every figure
        go.Figure([go.Scatter(x=[0], y=[0]), go.Bar(x=[0], y=[0]), go.Heatmap(z=[[0.0]]),
                   go.Histogram(x=[0]), go.Box(x=[0])]).to_json()
    except Exception as exc:  # warming is an optimisation: the pages import what they need anyway
        print(f"dynascope: warming the dashboard's imports failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    print(f"dynascope: dashboard pages loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def server_args(args: list[str]) -> list[str]:
    """Streamlit's arguments with ``--server.address 127.0.0.1`` added to a ``run`` that names no address
    (Streamlit itself would listen on every interface)."""
    named = any(a == "--server.address" or a.startswith("--server.address=") for a in args)
    if args[:1] != ["run"] or len(args) < 2 or named:
        return args
    return [*args[:2], "--server.address", DEFAULT_HOST, *args[2:]]


def main() -> None:
    import pandas  # noqa: F401  (st.dataframe converts through it; here, not in a thread: see the module doc)

    threading.Thread(target=warm, name="dynascope-warm", daemon=True).start()
    from streamlit.web.cli import main as streamlit_main

    streamlit_main(args=server_args(sys.argv[1:]), prog_name="streamlit")


if __name__ == "__main__":
    main()
