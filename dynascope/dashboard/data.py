"""The dashboard's data access: one cached store per path, cached queries, guarded charts.

Query results are cached under the store's *version*: the count, size and newest mtime of its segment
files, re-read every ``TTL_S`` seconds. A live run's new segments change the version, so the next rerun
(or auto-refresh tick) queries again and shows them without restarting the server; a finished run's
results stay cached, so clicking around a 10M-row run does not re-scan it every few seconds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import polars as pl
import streamlit as st
from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx
from streamlit.runtime.scriptrunner_utils.exceptions import ScriptControlException

from dynascope.store import StoreConnection, StoreError, open_store

TTL_S = 2.0  # how stale the store's file listing may be
STATUS_S = 15.0  # how stale a run's live/finished/crashed status may be (the live window is 60 s)
KEEP_S = 3600.0  # how long results of an unchanged store stay cached


@st.cache_resource(show_spinner=False)
def store(path: str) -> StoreConnection:
    """The read-only store for ``path``, opened once per server (queries use their own cursors)."""
    return open_store(path, read_only=True)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def version(path: str) -> tuple[int, int, int]:
    """(segment and commit files, bytes, newest mtime in ns) under ``path``: changes when a writer flushes
    or a compaction swaps files, which is exactly when cached results may be stale. A flush's segments
    count for queries only once its commit record lands, a moment after them, so commit records count too."""
    n = size = newest = 0
    for dirpath, _, files in os.walk(path):
        commits = os.path.basename(os.path.dirname(dirpath)) == "_commits"
        for f in files:
            if f.endswith(".parquet") or (commits and f.endswith(".json")):
                try:
                    info = os.stat(os.path.join(dirpath, f))
                except OSError:  # renamed away by a compaction mid-walk
                    continue
                n, size, newest = n + 1, size + info.st_size, max(newest, info.st_mtime_ns)
    return n, size, newest


def catalog(path: str) -> pl.DataFrame:
    """The run list with status, cached until the store changes, and while a run is live or crashed until
    ``STATUS_S`` passes: those statuses also depend on the clock (a run that stopped writing turns from live
    to crashed; a writer taken for crashed may heartbeat again). A list of finished runs stays as it is until
    the files change, so it is listed once, not every ``STATUS_S`` (at 1,024 ranks a listing costs 0.5-1.5 s,
    which the first page visited after each boundary paid again)."""
    token = version(path)
    held = _SETTLED.get(path)
    if held is not None and held[0] == token:
        return held[1]
    cat = _catalog(path, token, int(time.time() // STATUS_S))
    if cat.height and not cat["status"].is_in(["live", "crashed"]).any():
        _SETTLED[path] = (token, cat)
    return cat


_SETTLED: dict[str, tuple[tuple[int, int, int], pl.DataFrame]] = {}  # path -> (version, list of finished runs)


@st.cache_resource(ttl=KEEP_S, show_spinner=False, max_entries=64)
def _catalog(path: str, token: tuple[int, int, int], clock: int) -> pl.DataFrame:
    from dynascope.dashboard.queries.runs import run_list

    return run_list(store(path))


Query = Callable[..., Any]  # a dashboard query or an analysis: (store, ...) -> frame


def _name(fn: Query) -> str:
    """The cache key of a query function (the function itself is passed unhashed beside it)."""
    return f"{fn.__module__}.{fn.__qualname__}"


def query(fn: Query, path: str, *args: Any) -> Any:
    """``fn(store, *args)`` for a function of ``dynascope.dashboard.queries``, cached until the store changes."""
    return _query(_name(fn), fn, path, version(path), *args)


class _Refused(str):
    """A ValueError an analysis raised (e.g. MFU without a known peak), cached like a result."""


def analysis(fn: Query, path: str, **kwargs: Any) -> pl.DataFrame:
    """``fn(store, **kwargs)`` for an analysis of ``dynascope.analyses``, cached until the store changes;
    raises the analysis's own ValueError (also cached: a refusal would otherwise be recomputed at every
    rerun)."""
    out = _analysis(_name(fn), fn, path, version(path), **kwargs)
    if isinstance(out, _Refused):
        raise ValueError(str(out))
    return out


# Two workers: the machine this must be fast on has 2 cores, and DuckDB parallelises each query itself.
_PREFETCH = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dynascope-prefetch")


def prefetch(path: str, queries: Iterable[tuple[Query, tuple[Any, ...]]] = (),
             analyses: Iterable[tuple[Query, dict[str, Any]]] = ()) -> None:
    """Start queries and analyses a page will ask for further down, so DuckDB works on them while the
    script draws what comes first. Each lands in the same cache the page reads (a page that gets there
    first waits on the cache's per-key lock instead of computing twice); a failure is left for the page's
    own call to raise inside its guard."""
    ctx, token = get_script_run_ctx(), version(path)

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        add_script_run_ctx(threading.current_thread(), ctx)  # Streamlit's caches expect a script context
        with contextlib.suppress(Exception):
            fn(*args, **kwargs)

    for fn, args in queries:
        _PREFETCH.submit(run, _query, _name(fn), fn, path, token, *args)
    for fn, kwargs in analyses:
        _PREFETCH.submit(run, _analysis, _name(fn), fn, path, token, **kwargs)


def clear() -> None:
    """Forget every cached result (the sidebar's "Refresh now")."""
    for cached in (version, _catalog, _query, _analysis):
        cached.clear()
    _SETTLED.clear()


# cache_resource, not cache_data: results are returned as the same (immutable) polars frames instead of
# being pickled and copied on every read, which for a page's 40 MB parameter cube costs more than a scan.
# The function itself is not hashed (leading underscore): its module-qualified name is the key.
@st.cache_resource(ttl=KEEP_S, show_spinner=False, max_entries=512)
def _query(name: str, _fn: Query, path: str, token: tuple[int, int, int], *args: Any) -> Any:
    return _fn(store(path), *args)


@st.cache_resource(ttl=KEEP_S, show_spinner=False, max_entries=256)
def _analysis(name: str, _fn: Query, path: str, token: tuple[int, int, int], **kwargs: Any) -> pl.DataFrame:
    try:
        return _fn(store(path), **kwargs)
    except ValueError as exc:
        return _Refused(str(exc))


def current() -> tuple[str, tuple[str, ...]]:
    """The store path and the runs picked in the sidebar."""
    return st.session_state["store_path"], tuple(st.session_state.get("runs") or ())


@contextlib.contextmanager
def guard(title: str) -> Iterator[None]:
    """Run one chart's code; a failure becomes an ``st.info`` line instead of a Streamlit exception."""
    try:
        yield
    except ScriptControlException:  # st.rerun / st.stop must pass through
        raise
    except StoreError as exc:
        st.info(f"{title}: {exc}")
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        st.info(f"{title}: not available for this run ({type(exc).__name__}: {msg[:300]})")


def live(body: Callable[[], None]) -> None:
    """Run a page body, as a fragment that reruns itself on a timer when auto-refresh is on."""
    every = st.session_state.get("refresh_s") if st.session_state.get("auto_refresh") else None
    st.fragment(body, run_every=every)()


def empty(df: pl.DataFrame | None, what: str) -> bool:
    """True (and say so) when a chart has no rows for the selected runs."""
    if df is None or df.height == 0:
        st.info(f"No {what} in the selected runs.")
        return True
    return False


def per_run(fn: Query, path: str, runs: tuple[str, ...], **kwargs: Any) -> pl.DataFrame:
    """An analysis run once per selected run (each cached on its own) and stacked."""
    frames = [analysis(fn, path, run=r, **kwargs) for r in runs]
    full = [f for f in frames if f.height]
    return pl.concat(full, how="vertical_relaxed") if full else frames[0]


def downsample(df: pl.DataFrame, x: str, values: list[str], by: list[str], max_points: int = 400) -> pl.DataFrame:
    """Bucket ``x`` so each group keeps at most ``max_points``; each value gets mean, ``_lo`` (min), ``_hi`` (max).

    For analysis outputs that come per step; the store-side queries bucket in SQL already.
    """
    span = df.group_by(by or pl.lit(0)).agg((pl.col(x).max() - pl.col(x).min() + 1).alias("_span"))
    width = max(1, -(-int(span["_span"].max() or 1) // max_points))
    agg = [c for v in values for c in (pl.col(v).mean().alias(v), pl.col(v).min().alias(f"{v}_lo"),
                                       pl.col(v).max().alias(f"{v}_hi"))]
    return (df.with_columns((pl.col(x) // width * width).alias(x))
            .group_by([*by, x], maintain_order=True).agg(agg).sort([*by, x]))


# Runs up to this size on disk get every analysis at first render; larger ones get the slow ones
# (per-record fits, what-if simulation, spike detection) after one click, to keep first renders fast.
AUTO_MAX_BYTES = 64 * 2**20


def on_demand(key: str, label: str, path: str, run: str) -> bool:
    """True when a slow analysis should run now: the run is small, or the user asked once for this run."""
    sizes = dict(catalog(path).select("run_id", "size_bytes").iter_rows())
    flag = f"{key}:{run}"
    if (sizes.get(run) or 0) <= AUTO_MAX_BYTES or st.session_state.get(flag):
        return True
    if st.button(label, key=f"btn_{flag}"):
        st.session_state[flag] = True
        return True
    return False


def remembered(key: str, options: list[Any], default: list[Any]) -> list[Any] | None:
    """The ``default`` to give a keyed multiselect: None when the session already holds its value (pruned to
    the current options — another run may lack a kind — so the widget never holds a value it does not
    offer), else ``default``. Passing both a default and a session value makes Streamlit print a warning."""
    if key in st.session_state:
        st.session_state[key] = [v for v in st.session_state[key] if v in options]
        return None
    return default
