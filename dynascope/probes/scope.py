"""``Scope``: the live probe session that ``watch()`` (``probes.attach``) returns.

    scope = dynascope.watch(model, optimizer, run="runs/x")
    ...the unchanged training loop...
    scope.close()

The scope drives a list of probes (``probes.protocol.Probe``: a schedule, ``before``/``after`` the
optimizer step, the rows they produce); ``probes.delivery`` writes their rows and calls listeners. Hooks: optimizer step pre/post hooks
(the step boundary), forward pre/post hooks on the root module (forward timing) and autograd hooks on
its output (backward timing). Every call into a probe is guarded: an exception warns once, becomes a
``probe_error`` event, and training goes on.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dynascope.core.clock import now_us
from dynascope.core.warn import warn
from dynascope.probes import forks, zero_params
from dynascope.probes.delivery import Delivery
from dynascope.probes.listeners import LISTENER_DEADLINE_S, IsolatedListener
from dynascope.probes.loss_scale import loss_scale
from dynascope.probes.memory import MemoryProbe
from dynascope.probes.params import Tracked, discover, optimizer_fingerprint
from dynascope.probes.protocol import Listener, Probe, StepContext
from dynascope.probes.resolver import Resolver, lower_priority
from dynascope.probes.step_hooks import attach_step_hooks
from dynascope.probes.system import SystemSampler
from dynascope.probes.tensors import TensorStats
from dynascope.probes.timing import PROBE_PHASE, TimingProbe
from dynascope.store.writer import RunWriter

__all__ = ["Scope"]

WAIT_ROW_S = 1e-3  # a wait for the passes at a step where no probe is due gets its own row from this long

class Scope:
    """A live probe session; see ``watch``. Also a context manager (closes on exit).

    ``probes`` run in order at each step; ``stats``, ``memory``, ``spectral``, ``timing`` and ``system``
    name the built-in ones (None when not attached).
    """

    def __init__(self, model: Any, optimizer: Any, writer: RunWriter, own_writer: bool, probes: Sequence[Probe],
                 *, reference: Any = None, stage: str | None = None) -> None:
        self.model, self.optimizer, self.writer = model, optimizer, writer
        self._own_writer, self.stage = own_writer, stage
        self.run_dir: Path = writer.run_dir
        self.probes: list[Probe] = list(probes)
        self.reference: Any = None
        self._step = 0
        self._due: list[Probe] | None = None  # probes whose before() ran for the current step (None: none ran)
        self._warned: set[str] = set()
        self._failures: dict[str, int] = {}  # per probe: how many times it has failed
        self._handles: list[Any] = []
        self._closed = False
        self._stop: tuple[int | None] | None = None  # (step to stop at, or None: now) once a stop is asked
        self._services: list[Any] = []  # background parts with close(), closed before the writer
        self.forked = False  # a copy inherited through fork: inert (probes.forks)
        forks.track(self)
        self.delivery = Delivery(writer, self._report)
        self.resolver = Resolver(self._resolver_error, self.delivery.deliver)
        writer_thread = getattr(writer, "_thread", None)
        if writer_thread is not None:  # background work at a lower priority (see probes.resolver)
            lower_priority(writer_thread)
        self.tracked: list[Tracked] = []
        self._fingerprint: tuple | None = None
        self._skipped_reported: set[str] = set()
        self._stepped = False  # the optimizer stepped since the last boundary
        self._scale: tuple[Any, Any, str | None] = (None, None, None)  # loss_scale() at the pre-hook
        self._grads_after = False  # this step's optimizer.step() got a closure (StepContext.grads_after)
        self.stats = self._find(TensorStats)
        self.memory = self._find(MemoryProbe)
        self.timing = self._find(TimingProbe)
        self.system = self._find(SystemSampler)
        from dynascope.probes.spectral import SpectralProbe

        self.spectral = self._find(SpectralProbe)
        self._guard("discover", self._refresh)
        if reference is not None:
            self._guard("reference", self.set_reference, reference)
        self._attach()
        if self.stats is not None:  # full coverage: the first record's snapshot and kernels, off this thread
            self._guard(self.stats.name, self.stats.prepare, self.tracked, self._step)
        if self.optimizer is None:  # manual boundaries: step 0 starts now
            self._guard("boundary", self._before, True)

    def _find(self, cls: type) -> Any:
        return next((p for p in self.probes if isinstance(p, cls)), None)

    @property
    def step_index(self) -> int:
        """The step rows are recorded under now (see ``resume`` to continue a numbering)."""
        return self._step

    @property
    def timer(self) -> Any:
        return self.timing.timer if self.timing is not None else None

    # ---- guarding -----------------------------------------------------------------------------------
    def _report(self, probe: str, exc: BaseException) -> None:
        msg = f"{probe}: {type(exc).__name__}: {exc}"
        if probe not in self._warned:
            self._warned.add(probe)
            warn(f"dynascope: probe {msg} (training continues)", RuntimeWarning, stacklevel=3)
        # a probe that fails at every step of a long run is an events row for each of its first ten
        # failures, then at the 16th, 32nd, 64th...: the count says how many there were, not a row apiece
        n = self._failures[probe] = self._failures.get(probe, 0) + 1
        if n <= 10 or n & (n - 1) == 0:
            self.writer.event("probe_error", msg, step=self._step, severity="warning", probe=probe, failures=n)

    def _resolver_error(self, probe: str, exc: BaseException) -> None:
        self._report(f"resolve:{probe}", exc)

    def _guard(self, probe: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self._report(probe, exc)
            return None

    def _guarded(self, probe: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def hook(*args: Any, **kwargs: Any) -> Any:
            self._guard(probe, fn, *args, **kwargs)
            return None  # never change the module's output / optimizer args
        return hook

    # ---- setup --------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        fp = optimizer_fingerprint(self.optimizer)
        if fp == self._fingerprint and self.tracked:
            return
        self._fingerprint = fp
        self.tracked, skipped = discover(self.model, self.optimizer)
        for name, reason in skipped:
            if name not in self._skipped_reported:
                self._skipped_reported.add(name)
                self.writer.event("probe_skip", f"{name}: {reason}", step=self._step, tensor=name,
                                  reason=reason)

    def _attach(self) -> None:
        if self.optimizer is not None:
            handles = attach_step_hooks(self.optimizer, self._guarded("optimizer_pre", self._pre),
                                        self._guarded("optimizer_post", self._post))
            if handles is None:  # nothing to hook: the user's scope.step() calls are the boundaries
                self._report("optimizer", TypeError(
                    f"cannot hook {type(self.optimizer).__name__}.step(); call scope.step() after each step"))
                self.optimizer = None
            self._handles += handles or []
        if self.timing is not None:
            self._handles += self.timing.attach(self.model, self._guard)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.forked:
            return
        # the hook gets step()'s own arguments: (optimizer, closure?) and its keywords
        self._grads_after = (kwargs or {}).get("closure", args[1] if len(args) > 1 else None) is not None
        self._scale = loss_scale(optimizer, kwargs)
        self._before(manual=False)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.forked:
            return
        if self.timing is not None:
            self.timing.optimizer_done()
        self._stepped = True
        self._boundary()

    # ---- the protocol: before, the step boundary ------------------------------------------------------
    def _context(self, manual: bool) -> StepContext:
        scale, found_inf, unknown = self._scale if not manual else (None, None, None)
        return StepContext(self._step, self.stage, self.tracked, self.reference, manual,
                           grads_after=self._grads_after and not manual, grad_scale=scale, found_inf=found_inf,
                           scale_unknown=unknown)

    @contextmanager
    def _own_work(self, due: Sequence[Probe]) -> Iterator[None]:
        """Time the probes' own work on this thread as a phase (when timing is on and another probe is due)."""
        timer = self.timer
        rec = None
        if timer is not None and any(p is not self.timing for p in due):
            rec = self._guard("timing", timer.start, PROBE_PHASE)
        try:
            yield
        finally:
            if rec is not None:
                self._guard("timing", timer.stop, rec)

    def _before(self, manual: bool) -> None:
        self._refresh()
        ctx = self._context(manual)
        # The schedules wait for the post-step passes still reading W_t (probes.background): that wait is the
        # probe's time in this step, so it is timed with the probes' own work (a step where nothing is due
        # and nothing was waited for keeps no row).
        timer = self.timer
        rec = self._guard("timing", timer.start, PROBE_PHASE) if timer is not None and any(
            p is not self.timing for p in self.probes) else None
        t0 = time.perf_counter()
        self._due = [p for p in self.probes if self._guard(p.name, p.schedule, ctx.step)]
        if rec is not None and not any(p is not self.timing for p in self._due) and time.perf_counter() - t0 < WAIT_ROW_S:
            self._guard("timing", timer.cancel, rec)
            rec = None
        try:
            for p in self._due:  # a failed before() is reported; its after() still runs and may return nothing
                if p is not self.timing:
                    self._guard(p.name, p.before, ctx)
        finally:
            if rec is not None:
                self._guard("timing", timer.stop, rec)
        if self.timing in self._due:  # last: the optimizer phase starts when the probes are done
            self._guard(self.timing.name, self.timing.before, ctx)

    def _boundary(self) -> None:
        step, stage = self._step, self.stage
        ctx = self._context(self.optimizer is None)
        out: list[tuple[Probe, Any]] = []
        # No before() ran when the optimizer skipped its step (scope.step() closes it): the probes scheduled
        # now still close the step (the step row, memory); the tensor statistics have no update to record.
        due = self._due if self._due is not None else [p for p in self.probes if self._guard(p.name, p.schedule, step)]
        with self._own_work(due):
            for p in due:
                if p is not self.timing:
                    self._after(p, ctx, out)
        if self.timing in due:  # last: its step row and phases close the step, the probes' work included
            self._after(self.timing, ctx, out)
        self._due = None
        self._grads_after = False
        self._scale = (None, None, None)
        self._step += 1
        self.resolver.collect((step, stage, out))

    def _after(self, p: Probe, ctx: StepContext, out: list[tuple[Probe, Any]]) -> None:
        try:
            res = p.after(ctx)
        except Exception as exc:
            self._report(p.name, exc)
            self._guard(p.name, p.discard)
            return
        if res is not None:
            out.append((p, res))

    # ---- public API ---------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str, category: str = "phase") -> Iterator[None]:
        """Time a (nestable) phase of this rank: ``with scope.phase("rollout"): ...``."""
        timer = self.timer
        rec = self._guard("timing", timer.start, str(name), category) if timer is not None else None
        try:
            yield
        finally:
            if rec is not None:
                self._guard("timing", timer.stop, rec)

    def step(self) -> None:
        """Close the current step. With an optimizer attached, its ``step()`` is the boundary and this
        only closes a step in which the optimizer did not step (e.g. skipped by a GradScaler)."""
        if self._closed or self.forked:
            return
        if self.optimizer is not None and self._stepped:
            self._stepped = False
            return
        self._stepped = False
        self._guard("boundary", self._boundary)
        if self.optimizer is None:
            self._guard("boundary", self._before, True)

    def resume(self, step: int) -> None:
        """Continue the step numbering at ``step`` (a run resumed after ``step`` optimizer steps records
        its next step as ``step``); call it before the first step of the resumed loop."""
        self._step = int(step)
        if self.timing is not None:
            self.timing.timer.step = self._step
        if getattr(self.writer, "restarted", False):  # a restart's step resumed from (store.lineage)
            self.event("resume", f"resumed at step {self._step}: the steps from it replace the earlier process's")

    def event(self, kind: str, message: str = "", **fields: Any) -> None:
        """Record an event (checkpoint_save/load with ``dur_us=``, restart, eval, fault...)."""
        severity = fields.pop("severity", "info")
        dur_us = fields.pop("dur_us", None)
        step = fields.pop("step", self._step)
        self._guard("event", self.writer.event, kind, message, step=step, severity=severity, dur_us=dur_us,
                    **fields)

    def log(self, step: int | None = None, **scalars: Any) -> None:
        """Free-form metrics as ``scalars`` rows (tensors are read with ``float()``, i.e. synchronously)."""
        def go() -> None:
            keys = list(scalars)
            self.writer.append("scalars", {"step": self._step if step is None else int(step),
                                           "time_us": now_us(), "stage": self.stage, "key": keys,
                                           "value": [float(scalars[k]) for k in keys]})
        self._guard("log", go)

    def samples(self, **columns: Any) -> None:
        """RL rollout records: columns of the ``samples`` table as equal-length lists."""
        def go() -> None:
            cols = dict(columns)
            cols.setdefault("step", self._step)
            cols.setdefault("time_us", now_us())
            self.writer.append("samples", cols)
        self._guard("samples", go)

    def set_stage(self, name: str | None) -> None:
        """Label later tensor_stats/spectra/scalars rows (e.g. "sft", "rl")."""
        self.stage = name

    def set_reference(self, ref: Any) -> None:
        """New θ₀ for drift: ``"init"`` (the weights now), a state dict, or a safetensors/.pt path."""
        self._refresh()
        named = [(t.name, t.local()) for t in self.tracked]
        total = sum(t.nbytes for t in self.tracked)
        budget = self.stats.memory_budget if self.stats is not None else None
        resident = budget is None or budget * total >= 2 * total
        resume = self.reference is None and bool(getattr(self.writer, "restarted", False))  # θ₀ of the run's start
        self.reference = zero_params.build_reference(ref, named, self.run_dir, self.writer.rank, resident,
                                                     self.tracked, resume)
        if self.stats is not None:
            self.stats.reference = self.reference
        if self.reference is not None:
            reset = resume and self.reference.kind == "init"  # the first process held θ₀ in memory only
            self.writer.event("reference_set", f"θ₀ = {self.reference.kind}" + (
                ": the resumed weights, as the first process kept no θ₀ file; pass reference=<the base "
                "checkpoint> to measure drift from the run's start" if reset else ""), step=self._step,
                severity="warning" if reset else "info", resident=resident, path=str(self.reference.path or ""))

    def add_listener(self, fn: Listener, deadline_s: float = LISTENER_DEADLINE_S) -> None:
        """``fn(step, summary)`` is called after each recorded step, on a thread of its own
        (``probes.listeners``): one that raises is reported, one that runs past ``deadline_s`` is dropped;
        neither can hold the resolver or training. (With a listener attached, the resolver converts each
        step's rows on their own, not a few seconds' worth at once.)"""
        self.delivery.listeners.append(IsolatedListener(fn, self._resolver_error, self.writer.event, deadline_s))

    @property
    def should_stop(self) -> bool:
        """True once a stop was asked (an alert rule's ``stop`` action) and its step is reached; the
        integrations end training on it, a plain loop reads it after ``optimizer.step()``."""
        return self._stop is not None and (self._stop[0] is None or self._step >= self._stop[0])

    def request_stop(self, at_step: int | None = None) -> None:
        """Ask the training loop to stop, now or at ``at_step`` (every rank at the same step)."""
        if self._stop is None:
            self._stop = (at_step,)

    def add_service(self, service: Any) -> None:
        """A background part (the alert monitor) whose ``close()`` runs at ``close``, before the writer's."""
        self._services.append(service)

    def flush(self) -> None:
        """Resolve pending records and write buffered rows now."""
        self.resolver.drain()
        self.writer.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """Detach hooks, resolve what is pending, stop threads, close the writer if this scope made it.

        Each wait (the resolver, each listener, the writer) gets what is left of ``timeout_s``; what a part
        could not finish by then is left to its daemon thread and reported, never waited for."""
        if self._closed or self.forked:  # a copy inherited through fork has nothing of its own to close
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 0.1)

        for h in self._handles:
            self._guard("detach", h.remove)
        self._guard("resolver", self.resolver.close, left())
        if self.timing is not None:  # phases that ended after the last boundary (no listener call: no step)
            for table, cols in (self._guard("timing", self.timing.leftover) or {}).items():
                self.writer.append(table, cols)
        for p in self.probes:
            self._guard(p.name, p.close)
        for fn in self.delivery.listeners:
            self._guard("listener", fn.close, min(left(), 5.0))
        if self._services:  # they read the rows just written: flush first, then let them write theirs
            self._guard("flush", self.writer.flush)
            for service in self._services:
                self._guard("service", service.close)
        if self._own_writer:
            self._guard("writer", self.writer.close, left())
        else:
            self._guard("writer", self.writer.flush)

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
