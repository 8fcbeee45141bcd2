"""``WatchSettings``: what ``watch()`` records, how often and at what cost, as one object.

    settings = dynascope.WatchSettings(every=10, memory_budget=0.1, stage="sft")
    scope = dynascope.watch(model, optimizer, run="runs/x", settings=settings)

``watch()`` also takes each field as a keyword argument (``watch(model, optimizer, every=10)``): the
keywords override the fields of ``settings`` (or of the defaults). The run's own ``config`` (the
hyperparameters recorded in the ``runs`` table), the ``writer`` to share, and extra ``probes`` and
``listeners`` stay arguments of ``watch()``: they are objects of the run, not settings of the probes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dynascope.probes.schedule import Schedule
from dynascope.probes.tensors import DRIFT_EVERY, TIME_BUDGET, W_NORM_EVERY
from dynascope.store.journal import SEAL_SECS

__all__ = ["WRITER_FLUSH_S", "WatchSettings", "settings_from"]

WRITER_FLUSH_S = 10.0  # the default flush interval of the writer watch() makes


@dataclass(kw_only=True)
class WatchSettings:
    """The probes' settings; every field is also a keyword argument of ``watch()``.

    Attributes:
        every: record tensor statistics every N optimizer steps, or a ``schedule(step) -> bool``
            (see ``dynascope.probes.schedule``). Timings are recorded every step.
        reference: θ₀ for drift: "init" (the weights now), None, a state dict, or a checkpoint path.
        memory_budget: share of parameter bytes dynascope may hold on the device for ΔW snapshots and
            θ₀; it sizes the rotating window of tensors that get the full statistics each record
            (>= 2 or None: every tensor, every record, θ₀ resident).
        time_budget: share of wall time the windowed statistics may take on average (default 1%,
            ``probes.tensors.TIME_BUDGET``; None: no limit). ‖g‖ of every tensor is recorded regardless,
            and ‖W‖ as ``w_norm_every`` says.
        drift_every: drift from θ₀ at every N-th window a tensor is in (default 4: drift is cumulative
            and slow, so its refresh once per 4 rotations leaves more of the time budget to ΔW); a
            window that holds every tensor (``memory_budget`` >= 2 or None) always computes it.
        w_norm_every: ‖W‖ of every tensor at every N-th record (default 8, the first included; 1: every
            record) and of the window's tensors at every record, where ``update_ratio`` needs it. ‖W‖
            moves slowly, and its pass over every weight costs about as much as the gradients' norm pass.
            Weights' NaN/Inf counts are known where ‖W‖ is (a finite norm proves them 0); gradients',
            from which a non-finite weight normally comes, at every record.
        grad_tol: near-zero gradient threshold relative to the tensor's rms (default 1e-8).
        bf16_k: record PULSE's S_k (``bf16_unchanged_k_*``) against the weights ``bf16_k`` steps back;
            the bf16 snapshot is resident when the budget covers it, else on disk beside θ₀.
        spectral: True or dict(k=8, every=10, time_budget=0.05) for low-rank summaries of W − W₀.
        stage: label of the rows recorded from now on (``scope.set_stage`` changes it), e.g. "sft".
        rank, role, world_size: identity for processes outside torch.distributed (e.g. Ray actors).
        system_interval_s: system sampler period (None or 0 switches it off).
        flush_secs: how often the writer watch() makes writes its rows (default 10 s): rows reach
            readers, alert rules and /metrics a flush after they are recorded; each flush appends to
            the writer's journals (``seal_secs``; docs/scale.md). Not used when watch() is given a ``writer``.
        seal_secs: each flush appends to a journal per table (one file, not one per flush), which the
            writer seals into Parquet segments every ``seal_secs`` (default 300 s) and at close
            (``store.journal``; docs/scale.md). None: a segment per table per flush.
        node_writer: the ranks of a node hand their flushes to one writer of the node, which writes
            them with its own: a node's files are one writer's (``store.node``; docs/scale.md). True, or a
            key naming the node (default: the host name); None: ``DYNASCOPE_NODE_WRITER``, off unless set.
        clock_sync: measure this rank's wall-clock offset from rank 0 in ``watch()`` (an ``events`` row
            ``clock_offset``, ``probes.clocks``) even where the probe makes no process group of its own
            (a sharded run's is used always): every rank of the default group must then run the probe.
        wandb: mirror the compact per-step summaries to the active wandb run
            (``dynascope.probes.wandb_mirror.WandbMirror``; needs the ``wandb`` extra).
    """

    every: int | Schedule = 1
    reference: Any = "init"
    memory_budget: float | None = 0.1
    time_budget: float | None = TIME_BUDGET
    drift_every: int = DRIFT_EVERY
    w_norm_every: int = W_NORM_EVERY
    grad_tol: float | None = None
    bf16_k: int | None = None
    spectral: bool | dict = False
    stage: str | None = None
    rank: int | None = None
    role: str | None = None
    world_size: int | None = None
    system_interval_s: float | None = 5.0
    flush_secs: float = WRITER_FLUSH_S
    seal_secs: float | None = SEAL_SECS
    node_writer: bool | str | None = None
    clock_sync: bool = False
    wandb: bool = False


_FIELDS = frozenset(f.name for f in dataclasses.fields(WatchSettings))


def settings_from(settings: WatchSettings | None, options: dict[str, Any]) -> WatchSettings:
    """``settings`` (or the defaults) with ``options``, keyword arguments named after its fields, applied."""
    unknown = sorted(set(options) - _FIELDS)
    if unknown:
        raise TypeError(f"watch() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"settings are: {', '.join(sorted(_FIELDS))}")
    base = settings if settings is not None else WatchSettings()
    return dataclasses.replace(base, **options) if options else base
