"""``watch()``: build the probes that ``WatchSettings`` asks for and attach a ``Scope`` to model and optimizer.

    scope = dynascope.watch(model, optimizer, run="runs/x", every=10)
    scope = dynascope.watch(model, optimizer, run="runs/x", settings=dynascope.WatchSettings(every=10))

The order of the probes matters: the tensor statistics first, the memory probe after them, the user's
probes next, the timing probe last, so that the step row it writes spans the others' work.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dynascope.probes import clocks, zero
from dynascope.probes.memory import MemoryProbe
from dynascope.probes.protocol import Listener, Probe
from dynascope.probes.schedule import as_schedule, every
from dynascope.probes.scope import Scope
from dynascope.probes.settings import WRITER_FLUSH_S, WatchSettings, settings_from
from dynascope.probes.system import SystemSampler
from dynascope.probes.tensors import TensorStats
from dynascope.probes.timing import TimingProbe
from dynascope.store.writer import RunWriter

__all__ = ["WRITER_FLUSH_S", "watch"]

# The run writer that watch() makes flushes every 10 s (RunWriter's own default is 2 s). A flush has a
# fixed cost whatever its size (a segment file per table, each fsync'ed, and the two tensor_stats
# rollups): at 2 s it was the largest part of the probe's background CPU, ~1-2% of a step on 2 cores.
# The price: rows reach the store, and the dashboard, up to 10 s later (12 s with the resolver's batches,
# probes.resolver.RESOLVE_DELAY_S), and ``dynascope runs`` calls a
# killed run crashed after 25 s instead of 9 s. Pass ``writer=RunWriter(..., flush_secs=2)`` for fresher rows.


def watch(model: Any, optimizer: Any = None, run: str | os.PathLike = "runs/default", *,
          settings: WatchSettings | None = None, config: dict | None = None, writer: RunWriter | None = None,
          probes: Sequence[Probe] = (), listeners: Sequence[Listener | str] = (), **options: Any) -> Scope:
    """Attach dynascope's probes to ``model`` and ``optimizer`` and record into the run at ``run``.

    ``optimizer.step()`` is the step boundary: through torch's step hooks, or by wrapping ``step()`` on an
    optimizer without them; with neither, one warning, and ``scope.step()`` closes each step. Under
    DeepSpeed ``model`` may be the engine, and whatever optimizer is given (or none), the boundary is the
    engine's ZeRO step (``probes.zero``).

    Args:
        settings: what to record and at what cost (``WatchSettings``); default: its defaults.
        **options: any field of ``WatchSettings`` as a keyword (``every=10``, ``memory_budget=None``,
            ``stage="sft"``, ``wandb=True``...), applied over ``settings``.
        config: the run's own configuration (hyperparameters), recorded in the ``runs`` table.
        writer: share an existing ``RunWriter`` (it is then flushed, not closed, by ``close``); by
            default watch() makes one that flushes every ``flush_secs`` (10 s).
        probes: further ``Probe`` objects, run after the built-in ones.
        listeners: ``fn(step, summary)`` callables called after each recorded step; the name "wandb"
            stands for the wandb mirror (as ``wandb=True`` does).

    A probe or listener that cannot be built is reported (a warning and a ``probe_error`` event) and
    the others run; only a misspelt keyword raises (``TypeError``), before anything is attached.
    """
    s = settings_from(settings, options)
    r, local_rank, ws, role = _identity(s.rank, s.role, s.world_size)
    deepspeed = zero.resolve(model, optimizer)  # None unless DeepSpeed runs the model (probes.zero)
    if deepspeed is not None:
        model, optimizer = deepspeed.model, deepspeed.optimizer
    own = writer is None
    if writer is None:
        writer = RunWriter(run, rank=r, role=role, world_size=ws, config=config, flush_secs=s.flush_secs,
                           seal_secs=s.seal_secs, node=s.node_writer, framework="pytorch" if deepspeed is None else "deepspeed")
    schedule = as_schedule(s.every)
    built: list[Probe] = [TensorStats(s.memory_budget, s.grad_tol, time_budget=s.time_budget, schedule=schedule,
                                      bf16_k=s.bf16_k, run_dir=writer.run_dir, rank=writer.rank,
                                      drift_every=s.drift_every, w_norm_every=s.w_norm_every)]
    failed: list[tuple[str, Exception]] = []
    for name, make in (("spectral", lambda: _spectral_probe(s.spectral, built[0]) if s.spectral else None),
                       ("system", lambda: SystemSampler(writer, s.system_interval_s, local_rank)
                        if s.system_interval_s else None)):
        try:
            p = make()
            if p is not None:
                built.append(p)
        except Exception as exc:
            failed.append((name, exc))
    device = _device_of(model)
    built += [MemoryProbe(device, schedule), *probes, TimingProbe(device)]  # timing last: the step row spans them
    scope = Scope(model, optimizer, writer, own, built, reference=s.reference, stage=s.stage)
    for name, exc in failed:
        scope._report(name, exc)
    if deepspeed is not None:
        scope._handles += scope._guard("deepspeed", deepspeed.attach, scope) or []
    for spec in (["wandb"] if s.wandb else []) + list(listeners):
        try:
            scope.add_listener(_listener(spec))
        except Exception as exc:
            scope._report(f"listener:{spec}" if isinstance(spec, str) else "listener", exc)
    clocks.record_offset(scope, s.clock_sync)  # never raises: an event either way
    # One full collection now, before the first probed step. What attaching allocated (modules imported on
    # first use, the writer's and the probes' state) is enough to tip CPython's collector into a full pass
    # a few dozen steps later: 0.2-0.3 s inside one training step of a process holding ~300k objects, and
    # under data parallelism one rank's stall is every rank's wait. Here it costs the same, outside a step.
    gc.collect()
    return scope


def _identity(rank: int | None, role: str | None, world_size: int | None) -> tuple[int, int, int, str]:
    """(rank, local_rank, world_size, role): explicit settings, else torch.distributed, else env vars."""
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


def _spectral_probe(spec: Any, weights: TensorStats) -> Probe:
    from dynascope.probes.spectral import SpectralProbe

    kw = dict(spec) if isinstance(spec, dict) else {}
    kw.setdefault("passes", weights._pass)  # one pass thread: the spectra queue behind the weight pass
    kw.setdefault("weights", weights)  # and read the copies of W_t it writes, where it writes them
    if "every" in kw:
        kw["schedule"] = every(int(kw.pop("every")))
    return SpectralProbe(**kw)


def _listener(spec: Listener | str) -> Listener:
    """A listener callable, or the built-in one a name stands for ("wandb": the wandb mirror)."""
    if not isinstance(spec, str):
        return spec
    makers: dict[str, Callable[[], Listener]] = {"wandb": _wandb_mirror}
    if spec not in makers:
        raise LookupError(f"no listener named {spec!r} (named listeners: {', '.join(sorted(makers))}); "
                          "pass a callable fn(step, summary) instead")
    return makers[spec]()


def _wandb_mirror() -> Listener:
    from dynascope.probes.wandb_mirror import WandbMirror  # imports wandb: only when asked for

    return WandbMirror()
