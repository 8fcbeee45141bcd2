"""System sampler: a daemon thread writing ``system`` rows every ``interval_s``.

Every sample writes the process's CPU% and RSS (psutil). Where NVML (``pynvml`` from nvidia-ml-py)
finds GPUs, local rank 0 of each host also writes one row per GPU — utilization, memory, power,
temperature, SM clock — so a node's GPUs are sampled once, not once per rank.
"""

from __future__ import annotations

import threading
from typing import Any

from dynascope.core.clock import now_us
from dynascope.core.warn import warn
from dynascope.probes.protocol import Probe
from dynascope.probes.resolver import lower_priority
from dynascope.store.writer import RunWriter

__all__ = ["SystemSampler", "gpu_rows", "process_row"]


def process_row(proc: Any) -> dict[str, Any]:
    """CPU% since the previous call and RSS of this process."""
    return {"device": "cpu", "cpu_pct": float(proc.cpu_percent(None)), "rss_bytes": int(proc.memory_info().rss)}


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:
        return None


def gpu_rows(nvml: Any) -> list[dict[str, Any]]:
    """One row per GPU; a field NVML cannot read on this GPU is left NULL."""
    rows = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        row: dict[str, Any] = {"device": f"gpu:{i}"}
        for col, fn in (
            ("gpu_util_pct", lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
            ("mem_used_bytes", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).used)),
            ("mem_total_bytes", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total)),
            ("power_w", lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temp_c", lambda h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))),
            ("sm_clock_mhz", lambda h: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))),
        ):
            try:
                row[col] = fn(h)
            except Exception:
                row[col] = None
        rows.append(row)
    return rows


class SystemSampler(Probe):
    """Samples until ``close``; failures become one warning and one ``probe_error`` event, then it stops.

    A probe on its own clock: never scheduled at a step, it writes from its thread and stops at ``close``.
    """

    name = "system"

    def schedule(self, step: int) -> bool:
        return False

    def __init__(self, writer: RunWriter, interval_s: float = 5.0, local_rank: int = 0) -> None:
        import psutil

        self.writer, self.interval_s = writer, max(float(interval_s), 0.01)
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only sets the baseline
        self._nvml = _nvml() if local_rank == 0 else None
        self._stop = threading.Event()
        self._broken = False
        self._thread = threading.Thread(target=self._loop, name="dynascope-system", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        rows = [process_row(self._proc)]
        if self._nvml is not None:
            rows += gpu_rows(self._nvml)
        t = now_us()
        cols: dict[str, list] = {}
        for r in rows:
            for k in ("device", "gpu_util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "temp_c",
                      "sm_clock_mhz", "cpu_pct", "rss_bytes"):
                cols.setdefault(k, []).append(r.get(k))
        cols["time_us"] = [t] * len(rows)
        self.writer.append("system", cols)

    def _failed(self, exc: Exception) -> None:
        """The one warning and ``probe_error`` event of a failed sample; the sampler takes no more."""
        self._broken = True
        warn(f"dynascope: system sampler stopped: {type(exc).__name__}: {exc}",
             RuntimeWarning, stacklevel=1)
        self.writer.event("probe_error", f"system sampler: {type(exc).__name__}: {exc}",
                          severity="warning", probe="system")

    def _loop(self) -> None:
        lower_priority()  # background work: see dynascope.probes.resolver
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:
                self._failed(exc)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._broken:  # already reported; a last attempt would fail the same way
            return
        try:
            self.sample()  # a last sample so even short runs have one row
        except Exception as exc:
            self._failed(exc)
