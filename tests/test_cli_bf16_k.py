"""`dynascope diff --bf16-k`: PULSE S_k from the command line, and a one-line refusal of a bad k."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from dynascope.store import open_store

from helpers.bf16_plants import S1_PAIRS, S1_UNCHANGED
from helpers.bf16_plants import pair as _pair


def test_cli_diff_records_s_k_and_refuses_a_bad_k(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dynascope.cli import app

    _, s_new = _pair(S1_PAIRS)
    s_old, _ = _pair(S1_PAIRS)
    for name, w in (("base", s_old), ("step-1", s_new), ("step-2", s_new), ("step-3", s_old)):
        save_file({"s1": w}, tmp_path / f"{name}.safetensors")
    cks = [str(tmp_path / f"step-{i}.safetensors") for i in (1, 2, 3)]
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "base.safetensors"), *cks, "--run", str(tmp_path / "r"),
                                   "--k", "0", "--bf16-k", "2"])
    assert res.exit_code == 0, res.output
    with open_store(tmp_path / "r") as con:
        got = con.sql("SELECT step, bf16_unchanged_k_count, bf16_k_steps FROM tensor_stats ORDER BY step").pl()
    assert got.rows() == [(1, None, None), (2, None, None), (3, S1_UNCHANGED, 2)]  # old at 3 against new at 1
    bad = CliRunner().invoke(app, ["diff", str(tmp_path / "base.safetensors"), cks[0], "--run", str(tmp_path / "x"),
                                   "--bf16-k", "0"])
    assert bad.exit_code == 2 and "--bf16-k must be at least 1" in bad.output
