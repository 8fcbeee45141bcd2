"""The resolver converts the records it collected together: the rows equal those of one record at a time,
in the store too, a batch waits at most ``delay_s``, and one bad record costs only its own rows."""

from __future__ import annotations

import math
import threading

import duckdb
import pyarrow as pa
import torch

import dynascope
from dynascope.probes.resolver import Resolver
from dynascope.probes.rows import Record, tensor_stats_batch
from dynascope.store.live import live_files
from dynascope.store.schema import TENSOR_STATS_COLUMNS

from helpers.records import record as _record
from helpers.records import tracked as _tracked


def _as_list(v: object, n: int) -> list:
    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return v.to_pylist()
    if hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0:
        return v.tolist()  # type: ignore[union-attr]
    return list(v) if isinstance(v, list) else [v] * n


def _same(a: object, b: object) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_a_batch_of_records_equals_its_records_one_by_one() -> None:
    tracked = _tracked()
    full, _ = _record(tracked)  # every family, NaN/Inf values, a constant
    sparse = Record(13, None, tracked)  # ‖g‖ only, and a family that covered nothing
    sparse.add("grad_norms", ("grad_norm",), [0, 4], torch.tensor([[1.0], [math.nan]], dtype=torch.float64))
    sparse.add("drift", ("ref_norm", "drift_norm"), [], torch.zeros((0, 2), dtype=torch.float64))
    sparse.host = torch.cat([v.reshape(-1) for v in sparse.values.values()])
    recs = [full, sparse, full]
    batch = tensor_stats_batch(recs)
    n = len(tracked)
    want: dict[str, list] = {}
    for rec in recs:
        for name, v in tensor_stats_batch([rec]).items():
            want.setdefault(name, []).extend(_as_list(v, n))
    assert set(batch) == set(want)
    for name, values in want.items():
        got = _as_list(batch[name], n * len(recs))
        assert len(got) == len(values), name
        assert all(_same(a, b) for a, b in zip(got, values, strict=True)), (name, got, values)
    for c in TENSOR_STATS_COLUMNS:
        if isinstance(batch[c.name], pa.Array) and not pa.types.is_dictionary(batch[c.name].type):
            assert batch[c.name].type == c.type, c.name
    assert _as_list(batch["stage"], 3 * n) == ["rl"] * n + [None] * n + ["rl"] * n


def _train(run, steps: int, **kw) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None, **kw)
    x = torch.randn(32, 8)
    for step in range(steps):
        if step == steps // 2:
            scope.set_stage("rl")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    scope.close()


def _rows(run) -> list[tuple]:
    cols = ", ".join(["step", "stage", "tensor", "layer", "kind", "shape", "numel", "sharded"] +
                     [c.name for c in TENSOR_STATS_COLUMNS if c.name not in ("tensor", "layer", "kind", "shape",
                                                                           "numel", "sharded", "dtype")])
    with duckdb.connect() as con:
        return con.execute(f"SELECT {cols} FROM read_parquet({live_files(run, 'tensor_stats')!r}, union_by_name = true) "
                           "ORDER BY step, tensor").fetchall()


def test_the_store_holds_the_same_rows_batched_or_not(tmp_path, monkeypatch) -> None:
    """A run whose records the resolver converted 64 at a time stores what one record at a time stores."""
    _train(tmp_path / "batched", 12)
    import dynascope.probes.resolver as resolver_mod

    monkeypatch.setattr(resolver_mod, "RESOLVE_BATCH", 1)  # each record on its own
    _train(tmp_path / "single", 12)
    batched, single = _rows(tmp_path / "batched"), _rows(tmp_path / "single")
    assert len(batched) == 12 * 4 and [r[:8] for r in batched] == [r[:8] for r in single]
    # the statistics agree to float32 rounding (the two runs train the same model from the same seed; on a
    # loaded machine a float32 reduction's order can differ between runs: ‖g‖ then differs in its 8th digit)
    for a, b in zip(batched, single, strict=True):
        assert all(_same(x, y) or (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-6)) for x, y in
                   zip(a, b, strict=True)), (a, b)
    assert {r[1] for r in batched} == {None, "rl"}


