"""``forgetting_by_point`` on a real probed run: forgetting from the base's own evaluation, the KL logged at each
point, and the weight measures the probe recorded at that step, checked against the weights themselves."""

from __future__ import annotations

import pytest
import torch

import dynascope
from dynascope.analyses import FORGETTING_CANDIDATES, forgetting_by_point


def _run(tmp_path, spectral: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 8), torch.randn(16, 3)
    spec = dict(k=2, every=1, time_budget=None) if spectral else False
    theta0, weights = {}, {}
    with dynascope.watch(model, opt, run=tmp_path / "r", stage="sft", every=1, memory_budget=None, time_budget=None,
                         spectral=spec, system_interval_s=None) as scope:
        scope.log(step=0, **{"eval/prose_nll_nats": 3.0})  # the pretrained point
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        scope.log(step=1, **{"eval/prose_nll_nats": 2.5, "eval/forward_kl_sft_nats": 0.0})  # the SFT point: the base
        scope.set_stage("rl")
        scope.set_reference("init")
        theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        for i in range(4):
            opt.zero_grad()
            (torch.nn.functional.mse_loss(model(x), y) * (1 + i)).backward()
            opt.step()
            if i in (1, 3):  # points after RL steps 2 and 4, at the step of their last update (3 and 5)
                step = scope.step_index - 1
                scope.log(step=step, **{"eval/prose_nll_nats": 2.5 + 0.01 * i, "eval/forward_kl_sft_nats": 0.1 * i,
                                        "eval/accuracy": 0.5})
                weights[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return tmp_path / "r", theta0, weights


def test_points_hold_forgetting_kl_and_the_weights_measures(tmp_path):
    run, theta0, weights = _run(tmp_path)
    df = forgetting_by_point(run)
    assert df["step"].to_list() == sorted(weights) == [3, 5]
    assert df["forgetting_nats"].to_list() == pytest.approx([0.01, 0.03])  # from the SFT point's 2.5, not 3.0
    assert df["forward_kl_nats"].to_list() == pytest.approx([0.1, 0.3])
    for row in df.iter_rows(named=True):
        w = weights[row["step"]]
        delta = torch.sqrt(sum(((w[n] - theta0[n]) ** 2).sum() for n in w))
        assert row["drift_norm"] == pytest.approx(float(delta), rel=1e-5)
        assert row["drift_ratio"] == pytest.approx(float(delta / torch.sqrt(sum((w[n] ** 2).sum() for n in w))), rel=1e-5)
        same = sum(int(((w[n].bfloat16().float() - theta0[n].bfloat16().float()).abs() <= 1e-5).sum()) for n in w)
        assert row["mukherjee_changed_share"] == pytest.approx(1 - same / sum(t.numel() for t in w.values()))
        mats = [w[n] - theta0[n] for n in w if w[n].ndim == 2]
        s1 = sum(float(torch.linalg.svdvals(d)[0] ** 2) for d in mats)
        assert row["rank1_energy"] == pytest.approx(s1 / sum(float((d ** 2).sum()) for d in mats), rel=1e-4)
        assert row["spectra_step"] == row["step"]
    assert set(FORGETTING_CANDIDATES) <= set(df.columns)


def test_without_spectra_rank1_is_null_not_a_stand_in(tmp_path):
    run, _, _ = _run(tmp_path, spectral=False)
    df = forgetting_by_point(run)
    assert df.height == 2 and df["rank1_energy"].null_count() == 2 and df["drift_norm"].null_count() == 0


def test_a_run_without_evaluations_gives_no_rows(tmp_path):
    with dynascope.watch(torch.nn.Linear(2, 2), None, run=tmp_path / "r", system_interval_s=None) as scope:
        scope.log(loss=1.0)
    assert forgetting_by_point(tmp_path / "r").is_empty()


def test_the_report_puts_forgetting_beside_the_kl(tmp_path):
    from dynascope.analyses import collect_findings, sentence

    run, _, _ = _run(tmp_path)
    (f,) = [f for f in collect_findings(run)[0] if f.finding == "kl_to_base"]
    assert f.numbers["forgetting_nats"] == pytest.approx(0.03)  # 2.53 at the last RL point − 2.5 at the SFT point
    assert f.numbers["kl_rl_base_nats"] == pytest.approx(0.3)
    assert "forgetting over the same steps (log-loss on held-out prose) +0.03 nats per token" in sentence("kl_to_base", f.numbers)
