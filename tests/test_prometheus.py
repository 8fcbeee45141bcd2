"""``/metrics`` against the store it reads, and against the real servers: Debian's Prometheus scrapes a
run and answers PromQL with the store's values; the shipped rules pass ``promtool test rules``, and one
fires through Alertmanager to a local webhook receiver."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dynascope.alerts.metrics import serve_metrics
from dynascope.store import RunWriter, open_store

from helpers.planted_timings import plant
from helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "dynascope-rules.yml"


def _run(tmp_path: Path) -> Path:
    run = plant(tmp_path / "run", ranks=4, slow={2: 3.0})
    w = RunWriter(run, rank=0, world_size=4, flush_secs=60)
    w.append("scalars", {"step": [8, 9], "key": "train/loss", "value": [0.5, 0.25], "time_us": 1})
    w.event("alert", "x", step=3, severity="error", rule="straggler rank", value=0.3, threshold=0.75)
    w.close()
    return run


def _scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_are_the_stores_newest_figures(tmp_path: Path) -> None:
    run = _run(tmp_path)
    server, _, collector = serve_metrics(run, 0, min_interval_s=60)
    try:
        assert server.server_address[0] == "127.0.0.1"
        got = _scrape(server.server_port)
        again = _scrape(server.server_port)
        assert collector.reads == 1 and again.keys() == got.keys()  # the second scrape is the cached answer
    finally:
        server.shutdown()
        server.server_close()
    with open_store(run) as store:
        want = dict(store.rows("SELECT rank, arg_max(dur_us, step) FROM timings WHERE category = 'step' GROUP BY 1"))
        train = dict(store.rows("SELECT rank, arg_max(dur_us, step) FROM timings WHERE phase = 'train' GROUP BY 1"))
    steps = {int(s.labels["rank"]): s.value for s in got["dynascope_step_seconds"]}
    assert steps == {r: pytest.approx(us / 1e6) for r, us in want.items()}
    assert {int(s.labels["rank"]): s.value for s in got["dynascope_step"]} == {r: 9 for r in range(4)}
    phases = {int(s.labels["rank"]): s.value for s in got["dynascope_phase_seconds"] if s.labels["phase"] == "train"}
    assert phases == {r: pytest.approx(us / 1e6) for r, us in train.items()}
    score = {int(s.labels["rank"]): s.value for s in got["dynascope_straggler_score"]}
    assert score[2] == pytest.approx(1 / 3) and score[0] == score[1] == score[3] == 1.0
    (loss,) = [s for s in got["dynascope_scalar"] if s.labels["key"] == "train/loss"]
    assert loss.value == 0.25 and loss.labels["rank"] == "0"
    (fired,) = [s for s in got["dynascope_alerts"] if s.name == "dynascope_alerts_total"]
    assert fired.value == 1 and fired.labels == {"run": fired.labels["run"], "rule": "straggler rank",
                                                 "severity": "error"}


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (.ci/run installs Debian's prometheus and prometheus-alertmanager)")
    return path


def test_shipped_rules_pass_promtool(tmp_path: Path) -> None:
    done = subprocess.run([_need("promtool"), "test", "rules", str(REPO / "tests" / "prometheus" / "rules_test.yml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hook(BaseHTTPRequestHandler):
    alerts: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.alerts.extend(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["alerts"])
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_prometheus_scrapes_and_alertmanager_delivers(tmp_path: Path) -> None:
    prometheus, alertmanager = _need("prometheus"), _need("prometheus-alertmanager")
    run = _run(tmp_path)
    metrics, _, _ = serve_metrics(run, 0, min_interval_s=0.5)
    hook = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    am_port, prom_port = _free_port(), _free_port()
    # The shipped rules, with `for` dropped so the test need not wait five minutes of evaluations.
    rules = yaml.safe_load(RULES.read_text())
    for rule in rules["groups"][0]["rules"]:
        rule.pop("for", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "am.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "hook", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": f"http://127.0.0.1:{hook.server_port}/"}]}]}))
    (tmp_path / "prom.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "dynascope",
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics.server_port}"]}]}]}))
    procs = [
        subprocess.Popen([alertmanager, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
                          f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{prom_port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        def query(q: str) -> list[dict]:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
            try:
                return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]["result"]
            except OSError:
                return []

        result = wait_until(lambda: query("dynascope_straggler_score"), "Prometheus to scrape the run", 120, 0.5)
        score = {r["metric"]["rank"]: float(r["value"][1]) for r in result}
        assert score["2"] == pytest.approx(1 / 3) and score["0"] == 1.0
        (loss,) = query('dynascope_scalar{key="train/loss"}')
        assert float(loss["value"][1]) == 0.25
        got = wait_until(lambda: [a for a in _Hook.alerts if a["labels"]["alertname"] == "DynascopeStraggler"],
                         "the straggler alert at the webhook receiver", 180, 0.5)
        assert {a["labels"]["rank"] for a in got} == {"2"} and got[0]["status"] == "firing"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        metrics.shutdown()
        hook.shutdown()


def test_grafana_dashboard_queries_metrics_the_endpoint_serves(tmp_path: Path) -> None:
    """Every metric the shipped Grafana dashboard and Prometheus rules query is one /metrics serves."""
    import re

    run = _run(tmp_path)
    server, _, _ = serve_metrics(run, 0)
    try:
        families = _scrape(server.server_port)
        served = set(families) | {s.name for samples in families.values() for s in samples}
    finally:
        server.shutdown()
        server.server_close()
    dash = json.loads((REPO / "deploy" / "grafana" / "dynascope.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [r["expr"] for r in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]]
    used = {m for e in exprs for m in re.findall(r"\bdynascope_[a-z_]+", e)}
    assert len(exprs) >= 10 and used and used <= served, used - served
