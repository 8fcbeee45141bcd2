"""PyTorch Lightning: a ``Callback`` that attaches dynascope's probes to the LightningModule.

    trainer = L.Trainer(..., callbacks=[DynascopeCallback(run="runs/lit")])

* ``on_train_start`` (the strategy has built the optimizers by then) attaches ``watch`` to the module and
  its first optimizer, with rank and world size from the trainer.
* A ``train`` phase spans each training batch. Lightning calls ``training_step``, never the module's
  ``forward``, so the probe's forward hook stays silent: ``forward`` is timed around ``training_step``
  (wrapped on the instance for the fit, removed after) and ``backward`` between the
  ``on_before_backward``/``on_after_backward`` hooks. In automatic optimization Lightning runs both
  inside ``optimizer.step(closure)``, so the probe's ``optimizer`` phase encloses them there: the
  optimizer's own time is ``optimizer`` minus its ``forward`` and ``backward`` children. The scope sees
  the closure in ``optimizer.step``'s arguments and reads that step's gradients after it.
* The metrics the module ``self.log``s (``trainer.callback_metrics``) become ``scalars`` every
  ``log_every_n_steps`` steps, Lightning's own logging cadence (reading them costs one sync per metric).
  dynascope numbers optimizer steps from 0, so Lightning's ``global_step`` N is dynascope step N−1.
"""

from __future__ import annotations

from typing import Any

from dynascope.core.extras import require
from dynascope.core.warn import warn
from dynascope.integrations._guard import GuardedCallback

try:  # the unified "lightning" package, or the standalone "pytorch_lightning"
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = require("lightning.pytorch", "dynascope.integrations.lightning")


class DynascopeCallback(GuardedCallback, pl.Callback):
    """Attach dynascope to a Lightning fit.

    Args:
        run: run directory. wandb: mirror compact summaries to the active wandb run.
        **watch_kwargs: passed to ``dynascope.watch`` (every, reference, memory_budget, spectral, stage, role…).
    """

    framework = "Lightning"

    def __init__(self, run: str = "runs/lightning", wandb: bool = False, **watch_kwargs: Any) -> None:
        super().__init__()
        self.run, self.wandb, self.watch_kwargs = run, wandb, watch_kwargs
        self.scope: Any = None
        self._writer: Any = None
        self._train_cm: Any = None
        self._backward_cm: Any = None
        self._module: Any = None
        self._warned = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._guard(lambda: self._attach(trainer, pl_module))

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        import dynascope
        from dynascope.store import RunWriter

        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if len(optimizers) > 1:
            warn("dynascope: several optimizers; probing the first one's parameters only",
                 RuntimeWarning, stacklevel=2)
        kw = dict(self.watch_kwargs)
        if kw.get("writer") is None:
            rank, world = kw.pop("rank", None), kw.pop("world_size", None)
            self._writer = RunWriter(
                self.run, rank=trainer.global_rank if rank is None else rank, role=kw.pop("role", None) or "trainer",
                world_size=trainer.world_size if world is None else world, framework="lightning",
                config=kw.pop("config", None) or {"module": type(pl_module).__name__,
                                                  "max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs})
            kw["writer"] = self._writer
        self.scope = dynascope.watch(pl_module, optimizers[0] if optimizers else None, run=self.run,
                                     wandb=self.wandb, **kw)
        self._module = pl_module
        done = int(getattr(trainer, "global_step", 0) or 0)
        if done:  # resumed from a checkpoint (ckpt_path=): continue the step numbering
            self.scope.resume(done)
        if self.scope.timing is not None:  # this callback times forward and backward; the probe's hooks must not
            self.scope.timing.detach_model()
        original, scope = pl_module.training_step, self.scope

        def training_step(*args: Any, **kwargs: Any) -> Any:
            with scope.phase("forward"):
                return original(*args, **kwargs)

        pl_module.training_step = training_step  # Lightning looks the hook up on the instance at each call

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.scope is not None and self._backward_cm is None:
            cm = self.scope.phase("backward")
            self._guard(cm.__enter__)
            self._backward_cm = cm

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        cm, self._backward_cm = self._backward_cm, None
        if cm is not None:
            self._guard(lambda: cm.__exit__(None, None, None))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.scope is not None and self._train_cm is None:
            cm = self.scope.phase("train")
            self._guard(cm.__enter__)
            self._train_cm = cm

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        cm, self._train_cm = self._train_cm, None
        if cm is not None:
            self._guard(lambda: cm.__exit__(None, None, None))
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        if self.scope is not None and trainer.global_step % every == 0:
            self._guard(lambda: self._log(trainer))
        if self._stop_asked():  # an alert's stop action: Lightning ends the fit after this batch
            trainer.should_stop = True

    def _log(self, trainer: Any) -> None:
        scalars = {}
        for key, value in trainer.callback_metrics.items():
            try:
                scalars[str(key)] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
        if scalars:
            self.scope.log(step=max(trainer.global_step - 1, 0), **scalars)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.scope is not None:
            self._guard(lambda: self.scope.event("fault", f"{type(exception).__name__}: {exception}",
                                                 severity="error"))
        self._close()

    def _close(self) -> None:
        for name in ("_backward_cm", "_train_cm"):
            cm = getattr(self, name)
            setattr(self, name, None)
            if cm is not None:
                self._guard(lambda cm=cm: cm.__exit__(None, None, None))
        if self._module is not None:
            self._module.__dict__.pop("training_step", None)
            self._module = None
        self._close_scope()
