"""An OpenMetrics/Prometheus ``/metrics`` endpoint over a run's store, for the cluster's own Prometheus.

Served from the training process (``watch(..., metrics_port=PORT)``) or from a follower
(``dynascope metrics RUN --port PORT``), bound to 127.0.0.1 unless told otherwise. A scrape reads the
store at most once per ``min_interval_s`` (later scrapes get the cached answer), on the HTTP server's
thread: a scraper that never comes costs nothing, one that comes every second costs one read in
``min_interval_s``. Names follow Prometheus' conventions: ``dynascope_`` prefix, base units (seconds,
ratios) in the name, ``run``, ``role`` and ``rank`` as labels:

- ``dynascope_step``: the newest step with a step row, per rank;
- ``dynascope_step_seconds``: that step's duration; ``dynascope_phase_seconds{phase}``: its phases;
- ``dynascope_straggler_score``: as the ``straggler_score`` alert quantity, at the newest judged step;
- ``dynascope_probe_overhead_ratio``: the probe's share of the newest step;
- ``dynascope_scalar{key}``: the newest value of each logged scalar (loss, grad_norm, reward, ...);
- ``dynascope_alerts_total{rule, severity}``: alerts fired so far (the run's ``alert`` events).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynascope.alerts.quantities import series
from dynascope.analyses.probe_time import PROBE_PHASE
from dynascope.analyses.steps import STEP_ROW
from dynascope.analyses.stragglers import phase_times_sql
from dynascope.core.errors import StoreError
from dynascope.store import open_store, quote_literal

__all__ = ["StoreCollector", "serve_metrics"]

_LABELS = ["run", "role", "rank"]
_LATEST = f"""
SELECT run_id, coalesce(role, '') AS role, rank, max(step) AS step, arg_max(dur_us, step) AS dur_us
FROM timings WHERE {STEP_ROW} GROUP BY ALL"""


class StoreCollector(Collector):
    """The run's newest figures as Prometheus metric families (see the module docstring)."""

    def __init__(self, run_dir: str | Path, min_interval_s: float = 5.0) -> None:
        self.run_dir, self.min_interval_s = Path(run_dir), min_interval_s
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._at = -float("inf")
        self.reads = 0

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._at >= self.min_interval_s:
                try:
                    self._cached = self._read()
                except StoreError:  # nothing written yet: no series rather than an error page
                    self._cached = []
                self._at = time.monotonic()
                self.reads += 1
            yield from self._cached

    def _read(self) -> list[Metric]:
        with open_store(self.run_dir) as store:
            latest = store.rows(_LATEST)
            step = GaugeMetricFamily("dynascope_step", "Newest step with a step row.", labels=_LABELS)
            dur = GaugeMetricFamily("dynascope_step_seconds", "Duration of the newest step.", labels=_LABELS)
            for run, role, rank, s, us in latest:
                step.add_metric([run, role, str(rank)], s)
                dur.add_metric([run, role, str(rank)], us / 1e6)
            phases = GaugeMetricFamily("dynascope_phase_seconds", "Time in each phase of the newest step.",
                                       labels=[*_LABELS, "phase"])
            probe = GaugeMetricFamily("dynascope_probe_overhead_ratio", "The probe's share of the newest step.",
                                      labels=_LABELS)
            newest = {(run, role, rank): (s, us) for run, role, rank, s, us in latest}
            for run, role, rank, _, phase, us in store.rows(f"""
                    WITH p AS ({phase_times_sql(None)}), l AS ({_LATEST})
                    SELECT p.run_id, p.role, p.rank, p.step, p.phase, p.dur_us FROM p
                    JOIN l ON p.run_id = l.run_id AND p.role = l.role AND p.rank = l.rank AND p.step = l.step"""):
                phases.add_metric([run, role, str(rank), phase], us / 1e6)
                if phase == PROBE_PHASE and newest[(run, role, rank)][1]:
                    probe.add_metric([run, role, str(rank)], us / newest[(run, role, rank)][1])
            out: list[Metric] = [step, dur, phases, probe, self._stragglers(store, latest), self._scalars(store)]
            out.append(self._alerts(store))
            return out

    @staticmethod
    def _stragglers(store: Any, latest: list[tuple]) -> Metric:
        fam = GaugeMetricFamily("dynascope_straggler_score", "Median rank's time over this rank's, slowest "
                                "phase (1 = as fast as the median).", labels=_LABELS)
        since = max((s for *_, s, _ in latest), default=0) - 20
        df = series(store, "straggler_score", max(since, 0))  # per phase: the slowest phase's score is the rank's
        df = df.group_by(["run_id", "role", "rank", "step"]).agg(pl.col("value").min()).sort("step")
        for run, role, rank, _, value in df.group_by(["run_id", "role", "rank"]).last().iter_rows():
            fam.add_metric([run, role or "", str(rank)], value)
        return fam

    @staticmethod
    def _scalars(store: Any) -> Metric:
        fam = GaugeMetricFamily("dynascope_scalar", "Newest value of each logged scalar.", labels=[*_LABELS, "key"])
        for run, role, rank, key, value in store.rows(
                "SELECT run_id, coalesce(role, ''), rank, key, arg_max(value, step) FROM scalars "
                "WHERE step IS NOT NULL AND isfinite(value) GROUP BY ALL"):
            fam.add_metric([run, role, str(rank), key], value)
        return fam

    @staticmethod
    def _alerts(store: Any) -> Metric:
        fam = CounterMetricFamily("dynascope_alerts", "Alerts fired (the run's alert events).",
                                  labels=["run", "rule", "severity"])
        counts: dict[tuple[str, str, str], int] = {}
        for run, severity, fields in store.rows(
                f"SELECT run_id, severity, fields_json FROM events WHERE event = {quote_literal('alert')}"):
            try:
                rule = str(json.loads(fields or "{}").get("rule", ""))
            except ValueError:
                rule = ""
            key = (run, rule, severity or "")
            counts[key] = counts.get(key, 0) + 1
        for labels, n in counts.items():
            fam.add_metric(list(labels), n)
        return fam


def serve_metrics(run_dir: str | Path, port: int, addr: str = "127.0.0.1",
                  min_interval_s: float = 5.0) -> tuple[Any, Any, StoreCollector]:
    """Start ``/metrics`` for the run on ``addr:port`` (a daemon thread); returns (server, thread, collector).
    ``server.shutdown()`` stops it."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(run_dir, min_interval_s)
    registry.register(collector)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return server, thread, collector
