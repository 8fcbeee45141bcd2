"""``dynascope.watch``: the probes' ``watch`` plus the live parts that read the store, alert rules and the
``/metrics`` endpoint (they sit above the analyses, which the probes must not import)."""

from __future__ import annotations

import os
from typing import Any

from dynascope.alerts.rules import rules_from
from dynascope.core.warn import warn
from dynascope.probes.attach import watch as watch_probes
from dynascope.probes.scope import Scope

__all__ = ["watch"]


def watch(model: Any, optimizer: Any = None, run: str | os.PathLike = "runs/default", *, alerts: Any = None,
          alert_interval_s: float = 2.0, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
          **kwargs: Any) -> Scope:
    """``dynascope.probes.attach.watch`` (every argument of it), and with ``alerts``: rules evaluated live.

    ``alerts=True`` turns the default rules on (``dynascope.alerts.DEFAULT_RULES``); a list of ``Rule`` (or
    of dicts), or a YAML file's path, gives one's own. Rank 0 evaluates them every ``alert_interval_s``
    over the rows flushed so far, on a thread of its own; every rank follows stop requests. A rule list
    that does not parse raises ``ValueError`` before anything is attached.

    ``metrics_port``: rank 0 serves the run's ``/metrics`` (``dynascope.alerts.metrics``) on
    ``metrics_addr:metrics_port``; a port that cannot be bound is a warning, and training goes on.
    """
    rules = rules_from(alerts)
    scope = watch_probes(model, optimizer, run, **kwargs)
    if metrics_port is not None and scope.writer.rank == 0:
        try:
            from dynascope.alerts.metrics import serve_metrics

            server, _, _ = serve_metrics(scope.run_dir, int(metrics_port), metrics_addr)
            scope.add_service(_Stopper(server))
        except Exception as exc:
            warn(f"dynascope: /metrics not served on {metrics_addr}:{metrics_port}: {type(exc).__name__}: {exc}")
    if not alerts:
        return scope
    try:
        from dynascope.alerts.monitor import Monitor  # the analyses it reads are imported only when asked for

        writer = scope.writer
        monitor = Monitor(scope.run_dir, rules if writer.rank == 0 else [], event=writer.event,
                          on_stop=scope.request_stop, interval_s=alert_interval_s,
                          world_size=_world_size(kwargs.get("world_size")))
        scope.add_service(monitor.start())
    except Exception as exc:  # training goes on without alerts
        warn(f"dynascope: alerts not started: {type(exc).__name__}: {exc}")
    return scope


def _world_size(given: Any) -> int:
    if given:
        return int(given)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        pass
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class _Stopper:
    """Closes the metrics server with the scope (``shutdown`` waits for the serving loop's next poll)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
