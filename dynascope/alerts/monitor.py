"""The monitor: evaluates alert rules over the rows a live run has written, off the training thread.

Each poll opens the store, reads each rule's quantity from the step after the last it judged, and judges
the steps every series has moved past (a step's rows can arrive from its ranks one flush apart: a step is
judged once the series has a later one, and every step at ``close``). Ranks that do not evaluate rules
still run a monitor, to see the stop request of the one that does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from dynascope.alerts.actions import Webhooks, read_stop, write_stop
from dynascope.alerts.quantities import DETECTORS, series
from dynascope.alerts.rules import Rule
from dynascope.core.errors import StoreError
from dynascope.core.warn import warn
from dynascope.store import open_store

__all__ = ["Firing", "Monitor"]

Key = tuple[str, str, int | None, str | None]  # (run_id, role, rank, part)


@dataclass(frozen=True)
class Firing:
    """One alert: which rule, on which series, at which step, with what value."""

    rule: Rule
    run_id: str
    role: str | None
    rank: int | None
    step: int
    value: float | None
    part: str | None = None  # the series within the rank (the straggler rule's phase)

    @property
    def message(self) -> str:
        where = f"{self.role or 'run'} rank {self.rank}" if self.rank is not None else self.run_id
        where += f", {self.part}" if self.part else ""
        value = "" if self.value is None else f" = {self.value:.4g}"
        return self.rule.message or f"{self.rule.label}: {self.rule.quantity}{value} at step {self.step} ({where})"

    def body(self) -> dict[str, Any]:
        return {"rule": self.rule.label, "quantity": self.rule.quantity, "condition": self.rule.condition,
                "value": self.value, "threshold": self.rule.threshold, "severity": self.rule.severity,
                "step": self.step, "run_id": self.run_id, "role": self.role, "rank": self.rank,
                "part": self.part, "message": self.message}


@dataclass
class _Series:
    judged: int = -1        # last step judged
    streak: int = 0         # consecutive judged steps the condition held on, ending at ``judged``
    quiet_until: int = -1   # no firing at or before this step (hold-down)


DUTY = 0.2  # the share of wall time the monitor thread may spend judging


def _lower_priority() -> None:
    """Nice the calling thread (Linux: priority is per thread, and the DuckDB threads it starts inherit it),
    so that on a host whose cores training fills the monitor yields to the trainer."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class Monitor:
    """Rules over ``run_dir``; ``event`` writes an alert's events row (the scope's or a follower's writer),
    ``on_stop(step)`` is told the step the run is asked to stop at. ``world_size`` > 1: the stop step is
    ``stop_margin`` steps past the newest step in the store, so every rank reads the request before it."""

    def __init__(self, run_dir: str | Path, rules: Sequence[Rule], *,
                 event: Callable[..., None] | None = None, on_stop: Callable[[int | None], None] | None = None,
                 interval_s: float = 2.0, world_size: int = 1, stop_margin: int = 10) -> None:
        self.run_dir = Path(run_dir)
        self.rules = list(rules)
        self.interval_s, self.world_size, self.stop_margin = interval_s, world_size, stop_margin
        self._event, self._on_stop = event, on_stop
        self.webhooks = Webhooks()
        self.fired: list[Firing] = []
        self.polls = self.errors = 0
        self.busy_s = self.slowest_s = 0.0  # time spent in passes, and the longest one (the alerts' lag)
        self._began: float | None = None  # when the pass under way began
        self.stop_at: int | None = None
        self._state: dict[str, dict[Key, _Series]] = {r.label: {} for r in self.rules}
        self._stop_seen = False
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- one pass ---------------------------------------------------------------------------------------
    def poll(self, final: bool = False) -> list[Firing]:
        """Judge what is new once; returns the firings (their actions are done)."""
        self.polls += 1
        self._began = began = time.monotonic()
        new: list[Firing] = []
        newest: int | None = None
        if self.rules:
            try:  # one DuckDB thread: a pass shares the host's cores with training, and is not in a hurry
                store = open_store(self.run_dir, threads=1)
            except StoreError:  # nothing flushed yet
                store = None
            if store is not None:
                with store:
                    cache: dict = {}
                    for rule in self.rules:
                        try:
                            new += self._judge(rule, store, final, cache)
                        except Exception as exc:  # a bad rule or a query failure: reported, not raised
                            self.errors += 1
                            self._report(f"alert rule {rule.label} failed: {type(exc).__name__}: {exc}")
                    newest = self._newest(store) if any("stop" in f.rule.actions for f in new) else None
        took = time.monotonic() - began
        self.busy_s, self.slowest_s, self._began = self.busy_s + took, max(self.slowest_s, took), None
        for f in new:
            self._act(f, newest)
        self._check_stop_file()
        return new

    def _judge(self, rule: Rule, store: Any, final: bool, cache: dict) -> list[Firing]:
        state = self._state[rule.label]
        # from the step after the one the furthest-behind rank has judged (a rank's series per part move
        # together but for a phase it ran once, which must not hold the reads back to that step)
        judged: dict[tuple, int] = {}
        for k, s in state.items():
            judged[k[:3]] = max(judged.get(k[:3], -1), s.judged)
        since = min(judged.values(), default=-1) + 1
        df = series(store, rule.quantity, since, cache).sort("step")
        out: list[Firing] = []
        detector = rule.quantity in DETECTORS
        # a step is complete once its rank has a later one: the rank's newest step, over all of its parts (a
        # phase that runs every few steps is judged by the rank's progress, not held back by its own)
        newest = {(r, o, k): int(m) for r, o, k, m in
                  df.group_by(["run_id", "role", "rank"]).agg(pl.col("step").max()).iter_rows()}
        for (run_id, role, rank, part), g in df.group_by(["run_id", "role", "rank", "part"], maintain_order=True):
            key: Key = (str(run_id), str(role) if role is not None else "", rank, part)
            s = state.setdefault(key, _Series())
            last = newest[(run_id, role, rank)]
            for step, value in g.select("step", "value").iter_rows():
                if step <= s.judged or (not final and not detector and step >= last):
                    continue
                holds = rule.holds(value)
                s.streak = s.streak + 1 if holds else 0
                s.judged = step
                if holds and s.streak >= (1 if detector else rule.window) and step > s.quiet_until:
                    s.quiet_until = step + rule.hold_down - 1 if rule.hold_down else step - 1
                    out.append(Firing(rule, key[0], role, rank, int(step), value, part))
        return out

    def _newest(self, store: Any) -> int:
        rows = store.rows("SELECT max(step) FROM timings UNION ALL SELECT max(step) FROM scalars")
        return max((int(r[0]) for r in rows if r[0] is not None), default=0)

    # ---- actions ----------------------------------------------------------------------------------------
    def _act(self, f: Firing, newest: int | None) -> None:
        self.fired.append(f)
        body = f.body()
        if self._event is not None:
            try:
                self._event("alert", f.message, step=f.step, severity=f.rule.severity,
                            **{k: v for k, v in body.items() if k not in ("message", "step", "severity")})
            except Exception as exc:
                self._report(f"alert event not written: {type(exc).__name__}: {exc}")
        if "warn" in f.rule.actions:
            warn(f"dynascope alert: {f.message}")
        if "webhook" in f.rule.actions and f.rule.url:
            self.webhooks.post(f.rule.url, body)
        if "stop" in f.rule.actions:
            at = None if self.world_size <= 1 else (newest or f.step) + self.stop_margin
            if at is not None:
                try:
                    write_stop(self.run_dir, at, f.message)
                except OSError as exc:
                    self._report(f"stop request not written: {exc}")
            self._stop(at)

    def _stop(self, at: int | None) -> None:
        if self._stop_seen:
            return
        self._stop_seen, self.stop_at = True, at
        if self._on_stop is not None:
            self._on_stop(at)

    def _check_stop_file(self) -> None:
        if not self._stop_seen and (req := read_stop(self.run_dir)) is not None:
            self._stop(int(req["stop_at_step"]))

    def _report(self, message: str) -> None:
        warn(message)
        if self._event is not None:
            try:
                self._event("alert_error", message, severity="warning")
            except Exception:
                pass

    # ---- the thread -------------------------------------------------------------------------------------
    def start(self) -> Monitor:
        self._thread = threading.Thread(target=self._loop, name="dynascope-alerts", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        _lower_priority()
        wait = self.interval_s
        while not self._closing.wait(wait):
            began = time.monotonic()
            try:
                self.poll()
            except Exception as exc:  # never let the thread die silently
                self.errors += 1
                self._report(f"alert monitor: {type(exc).__name__}: {exc}")
            # busy at most DUTY of the time: a pass that takes longer than interval_s · DUTY (a long run's
            # whole-run detectors, a slow file system) spaces the next one out instead of running back to back
            wait = max(self.interval_s, (time.monotonic() - began) * (1 - DUTY) / DUTY)

    def close(self, timeout_s: float = 5.0, final: bool = True) -> None:
        """Stop the thread and judge the last steps once (within ``timeout_s``: a pass still running after
        it is left to finish on its daemon thread)."""
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                self._summary()
                return
        if final:
            done = threading.Event()

            def last() -> None:
                try:
                    self.poll(final=True)
                except Exception:
                    pass
                done.set()

            threading.Thread(target=last, name="dynascope-alerts-final", daemon=True).start()
            done.wait(max(0.0, deadline - time.monotonic()))
        self._summary()
        self.webhooks.close(max(0.0, min(1.0, deadline - time.monotonic())))

    def _summary(self) -> None:
        """One ``monitor_closed`` row: how many passes judged the rules and how long they took. An alert
        reaches its events row at most a pass, the wait after it and the next pass after its step's rows
        land, so the slowest pass bounds the lag a run saw (a host whose cores training fills slows them)."""
        if not self.rules or self._event is None:
            return
        began = self._began  # a pass still under way at close counts for as long as it has run
        finished = self.polls - (began is not None)
        mean_ms = 1e3 * self.busy_s / finished if finished else None  # of the passes that ended: none, NULL
        slowest = max(self.slowest_s, time.monotonic() - began if began is not None else 0.0)
        try:
            self._event("monitor_closed", f"alert monitor: {self.polls} passes (slowest {slowest:.2f} s), "
                        f"{len(self.fired)} fired, {self.errors} failed", severity="info", passes=self.polls,
                        fired=len(self.fired), errors=self.errors, slowest_pass_ms=1e3 * slowest,
                        mean_pass_ms=mean_ms, interval_s=self.interval_s)
        except Exception as exc:
            warn(f"alert monitor summary not written: {type(exc).__name__}: {exc}")

    def frame(self) -> pl.DataFrame:
        """The firings so far, one row each."""
        return pl.DataFrame([f.body() for f in self.fired])
