"""A user's own statistic, declared in their module and named in ``DYNASCOPE_STATISTICS``: the live probe
records it, its rollup pools it, and a reading process with the same variable queries it; a module that
is missing or declares nothing fails at import, its last line naming it. Each run in a fresh interpreter, as the
registry is read once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MY_STATS = '''
from dynascope.stats import Column, Statistic
from dynascope.stats.base import F64


def update_l1(x):
    import torch
    return [torch.sum(torch.abs(x.new.double() - x.old.double()))]


STATISTICS = (Statistic(
    "update_l1", columns=(Column("update_l1", F64, reduce="sum", pool=(("update_l1", "sum", None),),
                                 doc="Σ|W_t − W_{t−1}|"),),
    outputs=("update_l1",), inputs=("new", "old"), kernel=update_l1, transient=(3, 0)),)
'''

TRAIN = '''
import json, sys, torch, dynascope
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, want = torch.randn(8, 5), {}
with dynascope.watch(model, opt, run=sys.argv[1], memory_budget=None, system_interval_s=None):
    for step in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            want[f"{step} {n}"] = float((p.detach().double() - before[n].double()).abs().sum())
print(json.dumps(want))
'''

READ = '''
import json, sys
from dynascope.store import open_store
with open_store(sys.argv[1]) as s:
    rows = s.rows("SELECT step, tensor, update_l1 FROM tensor_stats")
    pooled = s.rows("SELECT sum(update_l1) FROM tensor_stats_by_kind")[0][0]
print(json.dumps({"rows": {f"{a} {b}": c for a, b, c in rows}, "pooled": pooled, "torch": "torch" in sys.modules}))
'''


def _python(code: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "my_stats.py").write_text(MY_STATS)
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", DYNASCOPE_STATISTICS="my_stats")


def test_a_declared_statistic_is_recorded_pooled_and_read(tmp_path: Path, env: dict[str, str]) -> None:
    run = str(tmp_path / "run")
    trained = _python(TRAIN, run, env=env)
    assert trained.returncode == 0, trained.stderr
    want = json.loads(trained.stdout.strip().splitlines()[-1])
    read = _python(READ, run, env=env)
    assert read.returncode == 0, read.stderr
    got = json.loads(read.stdout.strip().splitlines()[-1])
    assert got["rows"] == pytest.approx(want, rel=1e-12) and len(want) == 12 and min(want.values()) > 0
    assert got["pooled"] == pytest.approx(sum(want.values()), rel=1e-12)
    assert got["torch"] is False  # the reading side imported the declaration, not torch


@pytest.mark.parametrize(("module", "source", "message"), [
    ("nowhere", None, "UserError: DYNASCOPE_STATISTICS: cannot import statistics module 'nowhere'"),
    ("empty_stats", "X = 1\n", "statistics module 'empty_stats' must declare STATISTICS"),
    ("twice_stats", MY_STATS + "\nSTATISTICS = STATISTICS * 2\n",
     "tensor_stats column 'update_l1' is declared twice"),
])
def test_a_bad_module_fails_with_one_line_naming_it(tmp_path: Path, module: str, source: str | None,
                                                    message: str) -> None:
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", DYNASCOPE_STATISTICS=module)
    out = _python("import dynascope.store", env=env)
    assert out.returncode != 0 and message in out.stderr.strip().splitlines()[-1], out.stderr
