"""The plainest per-tensor references for the probes' statistics: element by element, in Python floats."""

from __future__ import annotations

import math

import torch


def naive_update(new: torch.Tensor, old: torch.Tensor, eta: float = 1e-3) -> list[float]:
    """Element by element in float64 / Python, the slowest and plainest way."""
    n, o = new.reshape(-1).tolist(), old.reshape(-1).tolist()
    nb = new.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]).tolist()
    ob = old.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()]).tolist()
    w_norm = math.sqrt(sum(x * x for x in n))
    update_norm = math.sqrt(sum((x - y) ** 2 for x, y in zip(n, o, strict=False)))
    changed = sum(a != b for a, b in zip(nb, ob, strict=False))
    rel = sum(abs(x - y) > eta * max(abs(x), abs(y)) for x, y in zip(n, o, strict=False))
    flips = sum((x > 0 and y < 0) or (x < 0 and y > 0) for x, y in zip(n, o, strict=False))
    return [w_norm, update_norm, changed, rel, flips, sum(math.isnan(x) for x in n), sum(math.isinf(x) for x in n)]


def naive_grad(g: torch.Tensor, tol: float = 1e-8) -> list[float]:
    v = g.double().reshape(-1).tolist()
    norm = math.sqrt(sum(x * x for x in v))
    rms = norm / math.sqrt(max(len(v), 1))
    return [norm, max((abs(x) for x in v), default=0.0), sum(x == 0 for x in v),
            sum(abs(x) <= tol * rms for x in v), sum(math.isnan(x) for x in v), sum(math.isinf(x) for x in v)]


def assert_row_matches(r: dict, upd: list[float], grad: list[float], drift: list[float]) -> None:
    """A combined ``tensor_stats`` row against ``naive_update``/``naive_grad`` of the full tensors."""
    import pytest

    assert r["w_norm"] == pytest.approx(upd[0], rel=1e-5)
    assert r["update_norm"] == pytest.approx(upd[1], rel=1e-5)
    assert [r["changed_count"], r["changed_rel_count"], r["sign_flip_count"]] == upd[2:5]
    assert r["grad_norm"] == pytest.approx(grad[0], rel=1e-5)
    assert r["grad_max_abs"] == pytest.approx(grad[1], rel=1e-5)
    assert r["grad_zero_count"] == grad[2]
    assert r["drift_norm"] == pytest.approx(drift[1], rel=1e-5, abs=1e-9)
    assert r["drift_changed_count"] == drift[2]
    assert r["changed_frac"] == pytest.approx(upd[2] / r["numel"])
