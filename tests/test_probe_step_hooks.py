"""Optimizers without torch's step hooks: ``watch()`` wraps their ``step()`` (DeepSpeed's ZeRO wrappers,
accelerate's wrappers are such objects), or, with no ``step()`` to wrap, warns once, records why, and
takes the user's ``scope.step()`` calls as the boundaries. It never raises into the training script."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch

import dynascope


class PlainWrapper:
    """Like DeepSpeed's optimizer wrappers: a plain object that steps a torch optimizer it holds."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.calls = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        self.calls += 1
        self.optimizer.step()


class NoInit(torch.optim.SGD):
    """An ``Optimizer`` subclass whose ``__init__`` never ran (accelerate's ``AcceleratedOptimizer``
    shape): it has ``register_step_pre_hook`` but not the dictionaries behind it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: D107 - deliberately no super()
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()


def train(model: torch.nn.Module, opt: Any, scope: Any, steps: int, manual: bool = False) -> list[dict]:
    """Plain training; returns each step's true ‖ΔW‖ per tensor."""
    truth = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for p in model.parameters():
            p.grad = None
        if manual:
            scope.step()
        truth.append({n: float((p.detach() - old[n]).norm()) for n, p in model.named_parameters()})
    return truth


def rows(run: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    con = dynascope.open_store(run)
    return con.sql("select * from tensor_stats").pl(), con.sql("select event, message from events").pl()


@pytest.mark.parametrize("wrap", [PlainWrapper, NoInit])
def test_step_of_an_optimizer_without_hooks_is_the_boundary(tmp_path: Path, wrap: type) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # attaching warns about nothing
        scope = dynascope.watch(model, opt, run=tmp_path / "r", memory_budget=None, system_interval_s=None)
    truth = train(model, opt, scope, 3)
    scope.close()
    assert "step" not in vars(opt)  # the wrapper is gone: the class's own step() again
    stats, events = rows(tmp_path / "r")
    assert events.filter(pl.col("event") == "probe_error").is_empty(), events.to_dicts()
    assert sorted(set(stats["step"])) == [0, 1, 2] and stats.height == 3 * 4
    for r in stats.to_dicts():
        assert r["update_norm"] == pytest.approx(truth[r["step"]][r["tensor"]], rel=1e-6)
        assert r["grad_norm"] is not None and r["grad_norm"] > 0


def test_an_optimizer_with_no_step_warns_once_and_steps_by_hand(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="cannot hook object.step") as caught:
        scope = dynascope.watch(model, object(), run=tmp_path / "r", memory_budget=None, system_interval_s=None)
    assert len([w for w in caught if "dynascope" in str(w.message)]) == 1
    assert "\n" not in str(caught[0].message)
    truth = train(model, sgd, scope, 2, manual=True)
    scope.close()
    stats, events = rows(tmp_path / "r")
    errors = events.filter(pl.col("event") == "probe_error")["message"].to_list()
    assert len(errors) == 1 and "scope.step()" in errors[0]
    assert sorted(set(stats["step"])) == [0, 1]
    for r in stats.to_dicts():  # the model's parameters, boundaries from scope.step()
        assert r["update_norm"] == pytest.approx(truth[r["step"]][r["tensor"]], rel=1e-6)
