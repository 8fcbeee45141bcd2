"""Phase timings, the step row, events/log/samples, listeners and the system sampler."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.probes.schedule import as_schedule, every, log_spaced, never
from dynascope.probes.timing import PROBE_PHASE, grad_tensors

from helpers.waiting import wait_until


def rows(run: Path, sql: str) -> list[dict]:
    return dynascope.open_store(run).sql(sql).pl().to_dicts()


def test_phases_nest_and_auto_phases_are_timed(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / "t"
    summaries: list[tuple[int, dict]] = []
    with dynascope.watch(model, opt, run=run, system_interval_s=None, time_budget=None) as scope:
        scope.add_listener(lambda step, s: summaries.append((step, s)))
        for _ in range(3):
            with scope.phase("rollout"):
                with torch.no_grad():
                    model(torch.randn(8, 16))   # a no-grad forward: no backward follows
                with scope.phase("reward", category="annotation"):
                    time.sleep(0.002)
            with scope.phase("train"):
                loss = model(torch.randn(8, 16)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    got = rows(run, "select * from timings order by step, start_us")
    per_step = {s: [r for r in got if r["step"] == s] for s in range(3)}
    for _s, rs in per_step.items():
        by = {}
        for r in rs:
            by.setdefault(r["phase"], []).append(r)
        assert len(by["step"]) == 1 and by["step"][0]["category"] == "step"
        assert len(by["forward"]) == 2 and {r["parent"] for r in by["forward"]} == {"rollout", "train"}
        assert [r["parent"] for r in by["backward"]] == ["train"]
        assert by["optimizer"][0]["parent"] == "train"
        assert by["reward"][0]["parent"] == "rollout" and by["reward"][0]["category"] == "annotation"
        assert by["reward"][0]["dur_us"] >= 2000
        assert by["rollout"][0]["dur_us"] >= by["reward"][0]["dur_us"]
        assert all(r["rank"] == 0 and r["device"] == "cpu" and r["clock"] == "host" for r in rs)
    steps = [r for r in got if r["phase"] == "step"]
    assert all(b["start_us"] >= a["start_us"] for a, b in zip(steps, steps[1:], strict=False))
    assert [s for s, _ in summaries] == [0, 1, 2]
    last = summaries[-1][1]
    assert {"update_ratio", "phase/forward_ms", "phase/backward_ms", "phase/train_ms"} <= set(last)
    assert last["phase/rollout_ms"] >= 2.0


def test_a_generation_loop_is_one_forward_row_per_step(tmp_path: Path) -> None:
    """A rollout that calls the model once per token without gradients is one ``rollout/forward`` row a
    step, lasting the calls' summed time; forwards with gradients (two micro-batches) keep a row each."""
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / "t"
    tokens, spent_ns = 40, {}
    with dynascope.watch(model, opt, run=run, system_interval_s=None, time_budget=None) as scope:
        for step in range(3):
            with scope.phase("rollout"), torch.no_grad():
                t0 = time.perf_counter_ns()
                for _ in range(tokens):
                    model(torch.randn(1, 16))
                spent_ns[step] = time.perf_counter_ns() - t0
            with scope.phase("train"):
                for _ in range(2):
                    model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    got = rows(run, "select step, parent, dur_us from timings where phase = 'forward' order by step, start_us")
    for step in range(3):
        fwd = [r for r in got if r["step"] == step]
        assert [r["parent"] for r in fwd] == ["rollout", "train", "train"], fwd
        # the summed row: the calls' time, within the loop that made them
        assert 0 < fwd[0]["dur_us"] <= spent_ns[step] // 1000
    rollout = rows(run, "select step, dur_us from timings where phase = 'rollout' order by step")
    assert all(r["dur_us"] >= f["dur_us"] for r, f in zip(rollout, [g for g in got if g["parent"] == "rollout"],
                                                          strict=True))


def test_summed_records_resolve_to_one_row_of_their_total() -> None:
    from dynascope.probes.timing import PhaseRecord, summed

    recs = []
    for i, (parent, flag) in enumerate([("rollout", True), ("train", False), ("rollout", True), ("rollout", True)]):
        r = PhaseRecord("forward", parent, "phase", 7, "cpu")
        r.t0, r.t1, r.summed = 0, (i + 1) * 1_000_000, flag
        recs.append(r)
    out = [r.resolve() for r in summed(recs)]
    assert [(r["parent"], r["dur_us"]) for r in out] == [("rollout", 1000 + 3000 + 4000), ("train", 2000)]
    assert out[0]["start_us"] == recs[0].start_us


