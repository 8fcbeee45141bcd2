"""The Streamlit dashboard: ``launch(path)`` serves ``app.py`` over a run directory or a store root."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).with_name("app.py")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost' — the only binds that keep the dashboard private."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def command(path: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The ``streamlit run`` command line that serves the dashboard for ``path``."""
    # dynascope.dashboard._serve is `streamlit` with the first page's imports warmed during start-up.
    return [sys.executable, "-m", "dynascope.dashboard._serve", "run", str(APP), "--server.address", host, "--server.port",
            str(int(port)), "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer",
            # No source watching: on every rerun Streamlit's watcher resolves the path of each loaded module
            # (thousands, with torch and polars), ~0.7 s of CPU per page on 2 cores. Users do not edit the app.
            "--server.fileWatcherType", "none", "--server.runOnSave", "false",
            # Streamlit runs gc.collect(2) after every script run: ~0.2 s over torch's and polars' objects,
            # holding the GIL while the event loop should be telling the browser the page is done.
            "--runner.postScriptGC", "false",
            "--", str(Path(path).expanduser().resolve())]


def launch(path: str | os.PathLike, host: str = "127.0.0.1", port: int = 8501) -> int:
    """Serve the dashboard until interrupted; returns Streamlit's exit code.

    The path is checked first so a typo fails with one line instead of a page of Streamlit errors.
    """
    from dynascope.store.layout import locate

    try:
        import plotly  # noqa: F401
        import streamlit  # noqa: F401
    except ImportError as exc:
        from dynascope.store import StoreError

        raise StoreError(f"the dashboard needs streamlit and plotly: pip install 'dynascope[dashboard]' ({exc})") from None
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
