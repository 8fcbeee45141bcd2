"""``watch()`` and ``Scope``: attach the probes to a model and optimizer, record into a run store.

    scope = dynascope.watch(model, optimizer, run="runs/x")
    ...the unchanged training loop...
    scope.close()

``watch()`` composes a list of probes (``probes.protocol.Probe``: a schedule, ``before``/``after`` the
optimizer step, the rows they produce) and the scope drives them. Hooks: optimizer step pre/post hooks
(the step boundary), forward pre/post hooks on the root module (forward timing) and autograd hooks on
its output (backward timing). Every call into a probe is guarded: an exception warns once, becomes a
``probe_error`` event, and training goes on.
"""

from __future__ import annotations

import functools
import gc
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dynascope.core.clock import now_us
from dynascope.probes.memory import MemoryProbe
from dynascope.probes.params import Tracked, discover, optimizer_fingerprint
from dynascope.probes.protocol import Listener, Probe, Rows, StepContext, make_listener, rows_of
from dynascope.probes.reference import build_reference
from dynascope.probes.resolver import Resolver, lower_priority
from dynascope.probes.schedule import Schedule, as_schedule, every
from dynascope.probes.system import SystemSampler
from dynascope.probes.tensors import DRIFT_EVERY, TIME_BUDGET, W_NORM_EVERY, TensorStats
from dynascope.probes.timing import PROBE_PHASE, TimingProbe
from dynascope.store.writer import RunWriter

__all__ = ["WRITER_FLUSH_S", "Scope", "watch"]

# The run writer that watch() makes flushes every 10 s (RunWriter's own default is 2 s). A flush has a
# fixed cost whatever its size (a segment file per table, each fsync'ed, and the two tensor_stats
# rollups): at 2 s it was the largest part of the probe's background CPU, ~1-2% of a step on 2 cores.
# The price: rows reach the store, and the dashboard, up to 10 s later (12 s with the resolver's batches,
# probes.resolver.RESOLVE_DELAY_S), and ``dynascope runs`` calls a
# killed run crashed after 25 s instead of 9 s. Pass ``writer=RunWriter(..., flush_secs=2)`` for fresher rows.
WRITER_FLUSH_S = 10.0


def _identity(rank: int | None, role: str | None, world_size: int | None) -> tuple[int, int, int, str]:
    """(rank, local_rank, world_size, role): explicit kwargs, else torch.distributed, else env vars."""
    env = os.environ
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    r = rank if rank is not None else (torch.distributed.get_rank() if dist_on else int(env.get("RANK", 0)))
    ws = world_size if world_size is not None else (
        torch.distributed.get_world_size() if dist_on else int(env.get("WORLD_SIZE", 1)))
    lr = int(env.get("LOCAL_RANK", 0))
    return int(r), lr, int(ws), role or "trainer"


