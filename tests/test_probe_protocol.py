"""The probe protocol: user probes composed by watch(), their schedule and two halves, rows, failures, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.probes.protocol import Probe, StepContext
from dynascope.probes.schedule import every
from dynascope.store import open_store


class LossScale(Probe):
    """A user probe: the gradient's global norm before the step, the weight norm after, as scalars rows."""

    name = "loss_scale"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._g: float | None = None

    def schedule(self, step: int) -> bool:
        return every(2)(step)

    def before(self, ctx: StepContext) -> None:
        self.calls.append(("before", ctx.step))
        self._g = float(torch.stack([t.grad().norm() for t in ctx.tracked if t.grad() is not None]).norm())

    def after(self, ctx: StepContext):
        self.calls.append(("after", ctx.step))
        g, w = self._g, float(torch.stack([t.local().norm() for t in ctx.tracked]).norm())
        return lambda: {"scalars": {"step": ctx.step, "time_us": 0, "stage": ctx.stage, "key": ["g", "w"],
                                    "value": [g, w]}}

    def summarize(self, rows):
        return {"loss_scale/g": rows["scalars"]["value"][0]}


class Broken(Probe):
    name = "broken"

    def after(self, ctx: StepContext):
        raise RuntimeError("boom")


def _train(scope_kw: dict, run: Path, steps: int = 4) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list = []
    with pytest.warns(RuntimeWarning, match="broken: RuntimeError: boom"):
        with dynascope.watch(model, opt, run=run, system_interval_s=None, listeners=[lambda s, m: seen.append((s, m))],
                             **scope_kw) as scope:
            for _ in range(steps):
                model(torch.ones(1, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
    return scope, seen


def test_user_probes_run_on_their_schedule_and_their_rows_are_written(tmp_path: Path) -> None:
    mine = LossScale()
    scope, seen = _train({"probes": [mine, Broken()], "memory_budget": None}, tmp_path / "r")
    assert mine.calls == [("before", 0), ("after", 0), ("before", 2), ("after", 2)]
    assert scope.probes[-1] is scope.timing  # timing last: its step row spans every probe's work
    with open_store(tmp_path / "r") as con:
        got = con.sql("SELECT step, key, value FROM scalars WHERE key IN ('g', 'w') ORDER BY step, key").pl()
        errors = con.sql("SELECT count(*) AS n FROM events WHERE event = 'probe_error' "
                         "AND message LIKE 'broken:%'").pl()["n"][0]
        steps = con.sql("SELECT DISTINCT step FROM tensor_stats ORDER BY step").pl()["step"].to_list()
    assert got["step"].to_list() == [0, 0, 2, 2] and all(v > 0 for v in got["value"])
    assert errors == 4 and steps == [0, 1, 2, 3]  # a failing probe never stops the others
    assert [s for s, m in seen if "loss_scale/g" in m] == [0, 2] and all("update_ratio" in m for _, m in seen)


def test_resume_continues_the_step_numbering(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dynascope.watch(model, opt, run=tmp_path / "r", system_interval_s=None) as scope:
        scope.resume(500)
        for _ in range(2):
            with scope.phase("train"):
                model(torch.ones(1, 3)).sum().backward()
            opt.step()
        assert scope.step_index == 502
        with pytest.raises(AttributeError):
            scope.step_index = 7  # read-only: resume() is the one way to move it
    with open_store(tmp_path / "r") as con:
        assert con.sql("SELECT DISTINCT step FROM tensor_stats ORDER BY 1").pl()["step"].to_list() == [500, 501]
        assert set(con.sql("SELECT step FROM timings WHERE phase = 'train'").pl()["step"]) == {500, 501}


def test_settings_and_keywords_build_one_configuration(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = dynascope.WatchSettings(every=2, memory_budget=None, stage="sft", system_interval_s=None)
    # a keyword overrides the settings' field; the settings object itself is left as it was
    with dynascope.watch(model, opt, run=tmp_path / "r", settings=settings, stage="rl") as scope:
        assert scope.stage == "rl" and settings.stage == "sft" and scope.stats.memory_budget is None
        assert scope.system is None
        for _ in range(4):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
    with open_store(tmp_path / "r") as con:
        assert con.sql("SELECT DISTINCT step, stage FROM tensor_stats ORDER BY 1").fetchall() == [(0, "rl"), (2, "rl")]
    with pytest.raises(TypeError, match="'memory_budgte'"):  # a misspelt keyword fails before attaching
        dynascope.watch(model, opt, run=tmp_path / "t", memory_budgte=0.5)
    assert not (tmp_path / "t").exists()
    assert not hasattr(dynascope, "Run") and dynascope.Scope is dynascope.probes.scope.Scope
    # dynascope.watch is the probes' watch with the live parts (alert rules, /metrics) on top.
    from dynascope.alerts import attach

    assert dynascope.watch is attach.watch and dynascope.WatchSettings is dynascope.probes.WatchSettings


def test_a_step_the_optimizer_skipped_still_closes_with_its_step_row(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dynascope.watch(model, opt, run=tmp_path / "r", system_interval_s=None, memory_budget=None) as scope:
        for i in range(3):
            model(torch.ones(1, 3)).sum().backward()
            if i != 1:  # step 1: skipped, as a GradScaler skips a step with Inf gradients
                opt.step()
            opt.zero_grad()
            scope.step()
    with open_store(tmp_path / "r") as con:
        steps = con.sql("SELECT step FROM timings WHERE phase = 'step' ORDER BY step").pl()["step"].to_list()
        stats = con.sql("SELECT DISTINCT step FROM tensor_stats ORDER BY step").pl()["step"].to_list()
    assert steps == [0, 1, 2] and stats == [0, 2]
