"""A run resumed from a checkpoint: the replayed steps count from the resumed process, θ₀ stays the run's.

A plain torch loop records four steps, checkpointing after two; a second process (a fresh model, optimizer
and probe, as a restarted job has) loads the checkpoint into the same run directory and records steps 2–4
on other batches, so the replayed steps' values differ from the first process's. ``tensor_stats_global``
must give, for every step, the statistics of the process whose weights went on, computed here from the
full tensors, with drift measured from the first process's θ₀.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import dynascope
from dynascope.store.catalog import list_runs

from helpers.naive_stats import naive_grad, naive_update


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, seed: int, theta0: dict,
           truth: dict, scope) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        truth[step] = {n: (naive_update(p.detach(), old[n]), naive_grad(grads[n]), naive_update(p.detach(), theta0[n]))
                       for n, p in model.named_parameters()}
    del scope


def test_resume_replays_steps_from_the_newer_process_and_keeps_theta0(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    kw = {"run": run, "reference": "init", "memory_budget": 1.0, "system_interval_s": None}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    first: dict = {}
    scope = dynascope.watch(model, opt, **kw)
    _train(model, opt, range(2), 1, theta0, first, scope)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
    _train(model, opt, range(2, 4), 2, theta0, first, scope)
    scope.close()  # the job dies after step 3; its rows of steps 2 and 3 stay in the run

    model = _model()  # the restarted job: new objects, the checkpoint's weights and optimizer state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    resumed: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope = dynascope.watch(model, opt, **kw)
    scope.resume(2)
    _train(model, opt, range(2, 5), 3, theta0, resumed, scope)  # other batches: replayed steps differ
    scope.close()
    assert sum("restart" in str(w.message) for w in caught) == 1

    want = {**{s: first[s] for s in (0, 1)}, **resumed}
    with dynascope.open_store(run) as con:
        got = con.frame("SELECT * FROM tensor_stats_global ORDER BY step, tensor").to_dicts()
        refs = con.frame("SELECT message, severity FROM events WHERE event = 'reference_set' ORDER BY time_us").to_dicts()
        restarts = con.frame("SELECT fields_json FROM events WHERE event = 'restart'").to_dicts()
        raw = con.rows("SELECT count(*) FROM tensor_stats WHERE step IN (2, 3)")
        resumes = con.rows("SELECT step FROM events WHERE event = 'resume'")
    assert raw == [(2 * 2 * 4,)]  # both processes' rows of the replayed steps are kept, as written
    assert sorted({r["step"] for r in got}) == [0, 1, 2, 3, 4] and len(got) == 5 * 4
    seen = {"w_norm": 0, "update_norm": 0, "drift_norm": 0}
    for r in got:
        upd, grad, drift = want[r["step"]][r["tensor"]]
        assert r["grad_norm"] == pytest.approx(grad[0], rel=1e-6), (r["step"], r["tensor"])  # every record
        # The others where the record computed them (the rotating window, ‖W‖'s cadence); drift against
        # the first process's θ₀, not the resumed weights.
        for col, value in (("w_norm", upd[0]), ("update_norm", upd[1]), ("drift_norm", drift[1])):
            if r[col] is not None:
                assert r[col] == pytest.approx(value, rel=1e-6), (col, r["step"], r["tensor"])
                seen[col] += r["step"] >= 2
        if r["update_norm"] is not None:
            assert r["changed_count"] == upd[2]
    assert all(seen.values()), seen  # each checked on replayed or resumed steps
    assert [r["message"] for r in refs] == ["θ₀ = init", "θ₀ = init (kept)"]
    assert len(restarts) == 1 and json.loads(restarts[0]["fields_json"])["processes"] == 1
    assert resumes == [(2,)]  # the step resumed from
    assert list_runs(run).row(0, named=True)["restarts"] == 1  # `dynascope runs` shows it