def _device_of(model: Any) -> torch.device | None:
    try:
        p = next(iter(model.parameters()))
        return p.device if p.device.type != "meta" else None
    except Exception:
        return None


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
        self._listeners: list[Listener] = []
        self._handles: list[Any] = []
        self._closed = False
        self.resolver = Resolver(self._resolver_error, self._resolve_batch)
        writer_thread = getattr(writer, "_thread", None)
        if writer_thread is not None:  # background work at a lower priority (see probes.resolver)
            lower_priority(writer_thread)
        self.tracked: list[Tracked] = []
        self._fingerprint: tuple | None = None
        self._skipped_reported: set[str] = set()
        self._stepped = False  # the optimizer stepped since the last boundary
        self._grads_after = False  # this step's optimizer.step() got a closure (StepContext.grads_after)
        self.stats = self._find(TensorStats)
        self.memory = self._find(MemoryProbe)
        self.timing = self._find(TimingProbe)
        self.system = self._find(SystemSampler)
        from dynascope.probes.spectral import SpectralProbe

        self.spectral = self._find(SpectralProbe)
        self._refresh()
        if reference is not None:
            self._guard("reference", self.set_reference, reference)
        self._attach()
        if optimizer is None:  # manual boundaries: step 0 starts now
            self._before(manual=True)

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
            warnings.warn(f"dynascope: probe {msg} (training continues)", RuntimeWarning, stacklevel=3)
        self.writer.event("probe_error", msg, step=self._step, severity="warning", probe=probe)

    def _resolver_error(self, probe: str, exc: BaseException) -> None:
        self._report(f"resolve:{probe}", exc)

    def _guard(self, probe: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
            self._handles.append(self.optimizer.register_step_pre_hook(self._guarded("optimizer_pre", self._pre)))
            self._handles.append(self.optimizer.register_step_post_hook(self._guarded("optimizer_post", self._post)))
        if self.timing is not None:
            self._handles += self.timing.attach(self.model, self._guard)

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # the hook gets step()'s own arguments: (optimizer, closure?) and its keywords
        self._grads_after = (kwargs or {}).get("closure", args[1] if len(args) > 1 else None) is not None
        self._before(manual=False)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.timing is not None:
            self.timing.optimizer_done()
        self._stepped = True
        self._boundary()

    # ---- the protocol: before, the step boundary ------------------------------------------------------
    def _context(self, manual: bool) -> StepContext:
        return StepContext(self._step, self.stage, self.tracked, self.reference, manual,
                           grads_after=self._grads_after and not manual)

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
        self._due = [p for p in self.probes if self._guard(p.name, p.schedule, ctx.step)]
        with self._own_work(self._due):
            for p in self._due:  # a failed before() is reported; its after() still runs and may return nothing
                if p is not self.timing:
                    self._guard(p.name, p.before, ctx)
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

    def _resolve_batch(self, items: list[tuple[int, str | None, list[tuple[Probe, Any]]]]) -> None:
        """Rows of the steps the resolver collected: each probe converts its results of all of them at once
        (``resolve_many``). Listeners get one summary per step, so with listeners steps resolve one by one."""
        if self._listeners or len(items) == 1:
            for item in items:
                self._resolve(*item)
            return
        results: dict[int, tuple[Probe, list[Any]]] = {}
        for _, _, out in items:
            for p, res in out:
                results.setdefault(id(p), (p, []))[1].append(res)
        for p, batch in results.values():
            try:
                rows_list = p.resolve_many(batch)
            except Exception as exc:  # report it, then resolve step by step: one bad step costs only itself
                self._report(f"resolve:{p.name}", exc)
                rows_list = [rows for res in batch if (rows := self._guard(f"resolve:{p.name}", rows_of, res))]
            for rows in rows_list:
                for table, cols in rows.items():
                    if cols:
                        self.writer.append(table, cols)

    def _resolve(self, step: int, stage: str | None, out: list[tuple[Probe, Any]]) -> None:
        summary: dict[str, float] = {}
        for p, res in out:
            try:
                rows: Rows = rows_of(res)
                for table, cols in rows.items():
                    if cols:
                        self.writer.append(table, cols)
                if self._listeners:
                    summary.update(p.summarize(rows))
            except Exception as exc:
                self._report(f"resolve:{p.name}", exc)
        if out:
            for fn in list(self._listeners):
                try:
                    fn(step, summary)
                except Exception as exc:
                    self._report(f"listener:{getattr(fn, '__name__', type(fn).__name__)}", exc)

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
        if self._closed:
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
        self.reference = build_reference(ref, named, self.run_dir, self.writer.rank, resident)
        if self.stats is not None:
            self.stats.reference = self.reference
        if self.reference is not None:
            self.writer.event("reference_set", f"θ₀ = {self.reference.kind}", step=self._step,
                              resident=resident, path=str(self.reference.path or ""))

    def add_listener(self, fn: Listener) -> None:
        """``fn(step, summary)`` is called on the resolver thread after each recorded step (with a listener
        attached, the resolver converts each step's rows on their own, not a few seconds' worth at once)."""
        self._listeners.append(fn)

    def flush(self) -> None:
        """Resolve pending records and write buffered rows now."""
        self.resolver.drain()
        self.writer.flush()

    def close(self) -> None:
        """Detach hooks, resolve what is pending, stop threads, close the writer if this scope made it."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self.resolver.close()
        if self.timing is not None:  # phases that ended after the last boundary (no listener call: no step)
            for table, cols in (self._guard("timing", self.timing.leftover) or {}).items():
                self.writer.append(table, cols)
        for p in self.probes:
            self._guard(p.name, p.close)
        for fn in self._listeners:
            close = getattr(fn, "close", None)
            if callable(close):
                self._guard("listener", close)
        if self._own_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _spectral_probe(spec: Any) -> Probe:
    from dynascope.probes.spectral import SpectralProbe

    kw = dict(spec) if isinstance(spec, dict) else {}
    if "every" in kw:
        kw["schedule"] = every(int(kw.pop("every")))
    return SpectralProbe(**kw)


def watch(model: Any, optimizer: Any = None, run: str | os.PathLike = "runs/default", *,
          every: int | Schedule = 1, reference: Any = "init", memory_budget: float | None = 0.1,
          spectral: bool | dict = False, stage: str | None = None, rank: int | None = None,
          role: str | None = None, world_size: int | None = None, system_interval_s: float | None = 5.0,
          grad_tol: float | None = None, wandb: bool = False, config: dict | None = None,
          writer: RunWriter | None = None, time_budget: float | None = TIME_BUDGET, bf16_k: int | None = None,
          probes: Sequence[Probe] = (), listeners: Sequence[Listener | str] = (),
          drift_every: int = DRIFT_EVERY, w_norm_every: int = W_NORM_EVERY) -> Scope:
    """Attach dynascope's probes to ``model`` and ``optimizer`` and record into the run at ``run``.

    Args:
        every: record tensor statistics every N optimizer steps, or a ``schedule(step) -> bool``
            (see ``dynascope.probes.schedule``). Timings are recorded every step.
        reference: θ₀ for drift — "init" (the weights now), None, a state dict, or a checkpoint path.
        memory_budget: share of parameter bytes dynascope may hold on the device for ΔW snapshots and
            θ₀; it sizes the rotating window of tensors that get the full statistics each record
            (>= 2 or None: every tensor, every record, θ₀ resident).
        spectral: True or dict(k=8, every=10, time_budget=0.05) for low-rank summaries of W − W₀.
        rank, role, world_size: identity for processes outside torch.distributed (e.g. Ray actors).
        system_interval_s: system sampler period (None/0 disables it).
        grad_tol: near-zero gradient threshold relative to the tensor's rms (default 1e-8).
        wandb: mirror the compact summaries to wandb (the listener ``dynascope.integrations.wandb``
            registers; ``dynascope.watch`` imports it when asked).
        writer: share an existing ``RunWriter`` (it is then flushed, not closed, by ``close``); by
            default watch() makes one that flushes every ``WRITER_FLUSH_S`` (10 s).
        time_budget: share of wall time the windowed statistics may take on average (default 1%,
            ``probes.tensors.TIME_BUDGET``; None: no limit). ‖g‖ of every tensor is recorded regardless,
            and ‖W‖ as ``w_norm_every`` says.
        bf16_k: record PULSE's S_k (``bf16_unchanged_k_*``) against the weights ``bf16_k`` steps back;
            the bf16 snapshot is resident when the budget covers it, else on disk beside θ₀.
        probes: further ``Probe`` objects, run after the built-in ones.
        listeners: ``fn(step, summary)`` callables, or names of registered listeners ("wandb").
        drift_every: drift from θ₀ at every N-th window a tensor is in (default 4: drift is cumulative
            and slow, so its refresh once per 4 rotations leaves more of the time budget to ΔW); a
            window that holds every tensor (``memory_budget`` >= 2 or None) always computes it.
        w_norm_every: ‖W‖ of every tensor at every N-th record (default 8, the first included; 1: every
            record) and of the window's tensors at every record, where ``update_ratio`` needs it. ‖W‖
            moves slowly, and its pass over every weight costs about as much as the gradients' norm pass.
            Weights' NaN/Inf counts are known where ‖W‖ is (a finite norm proves them 0); gradients',
            from which a non-finite weight normally comes, at every record.
    """
    r, local_rank, ws, role_ = _identity(rank, role, world_size)
    own = writer is None
    if writer is None:
        writer = RunWriter(run, rank=r, role=role_, world_size=ws, framework="pytorch", config=config,
                           flush_secs=WRITER_FLUSH_S)
    schedule = as_schedule(every)
    built: list[Probe] = [TensorStats(memory_budget, grad_tol, time_budget=time_budget, schedule=schedule,
                                      bf16_k=bf16_k, run_dir=writer.run_dir, rank=writer.rank,
                                      drift_every=drift_every, w_norm_every=w_norm_every)]
    failed: list[tuple[str, Exception]] = []
    for name, make in (("spectral", lambda: _spectral_probe(spectral) if spectral else None),
                       ("system", lambda: SystemSampler(writer, system_interval_s, local_rank)
                        if system_interval_s else None)):
        try:
            p = make()
            if p is not None:
                built.append(p)
        except Exception as exc:
            failed.append((name, exc))
    device = _device_of(model)
    built += [MemoryProbe(device, schedule), *probes, TimingProbe(device)]  # timing last: the step row spans them
    scope = Scope(model, optimizer, writer, own, built, reference=reference, stage=stage)
    for name, exc in failed:
        scope._report(name, exc)
    for spec in (["wandb"] if wandb else []) + list(listeners):
        try:
            scope.add_listener(make_listener(spec) if isinstance(spec, str) else spec)
        except Exception as exc:
            scope._report(f"listener:{spec}" if isinstance(spec, str) else "listener", exc)
    # One full collection now, before the first probed step. What attaching allocated (modules imported on
    # first use, the writer's and the probes' state) is enough to tip CPython's collector into a full pass
    # a few dozen steps later: 0.2-0.3 s inside one training step of a process holding ~300k objects, and
    # under data parallelism one rank's stall is every rank's wait. Here it costs the same, outside a step.
    gc.collect()
    return scope
