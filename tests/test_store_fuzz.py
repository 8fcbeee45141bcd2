"""Fuzz the reader with damaged markers and segments: it answers or refuses with a StoreError, nothing else."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynascope.store import RunWriter, StoreError, open_store, run_sql
from dynascope.store.catalog import list_runs
from dynascope.store.compact import compact_store

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written

FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz") / "r"
    with RunWriter(run, fold=False) as w:  # its own segments as written: the fuzz corrupts a writer's segment
        w.append("scalars", {"step": list(range(50)), "key": "k", "value": 0.5})
        w.append("tensor_stats", {"step": 1, "tensor": ["a", "b"], "w_norm": [1.0, 2.0]})
    return run


def fresh(pristine, tmp_path_factory):
    run = tmp_path_factory.mktemp("case") / "r"
    shutil.copytree(pristine, run, symlinks=True)
    return run


def read_everything(run) -> None:
    """What a user does: open, query each table, list runs, compact. Only StoreError may escape."""
    try:
        store = open_store(run)
    except StoreError:
        return
    try:
        for table in ("runs", "scalars", "tensor_stats", "events"):
            try:
                run_sql(store, f"SELECT * FROM {table}", max_rows=100)
            except StoreError as exc:
                assert "\n" not in str(exc)
    finally:
        store.close()


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_marker(pristine, tmp_path_factory, data):
    run = fresh(pristine, tmp_path_factory)
    (run / "dynascope.json").write_bytes(data)
    read_everything(run)
    df = list_runs(run.parent)
    assert df.height == 1


@FUZZ
@given(data=st.binary(max_size=2000), table=st.sampled_from(["scalars", "tensor_stats", "events"]))
def test_random_segment_bytes(pristine, tmp_path_factory, data, table):
    run = fresh(pristine, tmp_path_factory)
    seg = next((run / table).glob("writer=r*/*.parquet"))
    seg.write_bytes(data)
    with pytest.raises(StoreError, match="corrupt segment"):  # at open, or at the first query of its table
        open_store(run).rows(f"SELECT count(*) FROM {table}")
    read_everything(run)
    assert list_runs(run.parent)["problem"].to_list()[0] is not None
    stats = compact_store(run, grace_s=0.0, settle_s=0.05)
    assert stats.new_segments == 0


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
                      min_size=1, max_size=8))
def test_bit_rot_inside_a_valid_segment(pristine, tmp_path_factory, flips):
    run = fresh(pristine, tmp_path_factory)
    seg = next((run / "scalars").glob("writer=r*/*.parquet"))
    data = bytearray(seg.read_bytes())
    for pos, byte in flips:
        data[pos % len(data)] = byte
    seg.write_bytes(bytes(data))
    read_everything(run)  # Parquet has no checksums: damaged values may read, but never crash the reader
    list_runs(run.parent)
