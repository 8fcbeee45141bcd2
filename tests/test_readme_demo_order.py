"""README's demo commands, in README order, in one fresh directory: each runs where the one before left its
run (every variant has its own default run directory). The tiny demos run for real in --quick mode; the
SmolLM2 run (2.7 GB, minutes) only as far as choosing its run directory."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `dynascope demo …` commands, and the variants README writes as their flags alone (`--ranks 4 …`, `--async`)
_COMMAND = re.compile(r"`(dynascope demo[^`\[]*|--ranks [^`\[]*|--async)`|\n(dynascope demo)\n|&& (dynascope demo)\n")


def readme_demo_commands() -> list[list[str]]:
    """The demo commands of README's set-up and demo sections, in order (tables are screenshots' captions)."""
    text = (ROOT / "README.md").read_text().split("\n## The long real-model run", 1)[0]
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("|")) + "\n"
    seen: dict[str, None] = {}
    for m in _COMMAND.finditer(prose):
        text = next(g for g in m.groups() if g).strip()
        seen.setdefault(text if text.startswith("dynascope") else f"dynascope demo {text}")
    return [shlex.split(c)[2:] for c in seen]


def test_readme_names_the_variants_in_order():
    commands = readme_demo_commands()
    assert commands[0] == [] and ["--async"] in commands and ["--model", "smollm2"] in commands, commands
    assert any("--ranks" in c for c in commands), commands


@pytest.mark.slow
def test_readme_demos_run_one_after_another(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import dynascope.demo.smollm2_train as tr
    from dynascope.cli import app

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    monkeypatch.chdir(tmp_path)
    seen: list[str] = []
    monkeypatch.setattr(tr, "run_smollm2", lambda run_dir, **kw: seen.append(run_dir))
    for args in readme_demo_commands():
        if args[:2] == ["--model", "smollm2"]:
            out = CliRunner().invoke(app, ["demo", *args])
            assert out.exit_code == 0 and len(seen) == 1 and not Path(seen[0]).exists(), out.output
            continue
        if "--async" in args and importlib.util.find_spec("ray") is None:
            continue
        done = subprocess.run([sys.executable, "-m", "dynascope.cli", "demo", *args, "--quick"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=900)
        if "Ray could not start a local node" in done.stderr:
            continue  # the machine's Ray start-up, not the demo (as in test_demo)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert "demo" in runs and "demo-4ranks" in runs, runs
