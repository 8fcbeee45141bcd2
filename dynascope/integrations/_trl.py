"""TRL specifics for ``DynascopeCallback``: profiling timings, the rollout phase, per-sample records.

TRL times its own stages with ``trl.extras.profiling.ProfilingContext`` (``profiling_context`` and
``@profiling_decorator``) but only reports them to wandb/mlflow/trackio as ``profiling/Time taken: X``.
We wrap ``ProfilingContext.__enter__/__exit__`` once, process-wide, so each context also opens a
dynascope phase on the active scope (names mapped by ``TRL_PHASES``; unknown ones, such as reward
function names, keep TRL's name) — the probe's phase stack then gives them parents, steps and CUDA
timing. Contexts entered on other threads (TRL's async reward functions) get their own thread's stack.

GRPO's rollout is ``_generate_and_score_completions`` (generate, reward, old/ref log-probs). TRL does
not profile it as a whole, so it is wrapped on the trainer instance: it becomes the ``rollout`` phase
(cut out of the ``train`` phase it runs inside), and its output plus the rewards from
``_calculate_rewards`` give one ``samples`` row per completion: prompt/response token counts, the
weighted reward TRL logs as ``reward``, group ids (TRL repeats each prompt ``num_generations`` times in a
row), and the span of the batched ``generate`` call (all completions of a batch share it: batched
generation finishes them together). The instance attributes are removed again at the end of training.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from dynascope.core.clock import now_us

# TRL profiling name (after the "<TrainerClass>." prefix) → dynascope phase; None = not recorded
TRL_PHASES: dict[str, str | None] = {
    "transformers.generate": "generate",
    "transformers.generate_batch": "generate",
    "vLLM.generate": "generate",
    "_calculate_rewards": "reward",
    "sync_weights": "weight_sync",
    "_get_per_token_logps_and_entropies": "logprob",
    "compute_loss": "loss",
    "_prepare_inputs": None,  # the buffer around the rollout; the rollout itself is the "rollout" phase
}
GENERATE = "generate"

_ACTIVE: weakref.WeakSet[_TrlHooks] = weakref.WeakSet()
_PATCH_LOCK = threading.Lock()


class _TrlHooks:
    """Per-trainer state: the profiling sink, and the rollout/reward wrappers on the trainer instance."""

    def __init__(self, trainer: Any, callback: Any) -> None:
        self.trainer, self.callback = trainer, callback
        self.prefix = type(trainer).__name__ + "."
        self._gen_span: list[int] = []
        self._rewards: Any = None
        self._sample_base = 0
        self._wrapped: list[str] = []

    @property
    def scope(self) -> Any:
        return self.callback.scope

    # ---- ProfilingContext sink ----------------------------------------------------------------------
    def enter(self, ctx: Any) -> None:
        name = str(getattr(ctx, "name", ""))
        if not name.startswith(self.prefix) or self.scope is None:
            return
        short = name[len(self.prefix):]
        phase = TRL_PHASES.get(short, short)
        if phase is None:
            return
        cm = self.scope.phase(phase)
        cm.__enter__()
        ctx._dynascope = (cm, phase, now_us())
        if phase == GENERATE and self.scope.timing is not None:  # decoding: no forward row per token
            self.scope.timing.model_paused += 1

    def exit(self, ctx: Any) -> None:
        state = ctx.__dict__.pop("_dynascope", None)
        if state is None:
            return
        cm, phase, start = state
        cm.__exit__(None, None, None)
        if phase == GENERATE:
            self._gen_span += [start, now_us()]
            if self.scope is not None and self.scope.timing is not None:
                self.scope.timing.model_paused = max(self.scope.timing.model_paused - 1, 0)

    # ---- instance wrappers --------------------------------------------------------------------------
    def wrap(self) -> None:
        t = self.trainer
        if hasattr(type(t), "_generate_and_score_completions"):
            original = t._generate_and_score_completions

            def rollout(inputs: Any, *args: Any, **kwargs: Any) -> Any:
                return self._rollout(original, inputs, *args, **kwargs)

            t._generate_and_score_completions = rollout
            self._wrapped.append("_generate_and_score_completions")
        if hasattr(type(t), "_calculate_rewards"):
            rewards = t._calculate_rewards

            def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
                out = rewards(*args, **kwargs)
                self._rewards = out  # (all processes' completions) × (reward functions), gathered
                return out

            t._calculate_rewards = calculate_rewards
            self._wrapped.append("_calculate_rewards")

    def unwrap(self) -> None:
        for name in self._wrapped:
            self.trainer.__dict__.pop(name, None)
        self._wrapped.clear()

    def _rollout(self, original: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        scope = self.scope
        if scope is None:
            return original(inputs, *args, **kwargs)
        resumed = self.callback.suspend_train()
        self._gen_span, self._rewards = [], None
        try:
            with scope.phase("rollout"):
                out = original(inputs, *args, **kwargs)
        finally:
            if resumed:
                self.callback.resume_train()
        if self.trainer.model.training:
            self.callback._guard(lambda: self._record_samples(out, len(inputs)))
        return out

    def _record_samples(self, out: dict, n_local: int) -> None:
        import torch

        t = self.trainer
        prompt_len = out["prompt_mask"].sum(-1).tolist()
        response_len = out["completion_mask"].sum(-1).tolist()
        n = len(response_len)
        index = int(getattr(t.accelerator, "process_index", 0))
        num_proc = int(getattr(t.accelerator, "num_processes", 1))
        reward: list[float | None] = [None] * n
        if self._rewards is not None and self._rewards.shape[0] == n_local * num_proc:
            per_func = self._rewards.float()
            weights = t.reward_weights.to(per_func.device).float().unsqueeze(0)
            total = (per_func * weights).nansum(dim=1)  # what TRL logs as "reward"
            total[torch.isnan(per_func).all(dim=1)] = float("nan")
            reward = total[index * n_local:(index + 1) * n_local].tolist()[:n]
        first = self._sample_base + index * n_local  # global index of this process's first completion
        self._sample_base += n_local * num_proc
        group = int(getattr(t, "num_generations", 1) or 1)
        version = int(t.state.global_step)  # optimizer steps applied to the weights that generated these
        span = self._gen_span
        gen = (min(span[0::2]), max(span[1::2])) if span else (None, None)
        ids = list(range(first, first + n))
        self.scope.samples(
            sample_id=ids, group_id=[i // group for i in ids], prompt_len=[int(x) for x in prompt_len],
            response_len=[int(x) for x in response_len], reward=reward,
            gen_start_us=gen[0], gen_end_us=gen[1], gen_ms=(gen[1] - gen[0]) / 1000 if span else None,
            policy_version=version, trainer_version=version)

    def detach(self) -> None:
        self.unwrap()
        _ACTIVE.discard(self)


def attach(trainer: Any, callback: Any) -> _TrlHooks | None:
    """Hook TRL's profiling contexts and rollout for ``trainer``; None when TRL is not in use."""
    try:
        from trl.extras import profiling
    except ImportError:
        return None
    if not any(c.__module__.startswith("trl.") for c in type(trainer).__mro__):
        return None
    _patch(profiling.ProfilingContext)
    hooks = _TrlHooks(trainer, callback)
    hooks.wrap()
    _ACTIVE.add(hooks)
    return hooks


def _patch(cls: Any) -> None:
    with _PATCH_LOCK:
        if getattr(cls, "_dynascope_patched", False):
            return
        enter, exit_ = cls.__enter__, cls.__exit__

        def __enter__(self: Any) -> Any:
            result = enter(self)
            for hooks in list(_ACTIVE):
                hooks.callback._guard(lambda h=hooks: h.enter(self))
            return result

        def __exit__(self: Any, *exc: Any) -> Any:
            try:
                return exit_(self, *exc)
            finally:
                for hooks in list(_ACTIVE):
                    hooks.callback._guard(lambda h=hooks: h.exit(self))

        cls.__enter__, cls.__exit__ = __enter__, __exit__
        cls._dynascope_patched = True
