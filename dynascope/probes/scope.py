"""``watch()`` and ``Scope``: attach the probes to a model and optimizer, record into a run store.

    scope = dynascope.watch(model, optimizer, run="runs/x")
    ...the unchanged training loop...
    scope.close()

Hooks: optimizer step pre/post hooks (the step boundary, ΔW snapshot, gradient statistics), forward
pre/post hooks on the root module (forward timing) and autograd hooks on its output (backward timing).
Every hook body is guarded: an exception warns once, becomes a ``probe_error`` event, and training goes on.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dynascope.probes.memory import MemoryProbe
from dynascope.probes.params import Tracked, discover, optimizer_fingerprint
from dynascope.probes.reference import LazyRef, build_reference
from dynascope.probes.resolver import Resolver
from dynascope.probes.schedule import Schedule, as_schedule
from dynascope.probes.system import SystemSampler
from dynascope.probes.tensors import Record, TensorStats, rows_from_record, summarize
from dynascope.probes.timing import PhaseRecord, Timer, first_grad_tensor
from dynascope.store.writer import RunWriter, now_us

__all__ = ["Scope", "watch"]

Listener = Callable[[int, dict[str, float]], None]


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
    """A live probe session; see ``watch``. Also a context manager (closes on exit)."""

    def __init__(self, model: Any, optimizer: Any, writer: RunWriter, own_writer: bool, *,
                 schedule: Schedule, reference: Any, memory_budget: float | None, spectral: Any,
                 stage: str | None, local_rank: int, system_interval_s: float | None,
                 grad_tol: float | None, time_budget: float | None = 0.015) -> None:
        self.model, self.optimizer, self.writer = model, optimizer, writer
        self._own_writer, self.schedule, self.stage = own_writer, schedule, stage
        self.run_dir: Path = writer.run_dir
        self.step_index = 0
        self._warned: set[str] = set()
        self._listeners: list[Listener] = []
        self._handles: list[Any] = []
        self._closed = False
        self.device = _device_of(model)
        self.timer = Timer(self.device)
        self.stats = TensorStats(memory_budget, grad_tol, time_budget=time_budget)
        self.memory = MemoryProbe(self.device)
        self.resolver = Resolver(self._resolver_error)
        self.tracked: list[Tracked] = []
        self._fingerprint: tuple | None = None
        self._skipped_reported: set[str] = set()
        self._stepped = False  # the optimizer stepped since the last boundary
        self._opt_rec: PhaseRecord | None = None
        self._bwd_live = False
        self._step_t0, self._step_start_us = time.perf_counter_ns(), now_us()
        self._refresh()
        if reference is not None:
            self._guard("reference", self.set_reference, reference)
        self.spectral = self._make_spectral(spectral)
        self._attach()
        if optimizer is None and self.schedule(0):
            self._guard("tensor_stats", self._manual_snapshot)
        self.system = None
        if system_interval_s:
            self.system = self._guard("system", SystemSampler, writer, system_interval_s, local_rank)

    # ---- guarding -----------------------------------------------------------------------------------
    def _report(self, probe: str, exc: BaseException) -> None:
        msg = f"{probe}: {type(exc).__name__}: {exc}"
        if probe not in self._warned:
            self._warned.add(probe)
            warnings.warn(f"dynascope: probe {msg} (training continues)", RuntimeWarning, stacklevel=3)
        self.writer.event("probe_error", msg, step=self.step_index, severity="warning", probe=probe)

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
                self.writer.event("probe_skip", f"{name}: {reason}", step=self.step_index, tensor=name,
                                  reason=reason)

    def _make_spectral(self, spec: Any) -> Any:
        if not spec:
            return None
        try:
            from dynascope.probes.schedule import every
            from dynascope.probes.spectral import SpectralProbe

            kw = dict(spec) if isinstance(spec, dict) else {}
            if "every" in kw:
                kw["schedule"] = every(int(kw.pop("every")))
            return SpectralProbe(**kw)
        except Exception as exc:
            self._report("spectral", exc)
            return None

    def _attach(self) -> None:
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._guarded("optimizer_pre", self._pre)))
            self._handles.append(self.optimizer.register_step_post_hook(self._guarded("optimizer_post", self._post)))
        if isinstance(self.model, torch.nn.Module):
            self._handles.append(self.model.register_forward_pre_hook(self._guarded("forward", self._fwd_pre)))
            self._handles.append(self.model.register_forward_hook(self._guarded("forward", self._fwd_post)))

    # ---- hooks --------------------------------------------------------------------------------------
    def _fwd_pre(self, module: Any, args: Any) -> None:
        module._dynascope_fwd = self.timer.start("forward")

    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        rec = getattr(module, "_dynascope_fwd", None)
        if rec is not None:
            module._dynascope_fwd = None
            self.timer.stop(rec)
        t = first_grad_tensor(out) if torch.is_grad_enabled() else None
        if t is not None:
            parent = rec.parent if rec is not None else None
            t.register_hook(lambda g: self._guard("backward", self._bwd_start, parent))

    def _bwd_start(self, parent: str | None) -> None:
        if self._bwd_live:
            return
        self._bwd_live = True
        rec = self.timer.start("backward", parent=parent, push=False)

        def done() -> None:
            self._bwd_live = False
            self.timer.stop(rec, pop=False)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._guard("backward", done))

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_rec = self.timer.start("optimizer")
        self._refresh()
        if self.schedule(self.step_index):
            self.stats.before(self.step_index, self.stage, self.tracked)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._opt_rec is not None:
            self.timer.stop(self._opt_rec)
            self._opt_rec = None
        self._stepped = True
        self._boundary()

    # ---- the step boundary --------------------------------------------------------------------------
    def _boundary(self) -> None:
        step = self.step_index
        rec = self._guard("tensor_stats", self.stats.after)
        if rec is None:
            self.stats.discard()
        spectra = self._guard("spectral", self._spectral, step) if rec is not None and self.spectral else None
        mem = self._guard("memory", self.memory.read) if rec is not None else None
        t1 = time.perf_counter_ns()
        self.stats.tick((t1 - self._step_t0) / 1e9)
        step_row = {"step": step, "phase": "step", "parent": None, "start_us": self._step_start_us,
                    "dur_us": (t1 - self._step_t0) // 1000, "device": self.timer.device, "category": "step"}
        self._step_t0, self._step_start_us = t1, now_us()
        phases = self.timer.take()
        self._bwd_live = False  # a backward that raised never ran its end callback; do not stay stuck
        self.step_index += 1
        self.timer.step = self.step_index
        self.resolver.submit(self._resolve, step, self.stage, rec, phases, step_row, spectra, mem)

    def _spectral(self, step: int) -> list[dict]:
        if not self.spectral.due(step) or self.stats.reference is None:
            return []
        ref = self.stats.reference
        named = [(t.name, t.local()) for t in self.tracked if t.local().ndim == 2]
        lazy = {n: LazyRef(ref, n, w) for n, w in named if ref.has(n)}
        rows = self.spectral.record(step, self.stage, named, lazy)
        if rows:
            cols = {k: [r.get(k) for r in rows] for k in rows[0]}
            self.writer.append("spectra", cols)
        return rows

    def _resolve(self, step: int, stage: str | None, rec: Record | None, phases: list[PhaseRecord],
                 step_row: dict, spectra: list[dict] | None, mem: dict | None) -> None:
        timing = [step_row] + [p.resolve() for p in phases]
        self.writer.append("timings", {k: [r[k] for r in timing] for k in step_row})
        summary: dict[str, float] = {}
        if rec is not None:
            cols = rows_from_record(rec)
            self.writer.append("tensor_stats", cols)
            summary = summarize(cols)
        if mem:
            self.writer.append("scalars", {"step": step, "time_us": now_us(), "stage": stage,
                                           "key": list(mem), "value": list(mem.values())})
        for r in timing[1:]:
            key = f"phase/{r['phase']}_ms"
            summary[key] = summary.get(key, 0.0) + r["dur_us"] / 1000.0
        energies = [r["rank1_energy"] for r in spectra or [] if r.get("rank1_energy") is not None]
        if energies:
            summary["spectral/rank1_energy"] = float(sum(energies) / len(energies))
        if rec is not None or phases:
            for fn in list(self._listeners):
                try:
                    fn(step, summary)
                except Exception as exc:
                    self._report(f"listener:{getattr(fn, '__name__', type(fn).__name__)}", exc)

    # ---- public API ---------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str, category: str = "phase") -> Iterator[None]:
        """Time a (nestable) phase of this rank: ``with scope.phase("rollout"): ...``."""
        rec = self._guard("timing", self.timer.start, str(name), category)
        try:
            yield
        finally:
            if rec is not None:
                self._guard("timing", self.timer.stop, rec)

    def step(self) -> None:
        """Close the current step. With an optimizer attached, its ``step()`` is the boundary and this
        only closes a step in which the optimizer did not step (e.g. skipped by a GradScaler)."""
        if self._closed:
            return
        if self.optimizer is not None and self._stepped:
            self._stepped = False
            return
        self._stepped = False
        if self.optimizer is None:
            # Manual boundaries: the snapshot for ΔW was taken at the previous boundary.
            self._guard("tensor_stats", self._manual_stats)
        self._guard("boundary", self._boundary)
        if self.optimizer is None and self.schedule(self.step_index):
            self._guard("tensor_stats", self._manual_snapshot)

    def _manual_stats(self) -> None:
        if self.schedule(self.step_index):
            self._refresh()
            self.stats.before(self.step_index, self.stage, self.tracked, snapshot=False)

    def _manual_snapshot(self) -> None:
        self._refresh()
        self.stats.snapshot_early(self.tracked)

    def event(self, kind: str, message: str = "", **fields: Any) -> None:
        """Record an event (checkpoint_save/load with ``dur_us=``, restart, eval, fault...)."""
        severity = fields.pop("severity", "info")
        dur_us = fields.pop("dur_us", None)
        step = fields.pop("step", self.step_index)
        self._guard("event", self.writer.event, kind, message, step=step, severity=severity, dur_us=dur_us,
                    **fields)

    def log(self, step: int | None = None, **scalars: Any) -> None:
        """Free-form metrics as ``scalars`` rows (tensors are read with ``float()``, i.e. synchronously)."""
        def go() -> None:
            keys = list(scalars)
            self.writer.append("scalars", {"step": self.step_index if step is None else int(step),
                                           "time_us": now_us(), "stage": self.stage, "key": keys,
                                           "value": [float(scalars[k]) for k in keys]})
        self._guard("log", go)

    def samples(self, **columns: Any) -> None:
        """RL rollout records: columns of the ``samples`` table as equal-length lists."""
        def go() -> None:
            cols = dict(columns)
            cols.setdefault("step", self.step_index)
            cols.setdefault("time_us", now_us())
            self.writer.append("samples", cols)
        self._guard("samples", go)

    def set_stage(self, name: str | None) -> None:
        """Label later tensor_stats/spectra/scalars rows (e.g. "sft", "rl")."""
        self.stage = name

    def set_reference(self, ref: Any) -> None:
        """New θ₀ for drift: ``"current"`` (the weights now), a state dict, or a safetensors/.pt path."""
        self._refresh()
        named = [(t.name, t.local()) for t in self.tracked]
        total = sum(t.nbytes for t in self.tracked)
        budget = self.stats.memory_budget
        resident = budget is None or budget * total >= 2 * total
        self.stats.reference = build_reference(ref, named, self.run_dir, self.writer.rank, resident)
        if self.stats.reference is not None:
            self.writer.event("reference_set", f"θ₀ = {self.stats.reference.kind}", step=self.step_index,
                              resident=resident, path=str(self.stats.reference.path or ""))

    def add_listener(self, fn: Listener) -> None:
        """``fn(step, summary)`` is called on the resolver thread after each recorded step."""
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
        self._guard("timing", self._flush_phases)
        if self.system is not None:
            self.system.close()
        self.resolver.close()
        for fn in self._listeners:
            close = getattr(fn, "close", None)
            if callable(close):
                self._guard("listener", close)
        if self._own_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def _flush_phases(self) -> None:
        phases = self.timer.take()
        if phases:
            rows = [p.resolve() for p in phases]
            self.writer.append("timings", {k: [r[k] for r in rows] for k in rows[0]})

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def watch(model: Any, optimizer: Any = None, run: str | os.PathLike = "runs/default", *,
          every: int | Schedule = 1, reference: Any = "init", memory_budget: float | None = 0.1,
          spectral: bool | dict = False, stage: str | None = None, rank: int | None = None,
          role: str | None = None, world_size: int | None = None, system_interval_s: float | None = 5.0,
          grad_tol: float | None = None, wandb: bool = False, config: dict | None = None,
          writer: RunWriter | None = None, time_budget: float | None = 0.015) -> Scope:
    """Attach dynascope's probes to ``model`` and ``optimizer`` and record into the run at ``run``.

    Args:
        every: record tensor statistics every N optimizer steps, or a ``schedule(step) -> bool``
            (see ``dynascope.probes.schedule``). Timings are recorded every step.
        reference: θ₀ for drift — "init" (weights now), None, a state dict, or a checkpoint path.
        memory_budget: share of parameter bytes dynascope may hold on the device for ΔW snapshots and
            θ₀; it sizes the rotating window of tensors that get the full statistics each record
            (>= 2 or None: every tensor, every record, θ₀ resident).
        spectral: True or dict(k=8, every=10, budget_ms=50) for low-rank summaries of W − W₀.
        rank, role, world_size: identity for processes outside torch.distributed (e.g. Ray actors).
        system_interval_s: system sampler period (None/0 disables it).
        grad_tol: near-zero gradient threshold relative to the tensor's rms (default 1e-8).
        wandb: mirror the compact summaries to wandb via ``dynascope.integrations.wandb.WandbMirror``.
        writer: share an existing ``RunWriter`` (it is then flushed, not closed, by ``close``).
        time_budget: share of step wall time the windowed statistics may take on average (default
            1.5%; None: no limit). ‖W‖ and ‖g‖ of every tensor are recorded regardless.
    """
    r, local_rank, ws, role_ = _identity(rank, role, world_size)
    own = writer is None
    if writer is None:
        writer = RunWriter(run, rank=r, role=role_, world_size=ws, framework="pytorch", config=config)
    scope = Scope(model, optimizer, writer, own, schedule=as_schedule(every), reference=reference,
                  memory_budget=memory_budget, spectral=spectral, stage=stage, local_rank=local_rank,
                  system_interval_s=system_interval_s, grad_tol=grad_tol, time_budget=time_budget)
    if wandb:
        try:
            from dynascope.integrations.wandb import WandbMirror

            scope.add_listener(WandbMirror())
        except Exception as exc:
            scope._report("wandb", exc)
    return scope
