"""Recorded tensor names go through the same normalisation as θ₀: a compiled model records its bare names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.store import open_store


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _run(run: Path, compiled: bool, backend: str = "eager") -> tuple[list[dict], list[str]]:
    model = _mlp()
    net = torch.compile(model, backend=backend) if compiled else model  # the wrapper is what renames
    assert any(n.startswith("_orig_mod.") for n, _ in net.named_parameters()) == compiled
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with dynascope.watch(net, opt, run=run, memory_budget=None, system_interval_s=None,
                         spectral=dict(every=1, k=2, time_budget=None), bf16_k=1):
        for _ in range(3):
            net(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    with open_store(run) as con:
        stats = con.sql("SELECT step, tensor, ref_covered, w_norm, drift_norm, bf16_unchanged_k_count "
                        "FROM tensor_stats ORDER BY step, tensor").pl().to_dicts()
        spectra = con.sql("SELECT DISTINCT tensor FROM spectra ORDER BY tensor").pl()["tensor"].to_list()
    return stats, spectra


# "eager" keeps the test fast; inductor (C++ codegen, ~80 s on 2 cores) is the backend users run.
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_and_uncompiled_runs_record_identical_names(tmp_path: Path, backend: str) -> None:
    plain, plain_sp = _run(tmp_path / "plain", compiled=False)
    comp, comp_sp = _run(tmp_path / "compiled", compiled=True, backend=backend)
    bare = sorted(_mlp().state_dict())  # the names a checkpoint of the bare model carries
    assert sorted({r["tensor"] for r in comp}) == sorted({r["tensor"] for r in plain}) == bare
    assert comp_sp == plain_sp == ["0.weight", "2.weight", "4.weight"]
    assert all(r["ref_covered"] for r in comp)  # θ₀ is found under the same names
    assert [r["bf16_unchanged_k_count"] is not None for r in comp] == [r["bf16_unchanged_k_count"] is not None
                                                                       for r in plain]
    for a, b in zip(comp, plain, strict=True):  # same model, same data: the same numbers under the same names
        assert (a["step"], a["tensor"]) == (b["step"], b["tensor"])
        assert a["w_norm"] == pytest.approx(b["w_norm"], rel=1e-5) and a["drift_norm"] == pytest.approx(
            b["drift_norm"], rel=1e-3, abs=1e-7)  # inductor fuses differently: values agree to rounding
