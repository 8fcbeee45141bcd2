"""delta_sync_bytes / delta_sync_summary on planted tensor_stats and timings rows: exact bytes by construction."""

from __future__ import annotations

import math

import pytest

from dynascope.analyses import delta_sync_bytes, delta_sync_summary
from dynascope.store import RunWriter

Q, MLP = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"


def _run(path, rows, timings=(), rank=0):
    with RunWriter(path, rank=rank) as w:
        w.append("tensor_stats", {c: [r.get(c) for r in rows] for c in rows[0]})
        for step, dur_us in timings:
            w.append("timings", {"step": step, "phase": "weight_sync", "category": "phase", "start_us": 1_000 * step,
                                 "dur_us": dur_us})
    return path


def _row(step, tensor, numel, unchanged, stage="rl", dtype="float32", sharded=False):
    return {"step": step, "stage": stage, "tensor": tensor, "numel": numel, "dtype": dtype, "sharded": sharded,
            "bf16_unchanged_count": unchanged}


def test_bytes_per_encoding_and_implied_sync_time(tmp_path):
    # step 1: 100 of 8_000 changed (1.25% < 1/32: value+index wins); step 2: 800 changed (10%: bitmap wins)
    rows = [_row(1, Q, 3_000, 2_940), _row(1, MLP, 5_000, 4_960), _row(2, Q, 3_000, 2_700), _row(2, MLP, 5_000, 4_500)]
    # weight_sync spans of 4, 8 and 6 ms: median 6 ms to move the fp32 weights (32_000 B)
    run = _run(tmp_path / "r", rows, timings=[(1, 4_000), (2, 8_000), (3, 6_000)])
    df = delta_sync_bytes(run)
    a, b = df.row(0, named=True), df.row(1, named=True)
    assert (a["step"], a["tensors"], a["numel"], a["changed_count"]) == (1, 2, 8_000, 100)
    assert a["full_bf16_bytes"] == 16_000
    assert a["value_index_bytes"] == 600  # 6 B per changed element
    assert a["bitmap_bytes"] == math.ceil(3_000 / 8) + 5_000 // 8 + 200  # 375 + 625 + 2 B per changed
    assert (a["delta_bytes"], a["encoding"]) == (600, "value+index")
    assert a["delta_pct"] == pytest.approx(100 * 600 / 16_000) and a["changed_pct"] == pytest.approx(1.25)
    assert (b["changed_count"], b["value_index_bytes"], b["bitmap_bytes"]) == (800, 4_800, 1_000 + 1_600)
    assert (b["delta_bytes"], b["encoding"]) == (2_600, "bitmap")
    bw = 32_000 / 0.006
    assert a["weight_sync_ms"] == pytest.approx(6.0) and a["sync_bytes_per_s"] == pytest.approx(bw)
    assert a["full_bf16_sync_ms"] == pytest.approx(1000 * 16_000 / bw)  # 3 ms: half the fp32 bytes
    assert a["delta_sync_ms"] == pytest.approx(1000 * 600 / bw)
    # every element changed: both encodings cost more than the weights, so a sync sends them whole
    full = delta_sync_bytes(_run(tmp_path / "all", [_row(1, Q, 3_000, 0)])).row(0, named=True)
    assert (full["value_index_bytes"], full["bitmap_bytes"]) == (18_000, 375 + 6_000)
    assert (full["delta_bytes"], full["encoding"], full["delta_pct"]) == (6_000, "full", 100.0)
    summary = delta_sync_summary(run).row(0, named=True)
    assert summary["steps"] == 1 and summary["delta_pct"] == pytest.approx(100 * 2_600 / 16_000)  # step 1 left out


def test_ranks_sharding_incomplete_steps_and_no_timings(tmp_path):
    run = tmp_path / "r"
    # replicated Q on ranks 0 and 1 counts once; sharded MLP halves add up; step 2 lacks Q's S₁: left out
    _run(run, [_row(1, Q, 1_000, 990), _row(1, MLP, 2_000, 1_980, sharded=True), _row(2, Q, 1_000, None),
               _row(2, MLP, 2_000, 2_000, sharded=True)])
    _run(run, [_row(1, Q, 1_000, 990), _row(1, MLP, 2_000, 1_990, sharded=True), _row(2, MLP, 2_000, 2_000, sharded=True)],
         rank=1)
    df = delta_sync_bytes(run)
    assert df["step"].to_list() == [1]
    r = df.row(0, named=True)
    assert (r["numel"], r["changed_count"], r["tensors"]) == (5_000, 10 + 20 + 10, 2)
    assert r["weight_sync_ms"] is None and r["delta_sync_ms"] is None
    assert delta_sync_bytes(run, stage="sft").is_empty()


