"""verl / OpenRLHF-style metric dicts → the dynascope store.

verl's driver (``RayPPOTrainer.fit``) times each stage of a step with ``marked_timer(name, timing_raw)``
and hands one flat dict per step to its ``Tracking`` logger: ``timing_s/<stage>`` seconds,
``timing_per_token_ms/<stage>``, ``response_length/{mean,max,min,clip_ratio}``, ``critic/score/*``,
``actor/*``, ``perf/mfu/actor``, ``perf/throughput`` … ``DynascopeTracking`` is a logger of that shape
(``log(data, step)``, ``finish()``) and ``log(metrics, step)`` is the one-call form.

What goes where:
* every numeric value → ``scalars`` under its own key (``timing_s/*`` too, so nothing is lost);
* ``timing_s/<stage>`` → ``timings`` rows. verl's stage name stays in ``phase``; when the stage has a
  canonical dynascope name (table ``PHASES``) a row with the canonical name encloses it (the verl row's
  ``parent``), so analyses that look for ``rollout``/``train``/… find it and the verl name is kept.
  ``timing_s/step`` becomes the ``phase='step', category='step'`` row.
* ``timing_s/generation_timing/{max,min,topk_ratio}`` are spreads across rollout workers, not spans:
  scalars only.

verl reports durations, not start times. Start times are reconstructed: the step ends when the dict is
logged (minus ``stop_profile``, which verl times after the step), starts ``timing_s/step`` earlier, and the
stages are laid end to end from there in verl's execution order (``ORDER``); stages verl runs inside
another (``generate_sequences`` inside ``gen``) start with their parent. Stage *durations* are exact;
offsets inside the step are only as exact as that sequential order (true for verl's synchronous trainer).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from typing import Any

from dynascope.core.clock import now_us
from dynascope.store import RunWriter

# verl stage (marked_timer name) → canonical dynascope phase
PHASES: dict[str, str] = {
    "gen": "rollout",
    "gen_max": "rollout",            # REMAX greedy baseline generation
    "generate_sequences": "generate",
    "reward": "reward",
    "old_log_prob": "old_logprob",
    "ref": "ref_logprob",
    "values": "critic_values",
    "adv": "advantage",
    "update_critic": "train_critic",
    "update_actor": "train",
    "update_weights": "weight_sync",
    "sync_weights": "weight_sync",
    "testing": "eval",
    "save_checkpoint": "checkpoint",
    "dump_rollout_generations": "dump_rollouts",
}
# the order verl's synchronous trainer runs its stages in, inside ``step``
ORDER = ("gen", "gen_max", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
         "update_weights", "sync_weights", "dump_rollout_generations", "testing", "save_checkpoint")
# stages verl times inside another stage (reported by the rollout workers through meta_info["timing"])
CHILDREN: dict[str, str] = {"generate_sequences": "gen"}
# A stage's duration is ``timing_s/<name>`` with one flat name, as verl's ``marked_timer(name, timing_raw)``
# and ``compute_timing_metrics`` write it; a key with a further ``/`` is a summary the rollout workers
# report beside them (``generation_timing/max``, verl 0.9's ``agent_loop/slowest/prompt_length`` and other
# spreads, counts and token lengths): a scalar, never a span.
BEFORE_STEP, AFTER_STEP = ("start_profile",), ("stop_profile",)
TIMING_PREFIX = "timing_s/"


class DynascopeTracking:
    """A verl ``Tracking`` backend (``log(data, step)``, ``finish()``) writing to a dynascope run.

    Args:
        run: run directory. writer: share an existing ``RunWriter`` (e.g. ``scope.writer``) instead.
        rank, role, world_size: identify this process (verl's driver: rank 0, role ``driver``).
    """

    def __init__(self, run: str | os.PathLike = "runs/verl", *, writer: RunWriter | None = None, rank: int = 0,
                 role: str = "driver", world_size: int = 1, config: dict | None = None) -> None:
        self._own = writer is None
        self.writer = writer or RunWriter(run, rank=rank, role=role, world_size=world_size, framework="verl",
                                          config=config)

    def log(self, data: Mapping[str, Any], step: int, backend: Any = None) -> None:
        """Record one step's metric dict (``backend`` is accepted for verl's ``Tracking.log`` signature)."""
        now = now_us()
        numbers: dict[str, float] = {}
        for key, value in data.items():
            number = _number(value)
            if number is not None:
                numbers[str(key)] = number
        if numbers:
            self.writer.append("scalars", {"step": int(step), "time_us": now, "key": list(numbers),
                                           "value": list(numbers.values())})
        rows = timing_rows(numbers, now)
        if rows["phase"]:
            self.writer.append("timings", {**rows, "step": int(step)})

    def samples(self, batch: Any, step: int) -> None:
        """Record per-sample rollout records from a verl ``DataProto`` (see ``samples_from_batch``)."""
        self.writer.append("samples", samples_from_batch(batch, step))

    def finish(self) -> None:
        """Flush; closes the writer if this backend created it."""
        if self._own:
            self.writer.close()
        else:
            self.writer.flush()

    close = finish


def timing_rows(metrics: Mapping[str, float], end_us: int) -> dict[str, list]:
    """``timings`` columns for the ``timing_s/*`` entries of one step's dict, logged at ``end_us``."""
    secs = {k[len(TIMING_PREFIX):]: float(v) for k, v in metrics.items()
            if k.startswith(TIMING_PREFIX) and math.isfinite(v) and v >= 0
            and "/" not in k[len(TIMING_PREFIX):]}
    cols: dict[str, list] = {"phase": [], "parent": [], "start_us": [], "dur_us": [], "category": []}

    def add(phase: str, parent: str | None, start: int, dur: int, category: str = "phase") -> None:
        for col, v in zip(cols, (phase, parent, start, dur, category), strict=True):
            cols[col].append(v)

    def us(s: float) -> int:
        return int(round(s * 1e6))

    step_end = end_us - sum(us(secs.get(n, 0.0)) for n in AFTER_STEP)
    top = [n for n in ORDER if n in secs]
    top += [n for n in secs if n not in ORDER and n not in CHILDREN and n != "step"
            and n not in BEFORE_STEP + AFTER_STEP]
    step_dur = us(secs["step"]) if "step" in secs else sum(us(secs[n]) for n in top)
    step_start = step_end - step_dur
    if "step" in secs:
        add("step", None, step_start, step_dur, "step")
    cursor, starts = step_start, {}
    for name in top:
        starts[name] = cursor
        _add_stage(add, name, None, cursor, us(secs[name]))
        cursor += us(secs[name])
    for name, parent in CHILDREN.items():
        if name in secs:
            _add_stage(add, name, parent if parent in starts else None, starts.get(parent, step_start), us(secs[name]))
    for name in BEFORE_STEP:
        if name in secs:
            add(name, None, step_start - us(secs[name]), us(secs[name]))
    for name in AFTER_STEP:
        if name in secs:
            add(name, None, step_end, us(secs[name]))
    return cols


def _add_stage(add: Any, name: str, parent: str | None, start: int, dur: int) -> None:
    canonical = PHASES.get(name)
    if canonical and canonical != name:
        add(canonical, parent, start, dur)  # the canonical span encloses verl's own name
        add(name, canonical, start, dur)
    else:
        add(name, parent, start, dur)


def samples_from_batch(batch: Any, step: int) -> dict[str, list]:
    """``samples`` columns from a verl ``DataProto`` after the reward stage (lengths, score, GRPO group).

    Mirrors verl's ``_compute_response_info``: the response is the last ``responses.shape[-1]`` columns of
    ``attention_mask``; score = ``token_level_scores.sum(-1)``; groups are ``non_tensor_batch['uid']``.
    verl's synchronous trainer generates with the weights it then trains, so both versions are ``step``.
    """
    tensors, extra = batch.batch, getattr(batch, "non_tensor_batch", {}) or {}
    resp_width = int(tensors["responses"].shape[-1])
    mask = tensors["attention_mask"]
    prompt_len = mask[:, :-resp_width].sum(-1).tolist()
    response_len = mask[:, -resp_width:].sum(-1).tolist()
    n = len(response_len)
    reward = tensors["token_level_scores"].sum(-1).tolist() if "token_level_scores" in tensors.keys() else [None] * n
    groups: dict[Any, int] = {}
    uids = list(extra["uid"]) if "uid" in extra else list(range(n))
    return {"step": step, "sample_id": list(range(n)), "group_id": [groups.setdefault(u, len(groups)) for u in uids],
            "prompt_len": [int(x) for x in prompt_len], "response_len": [int(x) for x in response_len],
            "reward": reward, "policy_version": step, "trainer_version": step, "time_us": now_us()}


# ---- one-call form and verl's Tracking registry ------------------------------------------------------------
_DEFAULT: dict[str, DynascopeTracking] = {}
_LOCK = threading.Lock()


def log(metrics: Mapping[str, Any], step: int, *, run: str | os.PathLike | None = None) -> None:
    """Record one step's verl/OpenRLHF metric dict into ``run`` (default ``$DYNASCOPE_RUN`` or runs/verl)."""
    path = os.fspath(run or os.environ.get("DYNASCOPE_RUN", "runs/verl"))
    with _LOCK:
        backend = _DEFAULT.get(path) or _DEFAULT.setdefault(path, DynascopeTracking(path))
    backend.log(metrics, step)


def finish() -> None:
    """Close the writers opened by ``log``."""
    with _LOCK:
        backends = list(_DEFAULT.values())
        _DEFAULT.clear()
    for b in backends:
        b.finish()


def register_backend(tracking_cls: Any = None, *, run: str | os.PathLike | None = None, name: str = "dynascope") -> Any:
    """Make ``name`` a backend verl's ``Tracking`` accepts, e.g. ``trainer.logger=['console','dynascope']``.

    verl's ``Tracking.__init__`` asserts each backend is in ``supported_backend`` and fills ``self.logger``;
    this adds ``name`` to that list and wraps ``__init__`` to attach a ``DynascopeTracking``
    (run: ``run`` or ``$DYNASCOPE_RUN`` or ``runs/<project>/<experiment>``), and ``finish`` to finish it
    (verl's own ``finish`` calls only the backends it knows). Returns the class.
    """
    if tracking_cls is None:
        from dynascope.core.extras import require

        tracking_cls = require("verl.utils.tracking", "dynascope.integrations.verl.register_backend").Tracking
    if getattr(tracking_cls, "_dynascope_backend", None) == name:
        return tracking_cls
    tracking_cls.supported_backend = [*tracking_cls.supported_backend, name]
    original = tracking_cls.__init__

    def __init__(self: Any, project_name: str, experiment_name: str, default_backend: Any = "console",
                 config: Any = None, **kwargs: Any) -> None:
        original(self, project_name, experiment_name, default_backend, config, **kwargs)
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        if name in backends:
            path = run or os.environ.get("DYNASCOPE_RUN") or os.path.join("runs", str(project_name), str(experiment_name))
            self.logger[name] = DynascopeTracking(path, config=config if isinstance(config, dict) else None)

    finish = getattr(tracking_cls, "finish", None)

    def finish_all(self: Any, *args: Any, **kwargs: Any) -> Any:
        # verl's finish() finalises only the backends it knows by name (0.9.1): flush ours too, first, so a
        # backend of verl's that raises cannot leave our rows unwritten.
        backend = getattr(self, "logger", {}).get(name)
        if isinstance(backend, DynascopeTracking) and not getattr(self, "_finished", False):
            backend.finish()
        return None if finish is None else finish(self, *args, **kwargs)

    tracking_cls.__init__ = __init__
    tracking_cls.finish = finish_all
    tracking_cls._dynascope_backend = name
    return tracking_cls


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)  # python/numpy numbers and one-element tensors
    except (TypeError, ValueError, RuntimeError):
        return None
