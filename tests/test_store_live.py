"""The live-segment rule for other engines: ``live_files`` names exactly what DuckDB's views read, over a
listing of the disk or one an object store returns; leases pin a snapshot's files against compaction;
commit records make a flush count whole, and go once their segments are merged away."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from dynascope.cli import app
from dynascope.store import TABLES, RunWriter, live_files, live_files_in, open_store, snapshot
from dynascope.store.compact import compact_store
from dynascope.store.layout import COMMITS
from dynascope.store.live import list_run
from dynascope.store.rollup_across import BY_TENSOR
from dynascope.store.snapshot import LEASES, held_leases, open_snapshot, take_lease

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names
from helpers.fleet_runs import write_synthetic_run

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written

V1 = Path(__file__).parent / "fixtures" / "v1run"


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_synthetic_run(root / "multi", ranks=2, steps=8, flush_every=1)
    shutil.copytree(V1, root / "v1run")
    return root


def _count(files: list[str]) -> int:
    if not files:
        return 0
    return duckdb.sql(f"SELECT count(*) FROM read_parquet({files!r}, union_by_name = true)").fetchall()[0][0]


# The tables writers write: compaction adds its rollup across ranks (BY_TENSOR) once a run is finished.
WRITTEN = tuple(t for t in TABLES if t != BY_TENSOR)


def _view_counts(root: Path, at_us: int | None = None, tables: tuple[str, ...] = WRITTEN) -> dict[str, int]:
    with open_store(root, at_us=at_us) as con:
        return {t: con.rows(f'SELECT count(*) FROM "{t}"')[0][0] for t in tables}


def _wait_in_effect(stats_root: Path) -> None:
    end = time.monotonic() + 30
    while any(int(p.name.split(".v")[1].split(".")[0]) > time.time_ns() // 1000 for p in stats_root.rglob("*.v*.parquet")):
        assert time.monotonic() < end
        time.sleep(0.02)


def test_live_files_are_what_the_views_read_after_a_compaction_left_sources_behind(fleet):
    compact_store(fleet, grace_s=3600, settle_s=0.05)
    _wait_in_effect(fleet)
    at = time.time_ns() // 1000
    views = _view_counts(fleet, at, tuple(TABLES))
    for table in TABLES:
        files = live_files(fleet, table, at)
        assert _count(files) == views[table], table
        on_disk = [str(p) for p in fleet.glob(f"*/{table}/*/*.parquet")]
        assert set(files) <= set(on_disk)
    everything = [str(p) for p in fleet.glob("multi/scalars/*/*.parquet")]  # what a plain glob reads:
    assert _count(everything) == 2 * _view_counts(fleet / "multi")["scalars"] > 0  # merged and sources


def test_the_pure_rule_takes_an_object_store_listing(fleet):
    compact_store(fleet, grace_s=3600, settle_s=0.05)
    _wait_in_effect(fleet)
    at = time.time_ns() // 1000
    local = str(fleet)
    listing = [e for run in sorted(fleet.iterdir()) for e in list_run(run)]
    as_s3 = [(e.path.replace(local, "s3a://bucket/runs"), e.size, e.mtime_us) for e in listing]
    for table in ("scalars", "tensor_stats", "timings"):
        got = live_files_in(as_s3, table, at)
        assert [g[0].replace("s3a://bucket/runs", local) for g in got] == live_files(fleet, table, at)
        assert all(isinstance(g, tuple) and g[1] > 0 for g in got)  # the caller's entries, sizes kept
        plain = live_files_in([p for p, _, _ in as_s3], table, at)
        assert plain == [g[0] for g in got]


def test_dynascope_files_prints_one_path_per_line(fleet):
    out = CliRunner().invoke(app, ["files", str(fleet), "timings"])
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == live_files(fleet, "timings")
    bad = CliRunner().invoke(app, ["files", str(fleet), "nope"])
    assert bad.exit_code == 2 and "unknown table 'nope'" in bad.output


def test_a_flush_counts_whole_once_its_commit_record_lands(tmp_path):
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600)
    w.append("scalars", {"step": 1, "key": "a", "value": 1.0})
    w.flush()
    commits = sorted((run / COMMITS).glob("writer=*/*.json"))
    assert [p.name for p in commits][-1] == "begin.json" and len(commits) == 2
    record = next(p for p in commits if p.name != "begin.json")
    body = json.loads(record.read_text())
    assert [Path(f).parts[0] for f in body["files"]] == ["runs", "scalars"]  # the run's row and the scalar
    assert _view_counts(run)["scalars"] == 1
    hidden = record.with_name(".hidden")
    record.rename(hidden)  # as if the writer had died before writing it
    assert _view_counts(run)["scalars"] == 0 and live_files(run, "scalars") == [
        f for f in live_files(run, "scalars") if "_schema" in f]
    hidden.rename(record)
    w.close()
    assert _view_counts(run)["scalars"] == 1


def test_commit_records_go_once_their_segments_are_merged_away(tmp_path):
    run = tmp_path / "r"
    write_synthetic_run(run, ranks=1, steps=6, flush_every=1)
    before = _view_counts(run)
    commits = sorted(p.name for p in (run / COMMITS).glob("writer=*/*.json"))
    assert len(commits) == 1 + 6 + 1  # begin, a flush per step, the close
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True)
    left = sorted(p.name for p in (run / COMMITS).glob("writer=*/*.json"))
    raw = sorted(int(p.name[:12]) for p in run.glob("*/writer=r0-*/*.parquet") if ".v" not in p.name)
    # what stays: the begin record and the records of flushes with a segment nothing merged (a table written
    # once: the run's row, the run_end event); every other record went with its segments
    assert stats.removed_commits == len(commits) - len(left) > 0 and "begin.json" in left
    for name in left:
        if name != "begin.json":
            lo, hi = int(name[:12]), int(name[13:25])
            assert any(lo <= s <= hi for s in raw), name
    assert _view_counts(run) == before


def test_a_lease_keeps_a_snapshot_on_disk_until_it_is_released(fleet):
    with snapshot(fleet) as snap:
        files = {t: snap.files(t) for t in TABLES}
        want = _view_counts(fleet, snap.at_us)
        compact_store(fleet, grace_s=0.0, settle_s=0.05, wait=True)  # grace over: sources would go
        assert all(Path(f).exists() for fs in files.values() for f in fs)
        assert {t: _count(fs) for t, fs in files.items() if t != BY_TENSOR} == want
        assert _view_counts(fleet) == want  # and the store reads the same as before
    compact_store(fleet, grace_s=0.0, settle_s=0.05, wait=True)
    gone = [f for fs in files.values() for f in fs if not Path(f).exists()]
    assert gone  # released: the merged-away sources went
    assert _view_counts(fleet) == want


def test_expired_and_unreadable_leases_pin_nothing(fleet):
    run = fleet / "multi"
    before = [str(p) for p in run.glob("scalars/writer=r0-*/*.parquet")]
    take_lease(run, time.time_ns() // 1000, ttl_s=-1.0)  # already expired
    (run / LEASES / "broken.json").write_text("{not json")
    held, problems, _ = held_leases(run)
    assert held == [] and len(problems) == 1 and "broken.json: unreadable lease" in problems[0]
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True)
    assert any("unreadable lease" in line for line in stats.skipped)
    assert not all(Path(p).exists() for p in before)


def test_the_views_at_a_past_moment_do_not_move_while_a_writer_commits(tmp_path):
    run = tmp_path / "r"
    w = RunWriter(run, flush_secs=3600)
    w.append("scalars", {"step": list(range(10)), "key": "a", "value": 1.0})
    w.flush()
    snap = open_snapshot(run)
    try:
        for step in range(10, 13):
            w.append("scalars", {"step": step, "key": "a", "value": 1.0})
            w.flush()
            assert _view_counts(run, snap.at_us)["scalars"] == 10
            assert _count(snap.files("scalars")) == 10
        assert _view_counts(run)["scalars"] == 13
    finally:
        snap.release()
        w.close()


def test_the_python_rule_reads_what_the_sql_rule_reads_on_random_listings() -> None:
    """``live_paths`` and ``live_sets`` (compaction's, the own fold's and the views' lists) against
    ``live_sql`` (``live_files``') and the journals no live segment spans, on random listings: writers with and without commit records, commits in effect or not, merges of
    overlapping ranges in effect or not, ties broken by name, moments between them all."""
    import random

    from dynascope.store.live import live_paths, live_sets

    rng = random.Random(7)
    checked = jchecked = 0
    for _ in range(60):
        listing, base = [], 1_700_000_000_000_000
        for run in ("/s/a", "/s/b"):
            for w in ("writer=r0-x", "writer=r1-y", "writer=_merged"):
                keeps = w != "writer=_merged" and rng.random() < 0.8
                if keeps:
                    listing.append(f"{run}/{COMMITS}/{w}/begin.json")
                n = rng.randint(0, 12)
                for lo in range(n):
                    listing.append(f"{run}/scalars/{w}/{lo:012d}-{lo:012d}.parquet")
                    if keeps and rng.random() < 0.7:
                        t = base + rng.randint(0, 10) * 1000
                        listing.append(f"{run}/{COMMITS}/{w}/{lo:012d}-{lo:012d}.v{t}.json")
                for _ in range(rng.randint(0, 4)):  # merges, some of the same range (the name decides)
                    lo = rng.randint(-1, max(n - 1, 0))
                    hi = rng.randint(lo, n + 1)
                    listing.append(f"{run}/scalars/{w}/{lo:012d}-{hi:012d}.v{base + rng.randint(0, 10) * 1000}.parquet")
                for _ in range(rng.randint(0, 3)):  # journals, some sealed into a segment or merged since
                    listing.append(f"{run}/scalars/{w}/{rng.randint(0, n + 2):012d}.jsonl")
        for at in (base - 1, base + 3_000, base + 5_500, base + 20_000):
            sql = {e for e in live_files_in(listing, None, at)}
            # a journal counts while no live segment of its directory spans its number (a covered segment's
            # cover spans all it spans)
            spans = [(f.rsplit("/", 1)[0], int(f.rsplit("/", 1)[1][:12]), int(f.rsplit("/", 1)[1][13:25])) for f in sql]
            jsql = {j for j in listing if j.endswith(".jsonl") and not any(
                d == j.rsplit("/", 1)[0] and lo <= int(j.rsplit("/", 1)[1][:12]) <= hi for d, lo, hi in spans)}
            assert live_paths(listing, at) == sql, at
            assert live_sets(listing, at) == (sql, jsql), at
            checked += len(sql)
            jchecked += len(jsql)
    assert checked > 500 and jchecked > 100
