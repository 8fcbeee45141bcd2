"""Run the dashboard server in the background (for scripts, benchmarks and tests that drive a browser)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dynascope._net import free_port
from dynascope.dashboard import command


@contextlib.contextmanager
def serving(path: str | os.PathLike, port: int | None = None, log: Path | None = None,
            timeout_s: float = 120.0) -> Iterator[str]:
    """Start ``streamlit run app.py -- PATH`` on a loopback port, wait for /_stcore/health, yield the base
    URL, and stop the whole process group on exit."""
    port = port or free_port()
    with serving_command(command(path, "127.0.0.1", port), port, log, timeout_s) as base:
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
