"""update_share_by_layer on a planted store: exact shares of ‖ΔW‖² and of bf16-visible changes per layer."""

from __future__ import annotations

import pytest

from dynascope.analyses import update_share_by_layer
from dynascope.store import RunWriter

Q0, MLP1, EMB = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"


def _write(path, rows: list[dict], rank: int = 0) -> None:
    with RunWriter(path, rank=rank) as w:
        w.append("tensor_stats", {c: [r.get(c) for r in rows] for c in rows[0]})


def _row(step, tensor, layer, numel, update, s1_unchanged, drift=None, drift_zero=None, stage="rl", **kw):
    return {"stage": stage, "step": step, "tensor": tensor, "layer": layer, "numel": numel, "update_norm": update,
            "bf16_unchanged_count": s1_unchanged, "drift_norm": drift, "drift_zero_count": drift_zero, **kw}


def test_planted_shares(tmp_path):
    run = tmp_path / "r"
    _write(run, [
        # step 1: per-step only (drift recorded at the last step only, as a sparse drift cadence would)
        _row(1, Q0, 0, 100, 1.0, 90), _row(1, MLP1, 1, 300, 2.0, 240), _row(1, EMB, None, 600, 0.0, 600),
        # step 2: Q0 ‖ΔW‖ = 3 (9), MLP1 = 4 (16) over two shards of 150 on ranks 0 and 1 (below), EMB 0
        _row(2, Q0, 0, 100, 1.0, 95, drift=3.0, drift_zero=70),
        _row(2, MLP1, 1, 150, 1.0, 130, drift=2.0, drift_zero=100, sharded=True),
        _row(2, EMB, None, 600, 1.0, 599, drift=0.0, drift_zero=600),
        _row(2, Q0, 0, 100, 9.0, 0, drift=99.0, drift_zero=0, stage="sft"),  # another stage: not counted
    ])
    # rank 1: the other shard of MLP1 and a replicated copy of Q0 (counted once: the lowest rank's)
    _write(run, [_row(2, MLP1, 1, 150, 1.0, 140, drift=2.0 * 3 ** 0.5, drift_zero=110, sharded=True),
                 _row(2, Q0, 0, 100, 1.0, 95, drift=3.0, drift_zero=70)], rank=1)
    df = update_share_by_layer(run)
    got = {r["layer"]: r for r in df.iter_rows(named=True)}
    assert list(got) == [0, 1, None]
    # cumulative: ‖ΔW‖² per layer 9 | 4 + 12 = 16 | 0 of 25; bf16-visible 30 | 50 + 40 = 90 | 0 of 120
    assert got[0]["drift_energy_pct"] == pytest.approx(100 * 9 / 25)
    assert got[1]["drift_energy_pct"] == pytest.approx(100 * 16 / 25)
    assert got[None]["drift_energy_pct"] == 0.0
    assert got[0]["drift_bf16_changed_pct"] == pytest.approx(100 * 30 / 120)
    assert got[1]["drift_bf16_changed_pct"] == pytest.approx(100 * 90 / 120)
    # per step, summed over steps: ‖ΔW‖² 1 + 1 | 4 + (1 + 1) | 0 + 1 of 9; changed 10 + 5 | 60 + (20 + 10) | 0 + 1 of 106
    assert got[0]["update_energy_pct"] == pytest.approx(100 * 2 / 9)
    assert got[1]["update_energy_pct"] == pytest.approx(100 * 6 / 9)
    assert got[None]["update_energy_pct"] == pytest.approx(100 * 1 / 9)
    assert got[1]["update_bf16_changed_pct"] == pytest.approx(100 * 90 / 106)
    # parameters: 100 | 300 | 600
    assert [got[k]["numel_pct"] for k in (0, 1, None)] == pytest.approx([10.0, 30.0, 60.0])
    assert got[1]["numel"] == 300 and got[1]["tensors"] == 1 and got[0]["last_step"] == 2 and got[0]["steps"] == 2
    for col in ("numel_pct", "drift_energy_pct", "drift_bf16_changed_pct", "update_energy_pct", "update_bf16_changed_pct"):
        assert df[col].sum() == pytest.approx(100.0)
    sft = update_share_by_layer(run, stage="sft")
    assert sft.height == 1 and sft["drift_energy_pct"][0] == 100.0


def test_no_rows_gives_an_empty_frame_with_the_columns(tmp_path):
    _write(tmp_path / "r", [_row(1, Q0, 0, 10, 1.0, 5, stage="sft")])
    df = update_share_by_layer(tmp_path / "r")
    assert df.is_empty() and "drift_energy_pct" in df.columns
