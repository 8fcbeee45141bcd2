"""Alert rules over real stores: planted spikes and slow ranks fire once each at their step, with their
events row; the stop action ends a plain loop; webhooks reach a real HTTP receiver and a hung one costs
nothing; ``dynascope watch-run`` follows a run from another process."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import CLI

import dynascope
from dynascope.alerts import DEFAULT_RULES, Monitor, Rule, load_rules
from dynascope.alerts.actions import read_stop
from dynascope.alerts.quantities import series
from dynascope.store import RunWriter, open_store

from helpers.planted_timings import plant
from helpers.waiting import wait_until

SPIKE = 30


def _scalars(run: Path, values: dict[int, float], key: str = "train/loss", rank: int = 0) -> None:
    w = RunWriter(run, rank=rank, world_size=2, flush_secs=60)
    w.append("scalars", {"step": list(values), "key": key, "value": list(values.values()), "time_us": 1})
    w.close()


def _alerts(run: Path) -> list[dict]:
    with open_store(run) as store:
        rows = store.rows("SELECT step, severity, fields_json FROM events WHERE event = 'alert' ORDER BY step")
    return [{"step": s, "severity": sev, **json.loads(f)} for s, sev, f in rows]


def test_rules_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown action 'page'"):
        Rule("loss", "> 1", action="page")
    with pytest.raises(ValueError, match="condition"):
        Rule("loss", "above 1")
    with pytest.raises(ValueError, match="needs url"):
        Rule("loss", "> 1", action="webhook")
    f = tmp_path / "rules.yaml"
    f.write_text("defaults: true\nrules:\n  - {quantity: loss, condition: '> 5', window: 2, action: [warn, stop]}\n")
    rules = load_rules(f)
    assert rules[: len(DEFAULT_RULES)] == list(DEFAULT_RULES) and rules[-1].actions == ("event", "warn", "stop")
    f.write_text("- {quantity: loss, when: '> 5'}\n")
    with pytest.raises(ValueError, match="unknown key 'when'"):
        load_rules(f)


def test_spike_fires_once_at_its_step_with_window_and_hold_down(tmp_path: Path) -> None:
    run = tmp_path / "run"
    values = {s: 1.0 for s in range(60)}
    values.update({SPIKE: 500.0, SPIKE + 1: 400.0, SPIKE + 2: 300.0, 45: 900.0})  # a 3-step spike, then one step
    _scalars(run, values)
    fired = Monitor(run, [Rule("loss", "> 100", window=2, hold_down=20)]).poll(final=True)
    # window 2: the 3-step spike fires at its second step, once (hold-down); the lone step 45 never holds twice.
    assert [(f.step, f.value) for f in fired] == [(SPIKE + 1, 400.0)]
    once = Monitor(run, [Rule("loss", "> 100", hold_down=20)]).poll(final=True)
    assert [f.step for f in once] == [SPIKE]  # SPIKE+1, +2 held down; 45 is within 20 steps of 30
    every = Monitor(run, [Rule("loss", "> 100", hold_down=0)]).poll(final=True)
    assert [f.step for f in every] == [SPIKE, SPIKE + 1, SPIKE + 2, 45]


def test_live_polls_judge_each_step_once(tmp_path: Path) -> None:
    """Rows arriving over several flushes: every step is judged once, the newest only once a later one exists."""
    run = tmp_path / "run"
    w = RunWriter(run, flush_secs=60)
    mon = Monitor(run, [Rule("loss", "> 100", hold_down=0)])
    firings = []
    for start in range(0, 40, 10):
        w.append("scalars", {"step": list(range(start, start + 10)), "key": "loss", "time_us": 1,
                             "value": [500.0 if s in (9, 10, 25) else 1.0 for s in range(start, start + 10)]})
        w.flush()
        firings += [f.step for f in mon.poll()]
    assert firings == [9, 10, 25]  # step 9 was the newest of the first flush: judged at the second poll
    w.close()


def test_planted_slow_rank_fires_the_straggler_rule_for_it_only(tmp_path: Path) -> None:
    run = plant(tmp_path / "run", ranks=4, slow={2: 3.0, 1: 0.5})  # rank 2 slow, rank 1 faster than the rest
    fired = Monitor(run, [r for r in DEFAULT_RULES if r.quantity == "straggler_score"]).poll(final=True)
    assert {f.rank for f in fired} == {2}
    assert fired[0].step == 4 and fired[0].value == pytest.approx(1 / 3)  # window 5: steps 0-4 held


def test_events_rows_and_stop_request_across_ranks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _scalars(run, {s: (1e3 if s == SPIKE else 1.0) for s in range(50)})
    w = RunWriter(run, rank=0, role="monitor", flush_secs=60)
    asked: list[int | None] = []
    mon = Monitor(run, [Rule("loss", "> 100", action="stop", severity="critical")], event=w.event,
                  on_stop=asked.append, world_size=2, stop_margin=10)
    mon.poll(final=True)
    w.close()
    (alert,) = _alerts(run)
    assert alert["step"] == SPIKE and alert["severity"] == "critical"
    assert alert["rule"] == "loss > 100" and alert["value"] == 1e3 and alert["threshold"] == 100
    assert asked == [59] and read_stop(run)["stop_at_step"] == 59  # newest step 49 + the margin
    other: list[int | None] = []
    Monitor(run, [], on_stop=other.append).poll()  # another rank: no rules, follows the request
    assert other == [59]


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    hang = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["rule"] == "hang":
            self.hang.wait(30)
        self.bodies.append(body)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_webhook_reaches_a_receiver_and_a_hung_one_never_holds_the_monitor(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hook"
    run = tmp_path / "run"
    _scalars(run, {s: (1e3 if s == SPIKE else 1.0) for s in range(50)})
    try:
        mon = Monitor(run, [Rule("loss", "> 100", action="webhook", url=url),
                            Rule("loss", "> 100", name="hang", action="webhook", url=url)])
        mon.webhooks.timeout_s = 60.0
        assert len(mon.poll(final=True)) == 2
        got = wait_until(lambda: _Receiver.bodies, "the webhook's POST")
        assert got[0]["rule"] == "loss > 100" and got[0]["step"] == SPIKE and got[0]["value"] == 1e3
        done = threading.Event()
        threading.Thread(target=lambda: (mon.close(timeout_s=1.0), done.set()), daemon=True).start()
        assert done.wait(20), "close() waited on a hung webhook"
    finally:
        _Receiver.hang.set()
        server.shutdown()


def test_stop_action_ends_a_plain_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / "run"
    writer = RunWriter(run, flush_secs=0.05)
    scope = dynascope.watch(model, opt, run, writer=writer, alert_interval_s=0.05,
                            alerts=[Rule("loss", "> 100", action="stop")])
    step, stop_seen_at = 0, None
    for step in range(100_000):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(step=step, loss=1e4 if step == SPIKE else float(loss))
        if scope.should_stop:
            stop_seen_at = step
            break
        if step > SPIKE:
            wait_until(lambda: scope._stop is not None, "the stop request", timeout_s=60)
    scope.close()
    writer.close()
    assert stop_seen_at is not None and stop_seen_at > SPIKE
    (alert,) = _alerts(run)
    assert alert["step"] == SPIKE
    # the monitor's own account at close: its passes (the live ones and the last) and the slowest, which
    # bounds the lag an alert saw
    with open_store(run) as store:
        (summary,), = store.rows("SELECT fields_json FROM events WHERE event = 'monitor_closed'")
    summary = json.loads(summary)
    assert summary["fired"] == 1 and summary["errors"] == 0 and summary["passes"] >= 2, summary
    assert summary["slowest_pass_ms"] >= summary["mean_pass_ms"] > 0, summary


def test_watch_run_follows_from_another_process(tmp_path: Path) -> None:
    run = plant(tmp_path / "run", ranks=4, slow={2: 3.0})
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {quantity: straggler_score, condition: '< 0.75', window: 5, severity: error}\n")
    done = subprocess.run([*CLI, "watch-run", str(run), "--rules", str(rules), "--once"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "[error] step 4: straggler_score < 0.75: straggler_score = 0.3333 at step 4 (trainer rank 2, train)" in done.stdout
    assert re.search(r"^1 alerts from 1 rules over 1 passes \(slowest \d+\.\d\d s\)$", done.stdout, re.M), done.stdout
    assert [(a["step"], a["rank"]) for a in _alerts(run)] == [(4, 2)]
    rules.write_text("- {quantity: loss, condition: 'big'}\n")
    bad = subprocess.run([*CLI, "watch-run", str(run), "--rules", str(rules), "--once"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "condition" in bad.stderr


def test_a_planted_gradient_spike_fires_the_default_rule_live(tmp_path: Path) -> None:
    """A real training loop, the default rules on: ×1e4 on one step's loss is one gradient-norm alert at
    that step, found by the detector over the probe's own per-tensor gradient norms while the loop runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    run = tmp_path / "run"
    writer = RunWriter(run, flush_secs=0.1)
    scope = dynascope.watch(model, opt, run, writer=writer, alerts=True, alert_interval_s=0.1, system_interval_s=None)
    monitor = scope._services[-1]
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for step in range(200):
        loss = torch.nn.functional.mse_loss(model(x), y) * (1e4 if step == SPIKE * 3 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    wait_until(lambda: any(f.rule.quantity == "grad_norm_spike" for f in monitor.fired),
               "the gradient-norm alert while the run is live", timeout_s=120)
    scope.close()
    writer.close()
    spikes = [a for a in _alerts(run) if a["quantity"] == "grad_norm_spike"]
    assert [a["step"] for a in spikes] == [SPIKE * 3]  # that step only: the hold-down keeps it one alert
    with open_store(run) as store:  # the value it reports is the step's global gradient norm, a spike
        (median,) = store.rows("SELECT median(g) FROM (SELECT step, sqrt(sum(grad_norm * grad_norm)) AS g "
                               "FROM tensor_stats GROUP BY step)")[0]
    assert spikes[0]["value"] > 1000 * median


def test_a_phase_that_runs_every_few_steps_is_judged_live(tmp_path: Path) -> None:
    """The straggler rule keeps one series per rank and phase: a phase seen every fifth step is judged as its
    rank moves on, poll by poll, not held back until the phase runs again (or lost between two reads)."""
    run = tmp_path / "run"
    writers = [RunWriter(run, rank=r, world_size=3, flush_secs=60) for r in range(3)]
    mon = Monitor(run, [Rule("straggler_score", "< 0.75", hold_down=0)])
    polls: list[list[tuple[int | None, int, str | None]]] = []
    for start in range(0, 40, 8):
        for w in writers:
            for step in range(start, start + 8):
                phases = {"train": 50_000} | ({"eval": 30_000 * (3 if w.rank == 2 else 1)} if step % 5 == 0 else {})
                w.append("timings", {"step": step, "phase": list(phases), "category": "phase", "parent": None,
                                     "start_us": 1_000_000 * step, "dur_us": list(phases.values())})
            w.flush()
        polls.append([(f.rank, f.step, f.part) for f in mon.poll()])
    # each poll judges the steps before the ranks' newest (a step is complete once a later one is written):
    # the first poll the evals at 0 and 5 of steps 0-7, the second the eval at 10 (15 is then the newest)...
    assert polls == [[(2, s, "eval") for s in range(max(start - 1, 0), start + 7) if s % 5 == 0]
                     for start in range(0, 40, 8)]
    assert mon.poll(final=True) == []
    for w in writers:
        w.close()


def test_a_pass_still_running_at_close_counts_in_the_monitors_account(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _scalars(run, {s: 1.0 for s in range(10)})
    release = threading.Event()

    def slow_series(*args: object, **kwargs: object) -> object:
        release.wait(30)  # a pass held up (a stalled file system, a host whose cores training fills)
        return series(*args, **kwargs)

    monkeypatch.setattr("dynascope.alerts.monitor.series", slow_series)
    w = RunWriter(run, rank=0, role="monitor", flush_secs=60)
    mon = Monitor(run, [Rule("loss", "> 100")], event=w.event, interval_s=0.01).start()
    try:
        wait_until(lambda: mon._began is not None, "a pass to begin")
        mon.close(timeout_s=0.5)  # the pass outlives close's deadline: close returns, and says so
    finally:
        release.set()
    w.close()
    with open_store(run) as store:
        (summary,), = store.rows("SELECT fields_json FROM events WHERE event = 'monitor_closed'")
    summary = json.loads(summary)
    assert summary["passes"] == 1 and summary["slowest_pass_ms"] >= 500 and summary["mean_pass_ms"] is None, summary