def test_steps_without_s1_are_left_out_not_counted_as_changed(tmp_path):
    # rows written by a probe that had no S₁ (null): no step can be priced, so none is
    run = _run(tmp_path / "r", [_row(1, Q, 1_000, None), _row(1, MLP, 1_000, None)])
    assert delta_sync_bytes(run).is_empty() and delta_sync_summary(run).is_empty()


def test_one_process_shards_and_copies_give_one_answer(tmp_path):
    """The same weights recorded three ways (one process; two shards per tensor; a DDP copy on a second
    rank) price the same bytes: shards pool, copies count once (tensor_stats_global)."""
    rows = [_row(s, t, n, n - (s * 37 + n // 100) % n) for s in range(1, 6) for t, n in ((Q, 3_000), (MLP, 5_000))]
    whole = delta_sync_bytes(_run(tmp_path / "one", rows))
    assert whole.height == 5 and whole["numel"].to_list() == [8_000] * 5
    halves = [dict(r, numel=r["numel"] // 2, bf16_unchanged_count=r["bf16_unchanged_count"] // 2, sharded=True)
              for r in rows]
    others = [dict(h, bf16_unchanged_count=r["bf16_unchanged_count"] - h["bf16_unchanged_count"])
              for r, h in zip(rows, halves, strict=True)]
    sharded = _run(tmp_path / "shards", halves)
    _run(sharded, others, rank=1)
    copies = _run(tmp_path / "copies", rows)
    _run(copies, rows, rank=1)
    cols = ["step", "tensors", "numel", "changed_count", "value_index_bytes", "delta_bytes"]
    assert delta_sync_bytes(copies).select(cols).equals(whole.select(cols))
    assert delta_sync_bytes(sharded).select(cols).equals(whole.select(cols))


def test_a_tie_between_encodings_names_the_cheaper_every_time(tmp_path):
    # after the first step, two steps choose value+index (1% changed) and two the bitmap (10%): a tie
    rows = [_row(s, Q, 8_000, 8_000 - c) for s, c in ((1, 80), (2, 80), (3, 800), (4, 80), (5, 800))]
    run = _run(tmp_path / "r", rows)
    assert sorted(delta_sync_bytes(run)["encoding"].to_list()[1:]) == ["bitmap", "bitmap", "value+index", "value+index"]
    assert {delta_sync_summary(run)["encoding"][0] for _ in range(20)} == {"value+index"}


def test_a_step_missing_a_shard_row_is_left_out_raw_compacted_and_in_the_finding(tmp_path):
    """Rank 1's shard of MLP at step 3 was lost: that step holds 1,000 of its 2,000 elements, so it is not
    priced (as combine_shards gives it NULL statistics), before and after `dynascope compact`, and the
    report's SQL counts the same steps as the analysis."""
    from dynascope.analyses.findings_sql import delta_sync_sql
    from dynascope.store import open_store, run_sql
    from dynascope.store.compact import compact_store

    run = tmp_path / "r"
    steps = range(1, 6)
    _run(run, [_row(s, MLP, 1_000, 1_000 - s, sharded=True) for s in steps])
    _run(run, [_row(s, MLP, 1_000, 1_000 - 2 * s, sharded=True) for s in steps if s != 3], rank=1)
    raw = delta_sync_bytes(run)
    assert raw["step"].to_list() == [1, 2, 4, 5] and set(raw["numel"]) == {2_000}
    assert raw["changed_count"].to_list() == [3 * s for s in (1, 2, 4, 5)]
    with open_store(run) as con:
        (run_id,), = con.sql("SELECT DISTINCT run_id FROM tensor_stats").fetchall()
        said = run_sql(con, delta_sync_sql(run_id, "rl")).to_pylist()[0]
    compact_store(run)
    assert delta_sync_bytes(run).equals(raw)
    summary = delta_sync_summary(run).row(0, named=True)
    assert summary["steps"] == said["steps"] == 3  # steps 2, 4, 5: the first (1) left out, 3 not whole
    assert summary["changed_pct"] == pytest.approx(said["changed_pct"]) == pytest.approx(100 * 12 / 2_000)
