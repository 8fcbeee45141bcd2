"""The resolver's vectorised rows equal a per-tensor reference written from the declarations (``naive_row``),
NULLs and edge values included, and the writer stores them as the registry types them."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from dynascope.probes.rows import Record, summarize, tensor_stats_batch
from dynascope.stats import REGISTRY
from dynascope.store.live import live_files
from dynascope.store.schema import TENSOR_STATS_COLUMNS
from dynascope.store.writer import RunWriter

from helpers.records import record as _record
from helpers.records import tracked as _tracked


def rows_from_record(rec: Record) -> dict:
    return tensor_stats_batch([rec])


def naive_row(values: dict, numel: int) -> dict:
    """One row from the named values of one tensor, the plainest way, as the declarations say: a count
    proven zero by a finite norm, flags, fractions, ratios, the rest as is (non-finite → NULL)."""
    v = dict(values, numel=numel)
    for c in REGISTRY.columns:  # a count whose threshold came from a non-finite norm has no value
        norm = c.null_where_not_finite
        if norm is not None and v.get(norm) is not None and not math.isfinite(v[norm]):
            v.pop(c.name, None)
    for c in REGISTRY.columns:
        norm = c.zero_where_finite
        if norm is not None and v.get(norm) is not None and math.isfinite(v[norm]):
            v.setdefault(c.name, 0)
    row = {}
    for col in TENSOR_STATS_COLUMNS:
        x = v.get(col.frac_of or col.name)
        if col.flag_of is not None:
            row[col.name] = col.flag_of in v
        elif col.frac_of is not None:
            row[col.name] = None if x is None or not math.isfinite(x) or numel == 0 else x / numel
        elif col.ratio is not None:
            a, b = v.get(col.ratio[0]), v.get(col.ratio[1])
            finite = a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
            row[col.name] = a / b if finite and b != 0 else None
        elif x is None or (isinstance(x, float) and not math.isfinite(x)):
            row[col.name] = None
        else:
            row[col.name] = int(x) if col.integer else x
    return row


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b and type(a) is type(b)


def test_vectorised_rows_equal_the_per_tensor_reference() -> None:
    tracked = _tracked()
    rec, naive = _record(tracked)
    cols = rows_from_record(rec)
    assert cols["step"] == 12 and cols["stage"] == "rl"
    for i, t in enumerate(tracked):
        meta = dict(tensor=t.name, layer=t.layer, kind=t.kind, shape=t.shape, dtype=t.dtype, sharded=t.sharded)
        want = naive_row({**naive[i], **meta}, t.param.numel())
        for c in TENSOR_STATS_COLUMNS:
            v = cols[c.name]
            got = v[i].as_py() if isinstance(v, pa.Array) else (v[i].item() if isinstance(v, np.ndarray) else v[i])
            assert _same(got, want[c.name]), (t.name, c.name, got, want[c.name])
    # The cases the fixture plants: a NaN norm is NULL; Inf/NaN counts become NULL; a zero or infinite
    # denominator gives a NULL ratio; a finite norm proves zero NaN/Inf counts; numel 0 gives NULL fractions.
    assert cols["w_norm"][1].as_py() is None and cols["w_nan_count"][1].as_py() is None
    assert cols["w_nan_count"][0].as_py() == 0 and cols["grad_inf_count"][4].as_py() == 0
    assert cols["sign_flip_count"][3].as_py() is None and cols["changed_count"][2].as_py() is None
    assert cols["update_ratio"][2].as_py() is None and cols["drift_ratio"][4].as_py() is None
    assert cols["changed_frac"][0].as_py() == 0.5 and cols["sign_flip_frac"][2].as_py() is None
    assert cols["grad_near_zero_count"].to_pylist()[:2] == [1, None] and cols["grad_inf_count"][1].as_py() == 2
    assert cols["grad_norm"][1].as_py() is None and cols["grad_near_zero_frac"][1].as_py() is None
    assert cols["ref_covered"].to_pylist() == [False, False, False, False, True]
    assert cols["bf16_k_steps"].to_pylist() == [None, 3, None, 3, None]


def test_a_record_outside_the_window_equals_the_reference() -> None:
    """The usual record between windows: ‖g‖ only, and a family that covered no tensor. Its columns without
    a value are NULL arrays typed as the registry types them."""
    tracked = _tracked()
    rec = Record(3, None, tracked)
    rec.add("grad_norms", ("grad_norm",), [0, 1, 4], torch.tensor([[1.0], [math.nan], [2.0]], dtype=torch.float64))
    rec.add("drift", ("ref_norm", "drift_norm"), [], torch.zeros((0, 2), dtype=torch.float64))
    rec.host = torch.cat([v.reshape(-1) for v in rec.values.values()])
    cols = rows_from_record(rec)
    naive = {0: {"grad_norm": 1.0}, 1: {"grad_norm": math.nan}, 4: {"grad_norm": 2.0}}
    for i, t in enumerate(tracked):
        meta = dict(tensor=t.name, layer=t.layer, kind=t.kind, shape=t.shape, dtype=t.dtype, sharded=t.sharded)
        want = naive_row({**naive.get(i, {}), **meta}, t.param.numel())
        for c in TENSOR_STATS_COLUMNS:
            v = cols[c.name]
            got = v[i].as_py() if isinstance(v, pa.Array) else (v[i].item() if isinstance(v, np.ndarray) else v[i])
            assert _same(got, want[c.name]), (t.name, c.name, got, want[c.name])
    for c in TENSOR_STATS_COLUMNS:
        if isinstance(cols[c.name], pa.Array):
            assert cols[c.name].type == c.type, c.name
    assert cols["drift_norm"].null_count == len(tracked) and cols["grad_inf_count"].to_pylist() == [0, None, None, None, 0]
    assert summarize(cols) == {}  # no headline fraction has a value


def test_summary_means_per_kind_skip_nulls() -> None:
    rec, _ = _record(_tracked())
    s = summarize(rows_from_record(rec))
    assert s["update_ratio"] == 0.25  # row 0; row 2 (zero ‖W‖) and row 3 (infinite ‖W‖) are NULL
    assert s["update_ratio/attn"] == s["update_ratio"] and "update_ratio/mlp" not in s
    assert s["changed_frac"] == 0.5


def test_writer_stores_the_arrays_with_their_nulls(tmp_path) -> None:
    tracked = _tracked()
    rec, _ = _record(tracked)
    w = RunWriter(tmp_path / "run", run_name="rows")
    for step in (1, 2):
        rec.step = step
        w.append("tensor_stats", rows_from_record(rec))
    w.close()
    import duckdb

    con = duckdb.connect()
    got = con.execute(f"SELECT step, tensor, layer, numel, w_norm, w_nan_count, update_ratio, ref_covered "
                      f"FROM read_parquet({live_files(tmp_path / 'run', 'tensor_stats')!r}, union_by_name = true) "
                      "ORDER BY step, tensor").fetchall()
    assert len(got) == 2 * len(tracked)
    row1 = [r for r in got if r[0] == 1 and r[1] == "layers.1.w"][0]
    assert row1[2] == 1 and row1[3] == 5 and row1[4] is None and row1[5] is None and row1[6] is None
    assert [r[7] for r in got if r[0] == 2] == [False, False, False, False, True]
    assert [r[2] for r in got if r[0] == 2][2] is None  # layer NULL stays NULL
