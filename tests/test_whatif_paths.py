"""The what-ifs' two paths give one answer: the sorted-array path (``_rank_steps``) against the SQL it falls
back to (``_timing_rows``), on real stores written by the RunWriter: random phase orders, repeated phases,
several sync rows, a rank-step without a step row, several runs and roles in one store, a phase named like
the remainder, samples with and without durations; and the fallback taken for NULL keys."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from polars.testing import assert_frame_equal

import dynascope.analyses._rank_steps as rank_steps_mod
import dynascope.analyses.schedules as schedules
import dynascope.analyses.stragglers as stragglers
from dynascope.analyses.steps import REMAINDER
from dynascope.store import RunWriter, open_store

from helpers.planted_timings import T0, plant, timing_rows
from helpers.planted_timings import random_run as _random_run


def _sql_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in (stragglers, schedules):
        monkeypatch.setattr(mod, "rank_steps", lambda *a, **k: None)


def _both(monkeypatch: pytest.MonkeyPatch, fn, *args, **kw) -> None:
    fast = fn(*args, **kw)
    with monkeypatch.context() as m:
        _sql_only(m)
        sql = fn(*args, **kw)
    assert_frame_equal(fast, sql, rel_tol=1e-9, abs_tol=1e-9)


def _mixed_store(root: Path) -> Path:
    """Two runs in one root; the second has two roles, uneven ranks, a phase named like the remainder, a
    rank-step whose phases start together with its sync row, and samples without an end."""
    _random_run(root / "a", 3, seed=7)
    rng = random.Random(3)
    for role, ranks in (("trainer", 3), ("rollout", 2)):
        for r in range(ranks):
            with RunWriter(root / "b", rank=r, role=role) as w:
                for step in range(6):
                    names = ["rollout", "train", REMAINDER, "allreduce", "optimizer"]
                    if (r + step) % 3 == 0:
                        names = ["rollout", "allreduce", "train", "train", "optimizer"]
                    rows, t = timing_rows(T0 + step * 10**7, [(p, rng.randint(1_000, 50_000),
                                                               "comm" if p == "allreduce" else "phase") for p in names])
                    if step == 3 and r == 1:  # a phase starting with the sync row counts before it
                        rows["start_us"][4] = rows["start_us"][3]
                    w.append("timings", {**rows, "step": step})
                    if step != 4 or r != 2:
                        w.append("timings", {"phase": "step", "category": "step", "step": step,
                                             "start_us": T0 + step * 10**7, "dur_us": t - T0 - step * 10**7 + 7_000})
                    gens = [rng.randint(1_000, 30_000) for _ in range(5)]
                    w.append("samples", {"step": step, "sample_id": list(range(5)), "gen_start_us": T0,
                                         "gen_end_us": [T0 + g if i != 2 or step != 1 else None
                                                        for i, g in enumerate(gens)]})
    return root


def test_paths_agree_when_a_phase_is_named_like_the_remainder(tmp_path, monkeypatch):
    # every rank-step alike (the dense median), the named phase and the remainder in one segment
    rng = random.Random(9)
    for r in range(3):
        with RunWriter(tmp_path / "u", rank=r) as w:
            for step in range(5):
                rows, t = timing_rows(T0 + step * 10**7, [(p, rng.randint(1_000, 9_000), "phase")
                                                          for p in ("train", REMAINDER)])
                w.append("timings", {**rows, "step": step})
                w.append("timings", {"phase": "step", "category": "step", "step": step,
                                     "start_us": T0 + step * 10**7, "dur_us": t - T0 - step * 10**7 + rng.randint(0, 5_000)})
    _both(monkeypatch, stragglers.what_if, tmp_path / "u", by_phase=True)
    _both(monkeypatch, stragglers.what_if_steps, tmp_path / "u", ranks="all")


@pytest.mark.parametrize("n_ranks", [1, 2, 4])
def test_what_if_paths_agree_on_random_runs(tmp_path, monkeypatch, n_ranks):
    run = _random_run(tmp_path / "rand", n_ranks, seed=11 + n_ranks)
    for kw in ({}, {"by_phase": True}, {"ranks": [0], "phases": ["a", REMAINDER]}, {"by_phase": True, "phases": ["c"]}):
        _both(monkeypatch, stragglers.what_if, run, **kw)
    for kw in ({}, {"ranks": "all"}, {"ranks": [n_ranks - 1], "phases": ["a", REMAINDER]}):
        _both(monkeypatch, stragglers.what_if_steps, run, **kw)


def test_paths_agree_on_a_store_of_several_runs_and_roles(tmp_path, monkeypatch):
    root = _mixed_store(tmp_path)
    for run in (None, "a", "b"):
        _both(monkeypatch, stragglers.what_if, root, run, by_phase=True)
        _both(monkeypatch, stragglers.what_if_steps, root, run, ranks="all")
        for kw in ({}, {"tail_pct": 50}, {"behaviour_logprob_phase": "optimizer", "rollout_phases": ("rollout",)}):
            _both(monkeypatch, schedules.schedule_inputs, root, run, **kw)


@pytest.mark.parametrize("kw", [{}, {"ranks": 2, "slow": {1: 1.5}}, {"eval_ms": 20.0, "gens_ms": [10.0, 50, 90, 90]}])
def test_schedule_paths_agree_on_planted_runs(tmp_path, monkeypatch, kw):
    run = plant(tmp_path / "p", **kw)
    for tail in (90.0, 50.0, 100.0):
        _both(monkeypatch, schedules.schedule_inputs, run, tail_pct=tail)
    _both(monkeypatch, schedules.schedule_what_if, run)


def test_null_keys_take_the_sql(tmp_path):
    run = _random_run(tmp_path / "n", 2, seed=5)
    with RunWriter(run, rank=0) as w:  # a top-level row without a start: only the SQL models it
        w.append("timings", {"phase": "a", "category": "phase", "step": 1, "dur_us": 10})
    assert rank_steps_mod.rank_steps(open_store(run), None) is None
    assert stragglers.what_if(run).height == 3  # rank 0, rank 1, all ranks


def test_alike_rank_steps_take_the_table_path(tmp_path, monkeypatch):
    # every rank-step runs the same phases: segment_phases appends the remainder as a column and takes the
    # medians along the ranks; the grouped path and the SQL give the same answer
    import dynascope.analyses._rank_segments as segments

    run = plant(tmp_path / "p", ranks=4, slow={1: 1.4, 2: 1.7})  # medians between two ranks
    taken = []
    width = segments._uniform_width
    monkeypatch.setattr(segments, "_uniform_width", lambda *a: taken.append(width(*a)) or taken[-1])
    table = stragglers.what_if(run, by_phase=True)
    assert taken and taken[-1] is not None
    with monkeypatch.context() as m:
        m.setattr(segments, "_uniform_width", lambda *a: None)
        assert_frame_equal(table, stragglers.what_if(run, by_phase=True), rel_tol=1e-12, abs_tol=1e-9)
    _both(monkeypatch, stragglers.what_if, run, by_phase=True)
    _both(monkeypatch, stragglers.what_if_steps, run, ranks=[2])


def test_sparse_rank_numbers_take_the_sorted_replay(tmp_path, monkeypatch):
    # rank ids far apart would make the (step, segment) × rank table mostly empty: the replay groups by
    # sorting instead, with the same result as the SQL
    import dynascope.analyses._schedule_frames as frames

    rng = random.Random(4)
    for r in (0, 3, 90_000):
        with RunWriter(tmp_path / "s", rank=r) as w:
            for step in range(5):
                order = [("weight_sync", 2_000, "phase"), ("rollout", rng.randint(20_000, 60_000), "phase"),
                         ("train", rng.randint(5_000, 9_000), "phase"), ("allreduce", 1_000, "comm"),
                         ("optimizer", 2_000, "phase")]
                rows, t = timing_rows(T0 + step * 10**6, order)
                w.append("timings", {**rows, "step": step})
                w.append("timings", {"phase": "step", "category": "step", "step": step, "start_us": T0 + step * 10**6,
                                     "dur_us": t - T0 - step * 10**6 + 500})
                w.append("samples", {"step": step, "sample_id": [0, 1, 2], "gen_start_us": T0,
                                     "gen_end_us": [T0 + rng.randint(1_000, 9_000) for _ in range(3)]})
    sorted_calls = []
    replay = frames._replayed_sorted
    monkeypatch.setattr(frames, "_replayed_sorted", lambda *a: sorted_calls.append(1) or replay(*a))
    _both(monkeypatch, schedules.schedule_inputs, tmp_path / "s")
    assert sorted_calls


def test_arrow_columns_read_from_their_buffers():
    # as_numpy reads primitive columns from their buffers: sliced chunks (offsets, bit-packed booleans at
    # odd offsets), several chunks, and NULLs (pyarrow's conversion) give pyarrow's own values
    import numpy as np
    import pyarrow as pa

    from dynascope.analyses._rank_steps import as_numpy

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
