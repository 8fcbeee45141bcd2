"""`dynascope sql -o FILE` writes the format the file's extension names, and refuses a name it cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from dynascope.cli import app

V1 = Path(__file__).parent / "fixtures" / "v1run"
QUERY = "SELECT step, count(*) AS n FROM tensor_stats GROUP BY step ORDER BY step"


@pytest.fixture(scope="module")
def expected() -> pl.DataFrame:
    from dynascope.store import open_store, run_sql

    with open_store(V1) as store:
        frame = pl.from_arrow(run_sql(store, QUERY))
    assert isinstance(frame, pl.DataFrame) and frame.height > 1
    return frame


def _sql(*args: str):
    return CliRunner().invoke(app, ["sql", str(V1), QUERY, *args])


def _read(path: Path) -> pl.DataFrame:
    if path.suffix == ".parquet":
        return pl.read_parquet(path)
    if path.suffix == ".csv":
        return pl.read_csv(path)
    if path.suffix == ".tsv":
        return pl.read_csv(path, separator="\t")
    return pl.DataFrame([json.loads(line) for line in path.read_text().splitlines()])


@pytest.mark.parametrize("ext", [".parquet", ".csv", ".json", ".tsv"])
def test_the_extension_names_the_format(tmp_path, expected, ext):
    out = tmp_path / f"result{ext}"
    res = _sql("-o", str(out))
    assert res.exit_code == 0, res.output
    got = _read(out)
    assert got.columns == expected.columns
    assert got.rows() == expected.rows()


def test_txt_gets_the_table_and_an_unknown_name_is_refused(tmp_path):
    assert _sql("-o", str(tmp_path / "r.txt")).exit_code == 0
    assert "step" in (tmp_path / "r.txt").read_text()
    for name, args, needle in [("r.dat", (), "cannot tell a format"),
                               ("r.parquet", ("-f", "csv"), "does not match")]:
        res = _sql("-o", str(tmp_path / name), *args)
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
        assert not (tmp_path / name).exists()


def test_format_still_wins_for_an_unknown_extension(tmp_path):
    out = tmp_path / "r.out"
    assert _sql("-f", "csv", "-o", str(out)).exit_code == 0
    assert out.read_text().splitlines()[0] == '"step","n"'
