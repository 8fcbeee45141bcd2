"""Phase timings on this rank: user phases, automatic forward/backward/optimizer, and the step row.

On a GPU a phase is bracketed by two CUDA events recorded on the current stream; their elapsed time is
read later on the resolver thread (``Event.synchronize`` there, never on the training thread). On CPU
``perf_counter_ns`` is exact and free. ``start_us`` is the host wall clock when the phase was entered;
each row's ``clock`` says which clock its ``dur_us`` comes from (``cuda_event`` or ``host``).

``TimingProbe`` is the probe: it hooks the model, and at each step boundary writes one
``phase='step'`` row spanning boundary to boundary plus the phases that finished in the step.

A forward run without gradients inside a user phase (``scope.phase("rollout")`` around a generation loop,
which calls the model once per token) is summed: one ``forward`` row per (step, parent phase), starting
where the first call began, lasting the calls' summed time. Forwards with gradients keep a row each, so
gradient accumulation's micro-batches stay visible.

Backward is timed with autograd hooks rather than "end of forward → optimizer step": a hook on the
model's output fires when backward reaches the model, and ``queue_callback`` fires when the whole
backward pass is done. That stays right with gradient accumulation, losses computed outside the
model, and work between backward and the optimizer (clipping, logging), which would otherwise be
billed to backward.

The probes' own work on the training thread (statistics before and after the optimizer step, and the
pre-hook's wait for their post-step passes on the pass thread) is timed as the phase ``PROBE_PHASE``, so that
a step breakdown shows what watching costs instead of leaving it in the step's un-instrumented remainder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dynascope.core.clock import now_us
from dynascope.probes.protocol import Probe, Rows, StepContext

__all__ = ["CUDA_CLOCK", "HOST_CLOCK", "PROBE_PHASE", "PhaseRecord", "SummedRecord", "Timer", "TimingProbe",
           "grad_tensors", "summed"]

PROBE_PHASE = "dynascope"
# The ``clock`` of a timings row: where its duration was measured
CUDA_CLOCK, HOST_CLOCK = "cuda_event", "host"


class PhaseRecord:
    """One timed interval; resolved to a ``timings`` row by ``resolve`` (may block on a CUDA event)."""

    __slots__ = ("phase", "parent", "category", "step", "start_us", "device", "t0", "t1", "ev0", "ev1", "summed")

    def __init__(self, phase: str, parent: str | None, category: str, step: int, device: str) -> None:
        self.phase, self.parent, self.category, self.step, self.device = phase, parent, category, step, device
        self.start_us = now_us()
        self.t0 = time.perf_counter_ns()
        self.t1: int | None = None
        self.ev0 = self.ev1 = None
        self.summed = False  # one row with the step's other summed records of its (parent, phase): ``summed``

    def resolve(self) -> dict[str, Any]:
        if self.ev0 is not None and self.ev1 is not None:
            self.ev1.synchronize()
            dur, clock = int(round(self.ev0.elapsed_time(self.ev1) * 1000.0)), CUDA_CLOCK
        else:
            dur, clock = ((self.t1 or self.t0) - self.t0) // 1000, HOST_CLOCK
        return {"step": self.step, "phase": self.phase, "parent": self.parent, "start_us": self.start_us,
                "dur_us": dur, "device": self.device, "category": self.category, "clock": clock}


class SummedRecord:
    """Records of one (step, parent, phase) as one row: it starts where the first began and lasts their
    summed time, so it lies within the parent phase and its duration is exact; when each call ran within
    the parent is not kept."""

    def __init__(self, first: PhaseRecord) -> None:
        self.records = [first]

    def resolve(self) -> dict[str, Any]:
        rows = [r.resolve() for r in self.records]
        return {**rows[0], "dur_us": sum(r["dur_us"] for r in rows)}


def summed(records: list[PhaseRecord]) -> list[PhaseRecord | SummedRecord]:
    """``records`` with those marked ``summed`` folded into one ``SummedRecord`` per (step, parent, phase)."""
    out: list[PhaseRecord | SummedRecord] = []
    groups: dict[tuple, SummedRecord] = {}
    for r in records:
        if not r.summed:
            out.append(r)
        elif (key := (r.step, r.parent, r.phase)) in groups:
            groups[key].records.append(r)
        else:
            out.append(groups.setdefault(key, SummedRecord(r)))
    return out


class Timer:
    """Opens and closes phases; finished records wait in ``done`` until the scope hands them off."""

    def __init__(self, device: torch.device | None) -> None:
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.device = str(device) if device is not None else "cpu"
        self._local = threading.local()
        self._lock = threading.Lock()
        self.done: list[PhaseRecord] = []
        self.step = 0

    def _stack(self) -> list[PhaseRecord]:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def current(self) -> str | None:
        st = self._stack()
        return st[-1].phase if st else None

    def start(self, phase: str, category: str = "phase", parent: str | None = None, push: bool = True
              ) -> PhaseRecord:
        rec = PhaseRecord(phase, parent if parent is not None else self.current(), category, self.step,
                          self.device)
        if self.cuda:
            rec.ev0 = torch.cuda.Event(enable_timing=True)
            rec.ev0.record()
        if push:
            self._stack().append(rec)
        return rec

    def stop(self, rec: PhaseRecord, pop: bool = True) -> None:
        if self.cuda:
            rec.ev1 = torch.cuda.Event(enable_timing=True)
            rec.ev1.record()
        rec.t1 = time.perf_counter_ns()
        if pop:
            st = self._stack()
            if rec in st:  # tolerate out-of-order exits: drop it and anything opened inside it
                del st[st.index(rec):]
        with self._lock:
            self.done.append(rec)

    def cancel(self, rec: PhaseRecord) -> None:
        """Forget an open phase: no row (and anything opened inside it is closed with it)."""
        st = self._stack()
        if rec in st:
            del st[st.index(rec):]

    def take(self) -> list[PhaseRecord]:
        with self._lock:
            out, self.done = self.done, []
        return out


def grad_tensors(out: Any, limit: int = 16) -> list[torch.Tensor]:
    """The floating tensors that require grad in a model output, at most ``limit``. Backward may flow
    through any one of them (TRL's fused LM head returns a ``loss`` first and backpropagates its
    ``log_probs``), so each gets the hook that starts the ``backward`` phase."""
    found: list[torch.Tensor] = []

    def walk(v: Any, depth: int) -> None:
        if len(found) >= limit:
            return
        if isinstance(v, torch.Tensor):
            if v.requires_grad and v.is_floating_point():
                found.append(v)
        elif depth <= 3:
            for item in v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ():
                walk(item, depth + 1)
    walk(out, 0)
    return found


class TimingProbe(Probe):
    """Phases of every step (forward/backward/optimizer automatically, user phases via ``scope.phase``)."""

    name = "timing"

    def __init__(self, device: torch.device | None) -> None:
        self.timer = Timer(device)
        self._t0, self._start_us = time.perf_counter_ns(), now_us()
        self._opt: PhaseRecord | None = None
        self._bwd_live = False
        # False when an engine's backward() is timed instead (DeepSpeed: it also reduces the gradients)
        self.autograd_backward = True
        # > 0 while an integration times a stretch itself (TRL's generate: one forward per decoded token)
        self.model_paused = 0
        self._guard: Callable[..., Any] = lambda probe, fn, *a: fn(*a)

    def attach(self, model: Any, guard: Callable[..., Any]) -> list[Any]:
        """Forward pre/post hooks on the root module (and, from its output, the backward timing).
        ``guard(probe, fn, *args)`` runs a hook body so that an exception never reaches the model."""
        self._guard = guard
        if not isinstance(model, torch.nn.Module):
            return []
        self._model_hooks = [model.register_forward_pre_hook(lambda *a: guard("forward", self._fwd_pre, *a) and None),
                             model.register_forward_hook(lambda *a: guard("forward", self._fwd_post, *a) and None)]
        return list(self._model_hooks)

    def detach_model(self) -> None:
        """Stop timing forward and backward from the model's hooks: an integration that opens those phases
        itself (Lightning, whose DDP wrapper calls the module's forward inside the callback's ``forward``)
        would otherwise get each one twice."""
        for h in getattr(self, "_model_hooks", []):
            h.remove()
        self._model_hooks = []
        self.autograd_backward = False

    def _fwd_pre(self, module: Any, args: Any) -> None:
        rec = None if self.model_paused else self.timer.start("forward")
        if rec is not None and rec.parent is not None and not torch.is_grad_enabled():
            # A generation loop inside a user phase calls the model once per token: its forwards are one
            # row per step (their summed time), not a row and two CUDA events to resolve per token.
            rec.summed = True
        module._dynascope_fwd = rec

    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        rec = getattr(module, "_dynascope_fwd", None)
        if rec is not None:
            module._dynascope_fwd = None
            self.timer.stop(rec)
        if rec is None or not self.autograd_backward or not torch.is_grad_enabled():
            return
        for t in grad_tensors(out):  # the first one backward reaches starts the phase (_bwd_live)
            t.register_hook(lambda g, parent=rec.parent: self._guard("backward", self._bwd_start, parent) and None)

    def _bwd_start(self, parent: str | None) -> None:
        if self._bwd_live:
            return
        self._bwd_live = True
        rec = self.timer.start("backward", parent=parent, push=False)

        def done() -> None:
            self._bwd_live = False
            self.timer.stop(rec, pop=False)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._guard("backward", done))

    def optimizer_done(self) -> None:
        """End of ``optimizer.step()`` (the scope calls it first thing in the post-hook, before any probe)."""
        if self._opt is not None:
            self.timer.stop(self._opt)
            self._opt = None

    def before(self, ctx: StepContext) -> None:
        if not ctx.manual:
            self._opt = self.timer.start("optimizer")

    def after(self, ctx: StepContext) -> Callable[[], Rows]:
        self.optimizer_done()
        t1 = time.perf_counter_ns()
        step_row = {"step": ctx.step, "phase": "step", "parent": None, "start_us": self._start_us,
                    "dur_us": (t1 - self._t0) // 1000, "device": self.timer.device, "category": "step",
                    "clock": HOST_CLOCK}  # boundary to boundary on the host: the steps tile the host's time
        self._t0, self._start_us = t1, now_us()
        phases = summed(self.timer.take())
        self._bwd_live = False  # a backward that raised never ran its end callback; do not stay stuck
        self.timer.step = ctx.step + 1
        return lambda: {"timings": _columns([step_row] + [p.resolve() for p in phases])}

    def leftover(self) -> Rows:
        """Phases that finished after the last boundary (written at close)."""
        phases = summed(self.timer.take())
        return {"timings": _columns([p.resolve() for p in phases])} if phases else {}

    def summarize(self, rows: Rows) -> dict[str, float]:
        out: dict[str, float] = {}
        t = rows.get("timings", {})
        for phase, cat, dur in zip(t.get("phase", []), t.get("category", []), t.get("dur_us", []), strict=False):
            if cat != "step":
                out[f"phase/{phase}_ms"] = out.get(f"phase/{phase}_ms", 0.0) + dur / 1000.0
        return out


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
