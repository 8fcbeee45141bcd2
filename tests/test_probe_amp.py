"""Gradient statistics under ``torch.amp.GradScaler`` describe the unscaled gradient, fused Adam or not.

The reference is plain torch on the same run: a step pre-hook registered before the probe's reads each
gradient as the optimizer is about to use it, divided by ``optimizer.grad_scale`` where the scaler left
the scale to a fused kernel, in float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope

from helpers.probe_runs import rows

STEPS = 5
INF_STEP = 3  # the step whose gradient gets an Inf element: the scaler skips it


def _run(run: Path, fused: bool, dtype: torch.dtype) -> tuple[list[dict], nn.Module]:
    """A run whose scale doubles at every good step; its reference per step: tensor → (‖g‖, max|g|)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)
    names = {id(p): n for n, p in model.named_parameters()}
    truth: list[dict] = []

    def reference(o: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        scale = getattr(o, "grad_scale", None)
        got = {}
        for p in model.parameters():
            g = p.grad.detach().double() / (scale.double() if scale is not None else 1.0)
            got[names[id(p)]] = (float(g.norm()), float(g.abs().max()))
        truth.append(got)

    opt.register_step_pre_hook(reference)
    with dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None, time_budget=None) as scope:
        for step in range(STEPS):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == INF_STEP:
                model[0].weight.grad[0, 0] = float("inf")
            stepped = len(truth)
            scaler.step(opt)
            scaler.update()
            if len(truth) == stepped:  # the scaler skipped optimizer.step()
                truth.append({})
            scope.step()  # closes a step the optimizer did not (a no-op after one it did)
    return truth, model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_are_the_unscaled_ones(tmp_path: Path, fused: bool, dtype: torch.dtype) -> None:
    run = tmp_path / "amp"
    truth, _ = _run(run, fused, dtype)
    got = rows(run, "select step, tensor, grad_norm, grad_max_abs, grad_inf_count, grad_near_zero_count, "
               "update_norm from tensor_stats order by step, tensor")
    good = [r for r in got if r["step"] != INF_STEP]
    assert len(good) == 4 * (STEPS - 1)
    for r in good:
        norm, max_abs = truth[r["step"]][r["tensor"]]
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-6), r
        assert r["grad_max_abs"] == pytest.approx(max_abs, rel=1e-6), r
        assert r["grad_norm"] < 1e3  # far below the scale, which grows x2 per step from 65536
        assert r["update_norm"] is not None and r["update_norm"] > 0
    skipped = [r for r in got if r["step"] == INF_STEP]
    events = {r["event"] for r in rows(run, "select event from events")}
    if fused:  # the fused step ran as a no-op: gradient counts exact, no update, an event saying so
        hit = {r["tensor"]: r for r in skipped}["0.weight"]
        assert hit["grad_norm"] is None and hit["grad_inf_count"] == 1 and hit["grad_near_zero_count"] is None
        assert all(r["update_norm"] is None for r in skipped)
        assert {"step_skipped", "non_finite"} <= events
    else:  # the scaler never called step(): the tensor statistics have no row at that step
        assert skipped == []


class _TakesScaler(torch.optim.Optimizer):
    """A plain SGD that takes the scaler itself and unscales on its own terms (its own step, not a
    parent's: a parent's patched ``step`` would run the step hooks a second time)."""

    _step_supports_amp_scaling = True  # GradScaler.step hands such an optimizer the unscaling

    def __init__(self, params, lr: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):  # type: ignore[override]
        inv = grad_scaler._get_scale_async().double().reciprocal().float() if grad_scaler is not None else 1.0
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * inv, alpha=-group["lr"])


def test_unknown_scale_is_null_with_an_event(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = _TakesScaler(model.parameters(), lr=1e-2)
    run = tmp_path / "unknown"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None, time_budget=None):
        for _ in range(2):
            opt.zero_grad()
            scaler = torch.amp.GradScaler("cpu")  # one per step: such an optimizer records no Inf checks
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            with pytest.warns(FutureWarning):
                scaler.step(opt)
    got = rows(run, "select grad_norm, grad_max_abs, grad_zero_count, update_norm from tensor_stats")
    assert len(got) == 4 and all(r["grad_norm"] is None and r["grad_max_abs"] is None for r in got), got
    assert all(r["grad_zero_count"] is not None and r["update_norm"] > 0 for r in got), got
    assert "grad_scale_unknown" in {r["event"] for r in rows(run, "select event from events")}
