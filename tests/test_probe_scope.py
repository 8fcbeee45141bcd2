"""watch() end to end on CPU: every recorded statistic against a naive per-tensor reference.

The model has the awkward cases real models have: tied weights, a bf16 submodule, a frozen parameter in
the optimizer, a parameter that never gets a gradient, and an empty parameter.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.probes.tensors import W_NORM_EVERY

from helpers.naive_stats import naive_update
from helpers.probe_runs import Awkward, rows, train


def test_full_coverage_matches_naive(tmp_path: Path) -> None:
    run = tmp_path / "full"
    truth, model = train(run, 3, memory_budget=None)
    got = rows(run, "select * from tensor_stats order by step, tensor")
    names = {n for n, _ in model.named_parameters()}
    assert "head.weight" not in names  # tied: listed once, as embed.weight
    assert len(got) == 3 * len(truth[0]) and {r["tensor"] for r in got} == set(truth[0])
    for r in got:
        (upd, grad, drift) = truth[r["step"]][r["tensor"]]
        assert r["w_norm"] == pytest.approx(upd[0], rel=1e-5, abs=1e-12)
        assert r["update_norm"] == pytest.approx(upd[1], rel=1e-5, abs=1e-12)
        assert [r["changed_count"], r["changed_rel_count"], r["sign_flip_count"], r["w_nan_count"], r["w_inf_count"]] == upd[2:]
        n = r["numel"]
        if n:
            assert r["changed_frac"] == pytest.approx(upd[2] / n)
            assert r["update_ratio"] == pytest.approx(upd[1] / upd[0], rel=1e-5)
        assert r["ref_covered"] is True
        assert r["drift_norm"] == pytest.approx(drift[1], rel=1e-5, abs=1e-12)
        assert [r["drift_changed_count"], r["drift_changed_rel_count"]] == drift[2:4]
        if grad is None:
            assert r["grad_norm"] is None and r["grad_zero_count"] is None
        else:
            assert r["grad_norm"] == pytest.approx(grad[0], rel=1e-5, abs=1e-30)
            assert r["grad_max_abs"] == pytest.approx(grad[1], rel=1e-6, abs=1e-30)
            assert [r["grad_zero_count"], r["grad_near_zero_count"], r["grad_nan_count"], r["grad_inf_count"]] == grad[2:]
    by = {(r["step"], r["tensor"]): r for r in got}
    assert by[(0, "lowp.weight")]["dtype"] == "bfloat16"
    assert by[(2, "frozen.weight")]["update_norm"] == 0.0 and by[(2, "frozen.weight")]["grad_norm"] is None
    assert by[(2, "unused.weight")]["grad_norm"] is None and by[(2, "unused.weight")]["changed_count"] == 0
    assert by[(1, "empty")]["numel"] == 0 and by[(1, "empty")]["changed_frac"] is None
    assert by[(1, "mid.weight")]["changed_count"] > 0


def test_default_budget_rotates_a_window(tmp_path: Path) -> None:
    run = tmp_path / "rot"
    truth, _ = train(run, 12, time_budget=None, drift_every=1)  # drift at every window (the cadence: test_probe_cadence)
    got = rows(run, "select * from tensor_stats order by step, tensor")
    assert len(got) == 12 * len(truth[0])
    # ‖W‖ of every tensor at every 8th record and of the window's at each (test_probe_cadence), with its
    # NaN/Inf counts proven 0 by the finite norms; ‖g‖ of every tensor at every record
    has_w = [r["step"] % W_NORM_EVERY == 0 or r["update_norm"] is not None for r in got]
    assert [r["w_norm"] is not None for r in got] == has_w and not all(has_w)
    assert all(r["w_nan_count"] == 0 for r, h in zip(got, has_w, strict=True) if h)
    assert all(r["grad_norm"] is not None and r["grad_inf_count"] == 0 for r in got if r["tensor"] != "unused.weight"
               and not r["tensor"].startswith(("frozen", "unused")))
    covered = [r for r in got if r["update_norm"] is not None]
    per_step = {s: sum(1 for r in covered if r["step"] == s) for s in range(12)}
    assert all(1 <= c < len(truth[0]) for c in per_step.values())  # a window, never everything
    assert {r["tensor"] for r in covered} == set(truth[0])  # ...that reaches every tensor
    for r in covered:
        upd, _, drift = truth[r["step"]][r["tensor"]]
        assert r["update_norm"] == pytest.approx(upd[1], rel=1e-5, abs=1e-12)
        assert r["changed_count"] == upd[2]
        assert r["ref_covered"] and r["drift_changed_count"] == drift[2]
    assert all(r["drift_norm"] is None for r in got if not r["ref_covered"])
    assert (run / "reference" / "theta0-r0.safetensors").exists()


def test_every_schedule_and_no_reference(tmp_path: Path) -> None:
    run = tmp_path / "every"
    train(run, 5, every=2, reference=None, memory_budget=None)
    got = rows(run, "select step, bool_or(ref_covered) as ref, count(*) as n from tensor_stats group by step "
                    "order by step")
    assert [r["step"] for r in got] == [0, 2, 4] and not any(r["ref"] for r in got)


def test_reference_from_path_and_set_reference(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    base = Awkward()
    ckpt = tmp_path / "base.safetensors"
    save_file({n: p.detach().contiguous() for n, p in base.named_parameters()}, str(ckpt))
    run = tmp_path / "ref"
    truth, _ = train(run, 2, reference=str(ckpt), memory_budget=None)  # same seed: θ₀ == the init
    got = rows(run, "select * from tensor_stats where step = 1")
    for r in got:
        assert r["drift_changed_count"] == truth[1][r["tensor"]][2][2]

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dynascope.watch(model, opt, run=tmp_path / "cur", reference=None, memory_budget=None,
                         system_interval_s=None) as scope:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        scope.set_reference("init")
        opt.step()  # same grads again: drift from "init" is exactly this step's update
    got = rows(tmp_path / "cur", "select * from tensor_stats order by step, tensor")
    assert [r["ref_covered"] for r in got] == [False, False, True, True]
    for r in got[2:]:
        assert r["drift_norm"] == pytest.approx(r["update_norm"])


def test_mid_run_param_group_and_skipped_params(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.ones(3))
    ints = nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)
    cplx = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.add_param_group({"params": [ints, cplx], "lr": 0.0})
    run = tmp_path / "mid"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None):
        for i in range(3):
            if i == 1:
                opt.add_param_group({"params": [extra]})
            (model(torch.ones(2, 4)).sum() + extra.sum()).backward()
            opt.step()
            opt.zero_grad()
    got = rows(run, "select step, count(*) as n from tensor_stats group by step order by step")
    assert [r["n"] for r in got] == [2, 3, 3]
    ev = rows(run, "select message from events where event = 'probe_skip'")
    assert len(ev) == 2 and any("complex" in e["message"] for e in ev) and any("int64" in e["message"] for e in ev)


def test_probe_errors_never_break_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dynascope.probes.tensors as tensors

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(tensors.TensorStats, "_grads", boom)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "err"
    w0 = model.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="kaboom"):
        with dynascope.watch(model, opt, run=run, system_interval_s=None) as scope:
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
    assert not torch.equal(model.weight, w0)  # training went on
    assert scope.step_index == 3
    ev = rows(run, "select event, message from events where event = 'probe_error'")
    assert len(ev) == 3 and all("kaboom" in e["message"] for e in ev)


def test_no_grad_steps_and_manual_steps(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    run = tmp_path / "manual"
    with dynascope.watch(model, None, run=run, system_interval_s=None, memory_budget=None) as scope:
        scope.step()  # no grads anywhere
        old = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        scope.step()
    got = rows(run, "select * from tensor_stats where tensor = 'weight' order by step")
    assert [r["step"] for r in got] == [0, 1]
    assert got[0]["changed_count"] == 0 and got[0]["grad_norm"] is None
    want = naive_update(model.weight.detach(), old)
    assert got[1]["update_norm"] == pytest.approx(want[1]) and got[1]["changed_count"] == 9
    assert not math.isnan(got[1]["w_norm"])


@pytest.mark.parametrize("as_kwarg", [False, True])
def test_a_closure_step_records_its_own_gradients(tmp_path: Path, as_kwarg: bool) -> None:
    # optimizer.step(closure) computes the gradients inside the step (LBFGS, Lightning's automatic
    # optimization): before the step they are still the last step's, so they are read after it
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / f"closure{as_kwarg}"
    seen: list[float] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        seen.append(float(model.weight.grad.norm()))
        return loss

    with dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None, time_budget=None):
        for _ in range(3):
            old = model.weight.detach().clone()
            opt.step(closure=closure) if as_kwarg else opt.step(closure)
            assert not torch.equal(old, model.weight)
    got = rows(run, "select step, grad_norm, update_norm from tensor_stats where tensor = 'weight' order by step")
    assert [r["grad_norm"] for r in got] == pytest.approx(seen, rel=1e-6)
    assert all(r["update_norm"] > 0 for r in got)


def test_spectral_probe_is_wired(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = tmp_path / "spec"
    seen: list[dict] = []
    with dynascope.watch(model, opt, run=run, system_interval_s=None,
                         spectral={"k": 2, "every": 2, "time_budget": None}) as scope:
        scope.add_listener(lambda step, s: seen.append(s))
        for _ in range(4):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    got = rows(run, "select step, tensor, k, drift_norm from spectra order by step, tensor")
    assert {r["step"] for r in got} == {2} or {r["step"] for r in got} == {0, 2}
    assert {r["tensor"] for r in got} <= {"0.weight", "2.weight"} and got
    at2 = [r for r in got if r["step"] == 2]
    assert at2 and all(r["drift_norm"] > 0 for r in at2)
    assert any("spectral/rank1_energy" in s for s in seen)


def test_time_budget_thins_windows_but_not_light_stats(tmp_path: Path) -> None:
    run = tmp_path / "tb"
    truth, _ = train(run, 12, time_budget=1e-9)  # windows cost more than this budget ever earns back
    got = rows(run, "select step, count(update_norm) as windowed, count(w_norm) as light from tensor_stats "
                    "group by step order by step")
    # ‖W‖: every tensor at records 0 and 8, the window's tensors (if a window was taken) at the others
    assert [r["light"] for r in got] == [len(truth[0]) if r["step"] % W_NORM_EVERY == 0 else r["windowed"]
                                         for r in got]
    assert got[0]["windowed"] > 0 and sum(r["windowed"] > 0 for r in got) < 12


def test_event_fields_named_like_the_guards_own_arguments(tmp_path: Path) -> None:
    """An event's fields go to the row whatever they are called: `probe=` and `fn=` are a user's fields,
    not the guard's arguments (they raised TypeError into the user's script before)."""
    model = nn.Linear(3, 1)
    scope = dynascope.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), run=tmp_path / "run",
                            system_interval_s=None)
    scope.event("weight_sync_mismatch", "stale", probe="weights", fn="load")
    scope.close()
    with dynascope.open_store(tmp_path / "run") as con:
        (fields,) = con.rows("SELECT fields_json FROM events WHERE event = 'weight_sync_mismatch'")[0]
    assert '"probe": "weights"' in fields and '"fn": "load"' in fields
