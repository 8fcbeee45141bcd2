"""Cadence of the default set: drift at every 4th window a tensor is in, ΔW at every window, ‖W‖ of every
tensor at every 8th record (and of the window's at each); the probe's
threads at a lower CPU priority than training; watch()'s writer flushing every 10 s; CPython's full
collection run inside watch(), not in a later training step.

Checked against the naive per-tensor reference of tests/test_probe_scope.py on its awkward model (tied,
bf16, frozen, unused and empty parameters), with the time budget lifted so a window is taken at every
step and the rotation is deterministic.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import dynascope
from dynascope.probes.attach import WRITER_FLUSH_S
from dynascope.probes.resolver import BACKGROUND_NICE, lower_priority
from dynascope.probes.tensors import W_NORM_EVERY
from dynascope.store.writer import RunWriter

from helpers.probe_runs import rows, train

STEPS = 45


def _visits(got: list[dict], col: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in got:
        if r[col] is not None:
            out.setdefault(r["tensor"], []).append(r["step"])
    return {t: sorted(s) for t, s in out.items()}


def test_drift_at_every_fourth_window_and_exact_there(tmp_path: Path) -> None:
    truth, _ = train(tmp_path / "d4", STEPS, time_budget=None)
    got = rows(tmp_path / "d4", "select * from tensor_stats order by step, tensor")
    windows = _visits(got, "update_norm")
    drift = _visits(got, "drift_norm")
    assert set(windows) == set(truth[0])  # ΔW still reaches every tensor
    assert max(len(s) for s in windows.values()) >= 5  # several rotations, so the cadence shows
    for tensor, steps in windows.items():
        assert drift.get(tensor, []) == steps[::4], tensor  # first window, then every 4th
    for r in got:
        if r["drift_norm"] is not None:
            d = truth[r["step"]][r["tensor"]][2]
            assert r["ref_covered"] is True
            assert r["drift_norm"] == pytest.approx(d[1], rel=1e-5, abs=1e-12)
            assert [r["drift_changed_count"], r["drift_changed_rel_count"]] == d[2:4]
        else:
            assert r["ref_covered"] is False and r["drift_changed_count"] is None


def test_drift_cadence_leaves_the_update_window_unchanged(tmp_path: Path) -> None:
    """Without a time budget the windows are the same whatever drift_every: only drift rows thin out."""
    train(tmp_path / "d1", 12, time_budget=None, drift_every=1)
    train(tmp_path / "d4", 12, time_budget=None)
    q = "select step, tensor, update_norm, changed_count, grad_zero_count from tensor_stats order by step, tensor"
    one, four = rows(tmp_path / "d1", q), rows(tmp_path / "d4", q)
    assert one == four
    n1 = rows(tmp_path / "d1", "select count(drift_norm) as n from tensor_stats")[0]["n"]
    n4 = rows(tmp_path / "d4", "select count(drift_norm) as n from tensor_stats")[0]["n"]
    assert n1 == rows(tmp_path / "d1", "select count(update_norm) as n from tensor_stats")[0]["n"]
    assert 0 < n4 < n1


def test_full_set_computes_drift_at_every_record(tmp_path: Path) -> None:
    truth, _ = train(tmp_path / "full", 6, memory_budget=None)
    got = rows(tmp_path / "full", "select step, tensor, drift_norm from tensor_stats")
    assert len(got) == 6 * len(truth[0]) and all(r["drift_norm"] is not None for r in got)


def test_weight_norm_of_every_tensor_every_eighth_record_and_exact(tmp_path: Path) -> None:
    truth, _ = train(tmp_path / "w8", 20, time_budget=None)
    got = rows(tmp_path / "w8", "select * from tensor_stats order by step, tensor")
    for r in got:
        full = r["step"] % W_NORM_EVERY == 0  # records 0, 8, 16 (one record per step here)
        assert (r["w_norm"] is not None) == (full or r["update_norm"] is not None), (r["step"], r["tensor"])
        if r["w_norm"] is not None:
            assert r["w_norm"] == pytest.approx(truth[r["step"]][r["tensor"]][0][0], rel=1e-5, abs=1e-12)
            assert r["w_nan_count"] == 0 and r["w_inf_count"] == 0
        else:  # unknown, not zero: no pass over these weights at this record
            assert r["w_nan_count"] is None and r["update_ratio"] is None
        if r["update_norm"] is not None and r["w_norm"]:
            assert r["update_ratio"] == pytest.approx(r["update_norm"] / r["w_norm"])
    every = rows(tmp_path / "w8", "select count(*) as n, count(w_norm) as w from tensor_stats")[0]
    assert every["w"] < every["n"]
    train(tmp_path / "w1", 6, time_budget=None, w_norm_every=1)
    one = rows(tmp_path / "w1", "select count(*) as n, count(w_norm) as w from tensor_stats")[0]
    assert one["w"] == one["n"]


def test_drift_every_must_be_positive(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="drift_every"):
        dynascope.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run=tmp_path / "bad", drift_every=0)
    with pytest.raises(ValueError, match="w_norm_every"):
        dynascope.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run=tmp_path / "bad2", w_norm_every=0)


def test_watch_writer_flushes_every_ten_seconds_and_a_shared_writer_keeps_its_own(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dynascope.watch(model, opt, run=tmp_path / "own", system_interval_s=None) as scope:
        assert scope.writer.flush_secs == WRITER_FLUSH_S == 10.0
    shared = RunWriter(tmp_path / "shared", flush_secs=0.5)
    with dynascope.watch(model, opt, writer=shared, system_interval_s=None) as scope:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert scope.writer is shared and shared.flush_secs == 0.5
    shared.close()
    got = rows(tmp_path / "shared", "select count(*) as n from tensor_stats")
    assert got[0]["n"] == 2  # weight and bias of the one step: close() flushed the shared writer


def _nice(t: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, t.native_id)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_probe_threads_run_below_training(tmp_path: Path) -> None:
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=tmp_path / "nice", system_interval_s=0.05)
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        scope.flush()  # the resolver has run a job, so its loop (which lowers it first) has started
        threads = [scope.resolver._thread, scope.writer._thread, scope.system._thread]
        assert [t.name for t in threads] == ["dynascope-resolver", "dynascope-writer-0", "dynascope-system"]
        deadline = time.monotonic() + 30
        while not all(_nice(t) >= BACKGROUND_NICE for t in threads) and time.monotonic() < deadline:
            time.sleep(0.01)  # the sampler lowers itself as its loop starts: wait for that, not a duration
        assert all(_nice(t) >= BACKGROUND_NICE for t in threads), [(t.name, _nice(t)) for t in threads]
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # training untouched
    finally:
        scope.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_lower_priority_never_raises_a_thread_back() -> None:
    done = threading.Event()
    seen: list[int] = []

    def body() -> None:
        lower_priority(nice=15)
        lower_priority(nice=BACKGROUND_NICE)  # already lower: stays at 15
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        done.wait(10)

    t = threading.Thread(target=body)
    assert lower_priority(t) is False  # not started: nothing to lower, and the caller is left alone
    t.start()
    try:
        while not seen:
            time.sleep(0.01)
        assert seen == [max(15, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))]
    finally:
        done.set()
        t.join()


def test_watch_leaves_no_full_collection_to_the_training_steps(tmp_path: Path) -> None:
    """watch() runs CPython's full collection itself, before the first step: what attaching allocated would
    otherwise tip the collector into a full pass (0.2-0.3 s in a process of ~300k objects) a few dozen
    steps later, inside a step."""
    import gc

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and threading.current_thread() is threading.main_thread():
            full.append(1)

    gc.callbacks.append(seen)
    try:
        scope = dynascope.watch(model, opt, run=tmp_path / "run", system_interval_s=None)
        assert full == [1]  # the one full pass, inside watch()
        assert gc.get_count()[1:] == (0, 0)  # ... so the older generations start from empty
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        for _ in range(60):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert full == [1], "a full collection ran during the training steps"
        scope.close()
    finally:
        gc.callbacks.remove(seen)
