"""tensor_stats_by_tensor, the rollup compaction pools across ranks: every reader gives the same answer from
it as from tensor_stats, and a row written after it sends them back to tensor_stats until the next compaction."""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

import dynascope.analyses.delta_sync as delta_mod
import dynascope.analyses.dynamics_layers as layers_mod
import dynascope.dashboard.queries.params as params_mod
from dynascope.analyses import delta_sync_bytes, delta_sync_summary, update_share_by_layer
from dynascope.store import RunWriter, open_store
from dynascope.store.compact import compact_store
from dynascope.store.rollup_across import BY_TENSOR, covers

from helpers.as_written import as_written  # noqa: F401 - the fixture pytestmark names

pytestmark = pytest.mark.usefixtures("as_written")  # compaction's input: runs as written

Q, MLP, EMB = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"
READERS = {"delta_sync_bytes": lambda s, r: delta_sync_bytes(s, r),
           "delta_sync_bytes rl": lambda s, r: delta_sync_bytes(s, r, stage="rl"),
           "update_share_by_layer": lambda s, r: update_share_by_layer(s, run=r, stage=None),
           "param_cube": lambda s, r: params_mod.param_cube(s, r).sort(pl.all(), nulls_last=True)}


def _rows(rank: int, steps: range, sharded_numel: int) -> dict[str, list]:
    """Per step: MLP sharded across ranks (the last rank's shard empty: FSDP's dim-0 chunks), Q replicated
    (the same values on every rank), the embedding replicated without S₁ on odd steps; drift on even steps."""
    out: dict[str, list] = {}
    for step in steps:
        stage = "sft" if step < 4 else "rl"
        for tensor, numel, sharded in ((MLP, sharded_numel, True), (Q, 4_096, False), (EMB, 8_192, False)):
            shift = rank if sharded else 0
            row = {"step": step, "stage": stage, "tensor": tensor, "layer": None if tensor == EMB else int(tensor.split(".")[2]),
                   "kind": "mlp" if tensor == MLP else "q" if tensor == Q else "embed", "dtype": "float32",
                   "numel": numel, "sharded": sharded, "w_norm": 10.0 + step + shift, "update_norm": 0.01 * (step + 1 + shift),
                   "changed_count": numel // 2, "bf16_unchanged_count": None if tensor == EMB and step % 2 else numel - 7 * step - shift,
                   "drift_norm": 0.1 * step + shift if step % 2 == 0 else None,
                   "drift_zero_count": numel - 3 * step if step % 2 == 0 else None,
                   "grad_norm": 1.0 + shift, "grad_zero_count": step + shift}
            if numel == 0:  # an empty shard: nothing in it to measure
                row.update(w_norm=0.0, update_norm=0.0, changed_count=0, bf16_unchanged_count=0, grad_norm=0.0,
                           grad_zero_count=0, drift_norm=0.0 if step % 2 == 0 else None,
                           drift_zero_count=0 if step % 2 == 0 else None)
            for k, v in row.items():
                out.setdefault(k, []).append(v)
    return out


def _write(run, ranks: int, steps: range) -> None:
    for rank in range(ranks):
        with RunWriter(run, rank=rank, world_size=ranks) as w:
            w.append("tensor_stats", _rows(rank, steps, 0 if rank == ranks - 1 else 3_000))
            for step in steps:
                w.append("timings", {"step": step, "phase": "weight_sync", "category": "comm", "start_us": 1_000 * step,
                                     "dur_us": 2_000 + 100 * rank})


def _answers(run, monkeypatch, rollup: bool) -> dict[str, pl.DataFrame]:
    with monkeypatch.context() as m:
        if not rollup:
            for mod in (delta_mod, layers_mod, params_mod):
                m.setattr(mod, "covers", lambda *a, **k: False)
        with open_store(run) as s:
            return {name: fn(s, run.name) for name, fn in READERS.items()}


def test_readers_answer_the_same_from_the_rollup_and_fall_back_when_rows_arrive(tmp_path, monkeypatch):
    run = tmp_path / "r"
    _write(run, 3, range(8))
    stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert stats.rollups_written == 1 and stats.skipped == []
    with open_store(run) as s:
        assert covers(s, run.name) and covers(s, None)
        rows, pooled, shards = s.rows(f"SELECT count(*), sum(tensors), count(*) FILTER (WHERE sharded) FROM {BY_TENSOR}")[0]
        # 8 steps × 3 tensors, one row each (tensor_stats_global's), standing for the 3 ranks' rows of each
        assert (rows, pooled, shards) == (8 * 3, 8 * 3 * 3, 8)
        # a sharded row's sums are its shards' (ranks 0 and 1; rank 2's shard is empty)
        mlp = s.rows(f"SELECT rank, numel, update_sq, bf16_rows FROM {BY_TENSOR} WHERE sharded AND step = 2")
        assert mlp == [(0, 6_000, pytest.approx(0.03 ** 2 + 0.04 ** 2), 1)]
    rolled, raw = _answers(run, monkeypatch, True), _answers(run, monkeypatch, False)
    for name in READERS:
        assert rolled[name].height > 0, name
        assert_frame_equal(rolled[name], raw[name], check_exact=False, rel_tol=1e-12, abs_tol=1e-12)

    # Writers back after the compaction (a resumed run, the two ranks that hold MLP's elements, so that
    # step 8 is whole): their rows count at once, the rollup no longer does.
    for rank in (0, 1):
        with RunWriter(run, rank=rank, world_size=3) as w:
            w.append("tensor_stats", _rows(rank, range(8, 9), 3_000))
    with open_store(run) as s:
        assert not covers(s, run.name)
        assert delta_sync_bytes(s, run.name)["step"].max() == 8 and update_share_by_layer(s, run=run.name)["steps"].max() == 5
    again = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
    assert again.rollups_written == 1
    with open_store(run) as s:
        assert covers(s, run.name)
        assert len([p for p in (run / BY_TENSOR).rglob("*.parquet") if "_merged" in str(p)]) == 1  # the old one went
    rolled, raw = _answers(run, monkeypatch, True), _answers(run, monkeypatch, False)
    for name in READERS:
        assert_frame_equal(rolled[name], raw[name], check_exact=False, rel_tol=1e-12, abs_tol=1e-12)
    assert not delta_sync_summary(run).is_empty()


def test_a_run_still_writing_gets_no_rollup(tmp_path):
    run = tmp_path / "r"
    _write(run, 2, range(4))
    live = RunWriter(run, rank=2, world_size=3)
    try:
        live.append("tensor_stats", _rows(2, range(4), 0))
        live.flush()
        stats = compact_store(run, grace_s=0.0, settle_s=0.05, wait=True, repair_after_s=0)
        assert stats.rollups_written == 0
        with open_store(run) as s:
            assert not covers(s, run.name) and s.rows(f"SELECT count(*) FROM {BY_TENSOR}")[0][0] == 0
    finally:
        live.close()


def test_a_writer_cannot_append_to_the_rollup(tmp_path):
    run = tmp_path / "r"
    with RunWriter(run, rank=0) as w:
        w.append(BY_TENSOR, {"step": [1], "tensor": [Q], "tensors": [1]})
    with open_store(run) as s:
        assert s.rows(f"SELECT count(*) FROM {BY_TENSOR}")[0][0] == 0
        assert s.rows("SELECT count(*) FROM events WHERE event = 'bad_batch'")[0][0] == 1