def test_a_collected_item_waits_at_most_the_delay() -> None:
    got: list[list] = []
    done = threading.Event()

    def resolve(items: list) -> None:
        got.append(list(items))
        done.set()

    r = Resolver(lambda *_: None, resolve, batch=4, delay_s=0.2)
    try:
        for i in range(6):
            r.collect(i)
        assert done.wait(30), "a partial batch was never resolved"  # the first 4 at once, the rest by the delay
        done.clear()
        assert done.wait(30)
        assert got == [[0, 1, 2, 3], [4, 5]]
        r.collect(6)
        r.submit(lambda: got.append(["job"]))  # a job runs after what was collected before it
        r.drain()
        assert got[-2:] == [[6], ["job"]]
    finally:
        r.close()


def test_one_bad_record_costs_only_its_own_rows(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=tmp_path / "run", system_interval_s=None, reference=None)
    after = scope.stats.after

    def broken_at_step_3(ctx):
        res = after(ctx)
        if ctx.step == 3:
            res.rec.host = torch.zeros(1, dtype=torch.float64)  # too short for its parts: this record fails
        return res
    scope.stats.after = broken_at_step_3
    x = torch.randn(8, 4)
    for _ in range(6):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    scope.close()
    with duckdb.connect() as con:
        steps = [r[0] for r in con.execute(f"SELECT DISTINCT step FROM read_parquet({live_files(tmp_path / 'run', 'tensor_stats')!r}, union_by_name = true) "
                                           "ORDER BY step").fetchall()]
        errors = con.execute(f"SELECT message FROM read_parquet({live_files(tmp_path / 'run', 'events')!r}, union_by_name = true) "
                             "WHERE event = 'probe_error'").fetchall()
    assert steps == [0, 1, 2, 4, 5]
    assert errors and all("resolve:tensor_stats" in m for (m,) in errors)


def test_joined_rows_are_the_rows_of_their_batches(tmp_path) -> None:
    """Consecutive batches of a table with the same columns become one; others stay as they are; the writer
    stores the same rows either way."""
    import numpy as np

    from dynascope.probes.protocol import join_rows
    from dynascope.store.writer import RunWriter

    steps: list[dict] = [
        {"timings": {"step": 0, "phase": ["step", "forward"], "parent": [None, "step"], "dur_us": [10, 4]},
         "scalars": {"step": 0, "key": ["rss"], "value": [1.5]}},
        {"timings": {"step": 1, "phase": ["step"], "parent": [None], "dur_us": [12]},
         "scalars": {"step": 1, "key": ["rss"], "value": [1.6]}},
        {"timings": {"step": 2, "phase": ["step"], "parent": [None], "dur_us": np.array([13])}},  # an array
        {"timings": {"step": 3, "phase": ["step"], "parent": [None], "dur_us": [14]}},
        {"timings": {"step": 4, "phase": ["step"], "parent": [None], "dur_us": [15], "device": "cpu"}},  # new column
        {"scalars": {"step": 5, "key": ["rss", "vms"], "value": [1.7]}},  # ragged: the writer reports it
    ]
    joined = join_rows(steps)
    tables = [next(iter(r)) for r in joined]
    assert tables == ["timings", "scalars", "timings", "timings", "timings", "scalars"]
    assert joined[0]["timings"] == {"step": [0, 0, 1], "phase": ["step", "forward", "step"],
                                    "parent": [None, "step", None], "dur_us": [10, 4, 12]}
    assert joined[1]["scalars"] == {"step": [0, 1], "key": ["rss", "rss"], "value": [1.5, 1.6]}

    def stored(batches: list[dict]) -> dict[str, list]:
        w = RunWriter(tmp_path / f"run{len(batches)}", flush_secs=3600)
        for rows in batches:
            for table, cols in rows.items():
                w.append(table, cols)
        out = {t: w._to_arrow(t, w._buffers[t]).drop_columns(["run_id"]).to_pylist()
               for t in ("timings", "scalars") if w._buffers[t].rows}
        w.close()
        return out
    assert stored(joined) == stored(steps)
