"""Trainer↔rollout consistency on planted inputs: the log-prob gap's exact values through the store, and the
weight-sync check on a tiny model built from config (identical copy: nothing; a stale tensor: caught, named)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dynascope
from dynascope.analyses import logprob_gap_by_step
from dynascope.probes.rollout_consistency import (
    Fingerprint,
    compare_fingerprints,
    logprob_gap_columns,
    verify_weight_sync,
    weight_fingerprints,
)
from dynascope.store import open_store


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def test_logprob_gap_columns_exact_values():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.25, -3.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    trainer = torch.tensor([[-1.25, -2.0, -0.375, 0.0], [-0.25, -2.5, -1.0, -7.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    cols = logprob_gap_columns(rollout, trainer, mask, threshold_nats=0.2)
    # row 0: |Δ| = 0.25, 0, 0.125 (the masked 9.0 does not count); row 1: 0, 0.5; row 2: no token
    assert cols == {"logprob_gap_tokens_count": [3, 2, 0], "logprob_gap_sum_nats": [0.375, 0.5, None],
                    "logprob_gap_max_nats": [0.25, 0.5, None], "logprob_gap_over_count": [1, 1, None],
                    "logprob_gap_threshold_nats": [0.2, 0.2, 0.2], "logprob_ratio_outside_count": [2, 1, None]}


def test_logprob_gap_pools_through_the_store_per_step(tmp_path):
    with dynascope.watch(torch.nn.Linear(2, 2), None, run=tmp_path / "r", system_interval_s=None) as scope:
        a = logprob_gap_columns(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2, dtype=torch.bool))
        b = logprob_gap_columns(torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.0, -1.0, -1.25]]),
                                torch.ones(1, 3, dtype=torch.bool))
        scope.samples(sample_id=[0, 1], reward=[1.0, 0.0], **{k: a[k] + b[k] for k in a})
    df = logprob_gap_by_step(tmp_path / "r")
    row = df.row(0, named=True)
    assert (row["step"], row["samples"], row["tokens_count"]) == (0, 2, 5)
    assert row["logprob_gap_mean_nats"] == pytest.approx(0.75 / 5)  # Σ|Δ| / Σ tokens, not a mean of means
    assert row["logprob_gap_max_nats"] == 0.5
    assert row["logprob_gap_over_pct"] == pytest.approx(100 * 2 / 5)  # 0.5 and 0.25 exceed 0.1 nats


def test_fingerprints_are_exact_checksums_of_the_bits():
    x = torch.tensor([[1.0, -2.0], [0.5, 3.0], [0.0, 1.0]], dtype=torch.bfloat16)
    bits = x.view(torch.int16).to(torch.int64)
    fp = weight_fingerprints({"x": x})["x"]
    assert fp == Fingerprint((3, 2), "bfloat16", int(bits.sum()), int((bits.sum(1) * torch.tensor([1, 2, 3])).sum()))
    # a transposed copy keeps the bit sum but not the row moment
    t = x.T.contiguous().reshape(3, 2)
    fpt = weight_fingerprints({"x": t})["x"]
    assert fpt.bit_sum == fp.bit_sum and fpt.bit_moment != fp.bit_moment
    # rows longer than 2¹⁶ sum in int64: the same checksum as a direct int64 sum
    long = torch.randn(2, 70_000).to(torch.bfloat16)
    lb = long.view(torch.int16).to(torch.int64)
    assert weight_fingerprints({"l": long})["l"].bit_moment == int(lb[0].sum() + 2 * lb[1].sum())
    # fp32 weights cast to the rollout dtype give the rollout copy's checksums exactly
    w = torch.randn(5, 7)
    assert weight_fingerprints({"w": w}, torch.bfloat16) == weight_fingerprints({"w": w.to(torch.bfloat16)})


def test_an_identical_bf16_copy_checks_clean_and_a_stale_tensor_is_caught_and_named(tmp_path):
    model = _tiny()
    rollout = copy.deepcopy(model).to(torch.bfloat16).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stale = "model.layers.1.mlp.down_proj.weight"
    with dynascope.watch(model, opt, run=tmp_path / "r", system_interval_s=None) as scope:
        assert verify_weight_sync(scope, model, rollout) == []  # the copy is exactly the cast of the trainer
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        with torch.no_grad():  # the sync of step 1 misses one tensor
            for (name, d), s in zip(rollout.named_parameters(), model.parameters(), strict=True):
                if name != stale:
                    d.copy_(s)
        bad = verify_weight_sync(scope, model, rollout)
        # the rollout engine may send its own fingerprints instead of its tensors
        again = verify_weight_sync(scope, model, weight_fingerprints(rollout))
    assert [m.tensor for m in bad] == [stale] and bad[0].reason == "values"
    want = model.get_parameter(stale).detach().to(torch.bfloat16)
    old = rollout.get_parameter(stale)
    assert bad[0].differing_count == int((want != old).sum()) > 0
    assert bad[0].diff_rel == pytest.approx(float((old.float() - want.float()).norm() / want.float().norm()))
    # from fingerprints alone the tensor is named, without the element count
    assert [(m.tensor, m.reason, m.differing_count) for m in again] == [(stale, "values", None)]
    n = len(list(model.parameters()))
    with open_store(tmp_path / "r") as con:
        scalars = con.rows("SELECT step, key, value FROM scalars WHERE key LIKE 'weight_sync/%' ORDER BY time_us, key")
        events = con.rows("SELECT step, severity, message, fields_json FROM events WHERE event = 'weight_sync_mismatch'")
    assert scalars == [(0, "weight_sync/mismatched_tensors", 0.0), (0, "weight_sync/tensors_checked", n),
                       (1, "weight_sync/mismatched_tensors", 1.0), (1, "weight_sync/tensors_checked", n),
                       (1, "weight_sync/mismatched_tensors", 1.0), (1, "weight_sync/tensors_checked", n)]
    assert len(events) == 2 and all(e[0] == 1 and e[1] == "error" and stale in e[2] and stale in e[3] for e in events)


def test_missing_extra_shape_and_dtype_are_named():
    a = {"w": torch.ones(2, 2), "b": torch.ones(2), "gone": torch.ones(1)}
    b = {"w": torch.ones(2, 3), "b": torch.ones(2, dtype=torch.float64), "new": torch.ones(1)}
    got = compare_fingerprints(weight_fingerprints(a), weight_fingerprints(b))
    assert [(m.tensor, m.reason) for m in got] == [("w", "shape"), ("b", "dtype"), ("gone", "missing"), ("new", "extra")]


def test_a_failing_check_warns_and_records_instead_of_raising(tmp_path):
    with dynascope.watch(torch.nn.Linear(2, 2), None, run=tmp_path / "r", system_interval_s=None) as scope:
        with pytest.warns(RuntimeWarning, match="weight-sync check failed"):
            assert verify_weight_sync(scope, object(), {"w": torch.ones(2)}) == []
    with open_store(tmp_path / "r") as con:
        assert con.rows("SELECT count(*) FROM events WHERE event = 'probe_error'") == [(1,)]
