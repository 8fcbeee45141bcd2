"""The trainer's self-mismatch floor on planted log-probs: the same ``logprob_gap_columns`` gives both gaps,
pooled per step through a real store, and ``logprob_gap_floor_by_step`` sets one beside the other."""

from __future__ import annotations

import math

import pytest
import torch

import dynascope
from dynascope.analyses import logprob_gap_floor_by_step
from dynascope.probes.rollout_consistency import TRAINER_SELF, logprob_gap_columns, logprob_gap_totals

FIRST = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]], dtype=torch.float64)  # the trainer's first pass
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
# second trainer pass: Δ = −0.102 is over 0.1 nats but its ratio e^Δ = 0.903 is inside [0.9, 1.1];
# Δ = 0.098 is under 0.1 nats but e^Δ = 1.103 is outside; the masked 9.0 never counts
SECOND = FIRST + torch.tensor([[0.0, -0.102, 0.098], [0.3, -0.5, 9.0]], dtype=torch.float64)
ROLLOUT = FIRST + torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.05, -7.0]], dtype=torch.float64)


def test_ratio_band_and_threshold_count_different_tokens():
    cols = logprob_gap_columns(SECOND, FIRST, MASK)
    assert cols["logprob_gap_tokens_count"] == [3, 2]
    assert cols["logprob_gap_sum_nats"] == pytest.approx([0.2, 0.8])
    assert cols["logprob_gap_over_count"] == [1, 2]          # 0.102 | 0.3, 0.5
    assert cols["logprob_ratio_outside_count"] == [1, 2]     # 0.098 | 0.3, −0.5
    assert logprob_gap_columns(FIRST, FIRST, MASK)["logprob_ratio_outside_count"] == [0, 0]
    assert logprob_gap_columns(FIRST, FIRST, torch.zeros_like(MASK))["logprob_ratio_outside_count"] == [None, None]


def test_totals_pool_the_same_columns_under_the_prefix():
    tot = logprob_gap_totals(logprob_gap_columns(SECOND, FIRST, MASK))
    assert tot == pytest.approx({f"{TRAINER_SELF}logprob_gap_tokens_count": 5.0,
                                 f"{TRAINER_SELF}logprob_gap_sum_nats": 1.0,
                                 f"{TRAINER_SELF}logprob_gap_over_count": 3.0,
                                 f"{TRAINER_SELF}logprob_ratio_outside_count": 3.0,
                                 f"{TRAINER_SELF}logprob_gap_max_nats": 0.5,
                                 f"{TRAINER_SELF}logprob_gap_threshold_nats": 0.1})
    empty = logprob_gap_totals(logprob_gap_columns(FIRST, FIRST, torch.zeros_like(MASK)))
    assert empty[f"{TRAINER_SELF}logprob_gap_tokens_count"] == 0 and math.isnan(empty[f"{TRAINER_SELF}logprob_gap_max_nats"])


def test_floor_beside_the_rollout_gap_through_the_store(tmp_path):
    with dynascope.watch(torch.nn.Linear(2, 2), None, run=tmp_path / "r", system_interval_s=None) as scope:
        scope.samples(sample_id=[0, 1], reward=[1.0, 0.0], **logprob_gap_columns(ROLLOUT, FIRST, MASK))
        scope.log(**logprob_gap_totals(logprob_gap_columns(SECOND, FIRST, MASK)))
    row = logprob_gap_floor_by_step(tmp_path / "r").row(0, named=True)
    # rollout: |Δ| 1.0, 0.5, 0 | 0, 0.05 → Σ 1.55 over 5 tokens; over 0.1: 2; e^Δ outside: 2
    assert row["rollout_gap_mean_nats"] == pytest.approx(0.31)
    assert row["rollout_gap_over_pct"] == pytest.approx(40.0) and row["rollout_ratio_outside_pct"] == pytest.approx(40.0)
    # the trainer against itself: Σ 1.0 over 5 tokens; over 0.1: 3; outside the band: 3
    assert row["self_gap_mean_nats"] == pytest.approx(0.2) and row["self_gap_max_nats"] == pytest.approx(0.5)
    assert row["self_gap_over_pct"] == pytest.approx(60.0) and row["self_ratio_outside_pct"] == pytest.approx(60.0)
    assert row["excess_gap_mean_nats"] == pytest.approx(0.11) and row["excess_over_pct"] == pytest.approx(-20.0)
    assert (row["step"], row["tokens_count"], row["self_tokens_count"]) == (0, 5, 5)


def test_no_recomputation_recorded_gives_no_rows(tmp_path):
    with dynascope.watch(torch.nn.Linear(2, 2), None, run=tmp_path / "r", system_interval_s=None) as scope:
        scope.samples(sample_id=[0, 1], reward=[1.0, 0.0], **logprob_gap_columns(ROLLOUT, FIRST, MASK))
    assert logprob_gap_floor_by_step(tmp_path / "r").is_empty()
