"""Every help screen shows an on/off flag bare (``--quick``), never as an option taking a value."""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from dynascope.cli import app


def _paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, cmd in getattr(group, "commands", {}).items():  # a group's subcommands
        out += _paths(cmd, (*prefix, name))
    return out


def test_no_help_screen_types_a_flag():
    paths = _paths(typer.main.get_command(app))
    assert ("demo",) in paths and ("import", "wandb") in paths
    for path in paths:
        res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (path, res.output)
        assert "<bool>" not in res.output, (path, res.output)
        assert "--help" in res.output, (path, res.output)  # the flag every screen has, shown bare


def test_flags_still_parse_as_flags():
    res = CliRunner().invoke(app, ["--debug", "sql", "/nonexistent", "SELECT 1"])
    assert res.exit_code == 2 and "Traceback" in res.output
