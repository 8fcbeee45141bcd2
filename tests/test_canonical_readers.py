"""The readers of the canonical view on a sharded and replicated run equal their reference values.

The same weights are stored twice through the real writer: as one process holds them (every tensor whole
on rank 0), and as an HSDP job lays them out (2 replica groups × 2 shards over 4 ranks, plus a bias that
each rank holds whole, as tensor parallel's replicated bias is). The KL-to-base finding, the delta-sync
bytes, the MFU's parameter count and the fleet summary must read the same on both, and equal the values
computed here by torch from the full tensors. A second pair does the same under a memory budget, where the
drift columns cover only the record's window of tensors.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from dynascope.analyses import collect_findings, delta_sync_bytes, fleet_summary, throughput_mfu
from dynascope.store import RunWriter

from helpers.canonical_rows import stats_row, weights

STEPS = (0, 1, 2, 3)
RANKS = 4
TOKENS, STEP_US = 400, 250_000  # per step: samples' tokens, and each rank's step time


def _pieces(step: int, windowed: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The run's two tensors at ``step``; under a budget, only "w" carries drift at odd steps."""
    w = weights(step, (8, 6))
    b = weights(1000 + step, (1, 6))
    return {"w": w, "b": (b[0], b[1], None if windowed and step % 2 else b[2])}


def _write(run: Path, layout: str, windowed: bool) -> None:
    n = 1 if layout == "single" else RANKS
    writers = [RunWriter(run, rank=r, world_size=n, flush_secs=60) for r in range(n)]
    for step in STEPS:
        for name, (new, old, ref) in _pieces(step, windowed).items():
            for r, w in enumerate(writers):
                if layout == "single" or name == "b":  # whole: one process, or a replicated bias on every rank
                    row = stats_row(name, new, old, ref, sharded=layout != "single" and name == "w")
                else:  # HSDP: mesh rank = replica * 2 + shard
                    a, z = [(0, 4), (4, 8)][r % 2]
                    row = stats_row(name, new[a:z], old[a:z], None if ref is None else ref[a:z], sharded=True,
                                    mesh="2x2", shard=str(r % 2), replica=r // 2)
                w.append("tensor_stats", {"step": step, "stage": "rl", **row})
        for w in writers:
            w.append("timings", {"step": step, "phase": "step", "category": "step", "start_us": 10**15 + step * STEP_US,
                                 "dur_us": STEP_US})
        writers[0].append("samples", {"step": step, "prompt_len": [TOKENS // 4] * 2, "response_len": [TOKENS // 4] * 2,
                                      "reward": [0.0, 1.0]})
        writers[0].append("scalars", {"step": step, "stage": "rl", "time_us": 10**15 + step,
                                      "key": ["eval/forward_kl_sft_nats", "eval/forward_kl_pretrained_nats"],
                                      "value": [0.01 * step, 0.02 * step]})
    for w in writers:
        w.close()


def _truth(windowed: bool) -> dict:
    """The readers' figures from the full tensors, by torch."""
    bf16 = {s: sum(int((n.bfloat16() != o.bfloat16()).sum()) for n, o, _ in _pieces(s, windowed).values())
            for s in STEPS}
    last = _pieces(STEPS[-1], windowed)
    carried = [(n, r) for n, _, r in last.values() if r is not None]
    drift = sum(float((n - r).pow(2).sum()) for n, r in carried) ** 0.5
    w_norm = sum(float(n.pow(2).sum()) for n, _ in carried) ** 0.5
    changed = sum(int((n.bfloat16() != r.bfloat16()).sum()) for n, r in carried)
    numel = sum(n.numel() for n, _, _ in last.values())
    return {"numel": numel, "bf16_changed": bf16, "drift_ratio": drift / w_norm,
            "bf16_changed_pct": 100.0 * changed / sum(n.numel() for n, _ in carried),
            "s1_median": statistics.median(1 - bf16[s] / numel for s in STEPS)}


@pytest.fixture(scope="module", params=[False, True], ids=["full", "budget"])
def pair(request, tmp_path_factory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("readers")
    for layout in ("single", "hsdp"):
        _write(tmp / layout, layout, request.param)
    return tmp / "single", tmp / "hsdp", _truth(request.param)


def test_delta_sync_bytes_read_the_full_tensors(pair) -> None:
    single, hsdp, truth = pair
    a, b = delta_sync_bytes(single), delta_sync_bytes(hsdp)
    cols = ["step", "tensors", "numel", "changed_count", "full_bf16_bytes", "delta_bytes", "encoding"]
    assert a.select(cols).to_dicts() == b.select(cols).to_dicts()
    assert b["numel"].to_list() == [truth["numel"]] * len(STEPS)
    assert dict(zip(b["step"], b["changed_count"], strict=True)) == truth["bf16_changed"]
    assert b["full_bf16_bytes"].to_list() == [2 * truth["numel"]] * len(STEPS)


def test_kl_finding_reads_the_full_tensors(pair) -> None:
    single, hsdp, truth = pair
    got = []
    for run in (single, hsdp):
        (f,) = [f for f in collect_findings(run)[0] if f.finding == "kl_to_base"]
        got.append(f.numbers)
    for n in got:
        assert n["drift_ratio"] == pytest.approx(truth["drift_ratio"], rel=1e-9)
        assert n["bf16_changed_pct"] == pytest.approx(truth["bf16_changed_pct"], rel=1e-9)
    assert got[0] == got[1]


def test_mfu_counts_each_parameter_once(pair) -> None:
    single, hsdp, truth = pair
    for run, ranks in ((single, 1), (hsdp, RANKS)):
        df = throughput_mfu(run, peak_tflops=1.0, n_layers=0, hidden=0).filter(phase="step")
        assert df.height == ranks
        # 6·N·tokens, the step's tokens split evenly over the ranks that ran it; N = the model's numel once
        want = 6 * truth["numel"] * TOKENS / ranks / (STEP_US / 1e6) / 1e12
        assert df["achieved_tflops"].to_list() == pytest.approx([want] * ranks, rel=1e-9)


def test_fleet_summary_reads_the_full_tensors(pair) -> None:
    single, hsdp, truth = pair
    rows = [fleet_summary(run).row(0, named=True) for run in (single, hsdp)]
    for r in rows:
        assert r["median_bf16_unchanged_frac_rl"] == pytest.approx(truth["s1_median"], rel=1e-9)
    keys = ["steps", "median_step_ms", "median_bf16_unchanged_frac_rl", "last_drift_unchanged_frac"]
    assert [rows[0][k] for k in keys] == [rows[1][k] for k in keys]
    assert rows[1]["ranks"] == RANKS and rows[0]["ranks"] == 1
