"""Faults the probe must absorb without an exception or a stall in the training loop: warnings turned
into errors, a probe that raises, a listener that raises, one that never returns, a resolver that stops."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import torch

import dynascope
from dynascope.probes.protocol import Probe
from dynascope.probes.resolver import PUT_WAIT_S, Resolver
from dynascope.store import open_store

from helpers.waiting import wait_until

STEPS = 150


class _Raises(Probe):
    name = "raises"

    def after(self, ctx):
        raise ValueError("planted probe failure")


def _events(run: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with open_store(run) as store:
        for event, message in store.rows("SELECT event, message FROM events"):
            out.setdefault(event, []).append(message)
    return out


def _close_within(scope, timeout_s: float) -> None:
    """Run close() on a thread; fail if it is still running long after its own timeout."""
    t = threading.Thread(target=scope.close, kwargs={"timeout_s": timeout_s}, daemon=True)
    t.start()
    t.join(timeout_s + 60)  # slack for a loaded machine; a hang never returns at all
    assert not t.is_alive(), "close() hung"


def test_warnings_as_errors_a_raising_probe_and_listeners_that_raise_or_hang(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "run"
    release = threading.Event()
    entered = threading.Event()

    def raising(step, summary):
        raise RuntimeError("planted listener failure")

    def hanging(step, summary):  # a wandb.log on a dead network
        entered.set()
        release.wait(600)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scope = dynascope.watch(model, opt, run, probes=[_Raises()], listeners=[raising], system_interval_s=None)
        scope.add_listener(hanging, deadline_s=0.5)
        hung = scope.delivery.listeners[-1]
        for step in range(STEPS):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 20:  # let the hanging call pass its deadline, so the next steps find it hung
                wait_until(entered.is_set, "the hanging listener's first call")
                wait_until(lambda: hung._busy_since is not None and time.monotonic() - hung._busy_since > 1.0,
                           "the hanging listener's deadline")
        assert scope.step_index == STEPS
        _close_within(scope, 5.0)
    release.set()
    events = _events(run)
    errors = events["probe_error"]
    assert any("raises: ValueError: planted probe failure" in m for m in errors)
    assert any("listener:raising: RuntimeError: planted listener failure" in m for m in errors)
    (dropped,) = events["listener_dropped"]
    assert "listener hanging has not returned in 0.5 s" in dropped
    with open_store(run) as store:  # the rows of every step are there despite all of it
        assert store.rows("SELECT count(DISTINCT step) FROM timings WHERE category = 'step'") == [(STEPS,)]


def test_a_stuck_resolver_drops_records_instead_of_blocking_the_step() -> None:
    stuck, errors, resolved = threading.Event(), [], []

    def resolve(items):
        stuck.wait(600)
        resolved.extend(items)

    r = Resolver(lambda name, exc: errors.append(str(exc)), resolve, max_pending=4, batch=1, delay_s=0.0)
    # Returns at all (a blocking put never would): the first full queue waits PUT_WAIT_S once, and every
    # later record is dropped at once.
    queued = [r.collect(i) for i in range(40)]
    assert PUT_WAIT_S > 0 and sum(queued) <= 6 and r.dropped == 40 - sum(queued)
    assert len(errors) == 1 and "records are dropped" in errors[0]
    stuck.set()
    r.drain(timeout_s=60)
    assert resolved == [i for i, q in enumerate(queued) if q]
    assert r.collect(99) and not r._stuck  # caught up: records queue again
    r.close(timeout_s=60)
    assert f"{r.dropped} records dropped" in errors[-1]


def _train_with_loader(run: Path, workers: int) -> int:
    """A watched loop whose DataLoader forks ``workers`` workers each epoch; returns the steps taken."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    steps = 0
    with dynascope.watch(model, opt, run, system_interval_s=None) as scope:
        for _ in range(3):
            loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=workers,
                                                 multiprocessing_context="fork")
            for x, y in loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                scope.log(loss=1.0)
                steps += 1
    return steps


def test_fork_during_training_neither_hangs_nor_duplicates(tmp_path: Path) -> None:
    steps = _train_with_loader(tmp_path / "run", workers=2)
    with open_store(tmp_path / "run") as store:
        per_step = store.rows("SELECT step, count(*) FROM timings WHERE category = 'step' GROUP BY step")
        writers = store.rows("SELECT count(*) FROM events WHERE event = 'run_end'")
    assert sorted(s for s, _ in per_step) == list(range(steps)) and {n for _, n in per_step} == {1}
    assert writers == [(1,)]  # the workers' inherited copies never wrote, not even at their exit


def test_a_forked_child_that_watches_gets_its_own_writer(tmp_path: Path) -> None:
    import os

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parent = dynascope.watch(model, opt, tmp_path / "parent", system_interval_s=None)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    pid = os.fork()
    if pid == 0:  # the child: the inherited scope is inert; its own scope records into its own run
        code = 1
        try:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()  # the inherited hooks: nothing recorded, nothing waited for
            parent.close()
            child_opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with dynascope.watch(model, child_opt, tmp_path / "child", system_interval_s=None):
                for _ in range(2):
                    model(torch.ones(2, 4)).sum().backward()
                    child_opt.step()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    parent.close()
    with open_store(tmp_path / "parent") as store:
        assert store.rows("SELECT count(*) FROM timings WHERE category = 'step'") == [(3,)]
    with open_store(tmp_path / "child") as store:
        assert store.rows("SELECT count(*) FROM timings WHERE category = 'step'") == [(2,)]
