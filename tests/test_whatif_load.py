"""The what-ifs' load step: the rows it keeps (NULL keys, starts and durations) against a plain reference, the
answers on a store with rows it cannot place equal to those without them, and the measured device inputs
it normalises once."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from dynascope.analyses._what_if_load import load_rank_steps, measured_devices
from dynascope.analyses.what_if_rank import what_if, what_if_steps
from dynascope.analyses.what_if_rank_shared import what_if_shared
from dynascope.analyses.what_if_schedule import schedule_what_if
from dynascope.analyses.what_if_schedule_inputs import schedule_inputs
from dynascope.store import RunWriter, open_store
from dynascope.store.layout import segment_name, writer_dir
from dynascope.store.schema import TABLES

from helpers.planted_timings import T0, plant, random_run, timing_rows

# Rows the load step cannot place (no run, rank, start or duration), and rows it keeps (a NULL role is the
# empty role): (run_id, role, rank, step, phase, category, start_us, dur_us).
UNPLACED = [(None, "trainer", 0, 1, "a", "phase", T0 + 10**7 + 5, 9_000),
            ("run", "trainer", None, 1, "b", "phase", T0 + 10**7 + 7, 3_000),
            ("run", "trainer", 0, 2, "a", "phase", None, 4_000),
            ("run", "trainer", 1, 2, "sync1", "wait", T0 + 2 * 10**7 + 11, None),
            ("run", "trainer", 1, 3, "step", "step", T0 + 3 * 10**7, None),
            ("run", "trainer", 2, 5, "step", "step", None, 10**9)]
PLACED = [("run", None, 7, s, p, c, T0 + s * 10**7 + o, d) for s in (0, 1) for p, c, o, d in (
    ("a", "phase", 0, 20_000), ("sync1", "wait", 20_000, 5_000), ("c", "phase", 25_000, 8_000),
    ("step", "step", 0, 40_000))]


def _write_rows(run: Path, rows: list[tuple], name: str) -> None:
    cols = ("run_id", "role", "rank", "step", "phase", "category", "start_us", "dur_us")
    data = {c: [r[i] for r in rows] for i, c in enumerate(cols)}
    schema = TABLES["timings"]
    table = pa.table({f.name: pa.array(data.get(f.name, [None] * len(rows)), type=f.type) for f in schema}, schema=schema)
    d = writer_dir(run, "timings", name)
    d.mkdir(parents=True)
    pq.write_table(table, d / segment_name(0, 0))


def _stores(tmp_path: Path) -> tuple[Path, Path]:
    """The same run twice, one with the rows the load step cannot place."""
    runs = []
    for tag, extra in (("with", UNPLACED + PLACED), ("without", PLACED)):
        run = random_run(tmp_path / tag / "run", 3, seed=8)
        _write_rows(run, extra, "raw")
        runs.append(run)
    return runs[0], runs[1]


def reference_load(path: Path) -> dict[tuple, tuple]:
    """The load step's rank-steps the plain way: (run_id, role, rank, step) → (step_us, step_start_us,
    covered, syncs, last_seg, its rows as sorted (start_us, dur_us, phase, sync, seg))."""
    found = open_store(path).rows("SELECT run_id, role, rank, step, phase, parent, category, stream, start_us, dur_us "
                                  "FROM timings")
    steps: dict[tuple, list] = defaultdict(list)
    rows: dict[tuple, list] = defaultdict(list)
    for run_id, role, rank, step, phase, parent, category, stream, start, dur in found:
        if None in (run_id, rank, step, start, dur) or stream is not None:
            continue  # not placed: no run, rank, step, start or duration (or a trace's GPU row)
        key = (run_id, role or "", rank, step)
        if category == "step" or (category is None and phase == "step"):
            steps[key].append((start, dur))
        elif phase not in (None, "step") and (parent or "") in ("", "step") and (category or "phase") in (
                "phase", "wait", "comm"):
            rows[key].append((start, dur, phase, (category or "phase") != "phase"))
    out = {}
    for key, spans in steps.items():
        mine = rows[key]
        seg = [sum(o[3] and o[0] < r[0] for o in mine) for r in mine]
        last = max(range(len(mine)), key=lambda i: mine[i][0], default=None)
        out[key] = (float(max(d for _, d in spans)), min(s for s, _ in spans), float(sum(r[1] for r in mine)),
                    sum(r[3] for r in mine), 0 if last is None else seg[last],
                    sorted((*r, s) for r, s in zip(mine, seg, strict=True)))
    return out


def test_the_load_step_keeps_the_rows_a_plain_reading_keeps(tmp_path):
    with_nulls, _ = _stores(tmp_path)
    rs = load_rank_steps(open_store(with_nulls), None)
    st, r = rs.steps, rs.rows
    groups = dict(zip(rs.groups["grp"], zip(rs.groups["run_id"], rs.groups["role"], strict=True), strict=True))
    got = {}
    for i in range(len(rs)):
        mine = np.flatnonzero(r["rs"] == i)
        got[(*groups[st["grp"][i]], int(st["rank"][i]), int(st["step"][i]))] = (
            float(st["step_us"][i]), int(st["step_start_us"][i]), float(st["covered"][i]), int(st["syncs"][i]),
            int(st["last_seg"][i]), sorted((int(r["start_us"][j]), int(r["dur_us"][j]), rs.phases[r["phase"][j]],
                                            bool(r["sync"][j]), int(r["seg"][j])) for j in mine))
    ref = reference_load(with_nulls)
    assert got == ref
    assert ("run", "", 7, 1) in got and ("run", "trainer", 1, 3) not in got  # its only step row has no duration
    assert all(np.all(np.diff(r["start_us"][r["rs"] == i]) >= 0) for i in range(len(rs)))  # by start


def test_rows_without_run_rank_start_or_duration_are_left_out_of_every_what_if(tmp_path):
    with_nulls, without = _stores(tmp_path)
    for fn in (lambda p, run: what_if(p, run, by_phase=True), lambda p, run: what_if_steps(p, run, ranks="all"),
               lambda p, run: schedule_inputs(p, run, rollout_phases=("a",)),
               lambda p, run: what_if_shared(p, run, ranks=[1], devices=1.5)):
        for run in (None, "run"):
            got = fn(with_nulls, run)
            assert not got.is_empty()
            assert_frame_equal(got, fn(without, run))
    # the rank-step whose top-level row has no start: that row's time is its remainder's
    phases = what_if(with_nulls, by_phase=True)
    assert set(phases["phase"].drop_nulls()) == {"a", "b", "c", "d", "(uninstrumented)"}


def test_a_measured_time_slice_efficiency_above_one_is_replayed_as_one(tmp_path):
    # benchmarks/whatif_validation.py measured 1.032 for three demo processes on two cores: time slicing
    # lost nothing within the measurement's noise. The model replays that as 1, its ideal sharing, and says so.
    measured = 1.0321843998829854
    with pytest.warns(UserWarning, match="timeslice_efficiency=1"):
        dev = measured_devices(2, timeslice_efficiency=measured)
    assert dev.timeslice == 1.0 and "1.03218" in dev.note
    assert measured_devices(2, timeslice_efficiency=0.9).note == ""
    run = plant(tmp_path / "one", rollout_ms=100.0, train_ms=90.0, opt_ms=5.0, gap_ms=5.0, sync_ms=0.0)
    with pytest.warns(UserWarning):
        noisy = schedule_what_if(run, devices=1, timeslice_efficiency=measured)
    ideal = schedule_what_if(run, devices=1)
    assert_frame_equal(noisy.drop("params"), ideal.drop("params"))
    assert noisy.filter(noisy["schedule"] == "async")["params"][0].endswith(dev.note)
    two = random_run(tmp_path / "two", 3, seed=2)
    with pytest.warns(UserWarning):
        assert_frame_equal(what_if_shared(two, ranks=[0], devices=2, timeslice_efficiency=measured),
                           what_if_shared(two, ranks=[0], devices=2))
    for bad in (0, -0.5, math.nan):
        with pytest.raises(ValueError, match="timeslice_efficiency"):
            schedule_what_if(run, timeslice_efficiency=bad)
    with pytest.raises(ValueError, match="devices"):
        what_if_shared(two, devices=0)
    with pytest.raises(ValueError, match="background"):
        schedule_what_if(run, devices=2, target_background=-1)


def test_names_and_codes_come_from_the_one_read(tmp_path, monkeypatch):
    # One query of timings: on a live run a second one (to list the names first) lists and opens every
    # writer's files again. Its codes are positions in the sorted names, with several runs (a run_id code),
    # NULL roles (the empty role) and NULL phases of step rows (the remainder's name) among them.
    import dynascope.analyses._what_if_load as load
    from dynascope.store.reader import StoreConnection

    root = tmp_path / "root"
    for i in range(2):
        random_run(root / f"r{i}", 3, seed=i)
    _write_rows(root / "r1", [("r1", None, 0, 50, None, "step", 10**9, 500),
                              ("r1", None, 0, 50, "forward", "phase", 10**9, 200)], "raw")
    queries = []
    arrow = StoreConnection.arrow
    monkeypatch.setattr(StoreConnection, "arrow", lambda self, sql, params=None: queries.append(sql) or arrow(self, sql, params))
    store = open_store(root)
    t, (runs, roles, phases), c = load._read(store, None)
    assert len(queries) == 1 and "timings" in queries[0]
    assert runs == ["r0", "r1"] and roles == ["", "trainer"] and "(uninstrumented)" in phases
    assert phases == sorted(phases)
    plain = store.frame("SELECT run_id, coalesce(role, '') AS role, coalesce(phase, '(uninstrumented)') AS phase, "
                        "start_us, dur_us, rank, step FROM timings WHERE start_us IS NOT NULL AND dur_us IS NOT NULL")
    got = {(runs[a], roles[b], phases[p], s, d, r, st) for a, b, p, s, d, r, st in zip(
        c["run_id"], c["role"], c["phase"], t["start_us"].to_pylist(), t["dur_us"].to_pylist(), t["rank"].to_pylist(),
        t["step"].to_pylist(), strict=True)}
    assert got == set(plain.iter_rows())  # every row placed, its names decoded from their codes
    rs = load_rank_steps(store, None)
    assert rs.groups.rows() == [(0, "r0", "trainer"), (1, "r1", ""), (2, "r1", "trainer")]  # by (run, role) codes
    one = load._read(store, "r0")
    assert "run_id" not in one[2] and one[1][0] == ["r0"]


def test_arrow_columns_read_from_their_buffers():
    # as_numpy reads primitive columns from their buffers: sliced chunks (offsets, bit-packed booleans at
    # odd offsets), several chunks, and NULLs (pyarrow's conversion) give pyarrow's own values
    from dynascope.analyses._sorted_runs import as_numpy

    rng = np.random.default_rng(0)
    for typ, values in ((pa.int64(), rng.integers(-10**12, 10**12, 50)), (pa.int32(), rng.integers(-9, 9, 50)),
                        (pa.uint8(), rng.integers(0, 255, 50)), (pa.float64(), rng.normal(size=50)),
                        (pa.bool_(), rng.random(50) < 0.3)):
        arr = pa.array(values, type=typ)
        chunked = pa.chunked_array([arr.slice(3, 7), arr.slice(13, 29), arr.slice(0, 0), arr.slice(45)])
        for col in (arr, arr.slice(5, 11), chunked):
            got = as_numpy(col)
            assert got.dtype == col.to_numpy(zero_copy_only=False).dtype
            assert np.array_equal(got, col.to_numpy(zero_copy_only=False)), (typ, col)
    with_null = pa.chunked_array([pa.array([1, None, 3])])
    assert np.array_equal(as_numpy(with_null), with_null.to_numpy(zero_copy_only=False), equal_nan=True)


def test_a_what_if_does_not_import_pandas(tmp_path):
    # pyarrow's NumPy conversion imports pandas the first time a process uses it (0.4 s); the what-ifs
    # read their columns without it
    import subprocess
    import sys

    run = plant(tmp_path / "p", ranks=2)
    code = ("import sys; import dynascope.analyses as A; "
            f"A.what_if({str(run)!r}, by_phase=True); A.schedule_what_if({str(run)!r}); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_empty_and_trace_only_stores_load_no_rank_steps(tmp_path):
    RunWriter(tmp_path / "empty").close()
    assert len(load_rank_steps(open_store(tmp_path / "empty"), None)) == 0
    rng = random.Random(0)
    with RunWriter(tmp_path / "nostep", rank=0) as w:  # top-level rows without a step row
        rows, _ = timing_rows(T0, [("a", rng.randint(1, 9), "phase"), ("s", 3, "wait")])
        w.append("timings", {**rows, "step": 0})
    assert len(load_rank_steps(open_store(tmp_path / "nostep"), None)) == 0
    assert what_if(tmp_path / "nostep").is_empty() and schedule_inputs(tmp_path / "nostep").is_empty()


def test_sorts_equal_their_references():
    # sort_order's np.sort of keys with their positions in the low bits is np.lexsort's (stable) order, and
    # sorted_in_runs is order_in_runs' values, on ties, several keys, keys too wide for the positions (the
    # stable argsort), runs of unequal size and NaN (the lexsort)
    from dynascope.analyses._sorted_runs import order_in_runs, sort_order, sorted_in_runs, stable_order

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 5_000):
        a, b = rng.integers(0, 4, n), rng.integers(-3, 3, n)
        assert np.array_equal(sort_order(a, b), np.lexsort((b, a)))
        assert np.array_equal(sort_order(a.astype(float)), np.argsort(a, kind="stable"))
        wide = rng.integers(0, 2**60, n)
        wide[: n // 2] = wide[0] if n else 0  # ties
        assert np.array_equal(stable_order(wide, 60), np.argsort(wide, kind="stable"))
        for sizes in ([n], [1] * n, list(rng.integers(1, 9, n // 4 + 1))):
            starts = np.cumsum([0, *sizes])[:-1]
            starts = starts[starts < n]
            v = rng.integers(0, 5, n).astype(float)
            if n > 3:
                v[3] = np.nan
            for values in (v, np.nan_to_num(v)):
                want = values[order_in_runs(values, starts)]
                assert np.array_equal(sorted_in_runs(values, starts), want, equal_nan=True)
                run = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
                assert np.array_equal(order_in_runs(values, starts), np.lexsort((values, run)))


def test_rows_written_out_of_time_order_load_the_same(tmp_path):
    # The load takes the rows as read when each rank-step's rows (its step rows aside) are already by start,
    # and sorts them by start otherwise: rows written in reverse time order (a zero-length row last in both)
    # load as those written in order.
    rng = random.Random(3)
    plan = {(r, step): [(p, rng.randint(1_000, 90_000), "wait" if p.startswith("sync") else "phase")
                        for p in ("a", "sync1", "b", "sync2", "c")] + [("z", 0, "phase")]
            for r in range(3) for step in range(6)}
    for name, backwards in (("fwd", False), ("back", True)):
        for r in range(3):
            with RunWriter(tmp_path / name, rank=r) as w:
                for step in range(6):
                    rows, t = timing_rows(T0 + step * 10**7, plan[(r, step)])
                    rows = {k: [*v[:-1][::-1], v[-1]] if backwards else v for k, v in rows.items()}
                    step_row = {"phase": "step", "category": "step", "step": step, "start_us": T0 + step * 10**7,
                                "dur_us": t - T0 - step * 10**7 + 500}
                    w.append("timings", {**rows, "step": step})
                    w.append("timings", step_row)
    a, b = (load_rank_steps(open_store(tmp_path / n), None) for n in ("fwd", "back"))
    assert len(a) == 18 and a.phases == b.phases
    for part in ("rows", "steps"):
        for col, x in getattr(a, part).items():
            assert np.array_equal(x, getattr(b, part)[col]), (part, col)