def test_the_probes_own_work_is_a_phase_outside_the_optimizer(tmp_path: Path) -> None:
    # The statistics the probes compute before and after optimizer.step() on the training thread are timed
    # as their own phase: top-level when the loop has no phase around them, never inside `optimizer`.
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "own"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, time_budget=None, memory_budget=None):
        for _ in range(4):
            model(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    got = rows(run, "select * from timings order by step, start_us")
    for s in range(4):
        rs = [r for r in got if r["step"] == s]
        own = [r for r in rs if r["phase"] == PROBE_PHASE]
        opt_row = next(r for r in rs if r["phase"] == "optimizer")
        step_row = next(r for r in rs if r["phase"] == "step")
        bwd = next(r for r in rs if r["phase"] == "backward")
        # one span before the optimizer step (gradient statistics, snapshots), one after it (ΔW)
        assert len(own) == 2 and all(r["parent"] is None and r["category"] == "phase" for r in own)
        before, after = own
        assert bwd["start_us"] + bwd["dur_us"] <= before["start_us"] + 1
        assert before["start_us"] + before["dur_us"] <= opt_row["start_us"] + 1
        assert opt_row["start_us"] + opt_row["dur_us"] <= after["start_us"] + 1
        assert after["start_us"] + after["dur_us"] <= step_row["start_us"] + step_row["dur_us"] + 1
        assert after["dur_us"] > 0  # ΔW of every tensor (no budget) is real work


def test_the_probe_phase_only_in_steps_with_probe_work(tmp_path: Path) -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for sched, expected in ((never, set()), (every(2), {0, 2})):
        run = tmp_path / str(bool(expected))
        with dynascope.watch(model, opt, run=run, every=sched, system_interval_s=None):
            for _ in range(4):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        got = rows(run, "select step, phase from timings")
        assert {r["step"] for r in got if r["phase"] == "optimizer"} == {0, 1, 2, 3}
        assert {r["step"] for r in got if r["phase"] == PROBE_PHASE} == expected


def test_events_log_samples_and_stage(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "e"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, stage="sft") as scope:
        scope.event("checkpoint_save", "saved", dur_us=1234, path="/x")
        scope.log(loss=0.5, reward=torch.tensor(2.0))
        scope.samples(sample_id=[0, 1], group_id=[7, 7], response_len=[10, 12], reward=[1.0, 0.0],
                      policy_version=[0, 0], trainer_version=[1, 1])
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        scope.set_stage("rl")
        scope.log(step=99, kl=0.1)
        assert scope.step_index == 1 and scope.run_dir == run.resolve()
    ev = rows(run, "select * from events where event = 'checkpoint_save'")
    assert ev[0]["dur_us"] == 1234 and ev[0]["step"] == 0 and '"/x"' in ev[0]["fields_json"]
    sc = {r["key"]: r for r in rows(run, "select * from scalars")}
    assert sc["loss"]["value"] == 0.5 and sc["reward"]["value"] == 2.0 and sc["loss"]["stage"] == "sft"
    assert sc["kl"]["step"] == 99 and sc["kl"]["stage"] == "rl"
    assert "mem/rss_bytes" in sc
    sm = rows(run, "select * from samples order by sample_id")
    assert [r["group_id"] for r in sm] == [7, 7] and sm[1]["response_len"] == 12 and sm[0]["step"] == 0
    assert {r["stage"] for r in rows(run, "select distinct stage from tensor_stats")} == {"sft"}


def test_listener_and_wandb_failures_are_contained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # wandb is not installed: the mirror cannot be made
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "l"
    with pytest.warns(RuntimeWarning):
        with dynascope.watch(model, opt, run=run, system_interval_s=None, wandb=True) as scope:
            scope.add_listener(lambda step, s: 1 / 0)
            for _ in range(2):
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
    kinds = [r["message"] for r in rows(run, "select message from events where event = 'probe_error'")]
    assert any(m.startswith("listener:wandb: ") and "pip install -e '.[wandb]'" in m for m in kinds), kinds
    assert sum("ZeroDivisionError" in m for m in kinds) == 2


def test_system_sampler_writes_process_rows(tmp_path: Path) -> None:
    run = tmp_path / "s"
    model = nn.Linear(2, 2)
    q = "select * from system where device = 'cpu'"
    with dynascope.watch(model, None, run=run, system_interval_s=0.05) as scope:
        wait_until(lambda: scope.flush() or len(rows(run, q)) >= 2, "two samples of the system sampler")
    got = rows(run, q)
    assert len(got) >= 2 and all(r["rss_bytes"] > 0 and r["cpu_pct"] >= 0 for r in got)


def test_schedules() -> None:
    assert [s for s in range(10) if every(3)(s)] == [0, 3, 6, 9]
    assert [s for s in range(10) if every(4, start=2)(s)] == [2, 6]
    ls = log_spaced(per_decade=2)
    assert [s for s in range(400) if ls(s)] == [0, 1, 3, 10, 32, 100, 316]
    assert log_spaced(1, min_every=50)(150)
    assert not any(never(s) for s in range(5))
    assert as_schedule(0) is never and as_schedule(2)(4) and not as_schedule(2)(3)
    assert as_schedule(lambda s: s == 5)(5)
    with pytest.raises(ValueError):
        every(0)
    with pytest.raises(ValueError):
        as_schedule("often")


def test_grad_tensors_walks_outputs() -> None:
    a = torch.ones(2, requires_grad=True) * 2
    assert [t is a for t in grad_tensors({"loss": None, "logits": (torch.ones(1), a)})] == [True]
    assert grad_tensors(torch.ones(2)) == []


def test_host_rss_reads_what_the_kernel_reports() -> None:
    import psutil

    from dynascope.probes.memory import MemoryProbe

    probe = MemoryProbe(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched between two reads
    before = probe.read()["mem/rss_bytes"]
    ref = psutil.Process().memory_info().rss
    assert abs(before - ref) < 8 * 2**20, (before, ref)
    del block
    grown = torch.ones(96 * 2**20 // 4)
    assert probe.read()["mem/rss_bytes"] > before + 16 * 2**20  # the read follows the process, not a cache
    del grown
    probe.close()
    assert probe.read() == {}  # closed: nothing, rather than a read of a recycled descriptor
