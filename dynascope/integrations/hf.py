"""Hugging Face ``Trainer`` (and TRL trainers): a ``TrainerCallback`` that attaches dynascope's probes.

    trainer = GRPOTrainer(..., callbacks=[DynascopeCallback(run="runs/grpo")])

* The probes attach to the trainer's model and optimizer. Recent transformers create the optimizer
  inside ``train()``; 5.x does it before ``on_train_begin``, but when a callback sees no optimizer there
  (delayed creation under FSDP/DeepSpeed) the probes attach at the first ``on_step_begin``, or at the
  latest ``on_pre_optimizer_step`` — always before the first optimizer step, so no ΔW is missed.
* Every ``logs`` dict (``on_log``) becomes ``scalars``. dynascope numbers optimizer steps from 0 (rows
  before the first optimizer step are step 0), so HF's ``global_step`` N is dynascope step N−1. A resumed
  run (or a second ``train()``) continues the numbering from ``global_step``.
* Under DeepSpeed (accelerate's DeepSpeed plugin) the probes attach to the trainer's DeepSpeed engine:
  statistics of the fp32 masters, the engine's optimizer step as the boundary (``probes.zero``).
* A ``train`` phase spans each step's micro-batches up to the optimizer step; with TRL, rollout
  (generation + scoring) is cut out of it and recorded as its own phase — see ``_trl.py``.
* ``on_train_end`` closes the scope (and flushes the store).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from dynascope.core.extras import require
from dynascope.integrations._guard import GuardedCallback
from dynascope.probes.zero import is_engine

transformers = require("transformers", "dynascope.integrations.hf")


class DynascopeCallback(GuardedCallback, transformers.TrainerCallback):
    """Attach dynascope to a ``transformers.Trainer`` (TRL's trainers included).

    Args:
        run: run directory for the store.
        wandb: mirror the compact per-step summary to the active wandb run.
        trl: record TRL's profiling timings, rollout records and phases when the trainer is a TRL trainer.
        **watch_kwargs: passed to ``dynascope.watch`` (every, reference, memory_budget, spectral, stage, role…).
    """

    framework = "HF"

    def __init__(self, run: str = "runs/hf", wandb: bool = False, *, trl: bool = True, **watch_kwargs: Any) -> None:
        self.run, self.wandb, self.use_trl = run, wandb, trl
        self.watch_kwargs = watch_kwargs
        self.scope: Any = None
        self.trainer: Any = None
        self._model: Any = None
        self._train_cm: Any = None
        self._thread: int | None = None
        self._trl: Any = None
        self._accelerator: Any = None
        self._writer: Any = None
        self._attached = False
        self._warned = False

    # ---- attaching --------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._thread = threading.get_ident()
        self._attached = False
        self._model = model
        self.trainer = _find_trainer(self)
        if optimizer is not None:
            self._guard(lambda: self._attach(args, state, model, optimizer))

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        if not self._attached and optimizer is not None:
            self._guard(lambda: self._attach(args, state, model or self._model, optimizer))
        self._open_train()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                              **kwargs: Any) -> None:
        self._close_train()
        if not self._attached and optimizer is not None:
            self._guard(lambda: self._attach(args, state, model or self._model, optimizer))

    def _attach(self, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        import dynascope
        from dynascope.store import RunWriter

        self._attached = True  # one attempt per train(): a failure warns once instead of retrying every step
        kw = dict(self.watch_kwargs)
        kw.setdefault("stage", _stage_of(self.trainer))
        if kw.get("writer") is None:  # our own writer, so the run records which framework wrote it
            config = kw.pop("config", None)
            if config is None and hasattr(args, "to_sanitized_dict"):
                config = {"trainer": type(self.trainer).__name__ if self.trainer is not None else None,
                          "args": args.to_sanitized_dict()}
            rank, world = kw.pop("rank", None), kw.pop("world_size", None)
            self._writer = RunWriter(
                self.run, rank=_process(args)[0] if rank is None else rank,
                role=kw.pop("role", None) or "trainer", world_size=_process(args)[1] if world is None else world,
                framework="trl" if _is_trl(self.trainer) else "transformers", config=config)
            kw["writer"] = self._writer
        engine = getattr(self.trainer, "model_wrapped", None)
        if is_engine(engine):  # under DeepSpeed: its engine is the step boundary and holds the fp32 masters
            model, optimizer = engine, None
        self.scope = dynascope.watch(model, _torch_optimizer(optimizer), run=self.run, wandb=self.wandb, **kw)
        done = int(getattr(state, "global_step", 0) or 0)
        if done:  # resumed from a checkpoint (or a second train()): continue the step numbering
            self.scope.resume(done)
        self._time_backward()
        if self.use_trl and self.trainer is not None:
            from dynascope.integrations import _trl

            self._trl = _trl.attach(self.trainer, self)

    def _time_backward(self) -> None:
        """The Trainer's ``accelerator.backward`` as the ``backward`` phase, in ``train``. The probe's
        autograd hooks would give it the enclosing phase of the forward that made the loss, and TRL runs
        that forward inside ``loss``/``logprob``, which have ended when backward starts. Under DeepSpeed the
        probe already times ``engine.backward`` (``autograd_backward`` is off then): left alone."""
        timing = self.scope.timing
        accelerator: Any = getattr(self.trainer, "accelerator", None)
        if timing is None or not timing.autograd_backward or not callable(getattr(accelerator, "backward", None)):
            return
        original, scope = accelerator.backward, self.scope

        def backward(*args: Any, **kwargs: Any) -> Any:
            cm = self._guard(lambda: _enter(scope.phase("backward")))  # a probe problem never stops the backward
            try:
                return original(*args, **kwargs)
            finally:
                if cm is not None:
                    self._guard(lambda: cm.__exit__(None, None, None))

        timing.autograd_backward = False
        accelerator.backward = backward
        self._accelerator = accelerator

    # ---- the train phase ---------------------------------------------------------------------------------
    def _open_train(self) -> None:
        if self.scope is not None and self._train_cm is None and threading.get_ident() == self._thread:
            self._train_cm = self._guard(lambda: _enter(self.scope.phase("train")))

    def _close_train(self) -> None:
        cm, self._train_cm = self._train_cm, None
        if cm is not None:
            self._guard(lambda: cm.__exit__(None, None, None))

    def suspend_train(self) -> bool:
        """Close the open ``train`` phase (TRL's rollout runs inside ``training_step``); True if one was open."""
        was_open = self._train_cm is not None and threading.get_ident() == self._thread
        if was_open:
            self._close_train()
        return was_open

    def resume_train(self) -> None:
        self._open_train()

    # ---- logs and the end ---------------------------------------------------------------------------------
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_train()
        if self._stop_asked():  # an alert's stop action: the Trainer ends after this step, cleanly
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if self.scope is None or not logs:
            return
        scalars = {k: v for k, v in ((k, _number(v)) for k, v in logs.items()) if v is not None}
        if scalars:
            self._guard(lambda: self.scope.log(step=max(int(state.global_step) - 1, 0), **scalars))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_train()
        if self._trl is not None:
            self._trl.detach()
            self._trl = None
        if self._accelerator is not None:
            self._accelerator.__dict__.pop("backward", None)
            self._accelerator = None
        self._close_scope()


def _enter(cm: Any) -> Any:
    cm.__enter__()
    return cm


def _find_trainer(callback: DynascopeCallback) -> Any:
    """The Trainer running this callback. Callback events carry model/optimizer but not the trainer, and
    TRL's per-sample data lives on it, so look a few frames up for the ``self`` whose handler holds us."""
    frame = inspect.currentframe()
    try:
        for _ in range(12):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            obj = frame.f_locals.get("self")
            handler = getattr(obj, "callback_handler", None)
            if handler is not None and callback in getattr(handler, "callbacks", ()):
                return obj
        return None
    finally:
        del frame


def _is_trl(trainer: Any) -> bool:
    return trainer is not None and any(c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def _stage_of(trainer: Any) -> str | None:
    names = [c.__name__ for c in type(trainer).__mro__] if trainer is not None else []
    if any(n in ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer") for n in names):
        return "rl"
    if "SFTTrainer" in names:
        return "sft"
    if any(n in ("DPOTrainer", "KTOTrainer", "RewardTrainer") for n in names):
        return names[0].removesuffix("Trainer").lower()
    return None


def _torch_optimizer(optimizer: Any) -> Any:
    if optimizer is None:
        return None
    # accelerate wraps the optimizer (AcceleratedOptimizer.optimizer); the step hooks live on the torch one
    import torch

    # (AcceleratedOptimizer subclasses Optimizer without its hook state, so unwrap whatever wraps one)
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def _process(args: Any) -> tuple[int, int]:
    """(rank, world size): torch.distributed's when it runs (the Trainer's arguments say 0 of 1 on every
    rank under DeepSpeed on CPU), else the Trainer's."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(getattr(args, "process_index", 0)), int(getattr(args, "world_size", 1))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)  # numbers, numpy/tensor scalars, and the numeric strings some loggers format
    except (TypeError, ValueError, RuntimeError):
        return None
    return number
